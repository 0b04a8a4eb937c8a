"""A TrainEngine's resumable state on disk, without pickle (TrainEngine.save_checkpoint / load_checkpoint).

    <dir>/model/shard-*.safetensors   parameters by HF name, each rank's own shards (checkpoint/shards.py);
                                      with LoRA only the adapters (+ a critic's value head): adapter-sized
    <dir>/optim/shard-*.safetensors   AdamW moments and step counts by "<param fqn>.<key>", sharded likewise
    <dir>/train_state.json            global_step, LR scheduler state, optimizer param_groups (rank 0)

No rank gathers anything: DTensor parameters and moments are written as the local chunks each rank
holds. Loading reads the JSON and then, on every rank, only the slices its current shards cover, so a
run saved on 4 ranks resumes on 2 (or 1). Tensors keep the engine's layout: a GPT-2 model under tp > 1
stores its fused qkv column-permuted (parallelize.py), which export undoes (checkpoint/export.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.checkpoint.manager import atomic_write_text
from hybridflow.checkpoint.shards import load_tensors, save_tensors

TRAIN_STATE_JSON = "train_state.json"


def _prefix(engine) -> str:
    """How the wrapper names the HF model's parameters ("model." for RLForward)."""
    for name, mod in engine.module.named_modules():
        if mod is engine.hf_model:
            return f"{name}." if name else ""
    raise RuntimeError("the engine's HF model is not inside its wrapped module")


def model_tensors(engine) -> dict[str, torch.Tensor]:
    """{HF name: parameter or buffer (DTensor shard or plain tensor)} as it lives on this rank; with
    LoRA only what trains (adapters, a critic's value head): the frozen base is model.path's, as loaded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    prefix = _prefix(engine)
    tensors = {
        _hf_name(engine, k.removeprefix(prefix)): v for k, v in get_model_state_dict(engine.module).items()
    }
    if engine.lora_layers:
        trained = {n for n, p in engine.hf_model.named_parameters() if p.requires_grad}
        tensors = {k: v for k, v in tensors.items() if k in trained}
    return tensors


def _local_names(engine) -> dict[str, str]:
    """{name in model_tensors: the wrapped module's state-dict key}."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    prefix = _prefix(engine)
    return {_hf_name(engine, k.removeprefix(prefix)): k for k in get_model_state_dict(engine.module)}


def _hf_name(engine, name: str) -> str:
    """A pipeline stage's parameter under the whole model's name (its layers renumbered), so the stages'
    files together hold the model by its HF names, whatever p saved them or resumes them."""
    if getattr(engine, "pipeline", None) is None:
        return name
    from hybridflow.engines.pipeline import hf_name

    return hf_name(engine.hf_model, name)


def _optimizer_state(engine) -> tuple[dict, dict[str, torch.Tensor]]:
    """(full optimizer state dict, its tensors flattened to "<fqn>.<key>"; the same tensor objects)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(engine.module, engine.optimizer)
    flat = {}
    for fqn, entry in osd["state"].items():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}.{key} is a {type(value).__name__}, not a tensor")
            prefix = _prefix(engine)
            name = prefix + _hf_name(engine, fqn.removeprefix(prefix)) if fqn.startswith(prefix) else fqn
            flat[f"{name}.{key}"] = value
    return osd, flat


def _json_ready(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    return value


def _stage_writer(engine) -> bool | None:
    """Whether this rank writes its pipeline stage's plain (unsharded) tensors: the stage's first rank
    (dp and tp rank 0); None without stages (rank 0 writes them)."""
    if getattr(engine, "pipeline", None) is None:
        return None
    return engine.mesh["dp"].get_local_rank() == 0 and engine.mesh["tp"].get_local_rank() == 0


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


NOT_FINITE = "is not finite; refusing to save it"  # checkpoint/manager.py names the refusal by this


def _not_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The floating tensors of which this rank holds a non-finite value (in its own shard): one isfinite
    per tensor where it lives, one sync per device for them all."""
    from torch.distributed.tensor import DTensor

    by_device: dict[torch.device, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, {})[name] = t
    bad = []
    for local in by_device.values():
        finite = torch.stack([torch.isfinite(t).all() for t in local.values()]).tolist()
        bad += [n for n, ok in zip(local, finite) if not ok]
    return bad


def check_finite(engine, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse, on every rank together, a checkpoint holding a non-finite weight or optimizer moment:
    a poisoned checkpoint would pass its SHA check and be resumed from."""
    bad = _not_finite(tensors)
    if engine._all_reduce(float(len(bad)), dist.ReduceOp.MAX):
        more = f" (and {len(bad) - 1} more on this rank)" if len(bad) > 1 else ""
        where = f"{bad[0]}{more}" if bad else "a tensor of another rank"
        raise ValueError(f"step {engine.global_step}: {where} {NOT_FINITE}")


def save(engine, directory: str | Path) -> None:
    """Collective over the engine's group: every rank writes its shards; rank 0 the JSON. Nothing is
    written when a tensor is not finite (check_finite)."""
    directory = Path(directory)
    with engine.phase(optimizer=True):
        writes_plain = _stage_writer(engine)
        model = model_tensors(engine)
        osd, flat = _optimizer_state(engine) if engine.optimizer is not None else ({}, {})
        check_finite(engine, {**model, **flat})
        save_tensors(model, directory / "model", writes_plain)
        state = {"global_step": engine.global_step}
        if engine.optimizer is not None:
            save_tensors(flat, directory / "optim", writes_plain)
            state["param_groups"] = _json_ready(osd["param_groups"])
            state["scheduler"] = _json_ready(engine.scheduler.state_dict())
    if _is_rank0():
        atomic_write_text(directory / TRAIN_STATE_JSON, json.dumps(state, indent=1))


def load(engine, directory: str | Path) -> None:
    """Collective: fill this rank's shards from `directory` (any saved dp/tp layout), then the JSON state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    directory = Path(directory)
    state = json.loads((directory / TRAIN_STATE_JSON).read_text())
    with engine.phase(optimizer=True):
        tensors = model_tensors(engine)
        load_tensors(tensors, directory / "model")
        local = _local_names(engine)  # a pipeline stage's own names for the whole model's
        # with LoRA the dict holds only the trained tensors: the base stays as model.path loaded it
        options = StateDictOptions(strict=not engine.lora_layers)
        set_model_state_dict(engine.module, {local[k]: v for k, v in tensors.items()}, options=options)
        if engine.optimizer is not None:
            if "param_groups" not in state:
                raise ValueError(f"{directory} holds no optimizer state (saved from a frozen model)")
            osd, flat = _optimizer_state(engine)
            load_tensors(flat, directory / "optim")
            osd["param_groups"] = _saved_settings(state["param_groups"], osd["param_groups"])
            set_optimizer_state_dict(engine.module, engine.optimizer, osd)
            engine.scheduler.load_state_dict(_per_group(state["scheduler"], len(osd["param_groups"])))
    engine.global_step = int(state["global_step"])


# what a param group holds beside its settings: its members and the kernel this build picks for them
_GROUP_OWN = ("params", "fused", "foreach")


def _saved_settings(saved: list[dict], current: list[dict]) -> list[dict]:
    """The current param groups with the saved settings (lr, betas, ...). The groups are the layout's
    (engines/optim.py: one per mesh and placements), so a checkpoint of another layout has another count;
    every group is built with the same settings, so the first saved group's are every group's."""
    settings = {k: v for k, v in saved[0].items() if k not in _GROUP_OWN}
    if "betas" in settings:  # JSON has no tuples; AdamW reads a pair either way, but keep the type exact
        settings["betas"] = tuple(settings["betas"])
    return [{**group, **settings} for group in current]


def _per_group(scheduler: dict, groups: int) -> dict:
    """The LR scheduler's state with its per-group lists (one value: every group has the same lr) as
    long as this engine's param groups, which LambdaLR zips them with."""
    out = dict(scheduler)
    for key in ("base_lrs", "_last_lr"):
        if key in out:
            out[key] = out[key][:1] * groups
    return out
