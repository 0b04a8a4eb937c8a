"""fp32 linear layers through oneDNN on CPUs where its kernels outrun MKL's (`model.cpu_gemm`).

PyTorch runs fp32 `F.linear` on CPU through MKL's sgemm. On some CPUs MKL takes a slow path (an AMD EPYC
with AVX-512, 2 threads: 194 GFLOP/s at the 25M model's training shapes, against 423 for oneDNN's JIT kernels
on the same tensors; docs/bench/cpu_gemm.md), so `use_onednn(model)` routes a plain model's fp32 `nn.Linear`
layers through `torch.ops.mkldnn._linear_pointwise`, forward and both backward GEMMs, and the built-in
decoder multiplies by `OneDnnWeight`s, where `resolve` says so: "auto" on the CPUs where MKL takes that
path (`mkl_slow_path`). Nothing changes on GPUs, under autocast, for DTensor (tensor-parallel)
weights or for other dtypes: those calls take `F.linear` as before.

oneDNN builds (JIT-compiles) a kernel per GEMM shape, 1-3 ms each at the 25M model's: a packed micro-batch's
token count changes every step, so rows are padded up to a bucket (`bucket_rows`, at most 1/8 extra) and a
run meets a few dozen shapes, not one per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.cpu import this_cpu

CHOICES = ("auto", "onednn", "mkl")


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def bucket_rows(m: int) -> int:
    """Rows padded to: a multiple of 8 up to 64, then 8 buckets per doubling (<= 12.5% padding)."""
    if m <= 64:
        return max(8, -(-m // 8) * 8)
    step = 1 << (int(math.log2(m)) - 3)
    return -(-m // step) * step


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T through oneDNN; M already a bucket."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T [+ bias] through oneDNN, no autograd: rows padded to their bucket."""
    m = x.shape[0]
    y = _mm(_padded(x, bucket_rows(m)), weight)[:m]
    return y if bias is None else y.add_(bias)


def _linear_nd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T [+ bias] -> (..., N) through `matmul`."""
    return matmul(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


class OneDnnWeight:
    """A (out, in) fp32 weight the built-in decoder multiplies through oneDNN: (x, bias) -> x @ w.T + b."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return matmul(x, self.weight, bias)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows and x.is_contiguous():
        return x
    out = x.new_empty((rows, x.shape[1]))
    out[: x.shape[0]] = x
    out[x.shape[0] :] = 0  # zeros: padded rows add nothing to the weight's gradient (0 * NaN would)
    return out


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        # the input itself is kept for backward, not its padded copy: one copy per layer would add up to
        # one more activation per linear layer (q, k and v each pad the same input)
        ctx.save_for_backward(x, weight)
        ctx.rows, ctx.has_bias = x.numel() // x.shape[-1], bias is not None
        return _linear_nd(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows = bucket_rows(ctx.rows)
        g = _padded(grad.reshape(-1, grad.shape[-1]), rows)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): weight^T as a (K, N) "weight"
            gx = _mm(g, weight.t())[: ctx.rows].reshape(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K): the padded rows are zeros in both
            gw = _mm(g.t(), _padded(x.reshape(-1, x.shape[-1]), rows).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.reshape(-1, grad.shape[-1]).sum(0)
        return gx, gw, gb


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(weight) in (torch.Tensor, nn.Parameter)  # not a DTensor
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through oneDNN where eligible (fp32 on CPU, plain tensors, no autocast), else F.linear."""
    if not _eligible(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _OneDnnLinear.apply(x, weight, bias)
    # nothing to differentiate (log-probs, generation): no autograd node, ~10 us less a call
    return _linear_nd(x, weight, bias)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def use_onednn(model: nn.Module) -> int:
    """Route every `nn.Linear` of `model` through `linear`; returns how many. Idempotent."""
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and "forward" not in mod.__dict__:
            mod.forward = _forward.__get__(mod)
            n += 1
    return n


def routed(module: nn.Module) -> bool:
    """Whether `use_onednn` routed this layer."""
    fwd = module.__dict__.get("forward")
    return getattr(fwd, "__func__", None) is _forward


def mkl_slow_path() -> bool:
    """Whether MKL's sgemm runs below this CPU's vector width: an x86 CPU with AVX-512 that is not Intel's.
    MKL picks its kernels by vendor and gives such CPUs its AVX2 ones, half the width (the AMD EPYC above:
    185-194 GFLOP/s against oneDNN's 399-423). A rule, not a timing probe: every process of a job, and a
    resumed job, must multiply the same way to give the same numbers, and a probe near its threshold
    flips with the machine's load from one process to the next."""
    cpu = this_cpu()
    return cpu.vendor not in ("", "GenuineIntel") and "avx512f" in cpu.flags


def resolve(choice: str, device: torch.device | str) -> bool:
    """Whether fp32 linear layers on `device` go through oneDNN for `choice` ("auto" | "onednn" | "mkl")."""
    if choice not in CHOICES:
        raise ValueError(f"model.cpu_gemm must be one of {', '.join(CHOICES)}, got {choice!r}")
    if torch.device(device).type != "cpu" or choice == "mkl":
        return False
    if not available():
        if choice == "onednn":
            raise ValueError(
                "model.cpu_gemm=onednn: this PyTorch build has no oneDNN linear op; use auto or mkl"
            )
        return False
    return choice == "onednn" or mkl_slow_path()
