"""Exact resume: a run checkpointed at step 2 and resumed (resume=auto, new worker processes) repeats
the uninterrupted run's steps 3-4 number for number, on CPU under a seed.

What must come back for that: actor weights, AdamW moments, the warmup+cosine LR schedule, the
adaptive KL coefficient, the loader's position (the run crosses an epoch boundary, so the next
epoch's shuffle too) and the RNG states; any one missing changes the losses.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.checkpoint import read_manifest
from hybridflow.trainers import build_trainer
from tests.trainers.lifecycle_helpers import comparable

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
SETTINGS = (
    DIGITS,
    "data.dataset_kwargs={num_samples: 12, val_size: 4, max_operand: 9}",  # 3 steps per epoch
    "algorithm.use_kl_loss=true",
    "algorithm.kl.in_reward=true",
    "algorithm.kl.controller=adaptive",
    "algorithm.kl.coef=0.05",
    "actor.optim.warmup_steps=2",
    "actor.optim.schedule=cosine",
    "actor.ppo_mini_batch_size=2",  # two optimizer steps per training step
    "trainer.total_steps=4",
    "trainer.val_every=2",
    "trainer.save_every=3",
    "trainer.keep_last=2",
)


def test_resumed_run_repeats_the_uninterrupted_run(ray_cluster, make_config):
    with build_trainer(make_config("grpo", *SETTINGS, "trainer.experiment_name=whole")) as trainer:
        whole = trainer.fit()
    cfg = make_config("grpo", *SETTINGS, "trainer.experiment_name=parts", "trainer.resume=auto")
    with build_trainer(cfg) as trainer:
        first = trainer.fit(stop_after=2)  # as if preempted right after the step-2 checkpoint
    assert [h["step"] for h in first] == [0, 1, 2]
    with build_trainer(cfg) as trainer:  # fresh worker processes
        assert trainer.latest_checkpoint().name == "step_2"
        rest = trainer.fit()
        kl_coef = trainer.kl_ctrl.value
    assert [h["step"] for h in rest] == [3, 4]
    for a, b in zip(whole, first + rest, strict=True):
        assert comparable(a) == comparable(b), a["step"]
    assert rest[-1]["actor/reward_kl_penalty_coeff"] != 0.05  # the adaptive controller moved
    assert "val/synthetic:arithmetic/acc@1" in first[-1] and "val/synthetic:arithmetic/acc@1" in rest[-1]

    run = Path(cfg.run_dir)
    ckpts = run / "checkpoints"
    # saves at 2 (the stop), 3 (save_every) and 4 (the end); keep_last=2 pruned step 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_3", "step_4"]
    assert (ckpts / "latest").read_text().strip() == "step_4"
    manifest = read_manifest(ckpts / "step_4", require=["actor", "trainer_state.json"])
    assert manifest["meta"]["algorithm"] == "grpo"
    state = json.loads((ckpts / "step_4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["extra"]["kl_ctrl"]["value"] == kl_coef
    assert state["loader"] and {"python", "numpy", "torch"} <= set(state["rng"])
    # the metrics file reads as one uninterrupted run
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4]
