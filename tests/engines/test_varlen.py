"""engines/varlen.py's kernel choice: flash's forward with the math kernel's gradient for short low-precision
packed calls on CPU. Pure tensor checks, no model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridflow.engines import varlen


def _qkv(dtype, requires_grad=True, shape=(3, 4, 9, 8)):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_(requires_grad) for _ in range(3)]


def test_flash_forward_math_backward_is_each_kernels_own_result():
    mask = torch.ones(9, 9, dtype=torch.bool).tril(diagonal=0)
    grad_out = torch.randn(3, 4, 9, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for how in ({"is_causal": True}, {"attn_mask": mask}):
        q, k, v = _qkv(torch.bfloat16)
        out = varlen._sdpa_math_backward(q, k, v, **how)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        q2, k2, v2 = _qkv(torch.bfloat16)
        assert torch.equal(out, F.scaled_dot_product_attention(q2, k2, v2, **how))  # the forward: PyTorch's
        with sdpa_kernel(SDPBackend.MATH):  # the gradient: the math kernel's, exactly
            expected = torch.autograd.grad(
                F.scaled_dot_product_attention(q2, k2, v2, **how), (q2, k2, v2), grad_out
            )
        assert all(torch.equal(g, e) for g, e in zip(grads, expected))


def test_chosen_only_for_differentiated_short_low_precision_cpu_calls():
    q = _qkv(torch.bfloat16)[0]
    assert varlen._sdpa_for(q, 9, 0.0) is varlen._sdpa_math_backward
    assert varlen._sdpa_for(q, varlen.MATH_MAX_TOKENS + 1, 0.0) is F.scaled_dot_product_attention
    assert varlen._sdpa_for(q, 9, 0.1) is F.scaled_dot_product_attention  # a recomputed dropout would differ
    with torch.no_grad():  # forward-only passes: PyTorch's kernel, the same forward as training's
        assert varlen._sdpa_for(q, 9, 0.0) is F.scaled_dot_product_attention
    q32 = _qkv(torch.float32)[0]
    assert varlen._sdpa_for(q32, 9, 0.0) is F.scaled_dot_product_attention
    with torch.autocast("cpu", dtype=torch.bfloat16):  # HF's rope hands sdpa fp32 q, k under autocast
        assert varlen._sdpa_for(q32, 9, 0.0) is varlen._sdpa_math_backward
