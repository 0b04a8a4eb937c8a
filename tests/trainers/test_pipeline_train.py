"""`hybridflow train` with the actor in two pipeline stages (actor.parallel.pp=2, engines/pipeline_engine.py):
GRPO on two CPU ranks for two steps equals the same run with pp = 1 (FSDP over dp = 2) on the same ranks,
under 1F1B and under interleaved 1F1B (actor.parallel.pp_schedule; GPipe runs the resumed third step).

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


# name: (pp, schedule) of the two-step runs, from p = 1 to interleaved stages on the same two ranks
RUNS = {"pp2": (2, "1f1b"), "pp1": (1, "1f1b"), "pp2i": (2, "interleaved_1f1b")}
# name: (the run whose last checkpoint it resumes, its pp and schedule) for a third step: every layout's
# state dict holds the whole model by name, so the cut (p, or interleaved stages) may change on resume;
# "from2i" (interleaved stages onto one process) is the others' reference
RESUMES = {
    "from2i": ("pp2i", 1, "1f1b"),
    "to2i": ("pp2", 2, "interleaved_1f1b"),
    "from1": ("pp1", 2, "gpipe"),
}


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    """The tiny Llama with 4 decoder layers: interleaved 1F1B cuts pp * 2 = 4 stages."""
    from hybridflow.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny4"), "tiny", "llama", seed=0, num_hidden_layers=4)


@pytest.fixture(scope="module")
def runs(ray_cluster, model4, tmp_path_factory):
    """{run name: metrics rows} of RUNS and RESUMES, and the pp = 2 (1F1B) run's directory."""
    tmp = tmp_path_factory.mktemp("pipeline_train")
    (tmp / "varied.py").write_text(REWARD)
    out = {}
    for name, (pp, schedule) in RUNS.items():
        config = grpo_config(
            tmp,
            model4,
            data="num_samples: 16, val_size: 2",
            resources="n_gpus_per_node: 2",
            trainer=f"experiment_name: {name}, total_steps: {STEPS}, save_every: 0, loggers: [jsonl], "
            f"val_every: {STEPS}, rollout_data_dir: '{tmp / name / 'gen'}', "
            f"validation_data_dir: '{tmp / name / 'val'}'",
        )
        assert cli_main(_args(config, tmp, pp, schedule)) == 0
        out[name] = _rows(tmp / name)
    out["dir"] = tmp / "pp2"
    for name, (saved, pp, schedule) in RESUMES.items():
        shutil.copytree(tmp / saved / "checkpoints", tmp / name / "checkpoints")
        args = _args(config, tmp, pp, schedule) + [f"trainer.experiment_name={name}",
                                                   f"trainer.total_steps={STEPS + 1}"]  # fmt: skip
        assert cli_main(args) == 0
        out[name] = _rows(tmp / name)
    return out


def _args(config, tmp, pp: int, schedule: str) -> list[str]:
    return ["train", str(config), f"actor.parallel.pp={pp}", f"actor.parallel.pp_schedule={schedule}",
            "actor.micro_batch_size_per_device=2", f"reward.fn={tmp / 'varied.py'}:varied"]  # fmt: skip


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_equal_updates(got: dict, want: dict) -> None:
    keys = [k for k in want if k.startswith(COMPARED)]
    assert {"actor/pg_loss", "actor/grad_norm", "actor/entropy"} <= set(keys) <= set(got)
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
    assert got["actor/grad_norm"] > 0


@pytest.mark.parametrize("name", ["pp2", "pp2i"])
def test_two_stage_grpo_equals_one_stage(runs, name):
    """1F1B and interleaved 1F1B (two stages a rank) against FSDP over the same two ranks."""
    steps = [r for r in runs[name] if r["step"] >= 1]
    assert len(steps) == STEPS
    for got, want in zip(steps, [r for r in runs["pp1"] if r["step"] >= 1]):
        _assert_equal_updates(got, want)


@pytest.mark.parametrize("name", ["to2i", "from1"])
def test_checkpoints_resume_onto_another_layout(runs, name):
    """Each stage's tensors and AdamW moments are saved by the whole model's names
    (engines/checkpoint_io.py), so a checkpoint resumes onto another p or schedule: 1F1B stages onto
    interleaved ones and p = 1 onto GPipe stages run the third step that the interleaved checkpoint
    resumed at p = 1 runs."""
    (got,), (want,) = ([r for r in runs[n] if r["step"] == STEPS + 1] for n in (name, "from2i"))
    _assert_equal_updates(got, want)


def test_generations_equal_token_for_token(runs):
    """Greedy validation (steps 0 and 2) and sampled training rollouts (steps 1 and 2): the texts the
    whole model gathered over pp generates equal those of the unpipelined actor, row for row."""
    for kind, steps in (("val", (0, STEPS)), ("gen", range(1, STEPS + 1))):
        for step in steps:
            got, want = (
                (runs["dir"].parent / name / kind / f"{step}.jsonl").read_text().splitlines()
                for name in ("pp2", "pp1")
            )
            assert got == want and len(got) >= 2, (kind, step)


def test_switch_bytes_equal_the_formula(runs):
    for row in (r for name in ("pp2", "pp2i") for r in runs[name] if r["step"] >= 1):
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
        (
            ["actor.parallel.pp_schedule=interleaved"],
            "actor.parallel.pp_schedule: 'interleaved' is not one of ['1f1b', 'interleaved_1f1b', 'gpipe']",
        ),
        (
            ["actor.parallel.pp_schedule=interleaved_1f1b"],
            "actor.parallel.pp = 2 x pp_virtual_stages = 2 "
            "(interleaved_1f1b): 4 pipeline stages exceed the model's 2 decoder layers",
        ),
        (
            ["actor.parallel.pp_virtual_stages=3"],
            "actor.parallel.pp_virtual_stages: 3 applies to pp_schedule=interleaved_1f1b only",
        ),
    ],
)
def test_what_stages_do_not_run_with_fails_in_one_line(tiny_model_dir, tmp_path, capsys, overrides, expected):
    config = grpo_config(tmp_path, tiny_model_dir, resources="n_gpus_per_node: 2")
    assert cli_main(["train", str(config), "actor.parallel.pp=2", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and expected in err, err
