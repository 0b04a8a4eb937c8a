"""Optimizer, LR schedule and global gradient-norm clipping that work on plain, FSDP2 and DTensor-TP params.

Why our own clipping: after TP + FSDP2 a model holds DTensors on two meshes (2-D ("dp","tp") for TP
params, 1-D "dp" for the rest); `torch.nn.utils.clip_grad_norm_` stacks per-param norms and cannot
mix meshes. We take the norm per (mesh, placements) group, reduce each to a full value, and combine.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridflow.engines.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    # The fused kernel: one pass over each tensor instead of ~10 ops per parameter (CPU time of the 25M
    # model's step 0.017 s against 0.125 s for the loop; on DTensors each op of the loop also pays DTensor's
    # dispatch). It takes a list of DTensors of one mesh and placements only, so each such layout is its own
    # param group (FSDP2's dp shards are one; tensor parallelism adds its column / row shards).
    fused = all(p.dtype in _FUSED_DTYPES for p in params)
    return torch.optim.AdamW(
        [{"params": group} for group in layout_groups(params)],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
        fused=fused or None,
    )


def layout_groups(tensors) -> list[list[torch.Tensor]]:
    """`tensors` grouped by (mesh, placements), plain tensors together: what list kernels accept at once."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        key = (id(t.device_mesh), tuple(t.placements)) if isinstance(t, DTensor) else ("local",)
        groups[key].append(t)
    return list(groups.values())


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warmup, then constant, or a
    linear / cosine decay from 1 to min_lr_ratio at step total_steps (held there after it)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    shape = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    cfg.check()
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def global_grad_norm(params, pp_group=None) -> torch.Tensor:
    """L2 norm of all gradients together, as a plain scalar tensor equal on every rank. pp_group: the
    pipeline ranks holding the model's other stages (engines/pipeline.py), whose squares are summed in."""
    total_sq = torch.zeros((), dtype=torch.float32)
    for grads in layout_groups(p.grad for p in params if p.grad is not None):
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.detach().float().cpu() ** 2
    if pp_group is not None:  # on the grads' device: NCCL reduces device tensors only
        device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
        total_sq = total_sq.to(device)
        dist.all_reduce(total_sq, group=pp_group)
        total_sq = total_sq.cpu()
    return total_sq.sqrt()


def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Scale gradients so their global L2 norm (across pipeline stages with pp_group) is at most max_norm
    (<= 0: only measure). Returns the norm before clipping. Non-finite norms leave gradients untouched
    (the caller skips the step)."""
    params = list(params)
    norm = global_grad_norm(params, pp_group)
    if max_norm > 0 and torch.isfinite(norm):
        coef = float(max_norm / (norm + 1e-6))
        if coef < 1.0:  # one list op per layout, not one DTensor dispatch per gradient
            for grads in layout_groups(p.grad for p in params if p.grad is not None):
                torch._foreach_mul_(grads, coef)
    return norm


def params_finite(params) -> bool:
    """Whether every parameter this rank holds (its local shard of a DTensor) is finite: one max-abs list
    kernel and one sync per device (the largest |x| cannot overflow as a sum of squares can; NaN propagates)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        t = p.to_local() if isinstance(p, DTensor) else p
        if t.numel():
            by_device[t.device].append(t.detach())
    peaks = [
        torch.stack([n.float() for n in torch._foreach_norm(ts, math.inf)]).max() for ts in by_device.values()
    ]
    return all(bool(torch.isfinite(peak)) for peak in peaks)
