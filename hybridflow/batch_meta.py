"""BatchMeta: what a Batch says about all of its rows at once, one typed field per fact.

Each field declares its `Rule`, what happens to it when batches are cut and joined:

  SAME     one value for every row (a step, a temperature). index / split / repeat keep it; concat and
           union need the set values to agree (None means "not set" and takes the other side's).
  PEAK     {name: float} figures of one call, logged with the step. index / split / repeat keep them;
           concat and union take the max per name (per-chunk peaks; figures already equal across ranks
           stay as they are).
  PADDING  how many trailing rows are padding copies (the controller's dp padding). It follows the
           rows: a selection counts the padding rows it keeps, concat adds them up, repeat multiplies
           them, union of the same rows needs equal counts (0: a part made without the padding), and
           any operation that would put a padding row before a real one raises.
  CALL     a worker method's note to the driver (CallInfo.info). index / split / repeat keep it (the
           controller drops an output's padding rows before reading it); the controller takes it off
           each output before outputs are joined, so concat / union of a batch still carrying it raise.

Nothing is "last chunk wins": a disagreement is a ValueError naming the field and the values.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np


class Rule(enum.Enum):
    SAME = "same"
    PEAK = "peak"
    PADDING = "padding"
    CALL = "call"


def _meta(rule: Rule, help: str, default: Any = None):
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"rule": rule, "help": help})
    return field(default=default, metadata={"rule": rule, "help": help})


OldLogProbSource = Literal["rollout", "update", "actor"]

# keys that checkpoints written before BatchMeta may hold and that nothing ever read
_RETIRED_KEYS = ("epoch", "batch_in_epoch")


@dataclass
class BatchMeta:
    """Facts about every row of a Batch. The module docstring gives the rules; each field its own."""

    global_step: int | None = _meta(
        Rule.SAME,
        "the training step the batch belongs to (it seeds the rollout's sampling); None outside one",
    )
    temperature: float | None = _meta(
        Rule.SAME, "the temperature of the rollout's log-probs (SamplingParams.logprob_temperature): every "
        "training forward divides its logits by it; None: not a rollout, 1.0",
    )  # fmt: skip
    rollout_log_probs_exact: bool | None = _meta(
        Rule.SAME, "False when the engine's log-probs follow another convention than the training forward's "
        "(vLLM under top-k / top-p: of the truncated distribution); None: no engine said so, exact",
    )  # fmt: skip
    old_log_probs_source: OldLogProbSource | None = _meta(
        Rule.SAME, "where the step's old log-probs come from (the rollout source says, trainers/sources/"
        "base.py old_log_prob_source; 'update': the update's own forward, detached)",
    )  # fmt: skip
    pairs: bool | None = _meta(Rule.SAME, "True: rows 2i and 2i+1 are one (chosen, rejected) preference pair")
    rollout_metrics: dict[str, float] = _meta(
        Rule.PEAK,
        "the generation engine's own figures of the call, logged with the step's metrics",
        default={},
    )
    reshard_metrics: dict[str, float] = _meta(
        Rule.PEAK, "the actor's weight switch for the call: reshard/*, timing_s/reshard (max over ranks)",
        default={},
    )  # fmt: skip
    pad_rows: int = _meta(
        Rule.PADDING, "how many trailing rows are padding copies of earlier rows (the controller padding a "
        "batch to a multiple of the dp size); training masks them out of every loss", default=0,
    )  # fmt: skip
    call_info: dict | None = _meta(
        Rule.CALL, "small values a worker method publishes to the driver beside its output (metrics); the "
        "controller takes them off into CallInfo.info",
    )  # fmt: skip

    def copy(self) -> BatchMeta:
        return dataclasses.replace(self, rollout_metrics=dict(self.rollout_metrics),
                                   reshard_metrics=dict(self.reshard_metrics))  # fmt: skip

    def pop_metrics(self) -> dict[str, float]:
        """The call's figures to log (rollout and reshard), taken off the meta."""
        out = {**self.reshard_metrics, **self.rollout_metrics}
        self.reshard_metrics, self.rollout_metrics = {}, {}
        return out

    # ---- the rules ---------------------------------------------------------------------------
    def index(self, n_rows: int, rows: slice | np.ndarray) -> BatchMeta:
        """The meta of rows `rows` (a slice or an index array) of a batch of `n_rows` rows."""
        out = self.copy()
        if self.pad_rows:
            picked = np.arange(n_rows)[rows]
            is_pad = picked >= n_rows - self.pad_rows
            out.pad_rows = int(is_pad.sum())
            if not is_pad[len(picked) - out.pad_rows :].all():
                raise ValueError(
                    f"index: the selection puts some of the {self.pad_rows} padding rows before real rows; "
                    "mask or drop the padding first (workers/common.py mask_padding)"
                )
        return out

    def repeat(self, n: int, interleave: bool) -> BatchMeta:
        """The meta of every row repeated n times (interleave: a,a,b,b; else a,b,a,b)."""
        out = self.copy()
        if self.pad_rows and not interleave:
            raise ValueError("repeat: a,b,a,b order would put padding rows before real ones; use interleave")
        out.pad_rows = self.pad_rows * n
        return out

    @staticmethod
    def concat(metas: list[BatchMeta], lengths: list[int]) -> BatchMeta:
        """The meta of the batches concatenated in order (`lengths`: their row counts)."""
        out = BatchMeta()
        for i, m in enumerate(metas):
            out = _merge(out, m, "concat")
            if m.pad_rows and any(p.pad_rows != n for p, n in zip(metas[i + 1 :], lengths[i + 1 :])):
                raise ValueError(
                    f"concat: part {i} ends in {m.pad_rows} padding rows but a later part holds real rows; "
                    "padding must stay at the end"
                )
        out.pad_rows = sum(m.pad_rows for m in metas)
        return out

    def union(self, other: BatchMeta) -> BatchMeta:
        """The meta of two batches of the same rows joined field-wise."""
        if self.pad_rows and other.pad_rows and self.pad_rows != other.pad_rows:
            raise ValueError(f"union: pad_rows differ ({self.pad_rows} vs {other.pad_rows})")
        out = _merge(self, other, "union")
        out.pad_rows = self.pad_rows or other.pad_rows
        return out

    # ---- JSON (checkpoints) --------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BatchMeta:
        """The inverse of to_dict; also reads the string-keyed dicts of checkpoints written before BatchMeta."""
        d = {k: v for k, v in d.items() if k not in _RETIRED_KEYS}
        if d.get("pairs") == "interleaved":
            d["pairs"] = True
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"batch meta: unknown fields {unknown}; known: {[f.name for f in dataclasses.fields(cls)]}"
            )
        return cls(**d)


def _merge(a: BatchMeta, b: BatchMeta, op: str) -> BatchMeta:
    """a and b joined by each field's rule; pad_rows is left to the caller (it depends on the operation)."""
    out = a.copy()
    for f in dataclasses.fields(BatchMeta):
        rule, mine, theirs = f.metadata["rule"], getattr(a, f.name), getattr(b, f.name)
        if rule is Rule.SAME:
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"{op}: batches disagree on meta.{f.name} ({mine!r} vs {theirs!r})")
            setattr(out, f.name, theirs if mine is None else mine)
        elif rule is Rule.PEAK:
            peaks = dict(mine)
            for k, v in theirs.items():
                peaks[k] = max(peaks.get(k, v), v)
            setattr(out, f.name, peaks)
        elif rule is Rule.CALL and (mine is not None or theirs is not None):
            raise ValueError(
                f"{op}: a batch still carries meta.call_info; the controller takes it off a method's output "
                "before outputs are joined"
            )
    return out
