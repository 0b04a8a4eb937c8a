"""The actor's train <-> generate switch, four ways behind one interface (`HybridEngine`).

- "hybridflow" (the paper's 3D-HybridEngine): all-gather only inside the micro-DP group, bucket by bucket
  (a bucket is one or more decoder layers). The gathered buffers *are* the generation weights: every
  generation tensor is a view into them, so nothing else is allocated and the full model never exists
  on any rank. generate -> train just drops the buffers (the training shard was never touched).
- "allgather" (DeepSpeed-Chat style): all-gather over all N ranks, every rank sending a 1/(t*p*d) share
  (ZeRO style: the d replicas of a training shard each send a different slab), then take the generation
  shard out of the full model.
- "vanilla" (HybridFlow-V): generation groups are consecutive ranks, so a rank's training shard is not
  part of its generation shard; all-gather the whole model inside the training model-parallel group.
- "two_copy" (OpenRLHF style): a separate, always resident generation copy of the weights, refreshed each
  iteration by a full weight transfer: global rank 0 gathers the model from its model-parallel group and
  broadcasts it to every rank, which copies out the part its generation copy holds.

Departure from the paper, on purpose: in "allgather" and "vanilla" the generation weights are views into
the gathered full model, which is kept until generate -> train (peak = M, as Table 2 says); copying the
generation shard out and freeing the rest would lower the steady state but raise the peak to M + M/(tg pg).
And in "hybridflow" a rank's own slot of each gathered bucket is a copy of its training shard (M/(tp)
per rank): the training engine owns those tensors and keeps them, so the paper's "redundant copy 0" would
need the training engine to hand its storage over during generation. The peak stays M/(tg pg).
Generation weights are returned as `{name: [chunk, ...]}`, chunks along the weight's TP split dim (or flat
chunks of a norm), which the TP forward in `tp_generate` consumes without concatenating them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.comm import CountedComm, MemoryLedger
from hybridflow.hybrid_engine.layout import STYLES, GenLayout, TrainLayout
from hybridflow.hybrid_engine.plan import GatherPlan, build_gather_plan, pack, unpack
from hybridflow.hybrid_engine.sharding import LlamaShape, ParamSpec, llama_param_specs

METHODS = ("hybridflow", "allgather", "vanilla", "two_copy")
DEFAULT_BUCKET_BYTES = 32 << 20

GenWeights = dict[str, list[torch.Tensor]]


def generation_layout(method: str, train: TrainLayout, pg: int, tg: int) -> GenLayout:
    """The generation layout each method uses: consecutive groups for "vanilla", strided otherwise."""
    if method not in METHODS:
        raise ValueError(f"unknown switch method {method!r}; choose one of {METHODS}")
    return GenLayout(train, pg=pg, tg=tg, style="vanilla" if method == "vanilla" else "hybridflow")


def switch_plan(
    method: str, gen: GenLayout, specs: list[ParamSpec], rank: int, bucket_numel: int
) -> GatherPlan:
    """The gather `rank` takes part in for `method` (pure: the same on every rank, usable without processes)."""
    tr = gen.train
    if method == "hybridflow":  # only the micro-DP group; norms travel only if it spans pipeline stages
        group, include_rep = next(g for g in gen.micro_dp_groups() if rank in g), tr.p // gen.pg > 1
    elif method == "allgather":
        group, include_rep = list(range(tr.world_size)), tr.p > 1
    elif method == "vanilla":
        group, include_rep = next(g for g in tr.mp_groups() if rank in g), tr.p > 1
    elif method == "two_copy":  # rank 0's model-parallel group is the source of the weight transfer
        group, include_rep = tr.mp_groups()[0], tr.p > 1
    else:
        raise ValueError(f"unknown switch method {method!r}; choose one of {METHODS}")
    return build_gather_plan(sorted(group), specs, tr, include_rep, bucket_numel)


def expected_bytes_received(method: str, plan: GatherPlan, rank: int, itemsize: int) -> int:
    """Bytes `rank` receives per switch under `plan` (all-gather slots, or two_copy's gather + broadcast)."""
    slot, n = plan.slot_numel * itemsize, len(plan.ranks)
    if method != "two_copy" or rank == plan.ranks[0]:
        return (n - 1) * slot
    return n * slot  # every other rank receives the whole broadcast buffer


class EngineGroups:
    """Every process group any method (and the generation forward) may use, created once, collectively.

    `dist.new_group` must be called by all ranks in the same order, so all ranks enumerate the same list.
    """

    def __init__(self, train: TrainLayout, pg: int, tg: int):
        self.train, self.rank = train, dist.get_rank()
        if dist.get_world_size() != train.world_size:
            raise ValueError(f"world size {dist.get_world_size()} != p*t*d = {train.world_size}")
        wanted = list(train.mp_groups())
        for style in STYLES:
            gen = GenLayout(train, pg, tg, style)
            wanted += gen.micro_dp_groups() + gen.tp_groups() + gen.pp_groups()
        self._groups: dict[tuple[int, ...], object] = {}
        for ranks in wanted:
            key = tuple(sorted(ranks))
            if key in self._groups:
                continue
            if len(key) == train.world_size:
                self._groups[key] = dist.group.WORLD
                continue
            group = dist.new_group(list(key))
            self._groups[key] = group if self.rank in key else None

    def get(self, ranks) -> object:
        key = tuple(sorted(ranks))
        if len(key) == self.train.world_size:
            return dist.group.WORLD
        if self._groups.get(key) is None:
            raise KeyError(f"rank {self.rank} has no process group for ranks {key}")
        return self._groups[key]

    def generation(self, gen: GenLayout) -> tuple[object, list[int], object, list[int]]:
        """(tp group, its ranks by g_tp, pp group, its ranks by g_pp) of this rank's generation replica."""
        tp = next(g for g in gen.tp_groups() if self.rank in g)
        pp = next(g for g in gen.pp_groups() if self.rank in g)
        return self.get(tp), tp, self.get(pp), pp


@dataclass
class SwitchStats:
    """Measured cost of one train -> generate switch on this rank."""

    method: str
    bytes_sent: int
    bytes_received: int
    peak_extra_bytes: int  # most bytes held beyond the training shard during the switch
    resident_extra_bytes: int  # bytes held beyond the training shard while training (two_copy's copy)
    seconds: float
    comm_seconds: float = 0.0  # part of `seconds` spent inside the collectives


class HybridEngine:
    """Switches this rank's actor weights between the training shard and a generation shard.

    `train_shard` ({name: tensor}, this rank's stage, TP shard t_i) is read in place at every switch, so a
    training step that updates those tensors is reflected by the next `to_generation()`.
    """

    def __init__(
        self,
        shape: LlamaShape,
        train_shard: dict[str, torch.Tensor],
        gen: GenLayout,
        method: str,
        groups: EngineGroups,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        if generation_layout(method, gen.train, gen.pg, gen.tg) != gen:
            raise ValueError(
                f"method {method!r} needs a {generation_layout(method, gen.train, 1, 1).style} layout"
            )
        tr = gen.train
        shape.check_tp(tr.t, "training t")
        self.shape, self.gen, self.method, self.groups = shape, gen, method, groups
        self.rank, self.shard = groups.rank, train_shard
        self.specs = llama_param_specs(shape, tr.p)
        self._spec = {s.name: s for s in self.specs}
        first = next(iter(train_shard.values()))
        self.dtype, self.device = first.dtype, first.device
        self.plan = switch_plan(
            method, gen, self.specs, self.rank, max(1, bucket_bytes // first.element_size())
        )
        self.comm, self.ledger = CountedComm(), MemoryLedger()
        self.weights: GenWeights | None = None
        self.stats: SwitchStats | None = None
        self._buffers: list[torch.Tensor] = []
        self._copy: dict | None = None
        if method == "two_copy":  # the second actor copy lives for the whole run
            self._copy = {
                k: self.ledger.empty(it.numel, self.dtype, self.device).view(it.shape)
                for k, it in self._needed()
            }

    def expected_bytes_received(self) -> int:
        """Bytes this rank receives per switch, from the plan alone (what the counters must show)."""
        return expected_bytes_received(self.method, self.plan, self.rank, self.dtype.itemsize)

    def _needed(self):
        """(key, item) of every gathered region this rank's generation shard uses, in plan order."""
        stages, pieces = self.gen.needed_pieces(self.rank)
        own_stage = self.gen.train.coords(self.rank)[1]
        for bucket in self.plan.buckets:
            for items in bucket.items:
                for it in items:
                    spec = self._spec[it.name]
                    if spec.stage not in stages:
                        continue
                    if it.split_dim is not None and it.piece in pieces:
                        yield it.key, it
                    elif it.split_dim is None and spec.stage != own_stage:
                        yield it.key, it

    def _select(self, available: dict[tuple[str, int, int], torch.Tensor]) -> GenWeights:
        """Generation weights as chunk lists, checked to cover exactly generation shard g_tp of tg."""
        stages, _ = self.gen.needed_pieces(self.rank)
        own_stage = self.gen.train.coords(self.rank)[1]
        keyed = {k: available[k] for k, _ in self._needed()}
        out: GenWeights = {}
        for spec in self.specs:
            if spec.stage not in stages:
                continue
            if spec.split_dim is None and spec.stage == own_stage:
                out[spec.name] = [self.shard[spec.name]]
                continue
            chunks = [keyed[k] for k in sorted(k for k in keyed if k[0] == spec.name)]
            dim = 0 if spec.split_dim is None else spec.split_dim
            want = spec.numel if spec.split_dim is None else spec.shape[dim] // self.gen.tg
            got = sum(c.reshape(-1).numel() if spec.split_dim is None else c.shape[dim] for c in chunks)
            if got != want:
                raise RuntimeError(f"{self.method}: rank {self.rank} assembled {got}/{want} of {spec.name}")
            out[spec.name] = chunks
        return out

    # ---- the switch -------------------------------------------------------------------------------------
    def to_generation(self) -> GenWeights:
        """train -> generate: returns {name: chunks} of this rank's generation shard; sets self.stats."""
        if self.weights is not None:
            raise RuntimeError("already in generation mode; call to_training() first")
        self.comm.reset()
        resident = self.ledger.current
        self.ledger.reset_peak()
        start = time.perf_counter()
        if self.method == "two_copy":
            self._sync_copy()
            self.weights = self._select(self._copy)
        else:
            views: dict = {}
            for bucket in self.plan.buckets:
                views.update(self._gather_bucket(bucket))
            self.weights = self._select(views)
        self.stats = SwitchStats(
            self.method,
            self.comm.stats.bytes_sent,
            self.comm.stats.bytes_received,
            self.ledger.peak,
            resident,
            time.perf_counter() - start,
            self.comm.stats.seconds,
        )
        return self.weights

    def to_training(self) -> None:
        """generate -> train: drop the generation-only buffers; the training shard was kept as it was."""
        for buf in self._buffers:
            self.ledger.release(buf)
        self._buffers, self.weights = [], None

    def _gather_bucket(self, bucket) -> dict:
        group_ranks = self.plan.ranks
        me, n = group_ranks.index(self.rank), len(group_ranks)
        buf = self.ledger.empty(n * bucket.numel, self.dtype, self.device)
        slot = buf[me * bucket.numel : (me + 1) * bucket.numel]
        pack(slot, bucket.items[me], self.shard)  # straight into our own part of the output: no staging copy
        self.comm.all_gather_into(buf, slot, self.groups.get(group_ranks))
        self._buffers.append(buf)
        return unpack(buf, bucket)

    def _sync_copy(self) -> None:
        src_group, src = self.plan.ranks, self.plan.ranks[0]
        n = len(src_group)
        for bucket in self.plan.buckets:
            buf = self.ledger.empty(n * bucket.numel, self.dtype, self.device)
            if self.rank in src_group:
                me = src_group.index(self.rank)
                slot = buf[me * bucket.numel : (me + 1) * bucket.numel]
                pack(slot, bucket.items[me], self.shard)
                self.comm.gather(slot, buf if self.rank == src else None, src, self.groups.get(src_group))
            self.comm.broadcast(buf, src=src, group=None)
            views = unpack(buf, bucket)
            for key, dst in self._copy.items():
                if key in views:
                    dst.copy_(views[key])
            self.ledger.release(buf)
