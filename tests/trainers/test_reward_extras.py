"""A reward function's extra keys (verl's reward_extra_info) through `hybridflow train`: their per-step
means in the metrics, their values in the generations table, and maj@n / pass@k from its 'pred' and
'acc' in validation, checked against the pure functions on the table's own rows; and the same run's
memory and FLOP/s metrics."""

from __future__ import annotations

import json

import pytest

from hybridflow.algorithms.eval_metrics import maj_at_n, mean_pass_at_k
from hybridflow.cli import main

# a shaped score (0.5 for answering at all, 1 more when right) whose 'acc' says right or wrong:
# validation's acc@1 must be the acc, not the score
REWARD = """def score(data_source, solution_str, ground_truth, extra_info=None):
    pred = solution_str.strip()
    right = pred == ground_truth
    return {"score": 0.5 + right, "acc": right, "pred": pred, "length": len(pred)}
"""


def test_reward_extra_keys_and_vote_metrics(ray_cluster, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "r.py").write_text(REWARD)
    argv = [
        "train", "algorithm.name=grpo", f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic",
        "data.dataset_kwargs={num_samples: 16, val_size: 4, max_operand: 9}", "data.max_prompt_length=16",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.response_length=4",
        f"reward.fn={tmp_path / 'r.py'}:score", "resources.device=cpu", "trainer.total_steps=1",
        "rollout.val.n=4", "rollout.val.temperature=1.0", "trainer.val_generations_to_log=16",
        f"trainer.output_dir={tmp_path}", "trainer.experiment_name=x", "trainer.loggers=[jsonl]",
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "x" / "metrics.jsonl").read_text().splitlines()]
    gens = [json.loads(x) for x in (tmp_path / "x" / "generations.jsonl").read_text().splitlines()]
    step1 = rows[1]
    # resource metrics of the step: peak host memory per role, achieved FLOP/s per phase
    assert 0.05 < step1["perf/memory/actor_rollout/host_peak_rss_gb"] < 64
    assert 0.05 < step1["perf/memory/driver/host_peak_rss_gb"] < 64
    assert step1["perf/tflops_per_device/update_actor"] > 0 and step1["perf/tflops_per_device/gen"] > 0
    assert "perf/mfu/gen" not in step1  # no peak is claimed for a CPU
    assert 0.0 <= step1["reward/extra/acc/mean"] <= 1.0 and step1["reward/extra/length/mean"] > 0
    assert step1["reward/extra/acc/mean"] + 0.5 == pytest.approx(step1["reward/mean"])  # score = acc + 0.5
    # the table carries the extra keys; 4 prompts x 4 samples per validation, in prompt order
    for step in (0, 1):
        table = [g for g in gens if g["step"] == step]
        assert len(table) == 16 and {"pred", "acc", "length"} <= set(table[0])
        assert all(g["pred"] == g["response_text"].strip() for g in table)
        answers = [[g["pred"] for g in table[p * 4 : p * 4 + 4]] for p in range(4)]
        correct = [[g["acc"] for g in table[p * 4 : p * 4 + 4]] for p in range(4)]
        src = "val/synthetic:arithmetic"
        assert rows[step][f"{src}/maj@4"] == pytest.approx(maj_at_n(answers, correct))
        assert rows[step][f"{src}/pass@2"] == pytest.approx(mean_pass_at_k(correct, 2))
        assert rows[step][f"{src}/mean@4"] == pytest.approx(sum(map(sum, correct)) / 16 + 0.5)
        assert rows[step][f"{src}/acc@1"] == pytest.approx(sum(c[0] for c in correct) / 4)
