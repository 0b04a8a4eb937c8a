"""engines/varlen.py's kernel choice: flash's forward with the math kernel's gradient for short low-precision
packed calls on CPU. Pure tensor checks, no model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridflow.engines import shared_prompt, varlen


def _qkv(dtype, requires_grad=True, shape=(3, 4, 9, 8)):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_(requires_grad) for _ in range(3)]


def test_flash_forward_and_the_matmul_gradient():
    """The forward is PyTorch's sdpa, bit for bit; the gradient is attention's as matmuls, which in fp64 is
    sdpa's to rounding and in bf16 stays within bf16's error of the exact one (measured 0.4-0.7% of the
    largest gradient, PyTorch's bf16 math kernel 0.4-0.6%)."""
    mask = torch.ones(9, 9, dtype=torch.bool).tril(diagonal=0)
    grad_out = torch.randn(3, 4, 9, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for how in ({"is_causal": True}, {"attn_mask": mask}):
        q, k, v = _qkv(torch.bfloat16)
        out = varlen._sdpa_matmul_backward(q, k, v, **how)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        q2, k2, v2 = _qkv(torch.bfloat16)
        assert torch.equal(out, F.scaled_dot_product_attention(q2, k2, v2, **how))  # the forward: PyTorch's
        exact = [t.double().detach().requires_grad_() for t in (q2, k2, v2)]
        want = torch.autograd.grad(F.scaled_dot_product_attention(*exact, **how), exact, grad_out.double())
        for g, w in zip(grads, want):
            assert float((g.double() - w).abs().max()) <= 1.5e-2 * float(w.abs().max())


def test_attention_matmuls_is_sdpa():
    """fp64, so only rounding differs: causal, a 2-D mask, a batch mask, a per-head mask, grouped-query heads,
    more keys than queries (a response after its prompt) and an all-masked query row (weighs nothing)."""
    g = torch.Generator().manual_seed(4)
    b, h, hk, n, s, d = 3, 4, 2, 5, 9, 8
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in
               ((b, h, n, d), (b, hk, s, d), (b, hk, s, d)))  # fmt: skip
    right = torch.arange(s)[None, :] <= torch.arange(n)[:, None] + (s - n)  # bottom-right causal
    per_head = torch.rand(b, h, n, s, generator=g) < 0.7
    per_head[..., 0] = True
    empty = right[None, None].repeat(b, 1, 1, 1)
    empty[1, 0, 2] = False  # one query of one row sees no key
    cases = [
        (q, k[:, :, :n], v[:, :, :n], {"is_causal": True}),
        (q, k, v, {"attn_mask": right}),
        (q, k, v, {"attn_mask": right[None, None].expand(b, 1, n, s)}),
        (q, k, v, {"attn_mask": per_head}),
        (q, k, v, {"attn_mask": empty}),
    ]
    for qq, kk, vv, how in cases:
        leaves = [t.clone().requires_grad_() for t in (qq, kk, vv)]
        got = varlen._attention_matmuls(*leaves, scale=0.3, enable_gqa=True, **how)
        grads = torch.autograd.grad(got, leaves, torch.ones_like(got))
        twins = [t.clone().requires_grad_() for t in (qq, kk, vv)]
        with sdpa_kernel(SDPBackend.MATH):
            want = F.scaled_dot_product_attention(*twins, scale=0.3, enable_gqa=True, **how)
        want_grads = torch.autograd.grad(want, twins, torch.ones_like(want))
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        for a, w in zip(grads, want_grads):
            torch.testing.assert_close(a, w, atol=1e-12, rtol=0)
    assert (
        float(varlen._attention_matmuls(q, k, v, attn_mask=empty, enable_gqa=True)[1, :2, 2].abs().max()) == 0
    )


def test_chosen_only_for_differentiated_short_low_precision_cpu_calls():
    q = _qkv(torch.bfloat16)[0]
    assert varlen._sdpa_for(q, 9, 0.0) is varlen._sdpa_matmul_backward
    assert varlen._sdpa_for(q, varlen.MATH_MAX_TOKENS + 1, 0.0) is F.scaled_dot_product_attention
    assert varlen._sdpa_for(q, 9, 0.1) is F.scaled_dot_product_attention  # a recomputed dropout would differ
    with torch.no_grad():  # forward-only passes: PyTorch's kernel, the same forward as training's
        assert varlen._sdpa_for(q, 9, 0.0) is F.scaled_dot_product_attention
    q32 = _qkv(torch.float32)[0]
    assert varlen._sdpa_for(q32, 9, 0.0) is F.scaled_dot_product_attention
    with torch.autocast("cpu", dtype=torch.bfloat16):  # HF's rope hands sdpa fp32 q, k under autocast
        assert varlen._sdpa_for(q32, 9, 0.0) is varlen._sdpa_matmul_backward


def _row(heads=4, kv_heads=2, n=23, d=8, dtype=torch.float32):
    """query (1, H, n, D), key / value (1, Hkv, n, D) of one packed row (grouped-query heads)."""
    g = torch.Generator().manual_seed(2)
    shapes = ((1, heads, n, d), (1, kv_heads, n, d), (1, kv_heads, n, d))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _outputs_and_grads(attend, row):
    out = attend(*row)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    return [out, *torch.autograd.grad(out, row, grad_out)]


def test_gathered_call_equals_one_call_per_length():
    """One gathered sdpa call (varlen_gather.py) against the per-length calls: outputs and q / k / v grads,
    plain sequences (lengths repeating, as runs) and a shared-prompt row (two prompts, responses after them).
    fp32 sums over at most 23 keys of unit-variance products: 1e-5 absolute is ~100 ulps of the largest."""
    lens = [5, 5, 3, 7, 1, 2]
    plain = varlen.varlen_gather.build(varlen.varlen_gather.from_lengths(lens, 4), "cpu")
    for sdpa in (F.scaled_dot_product_attention, varlen._sdpa_matmul_backward):
        row = _row()
        want = _outputs_and_grads(
            lambda q, k, v, sdpa=sdpa: varlen._per_sequence(q, k, v, 0.0, None, lens, sdpa), row
        )
        got = _outputs_and_grads(
            lambda q, k, v, sdpa=sdpa: varlen.varlen_gather.attend(plain, q, k, v, 0.0, None, sdpa), row
        )
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # segments: prompt 0 (4), responses 1 (3), 2 (5) after it, a plain sequence 3 (6), prompt 4 (2), response 5 (3)
    sizes = [4, 3, 5, 6, 2, 3]
    layout = shared_prompt.SharedLayout(sizes, [(2, [4]), (4, [0]), (6, [3])],
                                        [((2, 3), [(4, 5)]), ((4, 3), [(0, 1)]), ((4, 5), [(0, 2)])])  # fmt: skip
    row = _row(n=sum(sizes))
    sdpa = F.scaled_dot_product_attention
    want = _outputs_and_grads(lambda q, k, v: varlen._shared(layout, q, k, v, 0.0, None, sdpa), row)
    plan = varlen.varlen_gather.build(varlen.varlen_gather.from_shared(layout), "cpu")
    got = _outputs_and_grads(lambda q, k, v: varlen.varlen_gather.attend(plan, q, k, v, 0.0, None, sdpa), row)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_gathered_only_while_the_padded_pairs_cost_less_than_the_calls_saved():
    """Extra (query, key) pairs x head width against (calls - 1) x CALL_ELEMS (2**21 = 2,097,152)."""
    vg = varlen.varlen_gather
    assert vg.from_lengths([4, 4], 1).pays(8, 64)  # one run, no padding: 0 extra pairs
    # [1, 100] as 2 calls: padded 2 x 100 x 100 = 20,000 pairs, real 1 + 10,000: 9,999 extra
    assert vg.from_lengths([1, 100], 2).pays(1, 64)  # 639,936 <= 2,097,152
    assert not vg.from_lengths([1, 100], 2).pays(8, 64)  # 5,119,488 > 2,097,152
    # a shared prompt of 3 before responses of 2 and 5: keys 3, 5 and 8, queries padded to 5, keys to 8
    layout = shared_prompt.SharedLayout([3, 2, 5], [(3, [0])], [((3, 2), [(0, 1)]), ((3, 5), [(0, 2)])])
    segs = vg.from_shared(layout)
    assert (segs.starts, segs.prefixes, segs.calls) == ([0, 3, 5], [(0, 0), (0, 3), (0, 3)], 3)
    # padded 3 x 5 x 8 = 120, real 3 x 3 + 2 x 5 + 5 x 8 = 59: 61 extra pairs
    assert segs.pays(2**15, 2) and not segs.pays(
        2**15, 3
    )  # 61 x 65,536 = 3,997,696 <= 2 x 2**21 < 61 x 98,304
