"""trainer.rollout_ahead=1 with the frozen models on the rollout pool (resources.frozen_pool=rollout, the
default; trainers/sources/ahead.py): the reference and the reward model score step k+1's batch in the rollout
pool's processes while the actor trains on step k. The same numbers as with them in the training pool and
with the reference's rows split between the pools (frozen_pool=both), the calls and rows counted where
they ran, a resume from the checkpoint (which holds the batch in flight and its scores)
repeats the uninterrupted run, a plan file that chose both runs the split, and a misplaced setting is one
line through `hybridflow train`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybridflow.cli import main as cli_main
from hybridflow.models import load_reward_model, save_hf_model
from hybridflow.trainers import build_trainer, placement, ref_split
from tests.trainers.counting_workers import COUNTING_CLASSES
from tests.trainers.test_plan_schedule import _plan
from tests.trainers.test_rollout_ahead import AHEAD, _comparable


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    torch.manual_seed(5)
    return save_hf_model(load_reward_model(tiny_model_dir), tmp_path_factory.mktemp("rm"))


def _settings(rm_dir) -> tuple[str, ...]:
    return (*AHEAD, "algorithm.use_kl_loss=true", "reward.kind=model", f"model.reward_model_path={rm_dir}",
            "trainer.total_steps=3", "trainer.save_every=2")  # fmt: skip


def _counting(cfg):
    """build_trainer(cfg) with workers that count their reference / reward-model calls."""
    spec = placement._spec

    def counting(cfg, role, kwargs, with_ref):
        cls, kw = spec(cfg, role, kwargs, with_ref)
        return COUNTING_CLASSES.get(cls, cls), kw

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(placement, "_spec", counting)
        return build_trainer(cfg)


def _assert_close(a: dict, b: dict, rel: float) -> None:
    a, b = _comparable(a), _comparable(b)
    assert a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=rel, abs_tol=1e-7), (k, a[k], b[k])


def test_frozen_models_score_on_the_rollout_pool_with_the_same_numbers(
    ray_cluster, make_config, rm_dir, monkeypatch
):
    cfg = make_config("grpo", *_settings(rm_dir), "trainer.experiment_name=rollout", devices=2)
    with _counting(cfg) as trainer:
        groups = trainer.groups
        assert groups["ref"] is groups["rollout"] and groups["reward"].pool is groups["rollout"].pool
        on_rollout = trainer.fit()
        calls = {r: groups[r].execute_all("scoring_calls") for r in ("actor_rollout", "rollout", "reward")}
    # every step's reference log-probs ran in the rollout pool's process, none in the actor's; the reward
    # model scored the 3 training batches there too (and the validation at the end)
    assert calls == {"actor_rollout": [0], "rollout": [3], "reward": [4]}
    roles = json.loads((Path(cfg.run_dir) / "placement.json").read_text())["roles"]
    assert roles["ref"]["pool"] == roles["reward"]["pool"] == "rollout" and roles["ref"]["ref"]["dp"] == 1
    assert [h["rollout/policy_lag"] for h in on_rollout] == [0.0, 1.0, 1.0]
    assert on_rollout[-1]["actor/kl_loss"] > 0 and on_rollout[-1]["timing_s/ref"] > 0  # the KL term is live

    cfg_t = make_config("grpo", *_settings(rm_dir), "resources.frozen_pool=training",
                        "trainer.experiment_name=training", devices=2)  # fmt: skip
    with build_trainer(cfg_t) as trainer:
        assert trainer.groups["ref"] is trainer.groups["actor_rollout"]
        assert trainer.groups["reward"].pool is trainer.actor.pool
        on_training = trainer.fit()
    assert len(on_rollout) == len(on_training) == 3
    for a, b in zip(on_rollout, on_training):  # same seeds, prompts and frozen models: the same run
        _assert_close(a, b, 1e-5)

    # frozen_pool=both: the reference in both pools, each batch's rows split between them (ref_split.py).
    # The split follows measured busy times, so the test fixes it at half the rows (whole groups): a real
    # split every step, whatever the machine's speed (tests/trainers/test_ref_split.py tests the balance)
    half = lambda self, rows, *_: rows // 2  # noqa: E731
    monkeypatch.setattr(ref_split.RefSplit, "rows_for", half)
    cfg_b = make_config("grpo", *_settings(rm_dir), "resources.frozen_pool=both",
                        "trainer.experiment_name=both", devices=2)  # fmt: skip
    with _counting(cfg_b) as trainer:
        groups = trainer.groups
        assert groups["ref"] is groups["rollout"] and groups["ref_training"] is groups["actor_rollout"]
        assert groups["reward"].pool is groups["rollout"].pool
        on_both = trainer.fit()
        rows = {r: groups[r].execute_all("scored_rows") for r in ("actor_rollout", "rollout")}
    batch = cfg_b.data.train_batch_size * cfg_b.rollout.n
    split = [h["rollout/ref_rows_on_rollout_pool"] for h in on_both]
    n = cfg_b.rollout.n
    assert split == [batch // 2] * 3 and batch // 2 % n == 0
    # every row of the 3 batches scored once: the rollout pool's rows as logged, the training pool the rest
    assert rows == {"rollout": [sum(split)], "actor_rollout": [3 * batch - sum(split)]}
    for a, b in zip(on_rollout, on_both):
        b = {k: v for k, v in b.items() if k != "rollout/ref_rows_on_rollout_pool"}
        _assert_close(a, b, 1e-5)

    # resume from step 2: the checkpoint holds batch 3 and its reference / reward scores
    part = Path(cfg.run_dir) / "checkpoints" / "step_2" / "rollout_ahead"
    assert {p.name for p in part.glob("scores_*.safetensors")} == {
        "scores_ref.safetensors",
        "scores_reward.safetensors",
    }
    resumed = make_config("grpo", *_settings(rm_dir), "trainer.experiment_name=resumed",
                          f"trainer.resume={part.parent}", devices=2)  # fmt: skip
    with _counting(resumed) as trainer:
        rest = trainer.fit()
        ref_calls = trainer.groups["rollout"].execute_all("scoring_calls")
    assert [h["step"] for h in rest] == [3] and ref_calls == [0]  # step 3 took its scores from the checkpoint
    assert _comparable(rest[0]) == _comparable(on_rollout[2])

    # with the split, the checkpoint holds the rollout pool's rows of batch 3, now a Batch, which cannot travel
    # beside the whole batch: the training pool scores all of batch 3 (trainers/sources/base.py, InFlight.load)
    part = Path(cfg_b.run_dir) / "checkpoints" / "step_2" / "rollout_ahead"
    resumed = make_config("grpo", *_settings(rm_dir), "resources.frozen_pool=both",
                          "trainer.experiment_name=resumed_both", f"trainer.resume={part.parent}", devices=2)  # fmt: skip
    with _counting(resumed) as trainer:
        rest = trainer.fit()
        rows = {r: trainer.groups[r].execute_all("scored_rows") for r in ("actor_rollout", "rollout")}
    assert rows == {"rollout": [0], "actor_rollout": [batch]}
    assert rest[0]["rollout/ref_rows_on_rollout_pool"] == 0
    drop = (
        "rollout/ref_rows_on_rollout_pool"  # the same reference, scored in other micro-batches: fp32 rounding
    )
    _assert_close(
        {k: v for k, v in rest[0].items() if k != drop},
        {k: v for k, v in on_both[2].items() if k != drop},
        1e-5,
    )


def test_a_misplaced_frozen_pool_is_one_line_exit_2(tiny_model_dir, tmp_path, capsys):
    base = [f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic", "resources.device=cpu",
            f"trainer.output_dir={tmp_path}"]  # fmt: skip
    cases = {
        "resources.frozen_pool=training": "resources.frozen_pool: 'training' is only used with trainer.rollout_ahead=1",
        "resources.frozen_pool=driver": "resources.frozen_pool: 'driver' is not one of ['auto', 'rollout', 'training', 'both']",
    }
    for setting, expected in cases.items():
        assert cli_main(["train", *base, setting]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hybridflow train:")]
        assert len(err) == 1 and expected in err[0], err
    # with a rollout pool but no frozen model (GRPO, no KL term, rule reward) 'training' places nothing
    ahead = ["trainer.rollout_ahead=1", "resources.n_gpus_per_node=2", "resources.frozen_pool=training"]
    assert cli_main(["train", *base, *ahead]) == 2
    assert "resources.frozen_pool: 'training' places nothing" in capsys.readouterr().err
    # 'both' splits the reference: a reward model alone is not enough, and a plan places the models itself
    both = [*ahead[:2], "resources.frozen_pool=both"]
    rm = ["reward.kind=model", f"model.reward_model_path={tiny_model_dir}"]
    assert cli_main(["train", *base, *both, *rm]) == 2
    assert "resources.frozen_pool: both splits the reference's rows" in capsys.readouterr().err
    # under a plan file the plan says where the frozen models run: one that priced them elsewhere is refused
    path = _plan(tiny_model_dir, 2, "ahead", "rollout").save(tmp_path / "rollout.yaml")
    assert cli_main(["train", *base, *both, "algorithm.use_kl_loss=true", f"resources.placement={path}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hybridflow train:")]
    assert len(err) == 1 and "in the rollout pool but resources.frozen_pool=both" in err[0], err


def test_a_plan_with_the_reference_on_both_sides_runs_the_split(
    ray_cluster, tiny_model_dir, tmp_path, capsys
):
    """`hybridflow plan` chose frozen_pool=both (planner/ahead_both.py); `hybridflow train` with that plan file
    builds the training pool's reference (groups["ref_training"]) beside the rollout pool's and splits the
    rows between them, as resources.frozen_pool=both does under colocate."""
    p = _plan(tiny_model_dir, 2, "ahead", "both")
    assert p.ahead.frozen_pool == "both" and p.ahead.frozen == ["reference"]
    path = p.save(tmp_path / "both.yaml")
    argv = ["train", "algorithm.name=grpo", f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic",
            "data.dataset_kwargs={num_samples: 64, val_size: 6, max_operand: 9}", "data.max_prompt_length=16",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-3", "rollout.n=2",
            "rollout.response_length=4", "reward.num_workers=0", "resources.device=cpu",
            "resources.n_gpus_per_node=2", *AHEAD,
            "algorithm.use_kl_loss=true", f"resources.placement={path}", "trainer.total_steps=2",
            f"trainer.output_dir={tmp_path}", "trainer.experiment_name=planned", "trainer.loggers=[jsonl]"]  # fmt: skip
    assert cli_main(argv) == 0, capsys.readouterr().err[-2000:]
    run = tmp_path / "planned"
    roles = json.loads((run / "placement.json").read_text())["roles"]
    assert roles["ref"]["pool"] == "rollout" and roles["ref"]["world_size"] == p.ahead.n_devices == 1
    assert roles["ref_training"]["pool"] == roles["actor_rollout"]["pool"] == p.model("actor").pool
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    split = [r["rollout/ref_rows_on_rollout_pool"] for r in rows if "rollout/ref_rows_on_rollout_pool" in r]
    # 4 prompts x 2: half the batch, in whole groups, until both sides' costs are measured (ref_split.py)
    assert split[0] == 4.0 and len(split) == 2 and all(m % 2 == 0 and 0 <= m <= 8 for m in split)
    kl = [r["actor/kl_loss"] for r in rows if "actor/kl_loss" in r]
    assert (
        len(kl) == 2 and kl[-1] > 0
    )  # after one update the reference's log-probs differ: the KL term is live
