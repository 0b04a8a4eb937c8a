"""Named mesh layouts: where a worker sits in its model's parallel mesh, as the controller sees it.

A worker declares one layout per way it lays out data, e.g. "train" (dp/tp/pp coordinates of the
training mesh) and "rollout" (micro-DP replica coordinates of the generation mesh, docs/design.md §4). The
transfer protocols read only the layout, never the worker's internals: which data shard a rank
receives (`dp_rank` of `dp_size`) and whether its output is the one collected (`collect`).

Also here: `shard_indices`, the one rule for padding and splitting a batch of any size over
`n_shards` shards, shared by the driver (splitting a Batch) and by consumer workers (slicing a
future's output themselves, so the data never passes through the driver).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Layout:
    """One rank's coordinates in a named mesh.

    dp_rank / dp_size: which data shard this rank works on, of how many.
    collect:  whether the controller gathers this rank's output for its shard (exactly one rank per
              shard collects; by default tp rank 0 on the last pipeline stage).
    tp_rank / tp_size, pp_rank / pp_size: model-parallel coordinates (1 when unused).
    extra:    any further named coordinates (e.g. {"dg_rank": 1}) for user protocols.
    """

    dp_rank: int
    dp_size: int
    collect: bool
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    extra: dict = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        dp_rank: int,
        dp_size: int,
        collect: bool | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        **extra,
    ) -> Layout:
        for name, r, n in (("dp", dp_rank, dp_size), ("tp", tp_rank, tp_size), ("pp", pp_rank, pp_size)):
            if n < 1 or not 0 <= r < n:
                raise ValueError(f"layout: {name}_rank={r} is not in [0, {name}_size={n})")
        if collect is None:
            collect = tp_rank == 0 and pp_rank == pp_size - 1
        return cls(dp_rank, dp_size, bool(collect), tp_rank, tp_size, pp_rank, pp_size, dict(extra))


def default_layout(rank: int, world_size: int) -> Layout:
    """Pure data parallelism: every rank is its own shard and is collected."""
    return Layout(dp_rank=rank, dp_size=world_size, collect=True)


@dataclass(frozen=True)
class ShardPlan:
    """How a sharded protocol maps ranks to data shards.

    shard_of_rank[r]: the shard rank r receives (several ranks may share one: a tp/pp group), or
        None when rank r takes no part in the call.
    collect_ranks[s]: the rank whose output is gathered for shard s, in shard order.
    """

    n_shards: int
    shard_of_rank: list[int | None]
    collect_ranks: list[int]


def plan_from_layouts(layouts: list[Layout], name: str) -> ShardPlan:
    """Check that the ranks' layouts agree and form a valid plan (one collector per shard)."""
    sizes = {lay.dp_size for lay in layouts}
    if len(sizes) != 1:
        raise ValueError(f"layout {name!r}: ranks disagree on dp_size: {sorted(sizes)}")
    n = sizes.pop()
    collectors: dict[int, list[int]] = {s: [] for s in range(n)}
    for rank, lay in enumerate(layouts):
        if lay.collect:
            collectors[lay.dp_rank].append(rank)
    bad = {s: r for s, r in collectors.items() if len(r) != 1}
    if bad:
        raise ValueError(
            f"layout {name!r}: each dp shard needs exactly one collecting rank; "
            f"got shard -> collecting ranks {bad}"
        )
    return ShardPlan(n, [lay.dp_rank for lay in layouts], [collectors[s][0] for s in range(n)])


def shard_indices(total: int, n_shards: int, shard: int) -> tuple[np.ndarray | slice, int]:
    """Rows of shard `shard` when `total` rows are padded to a multiple of `n_shards` and split.

    Padding repeats leading rows (row total + i is row i % total), as Batch.pad_to_divisor does.
    Returns (rows, pad): a slice when no padding falls in this shard (zero-copy), else an index
    array; `pad` is the number of padding rows, all at the end of the shard.
    """
    if total == 0:
        return slice(0, 0), 0
    size = -(-total // n_shards)  # ceil
    start, stop = shard * size, (shard + 1) * size
    if stop <= total:
        return slice(start, stop), 0
    idx = np.arange(start, stop)
    pad = int((idx >= total).sum())
    return np.where(idx < total, idx, (idx - total) % total), pad
