"""The actor's train <-> generate switch inside the actor worker: the 3D-HybridEngine on FSDP2 + TP.

Training layout (engines/): t-way tensor parallel x d-way FSDP2 data parallel, p = 1, rank = dp_i * t + t_i.
Generation layout (layout.GenLayout): tg-way tensor parallel; the t ranks of a training TP group form
t/tg micro-DP replicas, so there are d * t/tg generation replicas. Per FSDP unit (one decoder layer, then
the root's embeddings / final norm / lm_head), every method first unshards the unit over dp (FSDP2's own
all-gather), then:

  hybridflow  all-gather the TP-split weights inside the micro-DP group (consecutive ranks, size t/tg),
              one collective per unit (a flat bucket of the unit's pieces, then copied out per weight):
              the result is exactly this rank's generation shard. With tg == t nothing moves and the
              unit simply stays unsharded while generating (no copy).
  allgather   all-gather the TP-split weights over the whole training TP group (one bucket per unit, as
              DeepSpeed-Chat gathers a module's parameters together): each rank then holds
              the full model (DeepSpeed-Chat) and generates on its tg-shard views of it.
  vanilla     HybridFlow-V: generation groups of consecutive ranks, so a rank owns none of its generation
              shard in general; it gathers the whole model inside the TP group, as allgather does.
  two_copy    OpenRLHF: a resident second copy of the generation shard, refreshed every step by a full
              weight transfer (rank 0 gathers each weight from its TP group and broadcasts it to all).

How each weight is split comes from the training engine's own DTensor placements: a weight sharded on
the "tp" mesh axis (Shard(k)) is TP-split along k; anything else is whole on every TP rank (embeddings,
norms, lm_head: engines/parallelize.py keeps them so). The generation shard of a TP-split weight is
pieces g*t/tg .. (g+1)*t/tg - 1 concatenated along k, since pieces are contiguous.

Bytes are counted at the collectives (FSDP's all-gather: (d-1) padded shards; ours: (n-1) input slots);
the formula they must equal is hybrid_engine/cost.fsdp_switch_cost (docs/hybrid_engine.md derives it).
Generation-weight bytes are the peak of what the switch holds for generation: kept unsharded units,
gathered shards or full copies, plus the one unit being processed.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from hybridflow.engines.parallelize import decoder_layers
from hybridflow.hybrid_engine.comm import CountedComm, MemoryLedger
from hybridflow.hybrid_engine.cost import METHODS, fsdp_switch_cost
from hybridflow.hybrid_engine.layout import GenLayout, TrainLayout
from hybridflow.rollout.tp_group import TPGroup

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class ReshardStats:
    """One train -> generate -> train round on this rank."""

    bytes_received: int = 0  # counted at the collectives
    formula_bytes: int = 0  # cost.fsdp_switch_cost for this layout and method
    gen_weight_bytes: int = 0  # peak bytes of generation weights held
    formula_gen_weight_bytes: int = 0
    seconds: float = 0.0  # both directions
    collectives: int = 0  # collectives this rank called: FSDP's unit all-gathers (d > 1) and ours

    def as_metrics(self) -> dict[str, float]:
        return {
            "reshard/bytes_per_rank": float(self.bytes_received),
            "reshard/formula_bytes_per_rank": float(self.formula_bytes),
            "reshard/gen_weight_bytes_per_rank": float(self.gen_weight_bytes),
            "reshard/formula_gen_weight_bytes_per_rank": float(self.formula_gen_weight_bytes),
            "reshard/collectives_per_rank": float(self.collectives),
            "timing_s/reshard": self.seconds,
        }


def generation_layout(method: str, t: int, d: int, tg: int) -> GenLayout:
    """The generation layout a method runs: consecutive groups for "vanilla", strided otherwise."""
    if method not in METHODS:
        raise ValueError(f"rollout.reshard: unknown method {method!r}; choose one of {METHODS}")
    return GenLayout(
        TrainLayout(1, t, d), pg=1, tg=tg, style="vanilla" if method == "vanilla" else "hybridflow"
    )


class Resharder:
    """Owns the actor's generation weights. `with r.generation() as (weights, tp): ...` gives this rank's
    generation shard (HF name -> tensor) and its TPGroup (None when tg == 1); `r.stats` then holds the
    round's counters. engine: the actor's TrainEngine, whose ("dp", "tp") mesh spans all ranks."""

    def __init__(self, engine, method: str = "hybridflow", tg: int = 1, split_vocab: bool = False):
        self.engine, self.method = engine, method
        mesh = engine.mesh
        self.t = mesh["tp"].size() if mesh is not None else 1
        self.d = mesh["dp"].size() if mesh is not None else 1
        self.layout = generation_layout(method, self.t, self.d, tg)
        self.tg, self.st = tg, self.t // tg
        self.rank = dist.get_rank() if mesh is not None else 0
        _, _, self.g_tp, _ = self.layout.coords(self.rank)
        self.tp, self.micro = None, None
        if mesh is not None and self.t > 1:
            hybrid = self.layout.style == "hybridflow"
            shape = (self.d, tg, self.st) if hybrid else (self.d, self.st, tg)
            names = ("dp", "gen_tp", "micro_dp") if hybrid else ("dp", "micro_dp", "gen_tp")
            gen_mesh = init_device_mesh(mesh.device_type, shape, mesh_dim_names=names)
            self.micro = gen_mesh["micro_dp"].get_group()
            if tg > 1:
                group = gen_mesh["gen_tp"].get_group()
                self.tp = TPGroup(group, tg, dist.get_global_rank(group, 0))
        self.tp_index = self.tp.rank() if self.tp is not None else 0
        # split_vocab: the generation engine runs embeddings / lm_head vocab-parallel (V/tg rows each)
        self.vocab = self._vocab_names() if split_vocab and self.tp is not None else frozenset()
        self.train_tp = mesh["tp"].get_group() if mesh is not None and self.t > 1 else None
        self.units = self._units()
        self.comm, self.ledger = CountedComm(), MemoryLedger()
        self.stats = ReshardStats()
        self._copy: dict[str, torch.Tensor] | None = None  # two_copy's resident generation copy
        self._kept: list[FSDPModule] = []

    @property
    def in_place(self) -> bool:
        """Whether the generation weights are the model's own (FSDP-unsharded) parameters: hybridflow
        with t = 1, so an engine reading the model needs no shard (the HF fallback decoder relies on it)."""
        return self.method == "hybridflow" and self.t == 1

    def _units(self) -> list[tuple[torch.nn.Module | None, list[str]]]:
        """(FSDP unit or None, parameter names) in forward order: each decoder layer, then the root."""
        names = [n for n, _ in self.engine.hf_model.named_parameters()]
        layer_of = {n: int(m.group(1)) for n in names if (m := _LAYER.search("." + n))}
        layers = decoder_layers(self.engine.hf_model)
        units = []
        for i, layer in enumerate(layers):
            unit = layer if isinstance(layer, FSDPModule) else None
            units.append((unit, [n for n in names if layer_of.get(n) == i]))
        root = self.engine.module if isinstance(self.engine.module, FSDPModule) else None
        units.append((root, [n for n in names if n not in layer_of]))
        return units

    def _vocab_names(self) -> frozenset[str]:
        """Parameter names of the input and output embeddings, if their rows divide by tg."""
        hf = self.engine.hf_model
        emb = (hf.get_input_embeddings(), hf.get_output_embeddings())
        if emb[0].num_embeddings % self.tg:
            return frozenset()
        return frozenset(
            f"{name}.{p}" for name, mod in hf.named_modules() if any(mod is e for e in emb)
            for p, _ in mod.named_parameters(recurse=False)
        )  # fmt: skip

    # ---- the switch -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def generation(self):
        """train -> generate on entry, generate -> train on exit; counters in self.stats. The engine's
        parameters stay on the device for the duration (with offload: moved in and out once)."""
        self.comm.reset()
        # two_copy's resident copy counts all the time
        self.ledger = MemoryLedger(sum(_nbytes(v) for v in (self._copy or {}).values()))
        with self.engine.phase():
            start = time.perf_counter()
            weights, split_bytes, whole_bytes, fsdp_bytes, vocab_bytes = self._to_generation()
            seconds = time.perf_counter() - start
            try:
                yield weights, self.tp
            finally:
                start = time.perf_counter()
                for unit in self._kept:
                    unit.reshard()
                self._kept = []
                del weights
                seconds += time.perf_counter() - start
        received, held = fsdp_switch_cost(
            self.method, split_bytes, whole_bytes, self.t, self.d, self.tg, self.t * self.d, vocab_bytes
        )
        fsdp_calls = sum(u is not None for u, _ in self.units) if self.d > 1 else 0
        self.stats = ReshardStats(
            fsdp_bytes + self.comm.stats.bytes_received,
            received,
            self.ledger.peak,
            held,
            seconds,
            fsdp_calls + self.comm.stats.calls,
        )

    def _to_generation(self):
        hf = self.engine.hf_model
        out: dict[str, torch.Tensor] = {}
        split_bytes = whole_bytes = fsdp_bytes = vocab_bytes = 0
        params = None
        for unit, names in self.units:
            # hybridflow with tg == t: the unit stays unsharded and is its own generation weights, unless
            # it holds embeddings to split over the vocabulary
            keep = self.method == "hybridflow" and self.st == 1 and not self.vocab.intersection(names)
            if unit is not None:
                unit.unshard()
            if unit is not None or params is None:  # unshard swaps the unit's parameters; nothing else does
                params = dict(hf.named_parameters())
            transient, bucket = 0, []
            for name in names:
                local, dim = _local(params[name])
                nbytes = _nbytes(local)
                if dim is None:
                    whole_bytes += nbytes
                    vocab_bytes += nbytes if name in self.vocab else 0
                else:
                    split_bytes += nbytes * self.t
                if unit is not None:  # FSDP2 all-gathers a dim-0 shard (padded to d equal rows) per rank
                    rows = -(-local.shape[0] // self.d)
                    fsdp_bytes += (self.d - 1) * rows * (nbytes // max(local.shape[0], 1))
                transient += nbytes
                if keep:  # the unit stays unsharded: its own tensors are the generation weights
                    out[name] = self.ledger.hold(local)
                elif self.method == "two_copy":
                    out[name] = self._refresh_copy(name, local, dim)
                elif dim is None:
                    out[name] = self._whole(name, local)
                else:
                    bucket.append((name, local, dim))
            if bucket:  # hybridflow / allgather / vanilla: one collective for the unit's TP-split weights
                out.update(self._gather_unit(bucket, unit, transient))
            elif not keep:  # the unsharded unit was a transient: peak while this unit's tensors exist
                self.ledger.transient(transient)
            if unit is not None:
                if keep:
                    self._kept.append(unit)
                else:
                    unit.reshard()
        return out, split_bytes, whole_bytes, fsdp_bytes, vocab_bytes

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The generation tensor of a weight every TP rank holds whole: a copy, or for the embeddings under
        split_vocab this generation TP rank's V/tg rows (hybridflow copies only those; allgather and
        vanilla hold the whole model anyway)."""
        vocab = name in self.vocab
        if vocab and self.method == "hybridflow":
            return self.ledger.hold(local.chunk(self.tg, 0)[self.tp_index].clone())
        full = self.ledger.hold(local.clone())
        return full.chunk(self.tg, 0)[self.tp_index] if vocab else full

    def _gather_unit(self, bucket, unit, unsharded: int) -> dict[str, torch.Tensor]:
        """This rank's generation tensors for one unit's TP-split weights [(name, local, dim)], with one
        all-gather per dtype over the micro-DP group (hybridflow) or the training TP group (allgather,
        vanilla): each member packs its pieces into its slot of a flat buffer, the all-gather fills the
        others' slots in place, and every weight is copied out as the cat of its n pieces along its split
        dim. The unit is resharded before the collective (its pieces are in the slot by then), so at the
        peak a rank holds either the unsharded unit and its slot, or the gathered buffer."""
        hybrid = self.method == "hybridflow"
        group, n = (self.micro, self.st) if hybrid else (self.train_tp, self.t)
        me = dist.get_rank(group) if n > 1 else 0
        by_dtype: dict[torch.dtype, list] = {}
        for item in bucket:
            by_dtype.setdefault(item[1].dtype, []).append(item)
        bufs = []
        for dtype, items in by_dtype.items():
            numel = sum(local.numel() for _, local, _ in items)
            buf = torch.empty((n, numel), dtype=dtype, device=items[0][1].device)
            torch.cat([local.reshape(-1) for _, local, _ in items], out=buf[me])
            bufs.append((buf, items))
        slots = sum(_nbytes(buf[0]) for buf, _ in bufs)
        self.ledger.transient(unsharded + slots)
        if unit is not None:
            unit.reshard()  # its tensors are packed: free the unsharded unit before the gather
        out = {}
        for buf, items in bufs:
            if n > 1:
                self.comm.all_gather_into(buf.view(-1), buf[me], group)
            off = 0
            for name, local, dim in items:
                pieces = [row[off : off + local.numel()].view(local.shape) for row in buf.unbind(0)]
                full = self.ledger.hold(torch.cat(pieces, dim=dim))
                out[name] = full if hybrid else full.chunk(self.tg, dim)[self.g_tp]  # allgather holds M
                off += local.numel()
        self.ledger.transient(sum(_nbytes(buf) for buf, _ in bufs))
        return out

    def _refresh_copy(self, name: str, local: torch.Tensor, dim: int | None) -> torch.Tensor:
        """two_copy: global rank 0 gathers the weight from its TP group and broadcasts it whole; every
        rank copies its generation shard out of it into its resident copy."""
        if dim is not None and self.t > 1:
            in_src_group = self.rank < self.t  # rank 0's training TP group is ranks 0 .. t-1
            full = torch.empty(_full_shape(local, dim, self.t), dtype=local.dtype, device=local.device)
            if in_src_group:
                slots = torch.empty((self.t, *local.shape), dtype=local.dtype, device=local.device)
                flat = slots.view(-1) if self.rank == 0 else None
                self.comm.gather(local.contiguous().view(-1), flat, 0, self.train_tp)
                if self.rank == 0:
                    full.copy_(torch.cat(slots.unbind(0), dim=dim))
        else:
            full = local.contiguous().clone() if self.rank == 0 else torch.empty_like(local)
        self.ledger.transient(_nbytes(full))
        self.comm.broadcast(full, src=0, group=None)
        if dim is None:
            piece = full.chunk(self.tg, 0)[self.tp_index] if name in self.vocab else full
        else:
            piece = full.chunk(self.tg, dim)[self.g_tp]
        if self._copy is None:
            self._copy = {}
        if name not in self._copy:
            self._copy[name] = self.ledger.hold(piece.clone())
        else:
            self._copy[name].copy_(piece)
        return self._copy[name]


def _local(p: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """(this rank's tensor, TP split dim or None) of a parameter, from its DTensor placements."""
    if not isinstance(p, DTensor):
        return p.detach(), None
    names = p.device_mesh.mesh_dim_names or ()
    dim = None
    for axis, placement in zip(names, p.placements):
        if isinstance(placement, Shard):
            if axis != "tp":
                raise RuntimeError(
                    f"parameter still sharded over {axis!r} after FSDP unshard: {p.placements}"
                )
            dim = placement.dim
    return p.to_local().detach(), dim


def _full_shape(local: torch.Tensor, dim: int, n: int) -> tuple[int, ...]:
    shape = list(local.shape)
    shape[dim] *= n
    return tuple(shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
