"""Each shared prompt computed once in a packed micro-batch (model.share_prompt; docs/design.md §7).

GRPO / RLOO sample n responses per prompt, so a micro-batch holds the same prompt up to n times. Under
causal attention a prompt's hidden states do not depend on what follows it, so the packed row holds each
group of rows with an identical prompt as [prompt, r_1, ..., r_k]: the prompt attends causally to itself,
each response's queries to all of the prompt's keys and causally to its own. Every response token keeps the
position it has in the padded layout (RoPE sees the same positions), and the first token of each r_i is
read from the prompt's last hidden state. The outputs are those of the unshared forward; in backward the
prompt positions receive the sum of what the k copies would have received, so the weight gradients match
too (tests/engines/test_shared_prompt.py).

Groups are found by content (the attended prompt tokens and their positions), in any row order; rows
whose prompt no other row of the micro-batch shares are plain sequences, as in engines/packing.py.
This applies to the one-row plan with per-sequence attention (engines/varlen.py) only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SharedLayout:
    """How attention runs over a shared row (engines/varlen.py reads it in every layer).

    sizes: the token count of every segment (a plain sequence, a prompt or a response) in row order.
    causal: [(length, segment indices)]: segments attending causally to themselves, batched by length.
    shared: [((prompt length, response length), [(prompt segment, response segment)])]: responses whose
    queries attend to their prompt's keys and causally to their own, batched by the two lengths."""

    sizes: list[int]
    causal: list[tuple[int, list[int]]]
    shared: list[tuple[tuple[int, int], list[tuple[int, int]]]]
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, p: int, n: int, device) -> torch.Tensor:
        """(n, p + n) bool: query t of a response sees the p prompt keys and its own keys up to t
        (sdpa's is_causal aligns top-left, this is the bottom-right alignment). Built once per forward."""
        key = (p, n, str(device))
        if key not in self._masks:
            self._masks[key] = torch.ones(n, p + n, dtype=torch.bool, device=device).tril(p)
        return self._masks[key]

    def gather_plan(self, heads: int, head_dim: int, device):
        """Its one-call attention plan (engines/varlen_gather.py), built once per forward; None where the
        per-length calls cost less."""
        key = ("gather", heads, head_dim, str(device))
        if key not in self._masks:
            from hybridflow.engines import varlen_gather

            segs = varlen_gather.from_shared(self)
            self._masks[key] = varlen_gather.build(segs, device) if segs.pays(heads, head_dim) else None
        return self._masks[key]


@dataclass
class SharedPlan:
    """A one-row pack plan with shared prompts: the fields of packing.PackPlan that RLForward reads."""

    cols: int
    src: tuple[torch.Tensor, torch.Tensor]  # (b, l) of every computed token
    dst: torch.Tensor  # its column in the one packed row
    seq_end: torch.Tensor  # (B,) column of each row's last token (its prompt's last one if no response)
    first_prev: torch.Tensor  # (B,) column whose hidden state predicts each row's first response token
    layout: SharedLayout
    saved: int  # prompt tokens not computed

    rows = 1

    @property
    def seq_row(self) -> torch.Tensor:
        return torch.zeros_like(self.seq_end)

    def to(self, device) -> SharedPlan:
        if device == torch.device("cpu"):
            return self
        move = lambda t: tuple(x.to(device) for x in t) if isinstance(t, tuple) else t.to(device)  # noqa: E731
        return SharedPlan(self.cols, move(self.src), move(self.dst), move(self.seq_end),
                          move(self.first_prev), self.layout, self.saved)  # fmt: skip

    def response_index(self, attention_mask: torch.Tensor, response_length: int):
        """For every attended response position (b, j): (b, j), the packed (row, col) of its token and
        the (row, col) of the hidden state that predicts it."""
        resp = attention_mask[:, -response_length:].bool()
        b, j = resp.nonzero(as_tuple=True)
        resp_len = resp.sum(-1)
        col = self.seq_end[b] - (resp_len[b] - 1 - j)
        prev = torch.where(j == 0, self.first_prev[b], col - 1)
        row = torch.zeros_like(col)
        return (b, j), (row, col), (row, prev)

    def pack(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """(B, L) ids and positions -> (1, cols): positions copied, so each token keeps its padded one."""
        ids = input_ids.new_zeros(1, self.cols)
        pos = position_ids.new_zeros(1, self.cols)
        ids[0, self.dst] = input_ids[self.src]
        pos[0, self.dst] = position_ids[self.src]
        return ids, pos


def prompt_groups(
    prompt_mask: torch.Tensor, prompt_ids: torch.Tensor, prompt_pos: torch.Tensor
) -> list[list[int]]:
    """Rows grouped by identical attended prompt tokens and positions, in order of first appearance;
    rows with an empty prompt are groups of their own. All tensors (B, Lp) on the CPU, each row's attended
    tokens one contiguous run (packing.contiguous). One pass over the batch (a loop over rows cost ~13 us
    a row: 7 ms of a 512-row micro-batch's forward)."""
    rows, width = prompt_mask.shape
    if rows == 0 or width == 0:
        return [[b] for b in range(rows)]
    count = prompt_mask.sum(-1)
    cols = torch.arange(width)
    start = torch.where(prompt_mask, cols, width).amin(-1).clamp(max=width - 1)
    # each row's run moved to column 0, -1 after it: rows equal exactly when their runs are
    idx = (start[:, None] + cols).clamp(max=width - 1)
    after = cols >= count[:, None]
    keys = torch.cat([prompt_ids.long().gather(1, idx), prompt_pos.long().gather(1, idx)], 1)
    keys.masked_fill_(after.repeat(1, 2), -1)
    keys[count == 0, 0] = -2 - torch.nonzero(count == 0).flatten()  # an empty prompt matches no other row
    _, group = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((int(group.max()) + 1,), rows).scatter_reduce(0, group, torch.arange(rows), "amin")
    order = torch.argsort(first[group] * rows + torch.arange(rows))  # by group's first row, then row
    # each group's rows sit together in `order`, the groups in order of their first rows
    counts = torch.bincount(group)[torch.argsort(first)]
    return [part.tolist() for part in order.split(counts.tolist())]


def plan(
    attention_mask: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, response_length: int
) -> SharedPlan | None:
    """The shared one-row plan of a (B, L) micro-batch whose rows are contiguous runs (packing.contiguous),
    or None when no two rows share a prompt (then packing.plan's is the plan)."""
    mask = attention_mask.cpu().bool()
    lp = mask.shape[1] - response_length
    groups = prompt_groups(mask[:, :lp], input_ids[:, :lp].cpu(), position_ids[:, :lp].cpu())
    if all(len(g) < 2 for g in groups):
        return None
    resp_len = mask[:, lp:].sum(-1).tolist()
    cols = torch.arange(mask.shape[1])
    first = torch.where(mask, cols, mask.shape[1]).amin(-1).tolist()
    lengths = mask.sum(-1).tolist()
    src_b, src_l, seq_end, first_prev = [], [], [0] * len(lengths), [0] * len(lengths)
    sizes: list[int] = []
    causal: dict[int, list[int]] = {}
    shared: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def place(b: int, start: int, n: int) -> int:
        """Row b's columns start..start+n-1 as the next segment; returns its index."""
        src_b.append(b)
        src_l.append(start)
        sizes.append(n)
        return len(sizes) - 1

    # plain sequences first, longest first (equal lengths next to each other), then each group
    plain = sorted((g[0] for g in groups if len(g) == 1 and lengths[g[0]]), key=lambda b: -lengths[b])
    col = 0
    for b in plain:
        causal.setdefault(lengths[b], []).append(place(b, first[b], lengths[b]))
        col += lengths[b]
        seq_end[b], first_prev[b] = col - 1, col - 1 - resp_len[b]
    saved = 0
    for g in (g for g in groups if len(g) > 1):
        p = lengths[g[0]] - resp_len[g[0]]
        prompt = place(g[0], first[g[0]], p)
        causal.setdefault(p, []).append(prompt)
        col += p
        saved += p * (len(g) - 1)
        prompt_end = col - 1
        for b in g:
            first_prev[b] = seq_end[b] = prompt_end
            if resp_len[b]:
                shared.setdefault((p, resp_len[b]), []).append((prompt, place(b, lp, resp_len[b])))
                col += resp_len[b]
                seq_end[b] = col - 1
    dst = torch.arange(col)
    n = torch.tensor(sizes)
    offset = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)  # each column's segment's first column
    src = (
        torch.repeat_interleave(torch.tensor(src_b), n),
        torch.repeat_interleave(torch.tensor(src_l), n) + dst - offset,
    )
    layout = SharedLayout(sizes, sorted(causal.items()), sorted(shared.items()))
    return SharedPlan(col, src, dst, torch.tensor(seq_end), torch.tensor(first_prev), layout, saved)
