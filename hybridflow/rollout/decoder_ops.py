"""Elementwise pieces of the functional decoder (rollout/llama_decoder.py), each HF's math in as few aten
calls as it takes: on a small model a decode step is mostly op dispatch (docs/bench/generation.md,
"Decode-step overhead on small models"). tests/rollout/test_engine.py checks them bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's LlamaRMSNorm: fp32 statistics, cast back, then scale (that order keeps bf16 results equal).
    if x.dtype != torch.float32:
        return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
    # The same ops as F.rms_norm's CPU composite (mean is sum then div_), bit for bit, in 6 aten calls
    # instead of ~25 (its dtype checks and casts): a decode step runs 2 norms per layer on a few rows.
    r = (x * x).sum(-1, keepdim=True).div_(_scalar(x.shape[-1], x)).add_(_scalar(eps, x)).rsqrt_()
    return (x * r).mul_(weight)


_SCALARS: dict = {}


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-dim tensor of like's dtype and device, made once: an op given a Python number wraps
    and casts it first (3 more aten calls each time). fp32 only: there the arithmetic is the same (the
    number is cast to fp32 either way); a bf16 op computes with the number in fp32, not rounded to bf16."""
    key = (value, like.dtype, like.device)
    out = _SCALARS.get(key)
    if out is None:
        out = _SCALARS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return out


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin (..., hd) -> cat(-sin[:hd/2], sin[hd/2:]): with it, HF's rope x*cos + rotate_half(x)*sin
    is x*cos + roll(x, hd/2)*signed_sin, bit for bit (only signs move), in 3 ops instead of 7."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (N, heads, hd); cos, sin_signed (N, 1, hd) (see signed_sin)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _functional_act(act: Callable) -> Callable:
    # SiLU (Llama's, as transformers' SiLUActivation or torch's nn.SiLU module) as the bare function:
    # a module call costs ~2 us of Python per use, twice the op itself on a few rows.
    return F.silu if type(act).__name__ in ("SiLU", "SiLUActivation") else act
