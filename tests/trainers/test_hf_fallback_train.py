"""`hybridflow train` with an architecture outside the built-in decoder (tiny GPT-2: the HF fallback
decoder) on 2 ranks, dp = 2 under FSDP: 2 GRPO steps complete with finite losses. Before the fallback
decoded on its own replica (rollout/hf_decoder.py), generation called the FSDP units before their root
and the first update failed ("FSDP state has already been lazily initialized ...")."""

from __future__ import annotations

import json
import math

from hybridflow.cli import main as cli_main
from hybridflow.models.tiny import save_tiny_model

# dense (distinct characters of the response), so the random tiny model gets non-zero advantages
REWARD = """def distinct(data_source, solution_str, ground_truth, extra_info=None):
    return len(set(solution_str)) / 4.0
"""


def test_grpo_two_ranks_gpt2_hf_fallback(ray_cluster, tmp_path):
    model = save_tiny_model(tmp_path / "gpt2", arch="gpt2", initializer_range=0.2)
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "grpo.yaml").write_text("algorithm: {name: grpo}\n")
    args = [
        "train", str(tmp_path / "grpo.yaml"), f"model.path={model}", "model.remove_padding=false",
        "data.dataset=synthetic:arithmetic", "data.dataset_kwargs={num_samples: 32, val_size: 4, max_operand: 9}",
        "data.max_prompt_length=16", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "actor.optim.lr=1e-2", "rollout.n=2", "rollout.response_length=6",
        f"reward.fn={tmp_path / 'reward.py'}:distinct", "reward.num_workers=0", "resources.device=cpu",
        "resources.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.val_every=2",
        "trainer.loggers=[jsonl]", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=gpt2",
        "trainer.resume=never",
    ]  # fmt: skip
    assert cli_main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "gpt2" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in updates] == [1, 2]
    for r in updates:
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/entropy"])
        assert 0 < r["actor/grad_norm"] < math.inf
    # validation generated (greedy) before training and after the last step, on both ranks' prompts
    assert [r["step"] for r in rows if any(k.startswith("val/") for k in r)] == [0, 2]
