"""Sharded initialisation: a model built on the meta device gets only this rank's shards, read as slices
from the HF safetensors files, so no rank ever holds the full model (docs/checkpoints.md).

Order (torchtitan's): `models.hf.load_*(..., device="meta")` builds the module with parameters on the
meta device (buffers stay real: rotary tables are computed, not stored); `parallelize` applies TP and
FSDP2 to the meta parameters (DTensors with the final placements, no storage); `materialize` then
allocates each rank's local shards (`to_empty`) and fills them with `safe_open(...).get_slice(name)
[offsets]`: a rank reads exactly the rows and columns its DTensor chunk covers. GPT-2's fused qkv,
stored column-permuted under tp (parallelize.py), is read whole along that one dimension, permuted and
narrowed. `InitStats` counts the parameter bytes allocated and read on this rank: the sharded-init
test and the memory benchmark assert on them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.models import lora
from hybridflow.models.meta import WEIGHTS_ATTR, ZERO_INIT_ATTR, weight_files


@dataclass
class InitStats:
    """Parameter bytes this rank allocated and read from disk at init, and the largest full tensor."""

    bytes_allocated: int = 0
    bytes_read: int = 0
    largest_tensor_bytes: int = 0
    full_model_bytes: int = 0


def _tied(root: nn.Module) -> list[tuple[tuple[nn.Module, str], list[tuple[nn.Module, str]]]]:
    """Parameters shared by several modules (a tied lm_head): (first holder, the other holders)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    return [(h[0], h[1:]) for h in holders.values() if len(h) > 1]


def _local_chunk(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, its shape, its offset in the global tensor) for a DTensor or a plain tensor."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), tuple(shape), tuple(offset)
    return p, tuple(p.shape), (0,) * p.dim()


@torch.no_grad()
def materialize(
    root: nn.Module, model: nn.Module, device: torch.device, transforms: dict, seed: int = 0, renumber=None
) -> InitStats:
    """Allocate this rank's shards of `root`'s meta parameters on `device` and fill them from the
    safetensors files of the meta-built HF `model` (inside `root`). transforms: hf_layout_transforms.
    LoRA adapters (models/lora.py) get their seeded initial values; a base layer reads its HF name.
    renumber: a parameter's name in the whole model (a pipeline stage renumbers its layers), else its own."""
    from safetensors import safe_open

    files = weight_files(getattr(model, WEIGHTS_ATTR))
    buffers = {n: b.detach().clone() for n, b in root.named_buffers()}
    ties = _tied(root)
    root.to_empty(device=device)  # FSDP2 re-registers its sharded parameters on the new storage
    for (owner, pname), others in ties:  # to_empty gives each module its own copy: tie them again
        for module, name in others:
            module._parameters[name] = owner._parameters[pname]
    for n, b in root.named_buffers():
        b.copy_(buffers[n])
    stats = InitStats()
    with contextlib.ExitStack() as stack:
        handles = {}
        zero = set(getattr(model, ZERO_INIT_ATTR, ()))
        for name, p in model.named_parameters():
            name = renumber(name) if renumber is not None else name
            if name in zero:  # a new value head: starts at zero, nothing to read
                _local_chunk(p)[0].zero_()
                continue
            local, shape, offset = _local_chunk(p)
            if lora.is_adapter(name):  # this rank's slice of the whole initial value
                whole = lora.initial_adapter(name, tuple(p.shape), seed)
                local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
                continue
            stored = lora.hf_name(name)
            path = files[stored]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            sl = handles[path].get_slice(stored)
            perm = transforms.get(name)
            index = tuple(
                slice(None) if perm is not None and d == perm[0] else slice(o, o + s)
                for d, (o, s) in enumerate(zip(offset, shape))
            )
            t = sl[index]
            if perm is not None:
                dim, order = perm
                t = t.index_select(dim, order).narrow(dim, offset[dim], shape[dim])
            local.copy_(t)
            full = p.numel() * p.element_size()
            stats.bytes_allocated += local.numel() * local.element_size()
            stats.bytes_read += t.numel() * t.element_size()
            stats.largest_tensor_bytes = max(stats.largest_tensor_bytes, full)
            stats.full_model_bytes += full
    return stats
