"""EngineLimits: the search keeps exactly the layouts the executing engines can run.

The built-in engines have no pipeline parallelism and shard whole heads, KV heads and MLP columns
(ENGINE_LIMITS, `hybridflow plan`'s default); the paper's search (`plan()`'s default, unconstrained) uses
p > 1 and replicated KV heads where it pays.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from hybridflow.cli import main
from hybridflow.planner import (
    ClusterSpec,
    EngineLimits,
    ModelSpec,
    Plan,
    WorkloadSpec,
    auto_parallel,
    build_dataflow,
    plan,
)
from hybridflow.planner.parallel import enumerate_options, model_parallel_sizes
from hybridflow.planner.specs import ENGINE_LIMITS

BUILTIN = EngineLimits(max_pp=1, tp_shards_whole_heads=True)
# grouped-query attention with 2 KV heads: t = 4 or 8 would replicate them
GQA = ModelSpec("gqa", num_layers=16, hidden=2048, num_heads=16, num_kv_heads=2, ffn_hidden=5632)


def _allowed(o, limits: EngineLimits, spec: ModelSpec) -> bool:
    whole = all(v % o.t == 0 for v in (spec.num_heads, spec.num_kv_heads, spec.ffn_hidden))
    return (
        (limits.max_pp is None or o.p <= limits.max_pp)
        and (limits.max_pg is None or o.pg <= limits.max_pg)
        and (whole or not limits.tp_shards_whole_heads)
    )


def test_limits_validate_and_describe():
    assert EngineLimits().describe() == "unconstrained"
    assert BUILTIN.describe() == "max_pp=1, tp shards whole heads"
    assert hash(BUILTIN) == hash(EngineLimits(1, None, True))  # usable as a cache key
    with pytest.raises(ValueError, match="max_pp must be >= 1"):
        EngineLimits(max_pp=0)
    assert EngineLimits().allows_tp(GQA, 8) and not BUILTIN.allows_tp(GQA, 8)  # 8 % 2 KV heads: replicated
    assert BUILTIN.allows_tp(GQA, 2) and not EngineLimits().allows_tp(GQA, 32)  # 32 does not divide 16 heads
    odd_ffn = ModelSpec("odd", 4, 512, 8, 8, 1372)  # 1372 = 4 * 343: MLP columns split 4 ways at most
    assert sorted({t for _, t, _ in model_parallel_sizes(odd_ffn, 8, 8, BUILTIN)}) == [1, 2, 4]
    assert sorted({t for _, t, _ in model_parallel_sizes(odd_ffn, 8, 8)}) == [1, 2, 4, 8]
    assert {p for p, _, _ in model_parallel_sizes(odd_ffn, 8, 8, BUILTIN)} == {1}
    assert {p for p, _, _ in model_parallel_sizes(odd_ffn, 8, 8)} == {1, 2, 4}


@pytest.mark.parametrize(
    "spec, device, n",
    [(ModelSpec.from_param_count("13B"), "a100-80", 8), (GQA, "a100-40", 16), (GQA, "cpu", 8)],
)
def test_limits_drop_exactly_the_layouts_they_forbid(spec, device, n):
    """enumerate_options under limits = the unconstrained options filtered by the limits: nothing the
    engines could run is lost, nothing they cannot run is kept."""
    cluster = ClusterSpec.build(device, n, 8)
    wl = WorkloadSpec(prompts=64, prompt_len=256, response_len=256)
    for task in build_dataflow("ppo", spec).models:
        free = enumerate_options(task, cluster, wl, n)
        limited = enumerate_options(task, cluster, wl, n, BUILTIN)
        assert limited == [o for o in free if _allowed(o, BUILTIN, spec)], task.role
        assert len(limited) < len(free)
        front = auto_parallel(task, cluster, wl, n, BUILTIN)
        assert front and all(_allowed(o, BUILTIN, spec) and o.p == o.pg == 1 for o in front)


def test_max_pg_limits_generation_layouts_only():
    actor = build_dataflow("ppo", ModelSpec.from_param_count("13B")).model("actor")
    cluster, wl = ClusterSpec.build("a100-80", 8), WorkloadSpec()
    free = auto_parallel(actor, cluster, wl, 8)
    limited = auto_parallel(actor, cluster, wl, 8, EngineLimits(max_pg=1))
    assert limited and all(o.pg == 1 for o in limited)
    assert {o.p for o in limited} == {o.p for o in free} and max(o.p for o in limited) > 1


def test_constrained_plan_has_no_pipeline_where_the_paper_search_uses_one():
    """13B PPO on 8 A100-80: the paper's search trains the actor with p = 4; under the built-in engines'
    limits every model has p = pg = 1 and a t dividing its heads, at a (slightly) higher predicted time.
    The unconstrained search runs first, so a limit missing from a cache key would show here."""
    dataflow, cluster = (
        build_dataflow("ppo", ModelSpec.from_param_count("13B")),
        ClusterSpec.build("a100-80", 8),
    )
    free = plan(dataflow, cluster)
    assert free.model("actor").p > 1
    assert (
        free.engine_limits == {**asdict(EngineLimits()), "pipeline_max_tp": []}
        and free.limits == EngineLimits()
    )
    limited = plan(dataflow, cluster, limits=BUILTIN)
    for m in limited.models:
        spec = dataflow.model(m.role).spec
        assert (m.p, m.pg) == (1, 1) and m.t * m.d == m.n_devices, m.role
        assert spec.num_heads % m.t == spec.num_kv_heads % m.t == spec.ffn_hidden % m.t == 0
    assert limited.iteration_seconds >= free.iteration_seconds
    assert limited.iteration_seconds < 1.2 * free.iteration_seconds
    assert limited.limits == BUILTIN
    assert plan(dataflow, cluster) == free  # the default is still the paper's search


def test_plans_record_their_limits_and_old_files_read_as_unconstrained(tmp_path):
    dataflow, cluster = build_dataflow("grpo", GQA), ClusterSpec.build("a100-80", 8)
    p = plan(dataflow, cluster, WorkloadSpec(prompts=64), limits=BUILTIN)
    assert Plan.load(p.save(tmp_path / "plan.yaml")).limits == BUILTIN
    old = p.to_dict()
    del old["engine_limits"]
    assert Plan.from_dict(old).limits == EngineLimits()


def test_limits_that_nothing_fits_say_so():
    dataflow, cluster = (
        build_dataflow("ppo", ModelSpec.from_param_count("70B")),
        ClusterSpec.build("a100-80", 32),
    )
    assert plan(dataflow, cluster).model("actor").p > 1  # 70B needs a pipeline on 32 GPUs
    with pytest.raises(ValueError, match=r"with layouts the engines run \(max_pp=1, tp shards whole heads\)"):
        plan(dataflow, cluster, limits=BUILTIN)


def test_plan_command_plans_what_the_engines_run_by_default(tmp_path, capsys):
    """`hybridflow plan` searches ENGINE_LIMITS unless told --engines any; sizes given override either."""
    out = tmp_path / "plan.json"
    args = ["plan", "--model-size", "13B", "--gpus", "8"]
    assert main([*args, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"layouts limited to what the engines run: {ENGINE_LIMITS.describe()}" in text
    assert "note: searched beyond" not in text
    written = Plan.from_dict(json.loads(out.read_text()))
    assert written.limits == ENGINE_LIMITS and all(_runs(m) for m in written.models)
    assert main([*args, "--engines", "any", "--output", str(out)]) == 0
    assert "note: searched beyond what `hybridflow train` runs" in capsys.readouterr().out
    free = Plan.from_dict(json.loads(out.read_text()))
    assert free.limits == EngineLimits() and free.model("actor").p > 1
    assert main([*args, "--engines", "any", "--max-pp", "1", "--tp-whole-heads", "--output", str(out)]) == 0
    assert Plan.from_dict(json.loads(out.read_text())).limits == BUILTIN
    assert main([*args, "--max-pp", "0"]) == 2
    assert "max_pp must be >= 1" in capsys.readouterr().out


def _runs(m) -> bool:
    """What the trainer runs (ENGINE_LIMITS): p > 1 with any t for every role; the actor generates with
    pg = 1 (another model's pg is its p)."""
    return (m.pg == 1 or m.role != "actor") and m.p * m.t * m.d == m.n_devices


def test_builtin_limits_are_per_role_and_read_back_from_plan_files():
    """ENGINE_LIMITS: every role may run p > 1 with any t; a role limited to t <= 1 or to no pipeline (0)
    keeps to it, the others not; a plan file's lists read back as the same hashable limits."""
    assert ENGINE_LIMITS.allows("critic", 2, 2) and ENGINE_LIMITS.allows("reference", 4, 8)
    assert ENGINE_LIMITS.allows("actor", 2, 2) and ENGINE_LIMITS.max_pg == 1
    assert "p > 1" not in ENGINE_LIMITS.describe()
    one = EngineLimits(pipeline_max_tp=(("critic", 1), ("reward", 1)))
    assert one.allows("critic", 4, 1) and not one.allows("critic", 2, 2) and one.allows("critic", 1, 8)
    assert one.allows("actor", 2, 2) and "p > 1 only with t <= 1 for critic/reward" in one.describe()
    none = EngineLimits(pipeline_max_tp=(("critic", 0),))
    assert not none.allows("critic", 2, 1) and none.allows("actor", 2, 4)
    assert EngineLimits(**json.loads(json.dumps(asdict(one)))) == one
    assert {p for p, _, _ in model_parallel_sizes(GQA, 8, 8, none, "critic")} == {1}
    assert {(p, t) for p, t, _ in model_parallel_sizes(GQA, 8, 8, one, "critic") if p > 1} == {
        (2, 1),
        (4, 1),
        (8, 1),
    }
    # any t dividing the 2 KV heads
    staged = {(p, t) for p, t, _ in model_parallel_sizes(GQA, 8, 8, ENGINE_LIMITS, "critic") if p > 1}
    assert staged == {(2, 1), (2, 2), (4, 1), (4, 2), (8, 1)}


@pytest.mark.parametrize("size, gpus", [("13B", 128), ("7B", 8), ("70B", 64)])
def test_the_default_plans_of_the_readme_and_the_issue_have_layouts_the_trainer_runs(size, gpus):
    """The README's 13B / 128 GPUs example and the 7B / 8, 70B / 64 a new user tries: the default plan's
    layouts are ones the trainer runs (p > 1 with any t, the actor's pg = 1) and t divides the heads, KV heads and
    MLP width, as trainers/auto_placement.py check_plan demands."""
    spec = ModelSpec.from_param_count(size)
    dataflow, cluster = build_dataflow("ppo", spec), ClusterSpec.build("a100-80", gpus)
    assert any(m.p > 1 for m in plan(dataflow, cluster).models)
    builtin = plan(dataflow, cluster, limits=ENGINE_LIMITS)
    for m in builtin.models:
        assert _runs(m), (m.role, m.p, m.t, m.pg)
        assert spec.num_heads % m.t == spec.num_kv_heads % m.t == spec.ffn_hidden % m.t == 0
