"""resources.frozen_pool=both (trainer.rollout_ahead=1): the reference scores rows [0, m) of each batch on
the rollout pool, right after generating it, and rows [m, B) on the training pool, before the actor's
update; m moves each step to even the two pools' busy time (docs/design.md, "One-step-ahead rollout").

Why: one step ahead, the rollout pool generates batch k+1 while the actor trains on batch k. With the
reference wholly on one side, the other side idles for part of every step whenever generation and the
update take different times, and which side is longer changes with the model and the response length
(docs/bench/vs_trl.md: on 2 CPU cores with the ~25M model, the rollout side is the longer one at
128-token responses with the reference there, the training side the longer one with it there). Splitting
the rows lets the step approach (generation + reference + update) / 2 instead.

Rows move in whole groups of rollout.n (a GRPO / RLOO group shares its prompt: model.share_prompt
computes it once only within one side's micro-batch). A side that scores no rows keeps its last measured
per-row cost.
"""

from __future__ import annotations


def balanced_rows(rows: int, group: int, rollout_s: float, rollout_row_s: float, training_s: float) -> int:
    """Rows [0, m) of a batch of `rows` (groups of `group`) for the rollout pool's reference: the m at which
    the rollout side's step, rollout_s (receive the weights, generate) + rollout_row_s * m, matches the
    training side's, training_s, which runs meanwhile; rounded to whole groups (0..rows)."""
    m = (training_s - rollout_s) / rollout_row_s if rollout_row_s > 0 else rows / 2
    return min(max(group * round(m / group), 0), rows)


class RefSplit:
    """The driver's per-unit costs of each side, smoothed over steps, and the split of the next batch.

    Pairing: while the rollout pool generates (and scores rows [0, m) of) batch k+1, the training pool
    scores its rows of batch k and trains on it. Batch k is in the driver by then, so the training side's
    work is predicted from its own tokens and rows (update seconds per token, reference seconds per row);
    the rollout side's generation is not known before it runs: its recent average stands in."""

    def __init__(self, group: int, smoothing: float = 0.5):
        self.group, self.smoothing = group, smoothing
        self.estimate: dict[str, float] = {}  # rollout_s, rollout_row_s, training_row_s, update_token_s

    def _smooth(self, name: str, value: float | None) -> None:
        if value is not None:
            old = self.estimate.get(name, value)
            self.estimate[name] = self.smoothing * old + (1 - self.smoothing) * value

    def observe(self, rollout_rows: int, rollout_s: float, rollout_ref_s: float, training_rows: int,
                training_ref_s: float, update_tokens: float, update_s: float) -> None:  # fmt: skip
        """Busy seconds of one batch's rollout side (receive + generate; the reference on `rollout_rows`
        rows) and of one step's training side (the reference on `training_rows` rows; the update of a
        batch of `update_tokens` tokens)."""
        self._smooth("rollout_s", rollout_s)
        self._smooth("rollout_row_s", rollout_ref_s / rollout_rows if rollout_rows else None)
        self._smooth("training_row_s", training_ref_s / training_rows if training_rows else None)
        self._smooth("update_token_s", update_s / update_tokens if update_tokens else None)

    def rows_for(self, rows: int, tokens_now: float, training_rows_now: int) -> int:
        """m for the batch generated next (`rows` rows), while the training side trains on the current
        batch of `tokens_now` tokens and scores its reference on `training_rows_now` rows; half the
        batch (in whole groups) until every cost has been measured once."""
        e = self.estimate
        if len(e) < 4:
            return balanced_rows(rows, self.group, 0.0, 1.0, rows / 2)
        training_s = e["update_token_s"] * tokens_now + e["training_row_s"] * training_rows_now
        return balanced_rows(rows, self.group, e["rollout_s"], e["rollout_row_s"], training_s)
