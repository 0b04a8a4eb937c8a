"""Which log-probs stand for training in the update's gap, and when the gap is skipped (workers/losses.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch_meta import BatchMeta
from hybridflow.workers.losses import GapMeter, gap_training_side

FIELDS = ["responses", "response_mask", "rollout_log_probs"]


@pytest.mark.parametrize(
    "source,fields,side",
    [
        ("actor", [*FIELDS, "old_log_probs"], "old"),  # a separate actor forward before the update
        ("rollout", [*FIELDS, "old_log_probs"], "forward"),  # old = rollout's own: the update's forward
        ("update", FIELDS, "forward"),  # the update's own forward, one optimizer step
        (None, [*FIELDS, "old_log_probs"], "old"),  # a direct call that brings old log-probs
        ("actor", ["responses", "response_mask", "old_log_probs"], None),  # no rollout log-probs kept
    ],
)  # fmt: skip
def test_the_training_side(source, fields, side):
    assert gap_training_side(BatchMeta(old_log_probs_source=source), fields) == side


def test_skipped_when_the_rollout_log_probs_follow_another_convention():
    """vLLM under top-k / top-p returns log-probs of the truncated distribution: the difference would be
    the log of the kept mass, not a mismatch (docs/metrics.md)."""
    fields = [*FIELDS, "old_log_probs"]
    assert (
        gap_training_side(BatchMeta(rollout_log_probs_exact=False, old_log_probs_source="update"), fields)
        is None
    )
    assert (
        gap_training_side(BatchMeta(rollout_log_probs_exact=True, old_log_probs_source="update"), fields)
        == "forward"
    )


def test_the_meter_keeps_only_the_first_forward():
    """Parts added after close() (forwards after an optimizer step) do not count; one process: no collective."""
    meter = GapMeter()
    mask = torch.ones(1, 2)
    meter.add(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), mask)
    meter.close()
    meter.add(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-9.0, -9.0]]), mask)
    m = meter.metrics()
    assert m["rollout/log_prob_diff_mean"] == pytest.approx(0.25) and m["rollout/log_prob_diff_max"] == 0.5
    assert GapMeter().metrics() == {}  # nothing added: nothing logged
