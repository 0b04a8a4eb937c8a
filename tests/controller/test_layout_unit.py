"""Pure parts of the controller, no Ray: sharding rule, layouts, metric reduction, padding removal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import (
    Layout,
    Protocol,
    Worker,
    local_worker_context,
    reduce_metrics,
    register_protocol,
)
from hybridflow.controller.layout import plan_from_layouts, shard_indices
from hybridflow.controller.process import drop_padding
from hybridflow.controller.protocols import get_protocol, registered_methods


def _rows(total, n, s):
    rows, pad = shard_indices(total, n, s)
    return (list(range(total))[rows] if isinstance(rows, slice) else rows.tolist()), pad


@pytest.mark.parametrize("total,n", [(7, 2), (7, 4), (1, 4), (8, 4), (5, 3), (0, 2)])
def test_shard_indices_match_pad_to_divisor_then_chunk(total, n):
    b = Batch({"i": torch.arange(total)})
    if total:
        expected = [c["i"].tolist() for c in b.pad_to_divisor(n).chunk(n)]
    else:
        expected = [[] for _ in range(n)]
    got = [_rows(total, n, s) for s in range(n)]
    assert [r for r, _ in got] == expected
    assert sum(p for _, p in got) == (-total) % n  # all padding rows are counted once
    assert [p for _, p in got] == [
        max(0, len(r) - max(0, total - s * len(r))) for s, (r, _) in enumerate(got)
    ]


def test_shard_indices_slice_when_no_padding_falls_in_the_shard():
    rows, pad = shard_indices(7, 2, 0)
    assert rows == slice(0, 4) and pad == 0
    rows, pad = shard_indices(7, 2, 1)
    assert isinstance(rows, np.ndarray) and rows.tolist() == [4, 5, 6, 0] and pad == 1


def test_plan_from_layouts_validates_one_collector_per_shard():
    lays = [Layout.create(dp_rank=r // 2, dp_size=2, tp_rank=r % 2, tp_size=2) for r in range(4)]
    plan = plan_from_layouts(lays, "train")
    assert plan.shard_of_rank == [0, 0, 1, 1] and plan.collect_ranks == [0, 2]
    bad = [Layout.create(dp_rank=0, dp_size=1, collect=True) for _ in range(2)]
    with pytest.raises(ValueError, match="exactly one collecting rank"):
        plan_from_layouts(bad, "train")
    with pytest.raises(ValueError, match="disagree on dp_size"):
        plan_from_layouts([Layout.create(0, 1), Layout.create(0, 2)], "train")
    with pytest.raises(ValueError, match="tp_rank=2 is not in"):
        Layout.create(0, 1, tp_rank=2, tp_size=2)
    assert Layout.create(0, 1, pp_rank=0, pp_size=2).collect is False  # only the last stage collects


def test_reduce_metrics_means_and_suffix_ops():
    m = reduce_metrics(
        [
            {"loss": 1.0, "lr": [3.0, 5.0], "tok/sum": 4, "g/max": 2.0},
            {"loss": torch.tensor(3.0), "tok/sum": 6, "g/max": 7},
        ]
    )
    assert m == {"loss": 2.0, "lr": 4.0, "tok/sum": 10.0, "g/max": 7.0}
    with pytest.raises(TypeError, match="dict of metrics"):
        reduce_metrics([1.0])


def test_drop_padding_proportional():
    b = Batch({"i": torch.arange(8)})
    assert drop_padding(b, 4, 1, "m")["i"].tolist() == [0, 1, 2, 3, 4, 5]  # 2 output rows per input row
    assert drop_padding([1, 2, 3, 4], 4, 2, "m") == [1, 2]
    assert drop_padding({"loss": 1}, 4, 2, "m") == {"loss": 1}
    with pytest.raises(ValueError, match="cannot tell which output rows are padding"):
        drop_padding(Batch({"i": torch.arange(3)}), 4, 1, "m")


def test_register_protocol_rules():
    with pytest.raises(ValueError, match="exactly one of"):
        register_protocol("X_BAD")
    with pytest.raises(ValueError, match="already registered"):
        register_protocol(Protocol.DP_PROTO.value, distribute=lambda v, a, k: [])
    with pytest.raises(KeyError, match="unknown transfer protocol"):
        get_protocol("NOPE")


def test_worker_layouts_are_fixed_once_read():
    local_worker_context(rank=0, world_size=1)

    class W(Worker):
        pass

    w = W()
    assert w.get_layout(None).dp_size == 1
    w.set_layout("train", dp_rank=0, dp_size=1)
    w.set_layout("train", dp_rank=0, dp_size=1, tp_rank=0)  # same value: fine
    assert w.get_layout("train").collect
    with pytest.raises(RuntimeError, match="fixed once used"):
        w.set_layout("train", dp_rank=0, dp_size=1, collect=False)
    with pytest.raises(KeyError, match="has no layout 'rollout'"):
        w.get_layout("rollout")
    assert set(registered_methods(W)) == {"apply", "memory_stats"}  # only the base class's own
