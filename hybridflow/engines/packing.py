"""Padding removal for the training-side forward passes (verl's `use_remove_padding`; docs/design.md §7).

A micro-batch arrives as (B, L) rows: prompts left-padded, responses right-padded, so at natural EOS
much of each row is padding that the padded forward computes anyway. `pack` moves each sequence's
real tokens (its attended run) into shared rows, first-fit by decreasing length, each sequence's
`position_ids` restarting at 0. Attention stays within each sequence because transformers builds the
mask from those resets when the 2-D attention mask is None (masking_utils.find_packed_sequence_indices:
a block-diagonal causal mask for sdpa and eager attention, which is what the models load with; checked
numerically against the padded forward in tests/engines/test_packing.py).

Where the model takes engines/varlen.py's attention (sdpa models without a short sliding window), the plan
is one row of every sequence (row_tokens = all real tokens) and attention runs per sequence, without a mask.
Otherwise, why rows of `row_tokens` and not one row of everything: without a varlen kernel (CPU, sdpa) attention
costs rows x row_len^2 whatever the mask, so one row of all B sequences would cost far more attention
than the padded batch. Rows as long as the longest sequence keep attention at or below the padded cost
while the token count (every linear layer) drops to the real tokens plus a little slack.

Outputs return to the padded layout (`PackPlan.response_index`): a response token's log-prob / value
is read at the hidden state of the token before it in its packed row, exactly as the padded forward
reads column t - 1; positions that are padding come back as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.models.files import PACKABLE_MODEL_TYPES

# A micro-batch is packed only when more than this share of its trimmed (B, L) tokens is padding: below
# it the padded forward is as fast (docs/bench/packing.md: packed vs padded update CPU time 1.02x at 0%
# padding, 1.00x at 2.7%, 0.92-0.94x from 5.5% on, both the 1M and the 25M model), and with no padding at all
# it is the same sdpa call on the same tokens without the gathers.
MIN_PADDING_TO_PACK = 0.05


def worth_packing(attention_mask: torch.Tensor, shared: int = 0) -> bool:
    """Whether padding removal saves work on this (B, L) micro-batch (see MIN_PADDING_TO_PACK); `shared`:
    real tokens the packed forward does not compute either (prompts computed once, engines/shared_prompt.py)."""
    computed = float(attention_mask.sum()) - shared
    return 1.0 - computed / max(attention_mask.numel(), 1) > MIN_PADDING_TO_PACK


def resolve_remove_padding(setting: bool | None, model_type: str) -> bool:
    """EngineConfig.remove_padding for a model of `model_type`: None = whether the type packs."""
    if setting and model_type not in PACKABLE_MODEL_TYPES:
        raise ValueError(
            f"model.remove_padding=true: model type {model_type!r} cannot run packed sequences "
            f"(supported: {', '.join(PACKABLE_MODEL_TYPES)}); set it to false or null"
        )
    return model_type in PACKABLE_MODEL_TYPES if setting is None else bool(setting)


def resolve_share_prompt(setting: bool | None, remove_padding: bool) -> bool:
    """EngineConfig.share_prompt once remove_padding is resolved: None = remove_padding."""
    if setting and not remove_padding:
        raise ValueError(
            "model.share_prompt=true needs padding removal (the shared prompt lives in a packed row), "
            "but it is off for this model; set share_prompt to null or false, or remove_padding to true"
        )
    return remove_padding if setting is None else bool(setting)


@dataclass
class PackPlan:
    """Where each real token of a (B, L) micro-batch goes in the packed (R, C) rows."""

    rows: int
    cols: int
    src: tuple[torch.Tensor, torch.Tensor]  # (b, l) of every attended token, in order
    dst: tuple[torch.Tensor, torch.Tensor]  # its (row, col) in the packed layout
    k: torch.Tensor  # its index within its sequence
    seq_row: torch.Tensor  # (B,) packed row of each sequence
    seq_end: torch.Tensor  # (B,) packed column of its last token

    def to(self, device) -> PackPlan:
        if device == torch.device("cpu"):
            return self
        move = lambda t: tuple(x.to(device) for x in t) if isinstance(t, tuple) else t.to(device)  # noqa: E731
        return PackPlan(self.rows, self.cols, *(move(getattr(self, f)) for f in _TENSOR_FIELDS))

    def row_lengths(self) -> list[int]:
        """Token counts of the sequences in the order they sit along the rows (empty ones left out):
        the `seq_lens` of a one-row plan (engines/varlen.py)."""
        lengths = torch.bincount(self.src[0], minlength=len(self.seq_end))
        order = torch.argsort(self.seq_row * (self.cols + 1) + self.seq_end)
        return [n for n in lengths[order].tolist() if n]

    def response_index(self, attention_mask: torch.Tensor, response_length: int):
        """For every attended response position (b, j): (b, j), the packed (row, col) of its token and the
        (row, col) of the hidden state that predicts it (the token before it)."""
        resp = attention_mask[:, -response_length:].bool()
        b, j = resp.nonzero(as_tuple=True)
        # response tokens are the sequence's last ones: token j of b sits resp_len - j from its end
        resp_len = resp.sum(-1)
        col = self.seq_end[b] - (resp_len[b] - 1 - j)
        return (b, j), (self.seq_row[b], col), (self.seq_row[b], col - 1)


_TENSOR_FIELDS = ("src", "dst", "k", "seq_row", "seq_end")


def first_fit(lengths: list[int], capacity: int) -> tuple[list[int], list[int], int]:
    """First-fit decreasing: (row of each sequence, start column of each, number of rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    fill: list[int] = []
    row, start = [0] * len(lengths), [0] * len(lengths)
    for i in order:
        r = next((r for r, used in enumerate(fill) if used + lengths[i] <= capacity), len(fill))
        if r == len(fill):
            fill.append(0)
        row[i], start[i] = r, fill[r]
        fill[r] += lengths[i]
    return row, start, len(fill)


def contiguous(attention_mask: torch.Tensor) -> bool:
    """Whether every row's attended tokens form one run (left-padded prompt + right-padded response)."""
    a = attention_mask.bool()
    lengths = a.sum(-1)
    cols = torch.arange(a.shape[1], device=a.device)
    first = torch.where(a, cols, a.shape[1]).amin(-1)
    last = torch.where(a, cols, -1).amax(-1)
    return bool(((last - first + 1 == lengths) | (lengths == 0)).all())


def plan(attention_mask: torch.Tensor, row_tokens: int = 0) -> PackPlan:
    """Pack plan of a (B, L) mask whose rows are contiguous runs; rows hold up to max(row_tokens,
    the longest sequence) tokens (0: the longest sequence)."""
    a = attention_mask.bool()
    lengths = a.sum(-1)
    capacity = max(int(lengths.max()) if len(lengths) else 1, row_tokens, 1)
    row, start, rows = first_fit(lengths.tolist(), capacity)
    row_t, start_t = torch.tensor(row, dtype=torch.long), torch.tensor(start, dtype=torch.long)
    b, col = a.nonzero(as_tuple=True)
    k = (a.long().cumsum(-1) - 1)[b, col]  # index of each token within its sequence
    cols = max(int((start_t + lengths).max()) if len(lengths) else 1, 1)
    return PackPlan(rows, cols, (b, col), (row_t[b], start_t[b] + k), k, row_t, start_t + lengths - 1)


def pack(p: PackPlan, input_ids: torch.Tensor, position_ids: torch.Tensor):
    """(B, L) ids and positions -> packed (R, C) ids and positions. Empty slots at a row's end get
    position 0 each: one-token sequences of their own that no real token attends to."""
    ids = input_ids.new_zeros(p.rows, p.cols)
    pos = position_ids.new_zeros(p.rows, p.cols)
    ids[p.dst] = input_ids[p.src]
    pos[p.dst] = position_ids[p.src]
    # transformers splits a row where the position does not step by 1: check it splits exactly here
    row, col = p.dst
    step = pos[row, col] - pos[row, (col - 1).clamp(min=0)]
    inner, head = p.k > 0, (p.k == 0) & (col > 0)
    if bool((step[inner] != 1).any()) or bool((step[head] == 1).any()):
        raise ValueError(
            "remove_padding needs position_ids counting 0, 1, 2, ... along each sequence (packed "
            "sequences are found where the positions restart); set model.remove_padding=false for this data"
        )
    return ids, pos
