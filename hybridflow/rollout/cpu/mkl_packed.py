"""MKL's packed GEMM for fp32 CPU decode, behind a self-check (the only place the private ops are used).

Why: single-threaded MKL multiplies the 2-32-row matrices of decode ~1.2-1.4x faster from a weight in its
packed format (`cblas_sgemm_pack`): it skips re-packing the weight at every call, which dominates at small
row counts. `torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear` are private torch ops, so
`mkl_pack_works` checks once per process that they exist and give x @ w.T for row counts other than the
pack's before the decoder (rollout/llama_decoder.py) relies on them; when not, it uses plain transposed
copies.
"""

from __future__ import annotations

import torch


class MklPacked:
    """A (out, in) linear weight in MKL's packed GEMM format, fp32 CPU only. Call: (x, bias) -> x @ w.T + b.

    A packed B matrix is valid for any number of rows M (only N and K are fixed by the pack)."""

    __slots__ = ("packed", "shape")

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), 64)
        # The op reads N and K from this tensor's shape and falls back to a plain linear on it only
        # when M differs from its batch-size argument; __call__ always passes M, so its data is never
        # read and a zero-stride view (no memory) will do.
        self.shape = weight.new_empty(()).expand(weight.shape)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _linear()(x, self.packed, self.shape, bias, x.shape[0])


_LINEAR = None


def _linear():
    """The op's compiled entry point: calling it skips two layers of Python dispatch in torch.ops (~3 us
    a call, ~20 calls per decode step)."""
    global _LINEAR
    if _LINEAR is None:
        overload = torch.ops.mkl._mkl_linear.default
        _LINEAR = getattr(overload, "_op", overload)
    return _LINEAR


_MKL_PACK_OK: bool | None = None


def mkl_pack_works() -> bool:
    """Whether MKL packed GEMM is available and gives x @ w.T for row counts other than the pack's."""
    global _MKL_PACK_OK
    if _MKL_PACK_OK is None:
        _MKL_PACK_OK = False
        mkl_ops = getattr(torch.ops, "mkl", None)
        if torch.backends.mkl.is_available() and hasattr(mkl_ops, "_mkl_linear"):
            try:
                g = torch.Generator().manual_seed(0)
                w = torch.randn(48, 40, generator=g)
                packed = MklPacked(w)
                _MKL_PACK_OK = all(
                    torch.allclose(packed(x, None), x @ w.t(), rtol=1e-4, atol=1e-4)
                    for x in (torch.randn(m, 40, generator=g) for m in (1, 3, 17, 64, 130))
                )
            except RuntimeError:
                _MKL_PACK_OK = False
    return _MKL_PACK_OK
