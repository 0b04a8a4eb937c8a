"""Which pieces of which weights each rank puts into each all-gather bucket (pure; no communication).

A gather plan is computed identically on every rank from (specs, layout, group), so the ranks agree on
the byte layout of every bucket without exchanging metadata. Member m of a group of n contributes, per
bucket, a flat run of `Item`s (regions of its training shard) padded to the bucket's per-member size c;
the all-gather output holds n such slots back to back.

- A TP-split weight contributes its training piece t_i. When several members of the group hold the same
  piece (the all-gather-everything method spans the d data-parallel replicas), each sends only a 1/nsub
  slab of it along the split dim, ZeRO style.
- A replicated weight (a norm) travels only if some member of the group works on another stage; it is
  then cut into flat chunks, one per member of its stage, so nobody sends it twice.
Buckets follow decoder layers: unit u of a member is its stage's u-th local layer, the last unit holds the
embedding / final norm / lm_head, so members of different pipeline stages send similar-sized units
together and padding stays at the size difference of those units (the final norm, for p=2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.hybrid_engine.layout import TrainLayout
from hybridflow.hybrid_engine.sharding import ParamSpec


@dataclass(frozen=True)
class Item:
    """A region of one weight carried in a bucket: piece `piece` of the split, slab `sub` of `nsub`."""

    name: str
    split_dim: int | None  # None: a flat chunk of a replicated weight
    piece: int  # training TP index t_i (split weights) or chunk index (replicated weights)
    nchunks: int  # replicated weights: how many chunks the weight is cut into; 1 for split weights
    sub: int  # slab index inside the piece along split_dim
    nsub: int
    shape: tuple[int, ...]  # shape of the region

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def key(self) -> tuple[str, int, int]:
        return self.name, self.piece, self.sub


@dataclass(frozen=True)
class Bucket:
    items: tuple[tuple[Item, ...], ...]  # items[m]: member m's regions, in slot order
    numel: int  # per-member slot size (max over members; shorter slots are zero padded)


@dataclass(frozen=True)
class GatherPlan:
    ranks: tuple[int, ...]  # group members in collective order
    buckets: tuple[Bucket, ...]

    @property
    def slot_numel(self) -> int:
        """Elements one member contributes over all buckets (padded)."""
        return sum(b.numel for b in self.buckets)


def _split_sizes(n: int, parts: int) -> list[int]:
    """Sizes torch.tensor_split(n, parts) gives: the first n % parts parts one larger."""
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def member_units(
    rank: int, group: list[int], specs: list[ParamSpec], train: TrainLayout, include_replicated: bool
) -> list[list[Item]]:
    """The regions `rank` contributes to a gather over `group`, as layer units (see module docstring)."""
    _, stage, t_i = train.coords(rank)
    same_piece = [r for r in group if train.coords(r)[1:] == (stage, t_i)]
    same_stage = [r for r in group if train.coords(r)[1] == stage]
    per_stage = len({s.layer for s in specs if s.stage == stage and s.layer is not None})
    first_layer = min((s.layer for s in specs if s.stage == stage and s.layer is not None), default=0)
    units: list[list[Item]] = [[] for _ in range(per_stage + 1)]
    for s in specs:
        if s.stage != stage:
            continue
        u = per_stage if s.layer is None else s.layer - first_layer
        if s.split_dim is not None:
            piece = list(s.shape)
            piece[s.split_dim] //= train.t
            sub, nsub = same_piece.index(rank), len(same_piece)
            piece[s.split_dim] = _split_sizes(piece[s.split_dim], nsub)[sub]
            units[u].append(Item(s.name, s.split_dim, t_i, 1, sub, nsub, tuple(piece)))
        elif include_replicated:
            j, k = same_stage.index(rank), len(same_stage)
            units[u].append(Item(s.name, None, j, k, 0, 1, (_split_sizes(s.numel, k)[j],)))
    return units


def build_gather_plan(
    group: list[int], specs: list[ParamSpec], train: TrainLayout, include_replicated: bool, bucket_numel: int
) -> GatherPlan:
    """Bucket every member's units so that bucket k holds the same units of every member."""
    per_member = [member_units(r, group, specs, train, include_replicated) for r in group]
    n_units = max(len(u) for u in per_member)
    for u in per_member:
        u += [[] for _ in range(n_units - len(u))]
    unit_max = [max(sum(i.numel for i in u[k]) for u in per_member) for k in range(n_units)]
    buckets, start = [], 0
    while start < n_units:
        end, size = start + 1, unit_max[start]
        while end < n_units and size + unit_max[end] <= bucket_numel:
            size += unit_max[end]
            end += 1
        items = tuple(tuple(i for k in range(start, end) for i in u[k]) for u in per_member)
        numel = max(sum(i.numel for i in its) for its in items)
        if numel:
            buckets.append(Bucket(items, numel))
        start = end
    return GatherPlan(tuple(group), tuple(buckets))


def region(shard: torch.Tensor, item: Item) -> torch.Tensor:
    """The part of this rank's training tensor `shard` that `item` names (a view)."""
    if item.split_dim is None:
        return shard.reshape(-1).tensor_split(item.nchunks)[item.piece]
    return shard.tensor_split(item.nsub, dim=item.split_dim)[item.sub]


def pack(slot: torch.Tensor, items: tuple[Item, ...], shard: dict[str, torch.Tensor]) -> None:
    """Copy this member's regions into its slot of the gather buffer; zero the padding."""
    off = 0
    for it in items:
        slot[off : off + it.numel].view(it.shape).copy_(region(shard[it.name], it))
        off += it.numel
    slot[off:].zero_()


def unpack(buf: torch.Tensor, bucket: Bucket) -> dict[tuple[str, int, int], torch.Tensor]:
    """Views (no copies) into a gathered bucket buffer, keyed by (name, piece, sub)."""
    out = {}
    for m, items in enumerate(bucket.items):
        off = m * bucket.numel
        for it in items:
            out[it.key] = buf[off : off + it.numel].view(it.shape)
            off += it.numel
    return out
