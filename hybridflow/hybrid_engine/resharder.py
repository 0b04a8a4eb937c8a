"""The actor's train <-> generate switch inside the actor worker: the 3D-HybridEngine on FSDP2 + TP.

Training layout (engines/): tp-way tensor parallel x dp-way FSDP2 data parallel, p = 1, rank =
dp_i * tp + tp_i. Generation layout (layout.GenLayout): tg-way tensor parallel; the tp ranks of a training
TP group form tp/tg micro-DP replicas, so there are dp * tp/tg generation replicas. Per FSDP unit (one
decoder layer, then the root's embeddings / final norm / lm_head), the switch first unshards the unit over
dp (FSDP2's own all-gather), then all-gathers the TP-split weights inside the micro-DP group (consecutive
ranks, size tp/tg), one collective per unit (a flat bucket of the unit's pieces, then copied out per
weight): the result is exactly this rank's generation shard. With tg == tp nothing moves and the unit
simply stays unsharded while generating (no copy).

The paper's baselines (allgather, vanilla, two_copy) are subclasses in baselines.py, built only when
`rollout.reshard` names one (`build_resharder`); they override the hooks marked below.

How each weight is split comes from the training engine's own DTensor placements: a weight sharded on
the "tp" mesh axis (Shard(k)) is TP-split along k; anything else is whole on every TP rank (embeddings,
norms, lm_head: engines/parallelize.py keeps them so). The generation shard of a TP-split weight is
pieces g*tp/tg .. (g+1)*tp/tg - 1 concatenated along k, since pieces are contiguous.

Generation weights move and are held in the generation engine's compute dtype (`dtype`, e.g. bf16 under
model.dtype=bfloat16 over fp32 master weights): each shard is cast as it is packed, before any gather, so
half the bytes move and are held, and the decoder finds them ready. In place (tp = 1, the model's own
tensors) the engine casts them itself and the switch makes no copy (`_kept_tensor`). Bytes are counted
at the collectives (FSDP's all-gather: (dp-1) padded shards; ours: (n-1) input slots), in the dtype that
moves; the formula they must equal is hybrid_engine/cost.fsdp_switch_cost (docs/hybrid_engine.md derives it).
Generation-weight bytes are the peak of what the switch holds for generation: kept unsharded units,
gathered shards or full copies, plus the one unit being processed.

LoRA (models/lora.py): each adapted weight of a unit is merged (W + scale * B @ A) into the unit's
generation tensors as they are produced, under its HF name. B is split like W's output rows and A like
its input columns (engines/parallelize.py), so the pieces gathered for a generation shard multiply into
that shard's own update. Merging writes into gathered or FSDP-unsharded tensors, which are freed after
the call, so no second copy of the model is made; only a layout whose units are the live parameters
(dp = 1, tg = tp) merges into new tensors, one per adapted weight.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from hybridflow.controller.device import device_clock, process_mesh
from hybridflow.engines.parallelize import decoder_layers
from hybridflow.hybrid_engine.comm import CountedComm, MemoryLedger, tensor_bytes
from hybridflow.hybrid_engine.cost import METHODS, fsdp_switch_cost
from hybridflow.hybrid_engine.layout import GenLayout, TrainLayout
from hybridflow.models.lora import merge_into
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
    collectives: int = 0  # collectives this rank called: FSDP's unit all-gathers (dp > 1) and ours

    def as_metrics(self) -> dict[str, float]:
        return {
            "reshard/bytes_per_rank": float(self.bytes_received),
            "reshard/formula_bytes_per_rank": float(self.formula_bytes),
            "reshard/gen_weight_bytes_per_rank": float(self.gen_weight_bytes),
            "reshard/formula_gen_weight_bytes_per_rank": float(self.formula_gen_weight_bytes),
            "reshard/collectives_per_rank": float(self.collectives),
            "timing_s/reshard": self.seconds,
        }


def generation_layout(method: str, tp: int, dp: int, tg: int, pp: int = 1) -> GenLayout:
    """The generation layout a method runs: consecutive groups for "vanilla", strided otherwise."""
    if method not in METHODS:
        raise ValueError(f"rollout.reshard: unknown method {method!r}; choose one of {METHODS}")
    return GenLayout(
        TrainLayout(pp, tp, dp), pg=1, tg=tg, style="vanilla" if method == "vanilla" else "hybridflow"
    )


def build_resharder(
    engine,
    method: str = "hybridflow",
    tg: int = 1,
    split_vocab: bool = False,
    dtype: torch.dtype | None = None,
) -> Resharder:
    """The Resharder `rollout.reshard` names. The baselines are imported only when asked for, so the
    core never depends on them (they depend on it)."""
    if method == "hybridflow":
        return Resharder(engine, tg, split_vocab, dtype)
    from hybridflow.hybrid_engine.baselines import BASELINES

    if method not in BASELINES:
        raise ValueError(f"rollout.reshard: unknown method {method!r}; choose one of {METHODS}")
    return BASELINES[method](engine, tg, split_vocab, dtype)


class Resharder:
    """Owns the actor's generation weights. `with r.generation() as (weights, gen_group): ...` gives this
    rank's generation shard (HF name -> tensor) and its TPGroup (None when tg == 1); `r.stats` then holds
    the round's counters. engine: the actor's TrainEngine, whose ("dp", "tp") mesh spans all ranks.
    dtype: the generation engine's compute dtype (None: the weights' own), the dtype shards move in."""

    method = "hybridflow"

    def __init__(self, engine, tg: int = 1, split_vocab: bool = False, dtype: torch.dtype | None = None):
        self.engine = engine
        self.dtype = dtype
        mesh = engine.mesh
        self.tp_size = mesh["tp"].size() if mesh is not None else 1
        self.dp_size = mesh["dp"].size() if mesh is not None else 1
        # a pipelined engine's (pp, dp, tp) mesh: this switch is its stage's (pipeline_switch.py)
        self.pp_size = mesh["pp"].size() if mesh is not None and "pp" in mesh.mesh_dim_names else 1
        self.layout = generation_layout(self.method, self.tp_size, self.dp_size, tg, self.pp_size)
        self.tg, self.micro_size = tg, self.tp_size // tg
        self.rank = dist.get_rank() if mesh is not None else 0
        _, _, self.g_tp, _ = self.layout.coords(self.rank)
        self.gen_group, self.micro = self._generation_groups(mesh, tg)
        self.tp_index = self.gen_group.rank() if self.gen_group is not None else 0
        # split_vocab: the generation engine runs embeddings / lm_head vocab-parallel (V/tg rows each)
        self.vocab = self._vocab_names() if split_vocab and self.gen_group is not None else frozenset()
        self.train_tp = mesh["tp"].get_group() if mesh is not None and self.tp_size > 1 else None
        self.units = self._units()
        self.lora_layers = engine.lora_layers  # adapted layers: merged into the generation weights
        self.comm, self.ledger = CountedComm(), MemoryLedger()
        self.stats = ReshardStats()
        self.sizes: _Sizes | None = None  # the last switch's weight sizes (cost.fsdp_switch_cost's inputs)
        self._formula: tuple[int, int] | None = None  # (bytes, held): fixed by the layout and the weights
        self._kept: list[FSDPModule] = []

    def _generation_groups(self, mesh, tg: int):
        """(generation TPGroup or None, micro-DP process group or None) of this rank."""
        if mesh is None or self.tp_size == 1:
            return None, None
        strided = self.layout.style == "hybridflow"
        shape = (self.dp_size, tg, self.micro_size) if strided else (self.dp_size, self.micro_size, tg)
        names = ("dp", "gen_tp", "micro_dp") if strided else ("dp", "micro_dp", "gen_tp")
        if self.pp_size > 1:  # the same groups inside each stage's (dp, tp) plane
            shape, names = (self.pp_size, *shape), ("pp", *names)
        gen_mesh = process_mesh(mesh.device_type, shape, names)  # groups shared with other roles' switches
        gen_group = None
        if tg > 1:
            group = gen_mesh["gen_tp"].get_group()
            gen_group = TPGroup(group, tg, dist.get_global_rank(group, 0))
        return gen_group, gen_mesh["micro_dp"].get_group()

    @property
    def in_place(self) -> bool:
        """Whether the generation weights are the model's own (FSDP-unsharded) parameters: tp = 1, so an
        engine reading the model needs no shard (the HF fallback decoder relies on it). Not with LoRA: the
        generation weights are the merged ones, under the HF names the model's own no longer have."""
        return self.tp_size == 1 and not self.lora_layers

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
        # a pipeline stage holds the input embeddings (first), the output ones (last) or neither
        emb = [e for e in (hf.get_input_embeddings(), hf.get_output_embeddings()) if e is not None]
        if not emb or hf.config.vocab_size % self.tg:
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
        self.ledger = MemoryLedger(self._resident_bytes())
        with self.engine.phase():
            device = self.engine.device  # its clock waits for the queued switch, not just its launch
            start = device_clock(device)
            weights, sizes = self._to_generation()
            self.sizes = sizes
            seconds = device_clock(device) - start
            try:
                yield weights, self.gen_group
            finally:
                start = device_clock(device)
                for unit in self._kept:
                    unit.reshard()
                self._kept = []
                del weights
                seconds += device_clock(device) - start
        self.stats = self._round_stats(sizes, seconds)

    def _round_stats(self, sizes: _Sizes, seconds: float) -> ReshardStats:
        """The round's counters beside the formula's figures for the same weights."""
        # The formula's inputs are the weights' shapes under this layout, the same every round: computed once.
        if self._formula is None:
            world = self.tp_size * self.dp_size
            self._formula = fsdp_switch_cost(
                self.method, sizes.split, sizes.whole, self.tp_size, self.dp_size, self.tg, world, sizes.vocab
            )
        received, held = self._formula
        fsdp_calls = sum(u is not None for u, _ in self.units) if self.dp_size > 1 else 0
        return ReshardStats(
            sizes.fsdp + self.comm.stats.bytes_received,
            received,
            self.ledger.peak,
            held,
            seconds,
            fsdp_calls + self.comm.stats.calls,
        )

    def _to_generation(self) -> tuple[dict[str, torch.Tensor], _Sizes]:
        hf = self.engine.hf_model
        out: dict[str, torch.Tensor] = {}
        sizes = _Sizes(self.tp_size, self.dp_size)
        params = None
        for unit, names in self.units:
            keep = self._keeps_unit(names)
            if unit is not None:
                unit.unshard()
            if unit is not None or params is None:  # unshard swaps the unit's parameters; nothing else does
                params = dict(hf.named_parameters())
            transient, bucket = 0, []
            for name in names:
                local, dim = _local(params[name])
                transient += sizes.add(
                    local, self._moved_dtype(local), dim, name in self.vocab, unit is not None
                )
                # keep: the unit stays unsharded, its own tensors (cast if need be) the generation weights
                if keep:
                    out[name] = self._kept_tensor(local)
                elif (direct := self._direct(name, local, dim)) is not None:
                    out[name] = direct
                else:
                    bucket.append((name, local, dim))
            if bucket:  # one collective for the unit's TP-split weights
                out.update(self._gather_unit(bucket, unit, transient))
            elif not keep:  # the unsharded unit was a transient: peak while this unit's tensors exist
                self.ledger.transient(transient)
            if self.lora_layers:  # W + scale * B @ A on this rank's pieces, which are split alike
                # in place, except on live parameters: a unit kept whole without FSDP is the model itself
                merge_into(out, self.lora_layers, names, in_place=not (keep and unit is None))
            if unit is not None:
                if keep:
                    self._kept.append(unit)
                else:
                    unit.reshard()
        return out, sizes

    def _moved_dtype(self, local: torch.Tensor) -> torch.dtype:
        """The dtype a weight moves and is held in for generation: the compute dtype, for floating weights."""
        return self.dtype if self.dtype is not None and local.is_floating_point() else local.dtype

    def _cast(self, local: torch.Tensor) -> torch.Tensor:
        """The tensor in its generation dtype: itself when already there, else a cast copy."""
        return local.to(self._moved_dtype(local))

    def _kept_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """A kept unit's tensor as generation holds it. In place the engine is handed no shard: it reads
        the model's own tensors and casts them to its compute dtype itself, so a cast copy made here
        would be a second one, held unread for the whole call. The live tensor is then the generation
        weight, counted at the bytes of the engine's copy (those cost.fsdp_switch_cost prices)."""
        if not self.in_place:
            return self.ledger.hold(self._cast(local))
        self.ledger.hold(torch.empty(local.shape, dtype=self._moved_dtype(local), device="meta"))  # its size
        return local

    def _cast_copy(self, local: torch.Tensor) -> torch.Tensor:
        """A copy in the generation dtype that never aliases the live (training) tensor."""
        return local.to(self._moved_dtype(local), copy=True)

    # ---- hooks the baselines (baselines.py) override --------------------------------------------------
    def _resident_bytes(self) -> int:
        """Generation-weight bytes held between rounds (a resident copy): none here."""
        return 0

    def _keeps_unit(self, names: list[str]) -> bool:
        """tg == tp: the unit stays unsharded and is its own generation weights, unless it holds
        embeddings to split over the vocabulary."""
        return self.micro_size == 1 and not self.vocab.intersection(names)

    def _direct(self, name: str, local: torch.Tensor, dim: int | None) -> torch.Tensor | None:
        """The generation tensor of a weight that needs no gather (whole on every TP rank), else None."""
        return self._whole(name, local) if dim is None else None

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A weight every TP rank holds whole: a copy, or for the embeddings under split_vocab only this
        generation TP rank's V/tg rows."""
        if name in self.vocab:
            return self.ledger.hold(self._cast_copy(local.chunk(self.tg, 0)[self.tp_index]))
        return self.ledger.hold(self._cast_copy(local))

    def _gather_scope(self) -> tuple[dist.ProcessGroup | None, int]:
        """(group, size) the TP-split pieces are all-gathered over: the micro-DP group."""
        return self.micro, self.micro_size

    def _generation_piece(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's generation shard of a weight gathered over `_gather_scope`: all of it."""
        return gathered

    # ---- the gather -----------------------------------------------------------------------------------
    def _gather_unit(self, bucket, unit, unsharded: int) -> dict[str, torch.Tensor]:
        """This rank's generation tensors for one unit's TP-split weights [(name, local, dim)], with one
        all-gather per dtype over `_gather_scope`: each member packs its pieces, cast to their generation
        dtype, into its slot of a flat buffer, the all-gather fills the others' slots in place, and every
        weight is copied out as the cat of its n pieces along its split dim. The unit is resharded before the collective (its pieces
        are in the slot by then), so at the peak a rank holds either the unsharded unit and its slot, or
        the gathered buffer."""
        group, n = self._gather_scope()
        me = dist.get_rank(group) if n > 1 else 0
        by_dtype: dict[torch.dtype, list] = {}
        for item in bucket:
            by_dtype.setdefault(self._moved_dtype(item[1]), []).append(item)
        bufs = []
        for dtype, items in by_dtype.items():
            numel = sum(local.numel() for _, local, _ in items)
            buf = torch.empty((n, numel), dtype=dtype, device=items[0][1].device)
            if all(local.dtype == dtype for _, local, _ in items):
                torch.cat([local.reshape(-1) for _, local, _ in items], out=buf[me])
            else:  # copy_ casts into the slot: no cast copy in between
                off = 0
                for _, local, _ in items:
                    buf[me, off : off + local.numel()].copy_(local.reshape(-1))
                    off += local.numel()
            bufs.append((buf, items))
        slots = sum(tensor_bytes(buf[0]) for buf, _ in bufs)
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
                out[name] = self._generation_piece(self.ledger.hold(torch.cat(pieces, dim=dim)), dim)
                off += local.numel()
        self.ledger.transient(sum(tensor_bytes(buf) for buf, _ in bufs))
        return out


@dataclass
class _Sizes:
    """Bytes of the weights one switch saw, the inputs of cost.fsdp_switch_cost."""

    tp_size: int
    dp_size: int
    split: int = 0  # TP-split weights, whole (local bytes x tp)
    whole: int = 0  # weights every TP rank holds whole
    vocab: int = 0  # of those, the embeddings split over the vocabulary
    fsdp: int = 0  # received by FSDP2's unit all-gathers

    def add(
        self, local: torch.Tensor, moved: torch.dtype, dim: int | None, vocab: bool, fsdp_unit: bool
    ) -> int:
        """Count one weight, moved and held in dtype `moved`; returns its local bytes (as stored)."""
        nbytes = local.numel() * moved.itemsize
        if dim is None:
            self.whole += nbytes
            self.vocab += nbytes if vocab else 0
        else:
            self.split += nbytes * self.tp_size
        if (
            fsdp_unit
        ):  # FSDP2 all-gathers a dim-0 shard (padded to dp equal rows) per rank, in its param dtype
            rows = -(-local.shape[0] // self.dp_size)
            self.fsdp += (self.dp_size - 1) * rows * (tensor_bytes(local) // max(local.shape[0], 1))
        return tensor_bytes(local)


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
