"""How much the actor -> rollout-pool weight sync (trainer.rollout_ahead=1) holds at once: the worker obeys
these sizes (workers/weight_sync.py) and the planner prices them (planner/ahead.py). Standard library only,
so the planner stays pure (docs/design.md §7, "Layers")."""

BUCKET_BYTES = 64 << 20  # one broadcast per bucket: few calls, bounded extra memory on both sides
SEND_INFLIGHT_BYTES = 1 << 30  # buckets actor rank 0 may hold while their broadcasts run behind its update
