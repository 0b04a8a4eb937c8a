"""Configs for the driver and worker tests: the tiny model on the synthetic arithmetic task, CPU, quiet."""

from __future__ import annotations

from hybridflow.config import load_config


def tiny_config(model_dir, run_dir, algorithm: str, *overrides: str, devices: int = 1):
    base = [
        f"algorithm.name={algorithm}",
        f"model.path={model_dir}",
        "data.dataset=synthetic:arithmetic",
        "data.dataset_kwargs={num_samples: 64, val_size: 6, max_operand: 9}",
        "data.max_prompt_length=16",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3",
        "rollout.response_length=4",
        "rollout.n=2",
        "reward.num_workers=0",
        "resources.device=cpu",
        f"resources.n_gpus_per_node={devices}",
        "trainer.total_steps=2",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={run_dir}",
        f"trainer.experiment_name={algorithm}",
        "trainer.resume=never",
    ]
    return load_config(None, base + list(overrides))
