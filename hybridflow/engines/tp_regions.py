"""Tensor-parallel linear layers that compute on their local shards (Megatron-LM's regions), with the
parameters still DTensors on the "tp" mesh axis, placed exactly as torch's ColwiseParallel and
RowwiseParallel place them: the optimizer, clipping, FSDP2, checkpoints and the 3D-HybridEngine see the
same sharded parameters, and gradients reach them through `DTensor.to_local`.

Why not torch's styles as they are: they turn every activation into a DTensor, and DTensor prices each
op by a sharding propagation cached per input shape. The training engine packs each micro-batch into
one row of its real tokens (engines/packing.py), whose length changes from one step to the next, so in a
run nearly every step's linear layers missed that cache: ~30 propagations a step on a 4-layer model, ~80
ms against a 210 ms step on 2 CPU ranks (docs/bench/planner.md). Here the activations stay plain tensors
and each layer pays two explicit collectives, the ones torch's styles issue:

    column-parallel  y_i = x W_i^T + b_i          forward: nothing;   backward: all-reduce of dL/dx
    row-parallel     y = sum_i x_i W_i^T + b      forward: all-reduce; backward: nothing (dL/dy is whole)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class _EnterRegion(torch.autograd.Function):
    """Identity forward; backward sums the input's gradient over the group (each rank holds a part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # reduced in place; autograd may hold on to the one it gave
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _LeaveRegion(torch.autograd.Function):
    """Sum over the group forward; the gradient (the same on every rank) passes through as is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _local(p: nn.Parameter | None) -> torch.Tensor | None:
    return None if p is None else p.to_local()


def _colwise_forward(module: nn.Linear, group, x: torch.Tensor) -> torch.Tensor:
    return F.linear(_EnterRegion.apply(x, group), _local(module.weight), _local(module.bias))


def _rowwise_forward(module: nn.Linear, group, x: torch.Tensor) -> torch.Tensor:
    y = _LeaveRegion.apply(F.linear(x, _local(module.weight)), group)
    return y if module.bias is None else y + _local(module.bias)


class _Bound:
    """module.forward for a linear layer in a region: picklable and named, unlike a lambda."""

    def __init__(self, fn, module: nn.Module, group):
        self.fn, self.module, self.group = fn, module, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.module, self.group, x)


def _on_local_shards(style, module: nn.Linear, device_mesh: DeviceMesh, forward) -> nn.Module:
    """`module`'s parameters distributed as `style` places them, its forward `forward` on their shards."""
    distribute_module(module, device_mesh, style._partition_linear_fn)
    module.forward = _Bound(forward, module, device_mesh.get_group())
    return module


class LocalColwise(ColwiseParallel):
    """ColwiseParallel's sharding (weight and bias by output rows) for an nn.Linear whose input is whole
    on every rank; its output is this rank's columns, a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)
        return _on_local_shards(self, module, device_mesh, _colwise_forward)


class LocalRowwise(RowwiseParallel):
    """RowwiseParallel's sharding (weight by input columns, bias whole) for an nn.Linear whose input is
    this rank's columns; its output, the sum over the group, is whole on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)
        return _on_local_shards(self, module, device_mesh, _rowwise_forward)
