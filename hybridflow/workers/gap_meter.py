"""The train-vs-rollout gap measured inside the actor's update, where both sides of it exist (the math and
the reduction rule: algorithms/rollout_gap.py; what it means per mode: docs/metrics.md).

The training side is the actor's log-probs of the rollout's tokens at the weights that sampled them,
before any optimizer step of this update:
  "old"      the old log-probs of a separate actor forward (old_log_prob_source "actor")
  "forward"  the update's own forward (sources "update" and "rollout": the update is then one optimizer
             step, so its one forward runs before the weights move)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.algorithms.rollout_gap import gap_metrics, log_prob_gap_stats, reduce_gap_stats
from hybridflow.batch_meta import BatchMeta


def gap_training_side(meta: BatchMeta, fields: list[str]) -> str | None:
    """ "old" | "forward" (module docstring), or None when the gap is not measured: the batch holds no
    rollout log-probs, or they follow another convention (meta.rollout_log_probs_exact False: vLLM under
    top-k / top-p), so that the gap would measure the truncated probability mass rather than a numerical
    mismatch."""
    if "rollout_log_probs" not in fields or meta.rollout_log_probs_exact is False:
        return None
    if meta.old_log_probs_source in ("update", "rollout") or "old_log_probs" not in fields:
        return "forward"
    return "old"


class GapMeter:
    """This rank's gap statistics, collected from the first forward only, then reduced over the dp ranks."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.closed = False

    def add(self, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        if not self.closed:
            self.parts.append(log_prob_gap_stats(train_log_probs, rollout_log_probs, mask))

    def close(self) -> None:
        """No more parts: what follows runs on weights an optimizer step has moved."""
        self.closed = True

    def metrics(self, group=None, device: torch.device | str = "cpu") -> dict[str, float]:
        """The step's metrics, the same on every rank (a collective over `group`, the dp ranks: each
        holds its own rows), so DP_METRICS's mean over the ranks returns them unchanged; tp ranks hold
        the same rows and gather in their own dp group."""
        parts = [p.to(device) for p in self.parts]  # the "old" side's are on the host, the forward's not
        local = reduce_gap_stats(torch.stack(parts) if parts else torch.zeros(0, device=device))
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local, group=group)
            local = reduce_gap_stats(torch.stack(gathered))
        return gap_metrics(local.cpu())  # the one host sync of the gap per step
