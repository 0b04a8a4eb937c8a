"""Splitting a worker's batch into micro-batches, and trimming padding from each.

Two modes:
- fixed: `micro_batch_size` rows per micro-batch, in order;
- token budget (`max_tokens`): samples sorted by length (longest first) and packed greedily while
  rows * (longest prompt + longest response in the group) <= max_tokens, so long and short samples
  do not share a padded micro-batch. Sorting-by-length bucketing is the CPU form of padding removal;
  the rows are restored to their original order afterwards (`restore_order`).

Every data-parallel rank must run the same number of forward/backward passes (FSDP's collectives
are per pass), so the count can be raised to a common `num_micro_batches`: the costliest
micro-batches are split in halves until the count matches.

`trim_padding` drops columns that are padding in every row of a micro-batch: leading prompt
columns (prompts are left-padded) and trailing response columns (responses are right-padded).
Field layout (preamble): `prompts` (B, Lp), sequence fields `input_ids` / `attention_mask` /
`position_ids` (B, Lp + Lr), and every other 2-D+ tensor whose second dim is Lr is response-aligned.
"""

from __future__ import annotations

import torch

from hybridflow.batch import Batch

SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids")


def response_length(batch: Batch) -> int:
    """Lr, from `responses` (or `response_mask`)."""
    for key in ("responses", "response_mask"):
        if key in batch.tensors:
            return batch.tensors[key].shape[1]
    raise KeyError(
        f"batch needs `responses` (B, Lr) or `response_mask` to know the response length; fields are {batch.keys()}"
    )


def valid_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens (B,), response tokens (B,)) that are attended, i.e. not padding."""
    attn = batch["attention_mask"]
    lr = response_length(batch)
    resp_lens = attn[:, -lr:].sum(-1)
    return attn[:, :-lr].sum(-1), resp_lens


def trim_padding(mb: Batch) -> Batch:
    """Drop all-padding columns: leading prompt columns and trailing response columns. Keeps >= 1 response column."""
    attn = mb["attention_mask"]
    seq_len, lr = attn.shape[1], response_length(mb)
    lp = seq_len - lr
    prompt_lens, resp_lens = valid_lengths(mb)
    keep_p = int(prompt_lens.max()) if len(mb) else lp
    keep_r = max(int(resp_lens.max()) if len(mb) else lr, 1)
    if keep_p == lp and keep_r == lr:
        return mb
    tensors = {}
    for k, v in mb.tensors.items():
        if k in SEQUENCE_FIELDS:
            tensors[k] = v[:, lp - keep_p : lp + keep_r]
        elif k == "prompts":
            tensors[k] = v[:, v.shape[1] - keep_p :]
        elif v.dim() >= 2 and v.shape[1] == lr:
            tensors[k] = v[:, :keep_r]
        else:
            tensors[k] = v
    return Batch(tensors, mb.non_tensors, mb.meta.copy())


def _group_cost(
    prompt_lens: torch.Tensor, resp_lens: torch.Tensor, idx: list[int], real: bool = False
) -> int:
    """Tokens a micro-batch computes: rows x padded length, or with padding removed its real tokens."""
    if real:
        return int(prompt_lens[idx].sum()) + int(resp_lens[idx].sum())
    return len(idx) * (int(prompt_lens[idx].max()) + int(resp_lens[idx].max()))


def plan_micro_batches(
    batch: Batch,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    num_micro_batches: int | None = None,
    real_tokens: bool = False,
) -> list[list[int]]:
    """Row indices of each micro-batch. Exactly one of micro_batch_size / max_tokens must be given;
    num_micro_batches (>= the natural count, <= rows) forces the count (for equal counts over ranks).
    real_tokens: the budget counts real tokens (padding removed: engines/packing.py), not padded ones."""
    n = len(batch)
    if (micro_batch_size is None) == (not max_tokens):
        raise ValueError("give exactly one of micro_batch_size or max_tokens (token budget)")
    if max_tokens:
        prompt_lens, resp_lens = valid_lengths(batch)
        order = torch.argsort(prompt_lens + resp_lens, descending=True, stable=True).tolist()
        groups: list[list[int]] = []
        for i in order:
            if groups and _group_cost(prompt_lens, resp_lens, groups[-1] + [i], real_tokens) <= max_tokens:
                groups[-1].append(i)
            else:  # a sample longer than the budget still gets a micro-batch of its own
                groups.append([i])
    else:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        prompt_lens, resp_lens = valid_lengths(batch)
        groups = [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
    if num_micro_batches is not None:
        if not len(groups) <= num_micro_batches <= max(n, 1):
            raise ValueError(
                f"cannot make {num_micro_batches} micro-batches from {n} rows planned as {len(groups)}"
            )
        while len(groups) < num_micro_batches:
            splittable = [g for g in groups if len(g) > 1]
            big = max(splittable, key=lambda g: _group_cost(prompt_lens, resp_lens, g, real_tokens))
            pos = groups.index(big)
            groups[pos : pos + 1] = [big[: len(big) // 2], big[len(big) // 2 :]]
    return groups


def split_micro_batches(batch: Batch, groups: list[list[int]]) -> list[Batch]:
    """The planned micro-batches, each with its padding trimmed."""
    return [trim_padding(batch.index(g)) for g in groups]


def pad_response_aligned(t: torch.Tensor, lr: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad a (b, lr') tensor back to (b, lr)."""
    return torch.nn.functional.pad(t, (0, lr - t.shape[1]), value=value)


def restore_order(chunks: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs and put rows back in the batch's original order."""
    out = torch.cat(chunks)
    perm = torch.tensor([i for g in groups for i in g], dtype=torch.long)
    restored = torch.empty_like(out)
    restored[perm] = out
    return restored
