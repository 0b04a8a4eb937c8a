"""frozen_pool="both" in the one-step-ahead planner (ahead.py, docs/planner.md): the reference on both sides.

The trainer's resources.frozen_pool=both (trainers/ref_split.py) holds the reference in the rollout pool's
processes and in the actor's workers, and scores rows [0, m) of each batch on the rollout pool right after
generating it and the rest on the training side before the update, m chosen each step to even the two
sides. The planner prices the steady state of that split: with a fraction f of the rows on the rollout pool

    rollout side  = generation + sync + other frozen forwards + f * R_roll
    training side = training side without the reference + its share of the sync + (1 - f) * R_train

where R_roll is the reference's forward over the whole batch on the rollout pool (data parallel there, as
ahead.scoring_seconds prices it) and R_train its forward on the training side, as that side's search
prices it in the actor's pool. The iteration is the longer side; f in [0, 1] minimises it (the same
balance ref_split.balanced_rows strikes at run time, on measured costs).
"""

from __future__ import annotations

import math


def split_reference(
    rollout_s: float, training_s: float, ref_rollout_s: float, ref_training_s: float
) -> tuple[float, float, float]:
    """(f, rollout side seconds, training side seconds) minimising max(rollout_s + f * ref_rollout_s,
    training_s + (1 - f) * ref_training_s) over f in [0, 1]: the sides meet at
    f = (training_s + ref_training_s - rollout_s) / (ref_rollout_s + ref_training_s), clamped (one side
    longer even with all the rows on the other). No reference work on either side: f = 0."""
    total = ref_rollout_s + ref_training_s
    f = (training_s + ref_training_s - rollout_s) / total if total > 0 else 0.0
    f = min(max(f, 0.0), 1.0)
    return f, rollout_s + f * ref_rollout_s, training_s + (1 - f) * ref_training_s


def best_both_split(
    rollout, training, sync, num_devices: int, sender_waits: float = 1.0
) -> tuple[float, int, float] | None:
    """(iteration seconds, rollout devices, f) of the best n = 1..N-1 with the reference split, or None.
    `rollout(n)`: (generation + other frozen forwards, R_roll) on n rollout devices, or None (does not
    fit); `training(m)`: (training side with the whole reference, R_train) on m devices, or None;
    `sync(n)`: the weight sync's seconds. As best_split (ahead.py), the scan stops once the training
    side no longer fits (fewer devices do not help it)."""
    best = None
    for n in range(1, num_devices):
        side = training(num_devices - n)
        if side is None or not math.isfinite(side[0]):
            break
        g = rollout(n)
        if g is None or not math.isfinite(g[0]):
            continue
        s = sync(n)
        f, roll, train = split_reference(g[0] + s, side[0] - side[1] + sender_waits * s, g[1], side[1])
        cost = max(roll, train)
        if best is None or cost < best[0]:
            best = (cost, n, f)
    return best


def explain_frozen_pools(planned: str, dataflow, cluster, wl, limits, console) -> None:
    """One step ahead, each place of the frozen models with its best plan (ahead.py, ahead_both.py): both
    sides' seconds (sync included) and, with "both", the share of the reference's rows on the rollout pool."""
    from rich.table import Table

    from hybridflow.planner.ahead import FROZEN_POOLS, search_ahead

    table = Table(title="one step ahead: where the frozen models run (--frozen-pool)", title_justify="left")
    for col in ("frozen pool", "rollout devices", "rollout side s", "training side s", "ref rows on rollout",
                "iteration s"):  # fmt: skip
        table.add_column(col, justify="left" if col == "frozen pool" else "right")
    for place in FROZEN_POOLS:
        try:
            r = search_ahead(dataflow, cluster, wl, limits, None, place)
        except ValueError:  # "both" without a reference
            r = None
        if r is None:
            table.add_row(place, "-", "-", "-", "-", "no plan")
            continue
        mark = " <- plan" if place == planned else ""
        table.add_row(
            place + mark, str(r.rollout.n_devices), f"{r.rollout_side_seconds + r.sync_seconds:.3f}",
            f"{r.training_side_seconds + r.sender_waits * r.sync_seconds:.3f}",
            f"{r.ref_rows_on_rollout:.0%}" if place == "both" else "-", f"{r.iteration_time:.3f}",
        )  # fmt: skip
    console.print(table)
