"""One-step-ahead plans run end to end (docs/planner.md, "The one-step-ahead schedule"): `hybridflow train
... resources.placement=auto trainer.rollout_ahead=1`, and a plan file written by `hybridflow plan
--schedule ahead`, build the planned rollout pool and the actor's layout (read back from the run's
placement.json), and the rollout pool generates tensor-parallel (tg = 2, rollout/pool_tp.py) with the
outputs and metrics of tg = 1, each rollout rank holding and receiving only its generation shard
(workers/shard_sync.py). Real Ray groups, gloo, the tiny Llama.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import main as cli_main
from hybridflow.config import ConfigError
from hybridflow.models import load_causal_lm
from hybridflow.planner import Plan
from hybridflow.rollout.pool_tp import generation_shard
from hybridflow.trainers import build_trainer
from tests.trainers.lifecycle_helpers import assert_rollout_pool_greedy_equals_actor, comparable, grpo_config

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
AHEAD = (DIGITS, "trainer.rollout_ahead=1", "trainer.val_before_train=false", "trainer.total_steps=3")
LAG = "rollout/policy_lag"


def _shard_bytes(model_dir, tg: int) -> int:
    """Bytes of one rank's generation shard of the model (tied weights once)."""
    model = load_causal_lm(model_dir)
    return sum(t.numel() * t.element_size() for t in generation_shard(model, 0, tg).values())


def _placement(run: Path) -> dict:
    return json.loads((run / "placement.json").read_text())


def test_auto_with_rollout_ahead_runs_through_the_cli(ray_cluster, tiny_model_dir, tmp_path, capsys):
    config = grpo_config(
        tmp_path, tiny_model_dir, resources="n_gpus_per_node: 2, placement: auto",
        trainer="experiment_name: run, total_steps: 2, val_before_train: false, loggers: [jsonl]",
    )  # fmt: skip
    assert cli_main(["train", str(config), "trainer.rollout_ahead=1"]) == 0
    assert "rollout pool one step ahead (1 devices)" in capsys.readouterr().out  # the plan, printed
    run = tmp_path / "run"
    plan = Plan.load(run / "plan.yaml")
    assert plan.rollout_ahead == 1 and plan.ahead.n_devices == 1
    built = _placement(run)
    actor = plan.model("actor")
    assert built["pools"] == {actor.pool: 1, "rollout": 1} and built["plan"] == {"rollout_ahead": 1}
    assert built["roles"]["actor_rollout"]["world_size"] == actor.n_devices
    assert built["roles"]["actor_rollout"]["train"] == {"dp": actor.d, "tp": actor.t}
    assert built["roles"]["rollout"] == {"pool": "rollout", "world_size": 1, "rollout": {"dp": 1, "tp": 1}}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r[LAG] for r in rows] == [0.0, 1.0]


def _ahead_plan_file(tiny_model_dir, tmp_path: Path, capsys, n_devices: int = 2, tg: int = 2) -> Path:
    """`hybridflow plan --schedule ahead` for the tiny GRPO on 3 CPU devices (actor | reference | rollout,
    one each: the reference priced in the training pool), with the rollout pool edited to 2 devices generating tg = 2 (the planner prices tg > 1
    too, but picks one device here). The runs have no KL term: the reference pool is not started."""
    out = tmp_path / "plan.yaml"
    args = ["plan", "--model-config", str(tiny_model_dir), "--algorithm", "grpo", "--no-reward-model",
            "--gpu", "cpu", "--gpus", "3",
            "--prompts", "4", "--samples-per-prompt", "2", "--prompt-len", "16", "--response-len", "4",
            "--schedule", "ahead", "--frozen-pool", "training", "--output", str(out)]  # fmt: skip
    assert cli_main(args) == 0
    capsys.readouterr()
    data = yaml.safe_load(out.read_text())
    assert data["rollout_ahead"] == 1 and [p["n_devices"] for p in data["pools"]] == [1, 1]
    assert data["ahead"]["n_devices"] == 1
    data["ahead"].update(n_devices=n_devices, tg=tg)
    out.write_text(yaml.safe_dump(data))
    return out


def _fit_tg2(cfg, tiny_model_dir, ranks: int) -> list[dict]:
    """Train with a rollout pool of `ranks` ranks at tg = 2: it decodes greedily as the actor (tg = 1), and
    each rank holds its shard only (q/k/v, gate/up, o/down and the (92-row) embeddings and lm_head halved,
    the norms whole). -> the run's per-step metrics."""
    with build_trainer(cfg) as trainer:
        assert trainer.groups["rollout"].world_size == ranks
        history = trainer.fit()
        assert_rollout_pool_greedy_equals_actor(trainer, 6)
        assert trainer.groups["rollout"].rollout_param_bytes() == [_shard_bytes(tiny_model_dir, 2)] * ranks
    return history


def _assert_same_but_sync(tg2: list[dict], tg1: list[dict]) -> None:
    """The tg = 2 run's metrics equal tg = 1's step by step, but for the sync's byte counts."""
    for a, b in zip(tg2, tg1, strict=True):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for k in (k for k in a if not k.startswith("sync/")):
            assert math.isclose(a[k], b[k], rel_tol=1e-3, abs_tol=1e-4), (a["step"], k, a[k], b[k])


def test_plan_file_with_a_tensor_parallel_rollout_pool(
    ray_cluster, make_config, tiny_model_dir, tmp_path, capsys
):
    path = _ahead_plan_file(tiny_model_dir, tmp_path, capsys)
    four = "trainer.total_steps=4"  # syncs before steps 3 and 4 (and the check's), each a shard per rank
    cfg = make_config(
        "grpo", *AHEAD, four, f"resources.placement={path}", "trainer.experiment_name=tg2", devices=3
    )
    tg2 = _fit_tg2(cfg, tiny_model_dir, ranks=2)
    built = _placement(Path(cfg.run_dir))
    assert built["pools"]["rollout"] == 2 and sum(built["pools"].values()) == 3
    assert built["roles"]["rollout"] == {"pool": "rollout", "world_size": 2, "rollout": {"dp": 1, "tp": 2}}
    assert built["roles"]["actor_rollout"]["train"] == {"dp": 1, "tp": 1}

    # the same run with tg = 1 on one rollout device (one replica, so the same sampling seeds)
    ref = make_config("grpo", *AHEAD, four, "trainer.experiment_name=tg1", devices=2)
    with build_trainer(ref) as trainer:
        tg1 = trainer.fit()
    assert [h[LAG] for h in tg2] == [h[LAG] for h in tg1] == [0.0, 1.0, 1.0, 1.0]
    # sync/bytes: what each rollout rank received (its shard); sync/bytes_sent: actor rank 0's total
    full, half = _shard_bytes(tiny_model_dir, 1), _shard_bytes(tiny_model_dir, 2)
    assert half == 172_288 and full == 343_296  # 1/2 of the model but for the norms (64 floats each)
    assert [(h["sync/bytes"], h["sync/bytes_sent"]) for h in tg1[1:-1]] == [(full, full)] * 2
    assert [(h["sync/bytes"], h["sync/bytes_sent"]) for h in tg2[1:-1]] == [(half, 2 * half)] * 2
    _assert_same_but_sync(tg2, tg1)


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"tg": 3}, "tg must divide its 2 devices"),
        ({"tg": 2, "n_devices": 1}, "tg must divide its 1 devices"),
    ],
)
def test_rollout_pool_layouts_that_cannot_run_are_one_line(
    make_config, tiny_model_dir, tmp_path, capsys, edit, message
):
    path = _ahead_plan_file(tiny_model_dir, tmp_path, capsys)
    data = yaml.safe_load(path.read_text())
    data["ahead"].update(edit)
    path.write_text(yaml.safe_dump(data))
    cfg = make_config("grpo", *AHEAD, f"resources.placement={path}", devices=3)
    with pytest.raises(ConfigError) as e:
        build_trainer(cfg)
    assert any(message in line for line in e.value.errors), e.value.errors


def test_a_plan_for_the_other_schedule_stops_train_in_one_line(tiny_model_dir, tmp_path, capsys):
    """The plan's schedule and trainer.rollout_ahead must agree (off-policy training is the user's call):
    `hybridflow train` exits 2 with one line naming both fixes, before Ray starts."""
    path = _ahead_plan_file(tiny_model_dir, tmp_path, capsys)
    config = grpo_config(tmp_path, tiny_model_dir, resources=f"n_gpus_per_node: 3, placement: '{path}'")
    assert cli_main(["train", str(config)]) == 2
    # one line, beside the warning that 3 CPU ranks share fewer cores where they do
    err = "\n".join(x for x in capsys.readouterr().err.strip().splitlines() if "train: warning:" not in x)
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "has rollout_ahead: 1 but trainer.rollout_ahead=0" in err and "--schedule sync" in err


def test_two_tensor_parallel_replicas_each_rank_sent_only_its_shard(
    ray_cluster, make_config, tiny_model_dir, tmp_path, capsys
):
    """4 rollout ranks at tg = 2: two replicas, so each TP index's slice goes by one broadcast over a
    subgroup of actor rank 0 and the two rollout ranks of that index (workers/shard_sync.py). The run
    equals tg = 1 on 2 rollout ranks (two replicas as well: the same prompts and seeds per replica)."""
    path = _ahead_plan_file(tiny_model_dir, tmp_path, capsys, n_devices=4)
    cfg = make_config(
        "grpo", *AHEAD, f"resources.placement={path}", "trainer.experiment_name=tg2x2", devices=5
    )
    tg2 = _fit_tg2(cfg, tiny_model_dir, ranks=4)
    built = _placement(Path(cfg.run_dir))
    assert built["roles"]["rollout"] == {"pool": "rollout", "world_size": 4, "rollout": {"dp": 2, "tp": 2}}
    ref = make_config(
        "grpo", *AHEAD, "resources.rollout_devices=2", "trainer.experiment_name=tg1x2", devices=3
    )
    with build_trainer(ref) as trainer:
        assert trainer.groups["rollout"].world_size == 2
        tg1 = trainer.fit()
    half, full = _shard_bytes(tiny_model_dir, 2), _shard_bytes(tiny_model_dir, 1)
    assert (tg2[1]["sync/bytes"], tg2[1]["sync/bytes_sent"]) == (half, 2 * half)
    assert (tg1[1]["sync/bytes"], tg1[1]["sync/bytes_sent"]) == (full, full)
    _assert_same_but_sync(tg2, tg1)
