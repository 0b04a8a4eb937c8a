"""Rollout sources (trainers/sources/): which source a config runs, the typed batch in flight through a
checkpoint, a restored batch served for its step, and the RL driver asking only the source's API (no
schedule branches in trainers/rl.py: a new source is a subclass, the driver untouched)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta
from hybridflow.trainers import build_trainer
from hybridflow.trainers.sources import (
    InFlight,
    OldLogProbs,
    OneStepAheadSource,
    RolloutSource,
    SynchronousSource,
    old_log_prob_source,
    source_class,
)
from hybridflow.trainers.sources.base import IN_FLIGHT_PART

TRAINERS = Path(__file__).parents[2] / "hybridflow" / "trainers"
DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
SOURCE_API = {"prompts", "batch", "note_update", "save", "load", "reset"}


def _batch(rows: int, offset: float = 0.0, **meta) -> Batch:
    tensors = {
        "responses": torch.arange(rows * 3).view(rows, 3) + int(offset),
        "rollout_log_probs": torch.linspace(-2.0, -0.5, rows * 3).view(rows, 3) + offset,
        "attention_mask": torch.ones(rows, 5, dtype=torch.long),
    }
    non_tensors = {"uid": np.array([f"p{i // 2}" for i in range(rows)], dtype=object)}
    return Batch(tensors, non_tensors, BatchMeta(**meta))


def _assert_same(a: Batch, b: Batch) -> None:
    assert sorted(a.keys()) == sorted(b.keys()) and a.meta == b.meta
    for k in a.tensors:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    for k in a.non_tensors:
        assert list(a[k]) == list(b[k]), k


def test_the_config_picks_the_source(make_config):
    sync, ahead = make_config("grpo"), make_config("grpo", "trainer.rollout_ahead=1", devices=2)
    assert source_class(sync) is SynchronousSource and source_class(ahead) is OneStepAheadSource
    # the one-step-ahead source brings its own worker group; the synchronous one generates on the actor's
    assert SynchronousSource.roles == {} and OneStepAheadSource.roles == {"rollout": {}}
    assert SynchronousSource.on_policy and not OneStepAheadSource.on_policy


def test_in_flight_round_trips_through_a_checkpoint(tmp_path):
    prompts = _batch(4, global_step=7)
    rollouts = _batch(8, 1.0, temperature=0.7, global_step=7)
    reward = Batch({"rm_scores": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, 3.0, -2.0, 0.25])})
    ref_part = Batch({"ref_log_probs": torch.full((4, 3), -1.25)})  # rows [0, 4) of 8: the split's part
    InFlight(7, 5, prompts, rollouts, {"reward": reward, "ref": ref_part}, ref_rows=4).save(tmp_path)
    assert sorted(p.name for p in (tmp_path / IN_FLIGHT_PART).iterdir()) == [
        "prompts.json", "prompts.safetensors", "rollouts.json", "rollouts.safetensors",
        "scores_ref.json", "scores_ref.safetensors", "scores_reward.json", "scores_reward.safetensors",
        "state.json",
    ]  # fmt: skip
    back = InFlight.load(tmp_path)
    assert (back.step, back.version) == (7, 5) and back.restored
    _assert_same(back.prompts, prompts)
    _assert_same(back.rollouts, rollouts)
    # the reference's part of 4 rows cannot travel as a Batch beside 8 rows: dropped, scored again whole
    assert sorted(back.frozen) == ["reward"] and back.ref_rows == 0
    _assert_same(back.frozen["reward"], reward)


def test_a_whole_reference_output_is_kept_and_nothing_in_flight_loads_none(tmp_path):
    ref = Batch({"ref_log_probs": torch.full((8, 3), -0.75)})
    InFlight(3, 2, _batch(4), _batch(8), {"ref": ref}).save(tmp_path / "a")
    back = InFlight.load(tmp_path / "a")
    assert back.ref_rows == 8 and torch.equal(back.frozen["ref"]["ref_log_probs"], ref["ref_log_probs"])
    assert InFlight.load(tmp_path / "b") is None


def _trainer_stand_in(cfg, loader_batches: list[Batch]):
    """What a source reads of its trainer, without worker groups: config and loader."""
    loader = SimpleNamespace(next_batch=lambda: loader_batches.pop(0))
    return SimpleNamespace(cfg=cfg, train_loader=loader, groups={}, total_steps=cfg.trainer.total_steps)


def test_a_restored_batch_is_served_for_its_step_only(make_config, tmp_path):
    """A one-step-ahead checkpoint resumed synchronously trains on its batch in flight first (the loader is
    already past those prompts), with the lag it was sampled at and the synchronous old-log-prob rule."""
    cfg = make_config("grpo")
    rollouts = _batch(8, global_step=3)
    rollouts.meta.reshard_metrics = {"reshard/bytes": 10.0}
    rollouts.meta.rollout_metrics = {"rollout/cpu_streams": 2.0}
    reward = Batch({"rm_scores": torch.arange(8.0)})
    InFlight(3, 1, _batch(4, global_step=3), rollouts, {"reward": reward}).save(tmp_path)
    later = _batch(4, 9.0)
    source = SynchronousSource(_trainer_stand_in(cfg, [later]))
    source.load(tmp_path)
    prompts = source.prompts(3)
    _assert_same(prompts, source.in_flight.prompts)
    prompts.meta.global_step = 3
    step = source.batch(prompts)
    assert source.in_flight is None and source.prompts(4) is later  # then the loader's, as before
    assert step.policy_lag == 3 - 1 - 1  # sampled by version 1, trained from version 2
    assert step.old_log_probs is OldLogProbs.ROLLOUT  # fp32, one optimizer step, on-policy source
    assert step.metrics == {"reshard/bytes": 10.0, "rollout/cpu_streams": 2.0}
    assert step.rollout.meta.reshard_metrics == {} and step.rollout.meta.global_step == 3
    assert list(step.scored) == ["reward"] and torch.equal(
        step.scored["reward"][0]["rm_scores"], torch.arange(8.0)
    )


@pytest.mark.parametrize(
    "overrides,on_policy,expected",
    [((), True, "rollout"), ((), False, "update"), (("algorithm.kl.in_reward=true",), False, "actor"),
     (("actor.ppo_epochs=2",), True, "actor"), (("model.dtype=bfloat16",), True, "update")],
)  # fmt: skip
def test_the_source_says_where_old_log_probs_come_from(make_config, overrides, on_policy, expected):
    """The rule asks the source whether its batches are on policy; None asks the config's schedule."""
    cfg = make_config("grpo", *overrides)
    assert old_log_prob_source(cfg, True, on_policy) == expected
    assert old_log_prob_source(cfg, True) == old_log_prob_source(cfg, True, on_policy=True)


def _source_calls(tree: ast.AST) -> set[str]:
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "source"
        and isinstance(n.value.value, ast.Name)
        and n.value.value.id == "self"
    }


def _identifiers(tree: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.FunctionDef | ast.ClassDef):
            names.add(n.name)
        elif isinstance(n, ast.alias):
            names.add(n.asname or n.name)
    return names


def test_the_driver_has_no_schedule_branches():
    """trainers/rl.py reaches the schedule only through the source's API and names no schedule, pool or
    schedule setting in its code (its docstrings may say what a source does)."""
    tree = ast.parse((TRAINERS / "rl.py").read_text())
    assert _source_calls(tree) <= SOURCE_API, _source_calls(tree) - SOURCE_API
    named = {
        i
        for i in _identifiers(tree)
        if any(w in i for w in ("ahead", "frozen_pool", "ref_training", "split"))
    }
    assert not named, named
    public = {k for k, v in vars(RolloutSource).items() if not k.startswith("_") and callable(v)}
    assert SOURCE_API <= public


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_no_import_circle_inside_trainers():
    """Every import statement (top level or in a function, not TYPE_CHECKING-only: those are in an `if`
    the walk also sees, so none may close a circle either) between modules of hybridflow/trainers."""
    modules = {}
    for f in TRAINERS.rglob("*.py"):
        parts = f.relative_to(TRAINERS.parents[1]).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    edges = {m: {i for i in _imports(f) if i in modules and i != m} for m, f in modules.items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join([*path[path.index(n) :], n])
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])


class RecordingSource(SynchronousSource):
    """A source of its own, plugged into a real trainer: records the driver's calls."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.calls: list[tuple] = []

    def prompts(self, step):
        self.calls.append(("prompts", step))
        return super().prompts(step)

    def batch(self, prompts):
        self.calls.append(("batch", prompts.meta.global_step))
        return super().batch(prompts)

    def note_update(self, update):
        self.calls.append(("note_update",))

    def save(self, directory):
        self.calls.append(("save", Path(directory).name))


def test_a_source_of_its_own_drives_a_real_run(ray_cluster, make_config):
    """Real groups (Ray, gloo) on the tiny model: the GRPO driver runs two steps from a source it was
    never told about, calling it only through the API, once per step, and checkpointing through it."""
    cfg = make_config("grpo", DIGITS, "trainer.val_before_train=false")
    with build_trainer(cfg) as trainer:
        trainer.source = RecordingSource(trainer)
        history = trainer.fit()
        calls = trainer.source.calls
    per_step = [
        ("prompts", 1),
        ("batch", 1),
        ("note_update",),
        ("prompts", 2),
        ("batch", 2),
        ("note_update",),
    ]
    assert [c for c in calls if c[0] != "save"] == per_step
    assert calls[-1][0] == "save"  # the last step's checkpoint asked the source for its part
    assert [h["step"] for h in history] == [1, 2] and [h["rollout/policy_lag"] for h in history] == [0.0, 0.0]
    assert all(np.isfinite(h["actor/pg_loss"]) for h in history)


@pytest.mark.parametrize(
    "algo,chained",
    [("grpo", {"ref": ("compute_ref_log_prob", "ref_log_probs")}),
     ("ppo", {"ref": ("compute_ref_log_prob", "ref_log_probs"), "critic": ("compute_values", "values")})],
)  # fmt: skip
def test_the_synchronous_source_chains_the_scoring_models_on_the_generation(
    ray_cluster, make_config, monkeypatch, algo, chained
):
    """A synchronous step's reference log-probs (and PPO's values: the critic's weights stay until the
    step's update) are issued with its generation, on the generation's own output (each rank fetches its
    rows of it: the rollout makes no round trip through the driver on its way there), and equal the
    model's call on the rollout the driver holds. On 2 ranks, so their shards are cut from the generation's.
    The phases' busy time is the chained calls' alone: the driver's later pass through them adds none."""
    from hybridflow.controller import Future

    cfg = make_config(algo, DIGITS, "algorithm.use_kl_loss=true", "trainer.val_before_train=false", devices=2)
    with build_trainer(cfg) as trainer:
        sent = []
        for role in chained:
            group = trainer.groups[role]
            monkeypatch.setattr(
                group, "_call", lambda m, *a, _c=group._call, **k: sent.append((m, a[1])) or _c(m, *a, **k)
            )
        prompts = trainer.source.prompts(1)
        prompts.meta.global_step = 1
        with trainer.timers.phase("gen"):
            step = trainer.source.batch(prompts)
        phases = {role: "values" if role == "critic" else role for role in chained}
        for phase in phases.values():
            with trainer.timers.phase(phase):
                pass  # the driver's pass through a phase the source already issued
        trainer.timers.collect()
        times = trainer.timers.pop()
        assert sorted(step.scored) == sorted(chained) and not trainer.timers.driver_phases
        for role, (method, key) in chained.items():
            assert isinstance(step.scored[role][0], Future)
            scored = [args for m, args in sent if m == method]
            assert len(scored) == 1 and isinstance(scored[0][0], Future)  # the generation's, not a Batch
            out = step.scored[role][0].get()[key]
            direct = getattr(trainer.groups[role], method)(step.rollout)[key]
            assert len(out) == len(step.rollout) == len(prompts) * cfg.rollout.n
            torch.testing.assert_close(out, direct, rtol=0, atol=1e-6)
            busy = step.scored[role][0].busy_seconds()
            assert times[f"timing_s/{phases[role]}"] == pytest.approx(busy)


@pytest.mark.parametrize("from_store", [True, False])
def test_the_advantages_take_a_large_generation_from_the_object_store(
    ray_cluster, make_config, monkeypatch, from_store
):
    """A synchronous step's advantage call gets the generation's own output (its Future) and, from the
    driver, only what the driver added (the rule scores, the old log-probs named from the rollout's, the
    meta), not every row again, where the rollout passes ROWS_FROM_STORE_BYTES (set to 0 here; below it,
    this small batch goes out whole); either way its finished batch equals make_experience on the
    driver's whole copy."""
    from hybridflow.controller import Future, get
    from hybridflow.trainers import experience

    if from_store:
        monkeypatch.setattr(experience, "ROWS_FROM_STORE_BYTES", 0)
    cfg = make_config(
        "grpo", DIGITS, "algorithm.use_kl_loss=true", "trainer.val_before_train=false", devices=2
    )
    with build_trainer(cfg) as trainer:
        sent, call = [], trainer.actor._call
        monkeypatch.setattr(
            trainer.actor,
            "_call",
            lambda method, *a, **k: sent.append((method, a[1])) or call(method, *a, **k),
        )
        prompts = trainer.source.prompts(1)
        prompts.meta.global_step = 1
        batch = trainer.reward(trainer.ref_log_probs(trainer.old_log_probs(trainer.generate(prompts))))
        batch = trainer.compute_advantages(batch)
        (args,) = [a for method, a in sent if method == "apply"]
        fn, algo, kl, state, *parts = args[1:]
        if from_store:
            generated, added, *parts = parts
            assert isinstance(generated, Future) and generated is batch.step.generated
            assert isinstance(added, Batch) and added.keys() == ["old_log_probs", "scores"]
            assert added.meta.old_log_probs_source == "rollout" and added.meta.global_step == 1
        else:
            whole, *parts = parts
            assert whole is batch.local and "input_ids" in whole
        out = batch.experience.get()
        local = batch.local
        copy = Batch(dict(local.tensors), dict(local.non_tensors), local.meta.copy())
        expected = experience.make_experience(fn, algo, kl, state, copy, *get(parts))
        assert sorted(out.keys()) == sorted(expected.keys())
        for key in expected.tensors:
            torch.testing.assert_close(out[key], expected[key], rtol=0, atol=0, msg=key)
        assert (out.meta.old_log_probs_source, out.meta.global_step) == ("rollout", 1)
        trainer.timers.collect()
        trainer.timers.pop()
