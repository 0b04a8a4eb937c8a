"""A TrainEngine's weights as whole HF-layout tensors, gathered from its shards one tensor at a time:
the full state dict, full gradients, and `save_hf` streamed from rank 0.

Every function here is a collective when the engine is sharded: all ranks must call it and iterate to
the end (each tensor's gather is one all-gather over its mesh).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridflow.engines.parallelize import hf_layout_transforms
from hybridflow.models.lora import ADAPTER, adapted_part, hf_name, merge_named

if TYPE_CHECKING:
    from hybridflow.engines.train_engine import TrainEngine


def iter_full_state_dict(engine: TrainEngine, device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs; names and layouts are those of the HF checkpoint. With LoRA each
    adapted weight is merged (W + scale * B @ A) as it streams by: the HF model the adapters make."""
    _whole_model_only(engine)
    transforms = hf_layout_transforms(engine.hf_model)
    with engine.phase():
        live = engine.hf_model.state_dict().items()
        gathered = ((name, gather(name, t, transforms, device)) for name, t in live)
        yield from merge_named(gathered, engine.lora_layers) if engine.lora_layers else gathered


def iter_full_grads(engine: TrainEngine, device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, full gradient) of the parameters that have one."""
    transforms = hf_layout_transforms(engine.hf_model)
    for name, p in engine.hf_model.named_parameters():
        if p.grad is None:
            continue
        yield name, gather(name, p.grad, transforms, device)


def save_hf(engine: TrainEngine, path, tokenizer=None) -> None:
    """The full model as an HF directory written by rank 0: each tensor gathered, written and dropped,
    so no rank holds the whole model."""
    from hybridflow.checkpoint.stream_write import write_safetensors

    _whole_model_only(engine)
    model = engine.hf_model
    transforms = hf_layout_transforms(model)
    with engine.phase():
        live = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False) and len(live) > 1:
            live.pop("lm_head.weight", None)  # save_pretrained leaves the tied copy out too
        specs = {n: (tuple(t.shape), t.dtype) for n, t in live.items()}
        produce = lambda name: gather(name, live[name], transforms, "cpu")  # noqa: E731
        if engine.lora_layers:  # merged weights under HF names: each gathers its base, A and B
            specs, produce = _merged_specs(specs, live, transforms, engine.lora_layers)
        if engine.mesh is None or dist.get_rank() == 0:
            write_safetensors(path, specs, produce)
            model.config.save_pretrained(path)
            if engine.kind == "causal_lm" and getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        else:
            for name in specs:  # the other ranks take part in every gather
                produce(name)
    if engine.mesh is not None:
        dist.barrier()


def _whole_model_only(engine: TrainEngine) -> None:
    if engine.pipeline is not None:
        raise NotImplementedError(
            "the whole model's weights of a pipelined engine (parallel.pp > 1) are not gathered here; export "
            "from its checkpoint (`hybridflow export`), which holds every stage by the whole model's names"
        )


def _merged_specs(specs: dict, live: dict, transforms: dict, layers: dict):
    """(specs, produce) of the merged HF tensors of a LoRA model: adapters left out, base weights renamed
    and merged when produced (in stored order, so every rank gathers the same tensors in turn)."""
    sources = {}
    for name in specs:
        layer, part = adapted_part(name, layers)
        if layer is None or part == ".bias":  # a plain tensor or an adapted layer's bias, by its HF name
            sources[hf_name(name)] = [name]
        elif part == "base":
            sources[f"{layer}.weight"] = [
                name,
                f"{layer}.lora_A.{ADAPTER}.weight",
                f"{layer}.lora_B.{ADAPTER}.weight",
            ]
    out_specs = {hf: (specs[src[0]][0], specs[src[0]][1]) for hf, src in sources.items()}

    def produce(hf: str) -> torch.Tensor:
        items = [(n, gather(n, live[n], transforms, "cpu")) for n in sources[hf]]
        return next(iter(merge_named(items, layers)))[1]

    return out_specs, produce


def gather(name: str, t: torch.Tensor, transforms: dict, device) -> torch.Tensor:
    """Full, HF-layout copy of a (possibly sharded) tensor that never aliases the live one (a 1-rank
    full_tensor() or a CPU .to() would return the same storage, which training then mutates)."""
    live = t.to_local() if isinstance(t, DTensor) else t
    full = t.full_tensor() if isinstance(t, DTensor) else t
    if name in transforms:
        dim, perm = transforms[name]
        full = full.index_select(dim, torch.argsort(perm).to(full.device))
    out = full.detach().to(device)
    if out.untyped_storage().data_ptr() == live.untyped_storage().data_ptr():
        out = out.clone()
    return out
