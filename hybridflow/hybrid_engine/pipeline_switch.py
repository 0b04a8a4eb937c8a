"""The 3D-HybridEngine's switch for an actor trained in pipeline stages (p > 1, t = 1) that generates with
pg = tg = 1: each rank generates from the whole model (docs/hybrid_engine.md).

Each rank first gathers its own stage's weights whole over dp (FSDP2 shards, dim 0), then the p ranks of
its pp group (its micro-DP group: dg = p for pg = tg = 1) exchange their stages: stage s broadcasts its
weights, one flat buffer per dtype, to the others. The weights are bound, under the whole model's names,
to `skeleton`, a whole model built on the meta device (its buffers real: the rotary tables), which the
generation engine reads as its own; on the way back they are replaced by meta tensors again, so nothing
of the generation copy stays between rounds.

Bytes received per rank are cost.pipeline_switch_cost's: (d-1)/d of its own stage, and every other stage.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.engines.pipeline import hf_name
from hybridflow.hybrid_engine.comm import CountedComm, tensor_bytes
from hybridflow.hybrid_engine.cost import pipeline_switch_cost
from hybridflow.hybrid_engine.resharder import ReshardStats


class PipelineResharder:
    """`with r.generation() as (weights, None)`: `skeleton` holds the whole model for the duration;
    r.stats then holds the round's counters. engine: the actor's TrainEngine with engine.pipeline set."""

    method = "hybridflow"
    in_place = True  # the generation engine reads the skeleton's own parameters

    def __init__(self, engine, skeleton: nn.Module):
        if engine.mesh["tp"].size() != 1:
            raise ValueError("actor.parallel.pp > 1 generates with tp = 1 for now; set actor.parallel.tp=1")
        self.engine, self.pipe, self.skeleton = engine, engine.pipeline, skeleton
        self.dp_size = engine.dp_size
        self.comm, self.stats = CountedComm(), ReshardStats()
        self._specs: list[list[tuple[str, tuple, torch.dtype]]] | None = None

    @contextlib.contextmanager
    def generation(self):
        self.comm.reset()
        with self.engine.phase():
            start = time.perf_counter()
            own, fsdp = self._own_stage()
            weights = self._exchange(own)
            _bind(self.skeleton, weights)
            seconds = time.perf_counter() - start
            try:
                yield weights, None
            finally:
                _unbind(self.skeleton)
        stage_bytes = sum(tensor_bytes(t) for t in own.values())
        model_bytes = sum(tensor_bytes(t) for t in weights.values())
        received, held = pipeline_switch_cost(model_bytes, stage_bytes, self.dp_size)
        self.stats = ReshardStats(
            fsdp + self.comm.stats.bytes_received, received, model_bytes, held, seconds,
            len(own) * (self.dp_size > 1) + self.comm.stats.calls,
        )  # fmt: skip

    def _own_stage(self) -> tuple[dict[str, torch.Tensor], int]:
        """This stage's weights whole (whole model's names), and the bytes their dp all-gathers received
        (FSDP2 pads dim 0 to d equal shards)."""
        model, out, fsdp = self.engine.hf_model, {}, 0
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                rows = -(-p.shape[0] // self.dp_size)
                row_bytes = tensor_bytes(p.to_local()[:1]) if p.to_local().shape[0] else 0
                fsdp += (self.dp_size - 1) * rows * row_bytes
                p = p.full_tensor()
            out[hf_name(model, name)] = p.detach()
        return out, fsdp

    def _exchange(self, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's weights, each broadcast by its stage's rank of the pp group."""
        group = self.pipe.group
        if self._specs is None:  # names, shapes and dtypes of each stage: fixed, exchanged once
            mine = [(n, tuple(t.shape), t.dtype) for n, t in own.items()]
            self._specs = [None] * self.pipe.pp
            dist.all_gather_object(self._specs, mine, group=group)
        out: dict[str, torch.Tensor] = {}
        device = next(iter(own.values())).device
        for stage, specs in enumerate(self._specs):
            src = dist.get_global_rank(group, stage)
            for dtype in dict.fromkeys(d for _, _, d in specs):
                items = [(n, s) for n, s, d in specs if d == dtype]
                numel = sum(torch.Size(s).numel() for _, s in items)
                if stage == self.pipe.pp_rank:
                    buf = torch.cat([own[n].reshape(-1) for n, _ in items])
                else:
                    buf = torch.empty(numel, dtype=dtype, device=device)
                self.comm.broadcast(buf, src, group)
                off = 0
                for n, s in items:
                    k = torch.Size(s).numel()
                    out[n] = buf[off : off + k].view(s)
                    off += k
        return out


def _bind(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """The model's parameters replaced by `weights` (by name), without copies."""
    for name, _ in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = nn.Parameter(weights[name], requires_grad=False)


def _unbind(model: nn.Module) -> None:
    """Back to meta parameters: the generation copy is freed once its last reference goes."""
    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=False
        )


def skeleton_on(model: nn.Module, device: torch.device) -> nn.Module:
    """A meta-built whole model with its buffers (rotary tables) moved to `device`, parameters left on meta."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)
    return model
