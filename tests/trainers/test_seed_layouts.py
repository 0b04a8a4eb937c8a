"""Seeded sampling does not depend on the layout: the same GRPO config and seed through `hybridflow train`
on 1, 2 and 4 data-parallel ranks (fp32, the built-in engine) samples the same step-1 responses, because
each row's draws are keyed by (seed, step, prompt uid, sample index, position), not by rank or replica."""

from __future__ import annotations

import json

from hybridflow.cli import main


def _step1_outputs(model_dir, out, ranks: int) -> list[tuple[str, str]]:
    argv = [
        "train", "algorithm.name=grpo", f"model.path={model_dir}", "data.dataset=synthetic:arithmetic",
        "data.dataset_kwargs={num_samples: 8, val_size: 1, max_operand: 9}", "data.max_prompt_length=16",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.response_length=6",
        "reward.num_workers=0", "resources.device=cpu", f"resources.n_gpus_per_node={ranks}",
        "trainer.total_steps=1", "trainer.seed=7", f"trainer.output_dir={out}", "trainer.experiment_name=run",
        "trainer.loggers=[jsonl]", f"trainer.rollout_data_dir={out / 'rollouts'}",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "rollouts" / "1.jsonl").read_text().splitlines()]
    return [(r["input"], r["output"]) for r in rows]


def test_the_same_seed_samples_the_same_responses_on_1_2_and_4_ranks(ray_cluster, tiny_model_dir, tmp_path):
    one = _step1_outputs(tiny_model_dir, tmp_path / "dp1", 1)
    assert len(one) == 8 and len({o for _, o in one}) > 1  # sampled, not greedy
    assert _step1_outputs(tiny_model_dir, tmp_path / "dp2", 2) == one
    assert _step1_outputs(tiny_model_dir, tmp_path / "dp4", 4) == one
