"""A packed row's attention in one sdpa call per layer, for short sequences (engines/varlen.py picks it).

Why: attention per run of equal-length sequences (varlen.py) costs one sdpa call, and its views, casts and
concatenations, per distinct length (or per (prompt, response) length pair with shared prompts): at natural
EOS ~20-40 calls per layer, each on a few (32 x 32) blocks, so the op count, not the arithmetic, sets the
time of small models' steps (each op also pays a thread fork/join). Here every query segment (a sequence,
a prompt, a response) is one row of a padded (G, Qmax) batch, its keys one row of (G, Kmax): the prompt's
keys first for a response, then its own. One gather per q / k / v, one sdpa under a boolean mask (query t
sees the prefix and its own keys up to t: the bottom-right causal alignment) and one gather back per layer.

The cost is attention over G x Qmax x Kmax (query, key) pairs instead of each segment's own: `pays` takes
this path only while the extra pairs, times the heads' width, stay under CALL_ELEMS per per-length call it
saves (one such call's views, casts and kernel entry, forward and backward, cost about what ~8 MFLOP of
attention arithmetic do on a CPU core): the short rows of small models, not long responses of wide ones,
where the padded pairs would outweigh the calls (and the mask would grow as G x Qmax x Kmax). Outputs are those of the per-segment
calls up to the kernels' summation order (masked keys weigh exactly 0); padded query rows attend to key 0
only (no all-masked softmax row) and are never read back, so they add nothing to any gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CALL_ELEMS = 2**21  # extra (query, key) pairs x head width one saved per-length call is worth


@dataclass
class Segments:
    """A packed row's query segments g: queries at columns [starts[g], starts[g] + lengths[g]); keys the
    prefix span prefixes[g] = (start, length) (a shared prompt; length 0: none), then the queries' own
    columns. They cover the row's columns exactly once. `calls`: sdpa calls of the per-length path."""

    starts: list[int]
    lengths: list[int]
    prefixes: list[tuple[int, int]]
    calls: int

    def pays(self, heads: int, head_dim: int) -> bool:
        """Whether one gathered call beats the per-length calls (module docstring)."""
        keys = [p + n for (_, p), n in zip(self.prefixes, self.lengths)]
        padded = len(self.lengths) * max(self.lengths) * max(keys)
        real = sum(n * k for n, k in zip(self.lengths, keys))
        return (padded - real) * heads * head_dim <= (self.calls - 1) * CALL_ELEMS


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


def build(segs: Segments, device) -> GatherPlan:
    """The plan of `segs`: query t of a segment sees its prefix and its own keys up to t."""
    qs, qn = torch.tensor(segs.starts), torch.tensor(segs.lengths)
    ps, pn = torch.tensor([p for p, _ in segs.prefixes]), torch.tensor([n for _, n in segs.prefixes])
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


def from_lengths(seq_lens: list[int], calls: int) -> Segments:
    """Sequences one after another, each attending causally to itself."""
    starts = torch.tensor([0, *seq_lens[:-1]]).cumsum(0).tolist()
    return Segments(starts, list(seq_lens), [(0, 0)] * len(seq_lens), calls)


def from_shared(layout) -> Segments:
    """A shared-prompt row (engines/shared_prompt.py SharedLayout): plain sequences and prompts causal,
    each response after its prompt's keys."""
    starts = torch.tensor([0, *layout.sizes[:-1]]).cumsum(0).tolist()
    prefix = [(0, 0)] * len(layout.sizes)
    for _, pairs in layout.shared:
        for p, r in pairs:
            prefix[r] = (starts[p], layout.sizes[p])
    return Segments(starts, list(layout.sizes), prefix, len(layout.causal) + len(layout.shared))


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 through index_select: its backward is an index_add_, not the accumulating
    index_put_ of advanced indexing, which on CPU ran 2-8 ms a call at these shapes against 0.2 ms."""
    return torch.index_select(x, 0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def attend(plan: GatherPlan, query, key, value, dropout, scaling, sdpa) -> torch.Tensor:
    """query (1, H, N, D), key / value (1, Hkv, N, D) -> (1, N, H, D), one sdpa call."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (N, H, D)
    q = _take(q, plan.q_index).transpose(1, 2)  # (G, H, Qmax, D)
    k, v = (_take(x, plan.kv_index).transpose(1, 2) for x in (k, v))  # (G, Hkv, Kmax, D)
    o = sdpa(
        q, k, v, attn_mask=plan.mask, dropout_p=dropout, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
    )
    o = o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])  # (G * Qmax, H, D)
    return _take(o, plan.out_index).unsqueeze(0)
