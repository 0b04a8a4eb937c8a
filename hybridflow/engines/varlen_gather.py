"""A packed row's attention in one sdpa call per layer, for short sequences (engines/varlen.py picks it).

Why: attention per run of equal-length sequences (varlen.py) costs one sdpa call, and its views, casts and
concatenations, per distinct length (or per (prompt, response) length pair with shared prompts): at natural
EOS ~20-40 calls per layer, each on a few (32 x 32) blocks, so the op count, not the arithmetic, sets the
time of small models' steps (each op also pays a thread fork/join). Here every query segment (a sequence,
a prompt, a response) is one row of a padded (G, Qmax) batch, its keys one row of (G, Kmax): the prompt's
keys first for a response, then its own. One gather per q / k / v, one sdpa under a boolean mask (query t
sees the prefix and its own keys up to t: the bottom-right causal alignment) and one gather back per layer.

The cost is attention over G x Qmax x Kmax pairs instead of each segment's own: negligible while the keys
are short, so varlen.py takes this path up to GATHER_MAX_KEYS keys. Outputs are those of the per-segment
calls up to the kernels' summation order (masked keys weigh exactly 0); padded query rows attend to key 0
only (no all-masked softmax row) and are never read back, so they add nothing to any gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GatherPlan:
    """Index tensors of one packed row (N tokens) in G query segments, built once per forward.

    q_index:   (G, Qmax) each segment's t-th query's column (0 past its end)
    kv_index:  (G, Kmax) its keys' columns: the prefix's (a shared prompt), then its own (0 past the end)
    mask:      (G, 1, Qmax, Kmax) bool, True where a query attends a key
    out_index: (N,) the flat (g * Qmax + t) of each column, to read the outputs back in row order"""

    q_index: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor
    out_index: torch.Tensor


def build(starts: list[int], lengths: list[int], prefixes: list[tuple[int, int]], device) -> GatherPlan:
    """Segments g: queries at columns [starts[g], starts[g] + lengths[g]), keys prefixes[g] = (start,
    length) of a prefix span (length 0: none) followed by the queries' own columns. The segments must
    cover the row's columns exactly once (each column is some segment's query)."""
    qs, qn = torch.tensor(starts), torch.tensor(lengths)
    ps, pn = torch.tensor([p for p, _ in prefixes]), torch.tensor([n for _, n in prefixes])
    t = torch.arange(int(qn.max()))
    j = torch.arange(int((pn + qn).max()))
    valid_q = t < qn[:, None]  # (G, Qmax)
    q_index = torch.where(valid_q, qs[:, None] + t, 0)
    in_prefix = j < pn[:, None]  # (G, Kmax)
    valid_k = j < (pn + qn)[:, None]
    own = qs[:, None] + j - pn[:, None]
    kv_index = torch.where(in_prefix, ps[:, None] + j, torch.where(valid_k, own, 0))
    mask = valid_k[:, None, :] & (j <= (pn[:, None] + t)[:, :, None]) & valid_q[:, :, None]
    mask[:, :, 0] |= ~valid_q  # a padded query row attends key 0 only: no all-masked softmax row
    flat = torch.arange(q_index.numel()).view_as(q_index)
    out_index = torch.empty(int(qn.sum()), dtype=torch.long)
    out_index[q_index[valid_q]] = flat[valid_q]
    return GatherPlan(*(x.to(device) for x in (q_index, kv_index, mask[:, None], out_index)))


def from_lengths(seq_lens: list[int], device) -> GatherPlan:
    """Sequences one after another, each attending causally to itself."""
    starts = torch.tensor([0, *seq_lens[:-1]]).cumsum(0).tolist()
    return build(starts, list(seq_lens), [(0, 0)] * len(seq_lens), device)


def from_shared(layout, device) -> GatherPlan:
    """A shared-prompt row (engines/shared_prompt.py SharedLayout): plain sequences and prompts causal,
    each response after its prompt's keys."""
    starts = torch.tensor([0, *layout.sizes[:-1]]).cumsum(0).tolist()
    prefix = [(0, 0)] * len(layout.sizes)
    for _, pairs in layout.shared:
        for p, r in pairs:
            prefix[r] = (starts[p], layout.sizes[p])
    return build(starts, list(layout.sizes), prefix, device)


def attend(plan: GatherPlan, query, key, value, dropout, scaling, sdpa) -> torch.Tensor:
    """query (1, H, N, D), key / value (1, Hkv, N, D) -> (1, N, H, D), one sdpa call."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (N, H, D)
    q = q[plan.q_index].transpose(1, 2)  # (G, H, Qmax, D)
    k, v = (x[plan.kv_index].transpose(1, 2) for x in (k, v))  # (G, Hkv, Kmax, D)
    o = sdpa(
        q, k, v, attn_mask=plan.mask, dropout_p=dropout, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
    )
    o = o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])  # (G * Qmax, H, D)
    return o[plan.out_index].unsqueeze(0)
