"""DAPO's sampling-side pieces (Yu et al. 2025), as pure functions: dynamic sampling, overlong reward
shaping, truncated responses.

Dynamic sampling: a group whose n samples all score the same has zero GRPO advantage everywhere, so it
adds nothing but noise to the update and shrinks the effective batch. DAPO drops such groups and samples
more prompts until the batch holds `train_batch_size` groups again; `GroupAccumulator` concatenates the
kept groups of successive generation batches and trims to exactly that many rows, as verl's DAPO
recipe does (recipe/dapo: `batch[:train_batch_size * n]`, whole groups because rows of a group are
consecutive).

Overlong shaping: a response longer than max_len - buffer is penalised linearly up to `factor` at
max_len (verl's `reward_model.overlong_buffer`), so the policy learns to stay short of the cap
instead of being cut off by it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def keep_groups(metric: torch.Tensor, uid: Sequence) -> torch.Tensor:
    """Rows of the groups whose metric varies. metric: (B,) float per row; uid: (B,) group ids.
    -> (B,) bool: True for every row of a group with std > 0, or of a group of one sample (verl keeps
    those: a lone sample is not evidence of an all-equal group). Rows of a group need not be adjacent."""
    ids = np.asarray(uid, dtype=object)
    values = metric.detach().double().cpu().numpy()
    keep = np.zeros(len(ids), dtype=bool)
    for u in dict.fromkeys(ids.tolist()):  # first-seen order; a dict is deterministic
        rows = ids == u
        keep[rows] = rows.sum() == 1 or float(np.std(values[rows])) > 0.0
    return torch.from_numpy(keep)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment. lengths: (B,) response tokens -> (B,) penalties <= 0:
    -min((l - (max_len - buffer_len)) / buffer_len, 1) * factor where l > max_len - buffer_len, else 0."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    exceed = (lengths.double() - (max_len - buffer_len)).clamp(min=0.0)
    return -(exceed / buffer_len).clamp(max=1.0) * factor


def truncated_rows(response_mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B, Lr) 0/1 mask -> (B,) bool: responses that reached the length cap max_len. A response whose
    stop token fell exactly on the last position counts too (verl's response_length/clip_ratio rule)."""
    return response_mask.sum(-1) >= max_len


class GroupAccumulator:
    """Kept groups gathered over generation batches until `prompts` groups of `n` rows are there.

    add(batch, keep) appends the kept rows of one generation batch (any object with len, index(mask)
    and a static concat, e.g. hybridflow.batch.Batch) and counts the batch; `full` says whether the
    target is met; take() returns exactly prompts * n rows, the first ones in generation order (verl's
    trim: the surplus groups of the last generation batch are dropped)."""

    def __init__(self, prompts: int, n: int, concat):
        self.rows, self.n, self.concat = prompts * n, n, concat
        self.parts: list = []
        self.num_gen_batches = self.kept_groups = self.dropped_groups = 0

    def add(self, batch, keep: torch.Tensor) -> None:
        """keep: (len(batch),) bool, whole groups of n rows (keep_groups' output)."""
        kept = int(keep.sum())
        if kept % self.n or (len(batch) - kept) % self.n:
            raise ValueError(
                f"keep must select whole groups of {self.n} rows, selected {kept} of {len(batch)}"
            )
        self.num_gen_batches += 1
        self.kept_groups += kept // self.n
        self.dropped_groups += (len(batch) - kept) // self.n
        if kept:
            self.parts.append(batch.index(keep))

    @property
    def num_rows(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def full(self) -> bool:
        return self.num_rows >= self.rows

    def take(self):
        """The first prompts * n kept rows (needs `full`)."""
        if not self.full:
            raise ValueError(f"only {self.num_rows} of {self.rows} rows kept so far")
        whole = self.parts[0] if len(self.parts) == 1 else self.concat(self.parts)
        return whole if len(whole) == self.rows else whole.index(slice(0, self.rows))
