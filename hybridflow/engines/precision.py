"""An engine's dtypes (docs/checkpoints.md, "Dtypes"): frozen models' parameters stored in the compute
dtype (`cast_parameters`), and mixed precision on one data-parallel rank computed as FSDP2's
MixedPrecisionPolicy computes it over several (`ComputeCopies`).

With FSDP2 (dp >= 2) the gathered parameters are cast to the compute dtype, so the whole forward and
backward run in it (residual stream, norms, activations) and each gradient is reduced into the fp32
shards. One rank has no FSDP (parallelize.uses_fsdp): `ComputeCopies` does the same in place. While
`active()`, every parameter holds a compute-dtype copy of its fp32 value, and each gradient is added to an
fp32 sum as it is accumulated (FSDP2's reduce_dtype); on exit the fp32 values are back, with those sums
as their `.grad`, for clipping, the optimizer, checkpoints and weight sync, which never see the copies.

Why not autocast, which this replaces on that path: autocast keeps the residual stream and the elementwise
ops in fp32 and casts each linear layer's input to bf16; on a CPU those casts and fp32 passes made the 25M
model's bf16 update ~1.15x slower (docs/bench/vs_trl.md, "One-rank bf16 as FSDP2 computes it"). It also
made dp = 1 round differently from dp = 2.

Plain (non-DTensor) parameters only: tensor-parallel, pipelined and LoRA engines keep autocast (their
parameters are DTensors, stage modules or already in the compute dtype).
"""

from __future__ import annotations

import contextlib

import torch


def one_rank_precision(param_dtype, lora: bool, parallel) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(autocast dtype, compute-copies dtype) of a trainable engine that computes in `param_dtype` with no
    FSDP (None: fp32, or FSDP casts): copies where its parameters are plain tensors it may swap, autocast
    for DTensor (tp > 1) weights, pipeline stages and LoRA (whose base is stored in the dtype already)."""
    if param_dtype is None:
        return None, None
    if lora or parallel.tp > 1 or parallel.pp > 1:
        return param_dtype, None
    return None, param_dtype


class ComputeCopies:
    """The parameters of `module` computed in `dtype`, with fp32 gradients (module docstring)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.params = list(module.parameters())
        self.dtype = dtype
        self._sums: dict[torch.nn.Parameter, torch.Tensor] | None = None  # None: not active
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._take_grad)

    def _take_grad(self, p: torch.nn.Parameter) -> None:
        """Move the compute-dtype gradient just accumulated into the parameter's fp32 sum."""
        if self._sums is None or p.grad is None:
            return
        total = self._sums.get(p)
        if total is None:
            self._sums[p] = p.grad.float()
        else:
            total.add_(p.grad)
        p.grad = None  # the low-precision gradient is never held beside the next micro-batch's

    @contextlib.contextmanager
    def active(self):
        """Parameters in the compute dtype for the body's forwards and backwards; fp32 again after it,
        each trainable one's `.grad` the fp32 sum of the gradients the body's backwards produced."""
        if self._sums is not None:  # already active: a second swap would take the copies for the masters
            yield
            return
        masters = [p.data for p in self.params]
        grads = [p.grad for p in self.params]  # fp32 gradients from before: the sums add to them
        self._sums = {}
        try:
            for p, m in zip(self.params, masters):
                p.grad = None
                p.data = m.to(self.dtype)
            yield
        finally:
            sums, self._sums = self._sums, None
            for p, m, g in zip(self.params, masters, grads):
                p.grad = None  # a compute-dtype gradient no hook took (the body raised)
                p.data = m
                total = sums.get(p)
                p.grad = g if total is None else (total if g is None else g.add_(total))


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype, frozen_only: bool = False) -> None:
    """Parameters (not buffers: rotary tables stay fp32, as HF keeps them) to `dtype`, ties kept;
    frozen_only: only those that need no grad (a LoRA model's base)."""
    new: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and not (frozen_only and p.requires_grad):
                if id(p) not in new:
                    new[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
