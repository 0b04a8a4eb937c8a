"""Causal attention per sequence inside one packed row: the varlen attention of padding removal on
devices without a varlen kernel (CPU; docs/design.md §7, "Padding removal").

Why: transformers' packed path (attention_mask None, positions restarting at 0) builds a block-diagonal
mask, and sdpa with a mask computes every (query, key) pair of the row, so rows must stay as short as the
longest sequence (engines/packing.py) and first fit leaves slack in them (at natural EOS with a 32-token
cap, 1736 computed tokens for 1531 real ones). Here all of a micro-batch's sequences share one row with
no slack, and attention runs causally on each sequence's own slice (`F.scaled_dot_product_attention(...,
is_causal=True)`, one call per sequence), so every linear layer sees exactly the real tokens and
attention costs sum(len_i^2 / 2).

How it plugs in: `install(model)` registers one attention function under `NAME` and switches the model
to it. Without `seq_lens` in the call (the padded forward, HF generation) it is transformers' own sdpa
path with sdpa's mask, unchanged; `RLForward` passes `seq_lens` (a list of ints summing to the row
length) through the model's **kwargs, and `no_mask()` tells the mask builder to skip the block-diagonal
mask the call does not read. Activation checkpointing recomputes a layer with the same kwargs, so the
recomputation takes the same path. With `shared_layout` instead (engines/shared_prompt.py, model.share_prompt)
a row holds groups [prompt, r_1, ..., r_k], and each response attends to its prompt's keys and causally to its own.

Which sdpa kernel (`_sdpa_for`): on CPU in bf16 / fp16, PyTorch's flash kernel runs forward + backward 2.6-3.7x
slower than its math kernel on sequences of up to ~150 tokens, though its forward alone is 2.6x faster (one thread;
bench_update.py --attention, docs/bench/vs_trl.md "The synchronous update"). So a differentiated packed call over
at most MATH_MAX_TOKENS keys there runs flash's forward and, in backward, the gradient of attention recomputed from
the saved q, k, v as two matmuls and an fp32 softmax (`_attention_matmuls`: 1.1-2x faster than the math kernel's
backward in bf16). Forward-only passes run the same flash forward, so a no-grad pass's log-probs
stay bit-equal to the training forward's (the first PPO ratio is exactly 1, tests/engines/test_dtypes.py). fp32,
GPUs and the padded forward keep PyTorch's choice.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hybridflow.engines import varlen_gather

NAME = "hybridflow_sdpa"
_NO_MASK = contextvars.ContextVar("hybridflow_varlen_no_mask", default=False)
# Longest key run for which a low-precision CPU call takes the recomputed gradient: flash's forward + backward
# was 1.7x slower than the math kernel's at 150 keys and even at 200 (1.5x the matmuls' at 160); from ~250
# keys on flash won.
MATH_MAX_TOKENS = 160
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, seq_lens=None,
              shared_layout=None, **kwargs):  # fmt: skip
    """transformers' attention-interface signature. query (1, H, N, D), key / value (1, Hkv, N, D) of one
    packed row when seq_lens (lengths summing to N) or shared_layout (engines/shared_prompt.py) is given;
    returns (output (1, N, H, D), None)."""
    if shared_layout is not None:
        sdpa = _sdpa_for(query, _longest_keys(shared_layout), dropout)
        plan = shared_layout.gather_plan(query.shape[1], query.shape[3], query.device)
        if plan is not None:
            return varlen_gather.attend(plan, query, key, value, dropout, scaling, sdpa), None
        return _shared(shared_layout, query, key, value, dropout, scaling, sdpa), None
    if seq_lens is None:  # padded rows (fully masked ones among them): PyTorch's kernel choice, unchanged
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    sdpa = _sdpa_for(query, max(seq_lens), dropout)
    plan = _lengths_plan(seq_lens, query.shape[1], query.shape[3], query.device)
    if plan is not None:
        return varlen_gather.attend(plan, query, key, value, dropout, scaling, sdpa), None
    return _per_sequence(query, key, value, dropout, scaling, seq_lens, sdpa), None


_LAST_PLAN: list = [
    None,
    None,
]  # (key, GatherPlan or None) of the last seq_lens: every layer of a forward asks


def _lengths_plan(seq_lens: list[int], heads: int, head_dim: int, device) -> varlen_gather.GatherPlan | None:
    """The one-call plan of a row of sequences, or None where the per-length calls cost less."""
    key = (tuple(seq_lens), heads, head_dim, str(device))
    if _LAST_PLAN[0] != key:
        segs = varlen_gather.from_lengths(seq_lens, len(_runs(seq_lens)))
        _LAST_PLAN[:] = [key, varlen_gather.build(segs, device) if segs.pays(heads, head_dim) else None]
    return _LAST_PLAN[1]


def _sdpa_for(query: torch.Tensor, keys: int, dropout: float):
    """F.scaled_dot_product_attention, or flash forward + math backward where that is faster (module
    docstring): a differentiated call on CPU in bf16 / fp16 over at most MATH_MAX_TOKENS keys, no dropout."""
    cpu = query.device.type == "cpu"
    # under autocast sdpa casts its fp32 inputs (HF's rope promotes q, k to fp32) to the autocast dtype
    dtype = torch.get_autocast_dtype("cpu") if cpu and torch.is_autocast_enabled("cpu") else query.dtype
    differentiated = torch.is_grad_enabled() and query.requires_grad
    if cpu and differentiated and dtype in _LOW_PRECISION and keys <= MATH_MAX_TOKENS and dropout == 0.0:
        return _sdpa_matmul_backward
    return F.scaled_dot_product_attention


class _FlashForwardMatmulBackward(torch.autograd.Function):
    """sdpa with PyTorch's forward and, in backward, the gradient of attention recomputed as plain matmuls
    (`_attention_matmuls`) from the saved q, k, v in the dtype the forward ran in (autocast's, if on)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, enable_gqa):
        how = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        out = F.scaled_dot_product_attention(q, k, v, **how)
        ctx.save_for_backward(q, k, v)
        ctx.how, ctx.dtype = how, out.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):
            out = _attention_matmuls(*(t.to(ctx.dtype) for t in leaves), **ctx.how)
            grads = torch.autograd.grad(out, leaves, grad_out)
        return (*grads, None, None, None, None)


def _attention_matmuls(
    q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False
) -> torch.Tensor:
    """sdpa (4-D q (B, H, n, D), k and v (B, Hk, s, D), a boolean mask or is_causal) as two matmuls and an
    fp32 softmax. Why not the math kernel: in bf16 it scales a transposed k and copies k and v per query head
    (GQA), and those strided bf16 passes made its forward + backward 1.1-2x slower than this one at the packed rows'
    shapes (docs/bench/vs_trl.md). A group's query heads share one matmul against their k and v instead."""
    b, h, n, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    plain = attn_mask is None or (attn_mask.dtype == torch.bool and attn_mask.dim() in (2, 4))
    if not plain or (h != hk and not enable_gqa):
        with sdpa_kernel(SDPBackend.MATH):  # an additive or 3-D mask, or a call sdpa itself would refuse
            how = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            return F.scaled_dot_product_attention(q, k, v, **how)
    g = h // hk
    scale = d**-0.5 if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.reshape(b, hk, g * n, d), k.transpose(-1, -2)).to(wide).mul_(scale)
    scores = scores.view(b, hk, g, n, s)
    if is_causal:  # sdpa's: query i sees keys 0..i (top-left)
        attn_mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:  # (n, s) or (B | 1, H | 1, n, s): the head axis split into (Hk, group)
        if attn_mask.dim() == 4:
            attn_mask = attn_mask.unflatten(1, (-1, g if attn_mask.shape[1] == h else 1))
        scores = scores.masked_fill(~attn_mask, float("-inf"))  # in place measured slower
    probs = torch._safe_softmax(scores, -1).to(v.dtype)  # an all-masked row weighs 0, as sdpa's math kernel
    return torch.matmul(probs.view(b, hk, g * n, s), v).view(b, h, n, d)


def _sdpa_matmul_backward(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """F.scaled_dot_product_attention's signature (dropout_p must be 0) through _FlashForwardMatmulBackward."""
    return _FlashForwardMatmulBackward.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def _per_sequence(query, key, value, dropout, scaling, seq_lens, sdpa) -> torch.Tensor:
    """Causal attention on each sequence's slice of the row: (1, H, N, D) -> (1, N, H, D)."""
    runs = _runs(seq_lens)
    sizes = [n * k for n, k in runs]
    # (1, H, N, D) -> (1, N, H, D) views, split into runs of equal-length sequences (split, not slicing:
    # its backward concatenates the runs' grads instead of zero-filling a full-size tensor per slice)
    qs, ks, vs = (t.transpose(1, 2).split(sizes, 1) for t in (query, key, value))
    outs = []
    for (n, k), q, kk, v in zip(runs, qs, ks, vs):
        # a run of k sequences of n tokens is a (k, H, n, D) batch: one call per run, not per sequence
        q, kk, v = (t.reshape(k, n, *t.shape[2:]).transpose(1, 2) for t in (q, kk, v))
        o = sdpa(
            q, kk, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=kk.shape[1] != q.shape[1]
        )
        outs.append(o.transpose(1, 2).reshape(1, n * k, o.shape[1], o.shape[3]))
    return torch.cat(outs, dim=1)  # (1, N, H, D)


def _shared(layout, query, key, value, dropout, scaling, sdpa) -> torch.Tensor:
    """Attention over a row with shared prompts: one sdpa call per length of the causal segments (plain
    sequences and prompts) and one per (prompt length, response length) of the responses, each response's
    queries against cat(its prompt's keys, its own keys) under the bottom-right causal mask."""
    qs, ks, vs = (t.transpose(1, 2).split(layout.sizes, 1) for t in (query, key, value))  # (1, n, H, D) each
    gqa = key.shape[1] != query.shape[1]
    out: list[torch.Tensor | None] = [None] * len(layout.sizes)

    def run(q, k, v, segments, **how):
        o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout, scale=scaling,
                 enable_gqa=gqa, **how)  # fmt: skip
        for i, o_i in zip(segments, o.transpose(1, 2).split(1)):
            out[i] = o_i

    for _, segs in layout.causal:
        run(*(torch.cat([t[i] for i in segs]) for t in (qs, ks, vs)), segs, is_causal=True)
    for (p, n), pairs in layout.shared:
        q = torch.cat([qs[r] for _, r in pairs])
        k, v = (torch.cat([torch.cat((t[pr], t[r]), 1) for pr, r in pairs]) for t in (ks, vs))
        run(q, k, v, [r for _, r in pairs], attn_mask=layout.mask(p, n, query.device))
    return torch.cat(out, dim=1)  # (1, N, H, D)


def _longest_keys(layout) -> int:
    """The most keys one query of a shared row attends over: a causal segment, or a prompt + its response."""
    return max([n for n, _ in layout.causal] + [p + n for (p, n), _ in layout.shared])


def _runs(seq_lens: list[int]) -> list[tuple[int, int]]:
    """[(length, count)] of consecutive equal lengths: [5, 5, 3, 5] -> [(5, 2), (3, 1), (5, 1)]."""
    runs: list[list[int]] = []
    for n in seq_lens:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return [(n, k) for n, k in runs]


def _mask(*args, **kwargs):
    """sdpa's mask, except inside no_mask() (a packed call: attention reads seq_lens, not a mask)."""
    return None if _NO_MASK.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, _mask)


def install(model: torch.nn.Module) -> bool:
    """Switch `model` to NAME if it computes attention through transformers' sdpa function; returns
    whether it did (other implementations, e.g. flash-attention on GPU, keep the row packing)."""
    if model.config._attn_implementation not in ("sdpa", NAME):
        return False
    model.set_attn_implementation(NAME)
    return True


def fits(model: torch.nn.Module, longest: int) -> bool:
    """Whether per-sequence causal attention is the model's attention for sequences of up to `longest`
    tokens: installed, and no sliding window shorter than that (Mistral's window)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    windowed = window is not None and getattr(config, "use_sliding_window", True)
    return config._attn_implementation == NAME and not (windowed and longest > window)


@contextlib.contextmanager
def no_mask():
    token = _NO_MASK.set(True)
    try:
        yield
    finally:
        _NO_MASK.reset(token)
