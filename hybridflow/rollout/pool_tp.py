"""Generation tensor parallelism on a rollout-only pool (trainer.rollout_ahead=1; docs/design.md,
"One-step-ahead rollout").

The rollout pool's ranks form consecutive generation TP groups of rollout.tg ranks (ranks 0..tg-1 are
replica 0, and so on), each group one replica that the prompts are split over. Each rank holds only its
Megatron slice of the weights, as the 3D-HybridEngine's generation shard is laid out
(docs/hybrid_engine.md): q/k/v and gate/up (and their biases) by output rows, o and down by input
columns, norms whole, embeddings and lm_head vocab-parallel (V/tg rows) when the vocabulary divides by
tg, else whole. The slices are the model's own (contiguous) parameters: `load_shard` reads them from
model.path's safetensors (the full tensors are never allocated), `keep_shard` cuts a fully loaded model
down; the weight sync then sends each rank only its slice (workers/weight_sync.py) and copies it in
place, and generate reads them as they are.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.rollout.tp_group import TPGroup

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def consecutive_groups(world_size: int, tg: int) -> list[list[int]]:
    """The generation TP groups of a rollout pool: consecutive ranks, tg each."""
    if tg < 1 or world_size % tg:
        raise ValueError(f"rollout.tg={tg} must divide the rollout pool's {world_size} ranks")
    return [list(range(s, s + tg)) for s in range(0, world_size, tg)]


def pool_tp_group(rank: int, world_size: int, tg: int) -> TPGroup | None:
    """This rank's generation TP group (None for tg = 1). Collective: every rank of the pool calls it
    (torch.distributed.new_group is called for every group, in the same order, on every rank)."""
    if tg == 1:
        return None
    mine = None
    for ranks in consecutive_groups(world_size, tg):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = TPGroup(group, tg, ranks[0])
    return mine


def split_dim(name: str, vocab_split: bool) -> int | None:
    """The dimension HF tensor `name` is split along in a generation shard (None: held whole)."""
    kind = name.split(".")[-2] if "." in name else name
    if kind in COLUMN or (vocab_split and kind in VOCAB):
        return 0
    if kind in ROW and name.endswith("weight"):
        return 1
    return None  # norms, and a row-parallel bias (added once, after the all-reduce)


def shard_of(name: str, t: torch.Tensor, index: int, tg: int, vocab_split: bool) -> torch.Tensor:
    """TP rank `index`'s (of tg) slice of full tensor `name`, as a view."""
    dim = split_dim(name, vocab_split)
    if dim is None or tg == 1:
        return t
    if t.shape[dim] % tg:
        raise ValueError(f"rollout.tg={tg} must divide {name}'s dimension {dim} (shape {tuple(t.shape)})")
    size = t.shape[dim] // tg
    return t.narrow(dim, index * size, size)


def vocab_splits(model: nn.Module, tg: int) -> bool:
    """Whether the embeddings and lm_head are vocab-parallel: the vocabulary divides by tg."""
    return model.get_input_embeddings().num_embeddings % tg == 0


def generation_shard(model: torch.nn.Module, index: int, tg: int) -> dict[str, torch.Tensor]:
    """HF name -> this TP rank's (`index` of tg) slice of `model`'s full weights, as views. Tied weights
    appear once (named_parameters), so lm_head falls back to the split embeddings in the decoder."""
    vocab = vocab_splits(model, tg)
    return {name: shard_of(name, p.detach(), index, tg, vocab) for name, p in model.named_parameters()}


def _replace(model: nn.Module, new: dict[int, torch.Tensor]) -> None:
    """Put each parameter's new tensor (by id of the old parameter) in every module holding it, so a
    tied lm_head stays the embedding's twin."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(new[id(p)], requires_grad=False)
                module._parameters[pname] = made[id(p)]


@torch.no_grad()
def keep_shard(model: nn.Module, index: int, tg: int) -> nn.Module:
    """Cut a fully loaded model down to TP rank `index`'s slices, each its own contiguous tensor (the
    full ones are freed): for model directories whose safetensors `load_shard` cannot read by name."""
    vocab = vocab_splits(model, tg)
    _replace(model, {id(p): shard_of(n, p, index, tg, vocab).clone() for n, p in model.named_parameters()})
    return model


@torch.no_grad()
def load_shard(model: nn.Module, index: int, tg: int, device: torch.device) -> nn.Module:
    """Fill a meta-built HF model (models/meta.py) with TP rank `index`'s slices only: each a slice of
    the safetensors file's memory map (safe_open(...).get_slice) copied into a tensor of the slice's
    size, so no full tensor is allocated on this rank (a 256 MiB tensor's 1/8 row slice added ~6 MiB
    of resident memory before the copy)."""
    from safetensors import safe_open

    from hybridflow.models.meta import WEIGHTS_ATTR, weight_files

    files = weight_files(getattr(model, WEIGHTS_ATTR))
    vocab = vocab_splits(model, tg)
    new = {}
    with contextlib.ExitStack() as stack:
        handles = {}
        for name, p in model.named_parameters():
            if files[name] not in handles:
                handles[files[name]] = stack.enter_context(safe_open(str(files[name]), framework="pt"))
            part = shard_of(name, torch.empty(p.shape, device="meta"), index, tg, vocab)
            dim = split_dim(name, vocab) if part.shape != p.shape else None
            index_ = tuple(
                slice(None) if d != dim else slice(index * part.shape[d], (index + 1) * part.shape[d])
                for d in range(p.dim())
            )
            # a slice may be a view of the file's whole tensor: copy it into a tensor of its own size
            new[id(p)] = torch.empty(part.shape, dtype=p.dtype, device=device)
            new[id(p)].copy_(handles[files[name]].get_slice(name)[index_])
    _replace(model, new)
    return model


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as this rank holds them (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
