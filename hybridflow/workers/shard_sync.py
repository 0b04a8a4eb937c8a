"""Shard-only weight sync to a tensor-parallel rollout pool (trainer.rollout_ahead=1 with rollout.tg > 1;
docs/design.md, "One-step-ahead rollout").

Each rollout rank of a tg-way pool holds only its generation shard (rollout/pool_tp.py), so it is sent
only that: the spec (the rollout model's state dict, workers/weight_sync.py) carries the shard's shapes,
the same on every rank, and a tensor the shard splits differs from the actor's full shape in exactly one
dimension, by a factor tg. Actor rank 0 cuts each full tensor into tg slices along that dimension and
broadcasts slice j over a subgroup of the sync group: itself and the rollout ranks of TP index j (rank r
has index r % tg: consecutive TP groups), one per generation replica. So each rollout rank receives 1/tg
of the split tensors (the norms whole), and actor rank 0 sends tg such payloads per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist


def split_dims(spec: list, full_shapes: dict, tg: int) -> list[int | None]:
    """Per spec entry ([name, shard shape, dtype]), the dimension its shard is cut along from the actor's
    full shape (None: sent whole); ValueError naming the tensors whose shapes are neither."""
    dims, bad = [], []
    for name, shape, _ in spec:
        full = full_shapes.get(name)
        diff = [
            d
            for d in range(len(shape))
            if full is not None and len(full) == len(shape) and full[d] != shape[d]
        ]
        if (
            full is None
            or len(full) != len(shape)
            or len(diff) > 1
            or (diff and full[diff[0]] != shape[diff[0]] * tg)
        ):
            bad.append(f"{name} {shape}")
        dims.append(diff[0] if diff else None)
    if bad:
        raise ValueError(
            f"rollout pool: the actor's model has no tensor of the same name and shape (or 1/{tg} of it along "
            f"one dimension) for {bad[:3]} (the actor has e.g. {list(full_shapes.items())[:3]})"
        )
    return dims


def subgroup_ranks(n_rollout: int, tg: int) -> list[list[int]]:
    """Sync-group ranks (actor rank 0 is 0, rollout rank r is 1 + r) of the subgroup of each TP index."""
    return [[0] + [1 + r for r in range(n_rollout) if r % tg == j] for j in range(tg)]


def build_subgroups(store, rank: int, world: int, tg: int, make: Callable) -> list:
    """This sync-group rank's subgroups: all tg for actor rank 0 (made one after another, each waiting
    for its members), else the one of its TP index. make(store, rank, size) -> a process group."""
    out = []
    for j, ranks in enumerate(subgroup_ranks(world - 1, tg)):
        if rank in ranks:
            out.append(make(dist.PrefixStore(f"shard{j}/", store), ranks.index(rank), len(ranks)))
    return out


def send_shards(
    gathered: Iterator, spec: list, dims: list, groups: list, broadcast: Callable, buckets: list
) -> dict:
    """Actor rank 0: the full tensors from `gathered` ((name, tensor) in state-dict order), each bucket
    of the spec cut into its tg slices and slice j packed into a copy and given to broadcast(groups[j],
    flat) (which may return before the bytes are sent: weight_sync.py keeps the copy until they are).
    -> sync/bytes (what each rollout rank receives), sync/bytes_sent (all tg payloads)."""
    tg = len(groups)
    wanted, have, per_rank = {s[0] for s in spec}, {}, [0] * tg
    for bucket in buckets:
        for i in bucket:
            while spec[i][0] not in have:
                name, t = next(gathered)
                if name in wanted:
                    have[name] = t
        dtype = getattr(torch, spec[bucket[0]][2])
        for j, group in enumerate(groups):
            parts = []
            for i in bucket:
                t, dim = have[spec[i][0]], dims[i]
                if dim is not None:
                    size = t.shape[dim] // tg
                    t = t.narrow(dim, j * size, size)
                parts.append(t.to(dtype).reshape(-1))
            flat = torch.cat(parts)
            broadcast(group, flat)
            per_rank[j] += flat.numel() * flat.element_size()
        for i in bucket:
            del have[spec[i][0]]
    for _ in gathered:  # the remaining gathers are collectives over the actor's group
        pass
    assert len(set(per_rank)) == 1, per_rank  # every shard has the spec's shapes
    return {"sync/bytes": float(per_rank[0]), "sync/bytes_sent": float(sum(per_rank))}
