"""A CPU plan that leaves a node's cores idle: its ranks take them (controller/process.cpu_threads), and the
planner prices that from the engine's measured thread scaling (DeviceSpec.thread_fraction_*), by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridflow.planner import ClusterSpec, build_dataflow, search
from hybridflow.planner.fit import fit_thread_fractions
from hybridflow.planner.profile import ADDED_FIELDS, DeviceProfile
from hybridflow.planner.search import pool_candidates
from hybridflow.planner.simulate import thread_speedup
from hybridflow.planner.specs import get_device
from tests.planner.test_profile import SMALL, WORKLOAD  # the tiny small Llama and grpo_tiny's batch


def _cpu(**changes):
    return replace(get_device("cpu"), name="cpu-measured", measured=True, devices_per_node=2, **changes)


def test_amdahl_by_hand():
    assert thread_speedup(0.0, 8) == 1.0 and thread_speedup(1.0, 4) == 4.0
    assert thread_speedup(0.6, 2) == pytest.approx(1 / 0.7)  # (1 - 0.6) + 0.6 / 2
    assert thread_speedup(0.6, 1) == 1.0


def test_fractions_fitted_from_one_and_all_cores():
    """Speedups 1/0.7 (training, f = 0.6) and 1.25 (inference, f = 0.4) at 2 threads; an impossible one (2
    threads slower than 1) clamps to 0."""
    raw = {"train_s": [0.1, 0.4], "infer_s": [0.05, 0.2],
           "threads": {"count": 2, "train_s": [0.07, 0.28], "infer_s": [0.04, 0.16]}}  # fmt: skip
    got = fit_thread_fractions(raw)
    assert got == pytest.approx({"thread_fraction_train": 0.6, "thread_fraction_infer": 0.4})
    raw["threads"]["train_s"] = [0.2, 0.8]
    assert fit_thread_fractions(raw)["thread_fraction_train"] == 0.0


def test_a_pool_alone_on_part_of_a_node_is_priced_on_its_cores():
    """The GRPO actor colocated on 1 of 2 CPU devices: preparation and training run thread_speedup(f, 2)
    faster, generation as priced (the engine decodes small models on one thread); on both devices, or
    beside another pool, or with a profile that measured no gain, nothing changes."""
    dev = _cpu(thread_fraction_train=0.6, thread_fraction_infer=0.4)
    cluster = ClusterSpec(dev, 2, 2)
    tasks = tuple(build_dataflow("ppo", SMALL).model(r) for r in ("actor", "critic"))
    plain = pool_candidates(tasks, cluster, WORKLOAD, 2, prune=False)
    alone = pool_candidates(tasks, cluster, WORKLOAD, 2, prune=False, alone=True)
    assert list(plain.ns) == list(alone.ns) == [1, 2]
    gen, prep, train = plain.costs[0]
    assert tuple(alone.costs[0]) == pytest.approx((gen, prep / thread_speedup(0.4, 2), train * 0.7))
    assert tuple(alone.costs[1]) == tuple(plain.costs[1])  # 2 ranks on 2 cores: one thread each
    unmeasured = ClusterSpec(_cpu(), 2, 2)
    assert pool_candidates(tasks, unmeasured, WORKLOAD, 2, prune=False, alone=True).costs.tolist() == (
        pool_candidates(tasks, unmeasured, WORKLOAD, 2, prune=False).costs.tolist()
    )


def test_the_search_credits_only_a_placement_of_one_pool():
    """Two ranks pay a large fixed cost per pass (FSDP2's, tensor parallelism's); colocated on one of two
    devices, the models train and prepare on both cores."""
    slow = dict(fsdp_layer_overhead_s=1.0, tp_layer_overhead_s=1.0)
    flow = build_dataflow("ppo", SMALL)
    found = {}
    for name, dev in (("gained", _cpu(thread_fraction_train=1.0, thread_fraction_infer=1.0, **slow)),
                      ("base", _cpu(**slow))):  # fmt: skip
        found[name] = {
            tuple(map(tuple, r.placement)): r for r in search(flow, ClusterSpec(dev, 2, 2), WORKLOAD)
        }
    for placement, r in found["gained"].items():
        if len(placement) > 1:  # pools that run beside each other share the cores: priced as before
            assert r.iteration_time == found["base"][placement].iteration_time
    colocate = next(p for p in found["gained"] if len(p) == 1)
    gained, base = found["gained"][colocate], found["base"][colocate]
    # priced on one core a rank, both devices were worth their fixed costs; on both cores, one rank wins
    assert (base.allocation, gained.allocation) == ((2,), (1,))
    assert gained.iteration_time < base.iteration_time


def test_a_version_10_profile_prices_no_gain_from_idle_cores_and_says_so(tmp_path, capsys):
    cpu = _cpu(thread_fraction_train=0.5, thread_fraction_infer=0.5)
    data = DeviceProfile("cpu-measured", {"float32": cpu}, {"threads": 1}, {}).to_dict()
    data["version"] = 10
    for name in ADDED_FIELDS[11]:
        data["devices"]["float32"].pop(name)
    (tmp_path / "v10.json").write_text(json.dumps(data))
    loaded = DeviceProfile.load(tmp_path / "v10.json")
    assert loaded.device("float32").thread_fraction_train == 0.0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert "a version 10 device profile without the terms measured since (decode_row_overhead_s, " in note
    assert "thread_fraction_infer, thread_fraction_train)" in note
