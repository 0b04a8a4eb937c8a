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
cost per token.
"""

from __future__ import annotations

from hybridflow.planner.ahead_both import split_reference


def balanced_rows(rows: int, group: int, rollout_s: float, rollout_row_s: float, training_s: float,
                  training_row_s: float) -> int:  # fmt: skip
    """Rows [0, m) of each batch of `rows` (groups of `group`) for the rollout pool's reference: the m at
    which rollout_s + rollout_row_s * m (the rollout side: receive the weights, generate, score m rows)
    matches training_s + training_row_s * (rows - m) (the training side: score the other rows, update),
    rounded to whole groups (0..rows).

    Steady state, not one step: the rows a batch leaves to the training pool are scored there during the
    next step, so balancing one step alone would push work into the next. The planner prices the same
    balance (planner/ahead_both.split_reference): its row share, times the rows."""
    f, _, _ = split_reference(rollout_s, training_s, rollout_row_s * rows, training_row_s * rows)
    return min(max(group * round(f * rows / group), 0), rows)


class RefSplit:
    """The driver's per-token costs of each side, smoothed over steps, and the split of the next batch.

    When the driver issues batch k+1 it holds batch k, the latest: the update is predicted from its
    tokens, each row's reference from its mean tokens per row (lengths drift slowly as training goes
    on), and the generation is the recent average (measured per step; per token for the others). The
    costs are smoothed with weight `smoothing` on the past: enough to ride out one batch's random
    lengths, little enough to follow the drift."""

    def __init__(self, group: int, smoothing: float = 0.3):
        self.group, self.smoothing = group, smoothing
        # rollout_s, rollout_ref_token_s, training_ref_token_s, update_token_s
        self.estimate: dict[str, float] = {}

    def _smooth(self, name: str, value: float | None) -> None:
        if value is not None:
            old = self.estimate.get(name, value)
            self.estimate[name] = self.smoothing * old + (1 - self.smoothing) * value

    def observe(self, rollout_s: float, rollout_ref_s: float, rollout_tokens: float, training_ref_s: float,
                training_tokens: float, update_s: float, update_tokens: float) -> None:  # fmt: skip
        """Busy seconds of one batch's rollout side (receive + generate; the reference on its rows of
        `rollout_tokens` tokens) and of one step's training side (the reference on rows of
        `training_tokens` tokens; the update of a batch of `update_tokens` tokens)."""
        self._smooth("rollout_s", rollout_s)
        self._smooth("rollout_ref_token_s", rollout_ref_s / rollout_tokens if rollout_tokens else None)
        self._smooth("training_ref_token_s", training_ref_s / training_tokens if training_tokens else None)
        self._smooth("update_token_s", update_s / update_tokens if update_tokens else None)

    def rows_for(self, rows: int, tokens_now: float, tokens_per_row: float) -> int:
        """m for the batch generated next (`rows` rows): the training side's update is predicted from the
        current batch's `tokens_now` tokens, each row's reference from its `tokens_per_row`; half the
        batch (whole groups) until each cost is measured."""
        e = self.estimate
        if len(e) < 4:
            return balanced_rows(rows, self.group, 0.0, 1.0, 0.0, 1.0)
        a, b = e["rollout_ref_token_s"] * tokens_per_row, e["training_ref_token_s"] * tokens_per_row
        return balanced_rows(rows, self.group, e["rollout_s"], a, e["update_token_s"] * tokens_now, b)
