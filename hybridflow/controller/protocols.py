"""Transfer protocols: how a worker method's inputs are distributed and its outputs collected (docs/design.md §3).

`@register(protocol)` on a Worker method names one of these. Two kinds exist:

* **sharded** protocols (DP_PROTO, 3D_PROTO, 3D_ALL_MICRO_DP, DP_METRICS, WHOLE_BATCH) split every `Batch`
  argument (or future of one) into shards, one per data-parallel rank / replica, broadcast each
  shard to all ranks of its model-parallel group, and gather one output per shard. Because the
  rule is declarative (a `ShardPlan`), a consumer rank can cut its own shard out of a producer's
  outputs, so futures move worker-to-worker without the driver (see worker_group.py).
* **generic** protocols (ONE_TO_ALL, ALL_TO_ALL, RANK_ZERO, 3D_PP_ONLY, user protocols) are a
  (distribute, collect) pair of plain functions.

Departure from the paper/verl: 3D protocols read a named *layout* each worker declares
(`self.set_layout("train", dp_rank=..., dp_size=...)`), not a Megatron-specific rank info object,
so any engine (FSDP, TP, a custom one) plugs in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridflow.batch import Batch
from hybridflow.controller.layout import Layout, ShardPlan, default_layout, plan_from_layouts


class Protocol(str, Enum):
    ONE_TO_ALL = "ONE_TO_ALL"  # broadcast the arguments, return the list of per-rank outputs
    ALL_TO_ALL = "ALL_TO_ALL"  # argument i is a list with one item per rank; per-rank outputs
    RANK_ZERO = "RANK_ZERO"  # run on rank 0 only, return its output
    DP_PROTO = "DP_PROTO"  # split Batch args over all ranks, concatenate outputs
    THREE_D = "3D_PROTO"  # split over dp shards of a layout, broadcast in tp/pp, collect 1 per shard
    THREE_D_ALL_MICRO_DP = "3D_ALL_MICRO_DP"  # the same over generation replicas ("rollout" layout)
    THREE_D_PP_ONLY = "3D_PP_ONLY"  # broadcast; collect one output per pp stage (dp=0, tp=0)
    DP_METRICS = "DP_METRICS"  # split like DP_PROTO, reduce the per-rank metric dicts
    WHOLE_BATCH = "WHOLE_BATCH"  # the whole batch (and futures) to rank 0 only; its output a 1-shard future


@dataclass(frozen=True)
class GroupView:
    """What a protocol may know about a group: its size and each rank's layout (if one is used)."""

    name: str
    world_size: int
    layouts: list[Layout] | None  # None when the method names no layout


@dataclass(frozen=True)
class ProtocolSpec:
    """A registered protocol.

    distribute(view, args, kwargs) -> list (one per rank) of (args, kwargs), or None to skip a rank.
        Only for generic protocols; sharded ones are distributed by their `plan`.
    collect(view, outputs) -> result. For sharded protocols `outputs` holds the collected ranks'
        outputs in shard order; for generic ones one entry per rank (None for skipped ranks).
    plan(view) -> ShardPlan, set only for sharded protocols.
    default_layout: the layout a method uses when @register does not name one.
    """

    name: str
    collect: Callable[[GroupView, list], Any]
    distribute: Callable[[GroupView, tuple, dict], list] | None = None
    plan: Callable[[GroupView], ShardPlan] | None = None
    default_layout: str | None = None

    @property
    def sharded(self) -> bool:
        return self.plan is not None


_PROTOCOLS: dict[str, ProtocolSpec] = {}


def register_protocol(
    name: str,
    distribute: Callable[[GroupView, tuple, dict], list] | None = None,
    collect: Callable[[GroupView, list], Any] | None = None,
    *,
    plan: Callable[[GroupView], ShardPlan] | None = None,
    default_layout: str | None = None,
    overwrite: bool = False,
) -> str:
    """Add a user protocol; use its name in `@register(name)`.

    Give `distribute` for a generic protocol, or `plan` for a sharded one (then Batch arguments are
    split and futures sliced worker-side). `collect` defaults to "list of outputs".
    """
    if (distribute is None) == (plan is None):
        raise ValueError(f"protocol {name!r}: give exactly one of distribute= (generic) or plan= (sharded)")
    if name in _PROTOCOLS and not overwrite:
        raise ValueError(f"protocol {name!r} is already registered; pass overwrite=True to replace it")
    _PROTOCOLS[name] = ProtocolSpec(name, collect or _collect_list, distribute, plan, default_layout)
    return name


def get_protocol(name: str | Protocol) -> ProtocolSpec:
    key = name.value if isinstance(name, Protocol) else name
    if key not in _PROTOCOLS:
        raise KeyError(f"unknown transfer protocol {key!r}; known: {sorted(_PROTOCOLS)}")
    return _PROTOCOLS[key]


# ---- the @register decorator -----------------------------------------------------------------
@dataclass(frozen=True)
class RegisterSpec:
    protocol: str
    blocking: bool
    layout: str | None


_ATTR = "__hybridflow_register__"


def register(
    protocol: str | Protocol = Protocol.ONE_TO_ALL, blocking: bool = True, layout: str | None = None
):
    """Declare how a Worker method's data moves; the WorkerGroup exposes it as a group method.

    protocol: a Protocol member or the name of a user protocol (checked when the group is built).
    blocking: False makes the group method return a Future instead of the collected result
              (any single call can also be made non-blocking: `group.method.future(...)`).
    layout:   the named layout (see Worker.set_layout) the protocol reads; defaults per protocol
              ("train" for 3D_PROTO / 3D_PP_ONLY, "rollout" for 3D_ALL_MICRO_DP, none otherwise).
    """
    name = protocol.value if isinstance(protocol, Protocol) else str(protocol)

    def wrap(fn):
        setattr(fn, _ATTR, RegisterSpec(name, blocking, layout))
        return fn

    return wrap


def registered_methods(cls) -> dict[str, RegisterSpec]:
    """name -> RegisterSpec for every @register'ed method of a Worker class (inherited included)."""
    out = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), _ATTR, None)
        if isinstance(spec, RegisterSpec):
            out[name] = spec
    return out


# ---- collect helpers -------------------------------------------------------------------------
def _collect_list(view: GroupView, outputs: list) -> list:
    return list(outputs)


def concat_outputs(outputs: list):
    """Concatenate shard outputs: Batches with Batch.concat, lists by chaining, else the list."""
    if outputs and all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(outputs)
    if outputs and all(isinstance(o, list) for o in outputs):
        return [x for o in outputs for x in o]
    return list(outputs)


def reduce_metrics(dicts: list[dict]) -> dict:
    """Reduce per-rank metric dicts: the mean of every value by default.

    A value may be a number, a 0-d tensor or a list of numbers (all are pooled). Keys ending in
    "/max", "/min" or "/sum" are reduced with that operation instead of the mean.
    """
    pooled: dict[str, list[float]] = {}
    for d in dicts:
        if d is None:
            continue
        if not isinstance(d, dict):
            raise TypeError(f"DP_METRICS methods must return a dict of metrics, got {type(d).__name__}")
        for k, v in d.items():
            vals = v if isinstance(v, (list, tuple)) else [v]
            pooled.setdefault(k, []).extend(float(x) for x in vals)
    ops = {"max": max, "min": min, "sum": math.fsum}
    out = {}
    for k, vals in pooled.items():
        op = ops.get(k.rsplit("/", 1)[-1])
        out[k] = op(vals) if op else (math.fsum(vals) / len(vals) if vals else float("nan"))
    return out


# ---- built-in protocols ----------------------------------------------------------------------
def _layouts_or_default(view: GroupView) -> list[Layout]:
    return view.layouts or [default_layout(r, view.world_size) for r in range(view.world_size)]


def _plan_all_ranks(view: GroupView) -> ShardPlan:
    ranks = list(range(view.world_size))
    return ShardPlan(view.world_size, ranks, ranks)


def _plan_layout(view: GroupView) -> ShardPlan:
    if view.layouts is None:
        return _plan_all_ranks(view)
    return plan_from_layouts(view.layouts, view.name)


def _plan_rank_zero(view: GroupView) -> ShardPlan:
    return ShardPlan(1, [0] + [None] * (view.world_size - 1), [0])


def _broadcast(view: GroupView, args: tuple, kwargs: dict) -> list:
    return [(args, kwargs)] * view.world_size


def _per_rank(view: GroupView, args: tuple, kwargs: dict) -> list:
    for i, a in enumerate([*args, *kwargs.values()]):
        if not isinstance(a, (list, tuple)) or len(a) != view.world_size:
            raise ValueError(
                f"ALL_TO_ALL: argument {i} must be a list with one item per rank ({view.world_size}), "
                f"got {type(a).__name__} of length {len(a) if hasattr(a, '__len__') else '?'}"
            )
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(view.world_size)]


def _rank_zero(view: GroupView, args: tuple, kwargs: dict) -> list:
    return [(args, kwargs)] + [None] * (view.world_size - 1)


def _pp_only_collect(view: GroupView, outputs: list) -> list:
    lays = _layouts_or_default(view)
    stages = sorted((lay.pp_rank, r) for r, lay in enumerate(lays) if lay.dp_rank == 0 and lay.tp_rank == 0)
    return [outputs[r] for _, r in stages]


register_protocol(Protocol.ONE_TO_ALL.value, _broadcast)
register_protocol(Protocol.ALL_TO_ALL.value, _per_rank)
register_protocol(Protocol.RANK_ZERO.value, _rank_zero, lambda view, outs: outs[0])
register_protocol(Protocol.THREE_D_PP_ONLY.value, _broadcast, _pp_only_collect, default_layout="train")
register_protocol(Protocol.DP_PROTO.value, plan=_plan_layout, collect=lambda v, o: concat_outputs(o))
register_protocol(
    Protocol.THREE_D.value, plan=_plan_layout, collect=lambda v, o: concat_outputs(o), default_layout="train"
)
register_protocol(
    Protocol.THREE_D_ALL_MICRO_DP.value,
    plan=_plan_layout,
    collect=lambda v, o: concat_outputs(o),
    default_layout="rollout",
)
register_protocol(Protocol.DP_METRICS.value, plan=_plan_layout, collect=lambda v, o: reduce_metrics(o))
register_protocol(Protocol.WHOLE_BATCH.value, plan=_plan_rank_zero, collect=lambda v, o: o[0])
