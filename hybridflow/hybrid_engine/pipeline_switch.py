"""The 3D-HybridEngine's switch for an actor trained in pipeline stages (p > 1, t-way TP, d-way FSDP2) that
generates with pg = 1 and tg-way TP (tg dividing t): every rank generates from a tg-shard of the whole
model (docs/hybrid_engine.md).

Two steps. First the rank switches its own stage as an unpipelined actor does (resharder.Resharder on the
stage's (dp, tp) plane): FSDP's dp all-gather, then the micro-DP all-gather of the TP pieces inside its TP
group, leaving this rank's generation shard of its stage. Then the ranks of its pp group, which share its
TP index and so need the same generation shard of every stage, exchange them: stage s broadcasts its
shard, one flat buffer per dtype. The generation engine reads the result, under the whole model's names,
beside `skeleton` (a whole model on the meta device whose buffers are real: the rotary tables), which
names the architecture; generation TP groups are the stage's own (the ranks with its pp and dp index).

Bytes received and held per rank are cost.pipeline_switch_cost's; the shards move in the generation
dtype, cast before any gather as the unpipelined switch casts them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.controller.device import device_clock
from hybridflow.engines.pipeline import hf_name
from hybridflow.hybrid_engine.comm import CountedComm, tensor_bytes
from hybridflow.hybrid_engine.cost import pipeline_switch_cost
from hybridflow.hybrid_engine.resharder import Resharder, ReshardStats


class PipelineResharder:
    """`with r.generation() as (weights, gen_group)`: this rank's generation shard of the whole model (HF
    name -> tensor) and its TPGroup (None when tg = 1); r.stats then holds the round's counters.
    engine: the actor's TrainEngine with engine.pipeline set; skeleton: the model the generation engine
    is built on (meta parameters, real buffers)."""

    method = "hybridflow"
    in_place = False  # the generation engine reads `weights`, not the skeleton's (meta) parameters

    def __init__(
        self,
        engine,
        skeleton: nn.Module,
        tg: int = 1,
        split_vocab: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.engine, self.pipe, self.skeleton = engine, engine.pipeline, skeleton
        self.stage = Resharder(engine, tg, split_vocab, dtype)
        self.tg = tg
        self.comm, self.stats = CountedComm(), ReshardStats()
        # fixed by the layout and the weights, exchanged at the first switch: each stage's
        # [(name, shape, dtype)] and (split, whole, vocab) bytes (cost.pipeline_switch_cost's inputs)
        self._specs: list[list[tuple[str, tuple, torch.dtype]]] | None = None
        self._sizes: list[tuple[int, int, int]] | None = None

    @contextlib.contextmanager
    def generation(self):
        self.comm.reset()
        with self.stage.generation() as (own, gen_group):
            start = device_clock(self.engine.device)
            model = self.engine.hf_model
            weights = self._exchange({hf_name(model, n): t for n, t in own.items()})
            held = sum(tensor_bytes(t) for t in weights.values())
            seconds = device_clock(self.engine.device) - start
            try:
                yield weights, gen_group
            finally:
                del weights
        self.stats = self._round_stats(seconds, held)

    def _round_stats(self, seconds: float, held: int) -> ReshardStats:
        """The stage switch's counters plus the exchange's, beside cost.pipeline_switch_cost's figures."""
        s = self.stage
        received, formula_held = pipeline_switch_cost(
            self._sizes, self.pipe.pp_rank, s.tp_size, s.dp_size, self.tg
        )
        return ReshardStats(
            s.stats.bytes_received + self.comm.stats.bytes_received, received, held, formula_held,
            s.stats.seconds + seconds, s.stats.collectives + self.comm.stats.calls,
        )  # fmt: skip

    def _exchange(self, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's generation shard: this rank's own tensors for its stage, the others each
        broadcast by their stage's rank of the pp group (one flat buffer per dtype)."""
        group = self.pipe.group
        if self._specs is None:
            sizes = self.stage.sizes
            mine = (
                [(n, tuple(t.shape), t.dtype) for n, t in own.items()],
                (sizes.split, sizes.whole, sizes.vocab),
            )
            both = [None] * self.pipe.pp
            dist.all_gather_object(both, mine, group=group)
            self._specs, self._sizes = [b[0] for b in both], [b[1] for b in both]
        out: dict[str, torch.Tensor] = dict(own)
        device = next(iter(own.values())).device
        for stage, specs in enumerate(self._specs):
            src = dist.get_global_rank(group, stage)
            for dtype in dict.fromkeys(d for _, _, d in specs):
                items = [(n, s) for n, s, d in specs if d == dtype]
                if stage == self.pipe.pp_rank:
                    self.comm.broadcast(torch.cat([own[n].reshape(-1) for n, _ in items]), src, group)
                    continue
                buf = torch.empty(sum(torch.Size(s).numel() for _, s in items), dtype=dtype, device=device)
                self.comm.broadcast(buf, src, group)
                off = 0
                for n, s in items:
                    k = torch.Size(s).numel()
                    out[n] = buf[off : off + k].view(s)
                    off += k
        return out


def skeleton_on(model: nn.Module, device: torch.device) -> nn.Module:
    """A meta-built whole model with its buffers (rotary tables) moved to `device`, parameters left on meta."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)
    return model
