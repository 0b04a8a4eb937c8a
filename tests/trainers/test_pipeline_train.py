"""`hybridflow train` with the actor in two pipeline stages (actor.parallel.pp=2, engines/pipeline_engine.py):
GRPO on two CPU ranks for two steps equals the same run with pp = 1 (FSDP over dp = 2) on the same ranks.

Both runs generate the same rollouts: each rank is one generation replica with the same sampling seed
(hybrid_engine/pipeline_switch.py gathers the whole model onto each pp rank; FSDP over dp = 2 unshards
it), so the rewards, advantages and old log-probs match, and the per-step update metrics must too: fp32,
sums over at most a few hundred terms, summation order apart: 1e-4 relative bounds them with room; the
means of log-ratios (pg_loss, ppo_kl) are ~1e-8 at the first mini-batch's ratio of 1, noise of fp32
log-probs of magnitude ~5 (~6e-7 a token), hence 1e-6 absolute.
The pp = 2 run's switch bytes equal cost.pipeline_switch_cost every step, and its final checkpoint
holds every stage by the whole model's names, so `hybridflow export` loads in transformers.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridflow.cli import main as cli_main
from tests.trainers.lifecycle_helpers import grpo_config

STEPS = 2
# a score that differs between a prompt's samples (the untrained model's answers are never right), so
# GRPO's advantages and the update are not zero
REWARD = """def varied(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 11 / 10
"""
# the update's metrics and what fed it (rewards, advantages, response lengths); not the rollout-vs-training
# gap statistics (rollout/, rollout_corr/), which measure fp32 noise (~1e-7) by design
COMPARED = ("actor/", "advantages/", "reward/mean", "response_length/")


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_dir, tmp_path_factory):
    """{pp: metrics rows} of the two runs, and the pp = 2 run's directory."""
    tmp = tmp_path_factory.mktemp("pipeline_train")
    (tmp / "varied.py").write_text(REWARD)
    out = {}
    for pp in (2, 1):
        config = grpo_config(
            tmp,
            tiny_model_dir,
            data="num_samples: 16, val_size: 2",
            resources="n_gpus_per_node: 2",
            trainer=f"experiment_name: pp{pp}, total_steps: {STEPS}, save_every: 0, loggers: [jsonl], "
            f"val_every: {STEPS}, rollout_data_dir: '{tmp / f'pp{pp}' / 'gen'}', "
            f"validation_data_dir: '{tmp / f'pp{pp}' / 'val'}'",
        )
        assert cli_main(_args(config, tmp, pp)) == 0
        out[pp] = _rows(tmp / f"pp{pp}")
    out["dir"] = tmp / "pp2"
    # each run's last checkpoint resumed onto the other p for one more step
    for saved, resumed in ((2, 1), (1, 2)):
        shutil.copytree(tmp / f"pp{saved}" / "checkpoints", tmp / f"from{saved}" / "checkpoints")
        args = _args(config, tmp, resumed) + [f"trainer.experiment_name=from{saved}",
                                              f"trainer.total_steps={STEPS + 1}"]  # fmt: skip
        assert cli_main(args) == 0
        out[f"from{saved}"] = _rows(tmp / f"from{saved}")
    return out


def _args(config, tmp, pp: int) -> list[str]:
    return ["train", str(config), f"actor.parallel.pp={pp}", "actor.micro_batch_size_per_device=2",
            f"reward.fn={tmp / 'varied.py'}:varied"]  # fmt: skip


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_equal_updates(got: dict, want: dict) -> None:
    keys = [k for k in want if k.startswith(COMPARED)]
    assert {"actor/pg_loss", "actor/grad_norm", "actor/entropy"} <= set(keys) <= set(got)
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
    assert got["actor/grad_norm"] > 0


def test_two_stage_grpo_equals_one_stage(runs):
    steps = [r for r in runs[2] if r["step"] >= 1]
    assert len(steps) == STEPS
    for got, want in zip(steps, [r for r in runs[1] if r["step"] >= 1]):
        _assert_equal_updates(got, want)


def test_checkpoints_resume_onto_the_other_p(runs):
    """The p = 2 checkpoint resumed on p = 1 and the p = 1 one on p = 2 (each stage's tensors and AdamW
    moments saved by the whole model's names, engines/checkpoint_io.py) run the same third step."""
    (got,), (want,) = ([r for r in runs[f"from{p}"] if r["step"] == STEPS + 1] for p in (2, 1))
    _assert_equal_updates(got, want)


def test_generations_equal_token_for_token(runs):
    """Greedy validation (steps 0 and 2) and sampled training rollouts (steps 1 and 2): the texts the
    whole model gathered over pp generates equal those of the unpipelined actor, row for row."""
    for kind, steps in (("val", (0, STEPS)), ("gen", range(1, STEPS + 1))):
        for step in steps:
            got, want = (
                (runs["dir"].parent / f"pp{pp}" / kind / f"{step}.jsonl").read_text().splitlines()
                for pp in (2, 1)
            )
            assert got == want and len(got) >= 2, (kind, step)


def test_switch_bytes_equal_the_formula(runs):
    for row in (r for r in runs[2] if r["step"] >= 1):
        assert row["reshard/bytes_per_rank"] == row["reshard/formula_bytes_per_rank"] > 0
        assert row["reshard/gen_weight_bytes_per_rank"] == row["reshard/formula_gen_weight_bytes_per_rank"]


def test_a_two_stage_checkpoint_exports_to_transformers(runs, tmp_path):
    """Every tensor of the export is the one the stages saved (none left at transformers' init)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.checkpoint.shards import read_full, tensor_index

    assert cli_main(["export", str(runs["dir"]), "--output", str(tmp_path / "export")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    shards = tensor_index(runs["dir"] / "checkpoints" / f"step_{STEPS}" / "actor" / "model")
    assert set(shards) == set(model.state_dict()) and "lm_head.weight" in shards
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, read_full(name, shards[name])), name


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["model.remove_padding=true"], "model.remove_padding: true with actor.parallel.pp = 2"),
        (["rollout.reshard=allgather"], "rollout.reshard = allgather with actor.parallel.pp > 1"),
        (["rollout.pg=2"], "rollout.pg = 2: generation pipeline parallelism does not exist yet"),
    ],
)
def test_what_stages_do_not_run_with_fails_in_one_line(tiny_model_dir, tmp_path, capsys, overrides, expected):
    config = grpo_config(tmp_path, tiny_model_dir, resources="n_gpus_per_node: 2")
    assert cli_main(["train", str(config), "actor.parallel.pp=2", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and expected in err, err
