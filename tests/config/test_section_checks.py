"""Each section's own checks live beside its definition and take only that section (config/validate.py
SECTION_CHECKS); collect_errors runs every one of them."""

from __future__ import annotations

import dataclasses

from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.config.algorithm_config import AlgorithmConfig, DPOConfig, SafeRLHFConfig
from hybridflow.config.run_config import TrainerConfig, trainer_errors
from hybridflow.config.schema import ActorConfig, RolloutConfig, RolloutValConfig
from hybridflow.config.validate import SECTION_CHECKS, collect_errors
from hybridflow.engines.config import OptimConfig, ParallelConfig, optim_errors, parallel_errors
from hybridflow.fields import domain_errors


def test_every_section_has_its_check_and_defaults_pass():
    cfg = HybridFlowConfig()
    assert list(SECTION_CHECKS) == [f.name for f in dataclasses.fields(HybridFlowConfig)]
    for name, check in SECTION_CHECKS.items():
        assert check(getattr(cfg, name)) == [], name


def test_a_sections_domains_are_checked_from_its_fields_alone():
    """Each field's declared domain (hybridflow/fields.py) is checked by one walk, section by section;
    a comparison with NaN is False, so each bound must still refuse it, and inf where floats are finite."""
    assert domain_errors(
        ActorConfig(clip_ratio_c=1.0, ppo_epochs=0, optim=OptimConfig(lr=-1.0)), "actor."
    ) == [
        "actor.optim.lr: must be a finite number >= 0, got -1.0",
        "actor.ppo_epochs: must be >= 1, got 0",
        "actor.clip_ratio_c: must be a finite number > 1, got 1.0",
    ]
    assert domain_errors(RolloutConfig(top_p=0.0, val=RolloutValConfig(temperature=-0.5)), "rollout.") == [
        "rollout.top_p: must be in (0, 1], got 0.0",
        "rollout.val.temperature: must be a finite number >= 0, got -0.5",
    ]
    nan, inf = float("nan"), float("inf")
    assert domain_errors(OptimConfig(lr=inf, eps=nan, betas=[0.9, 1.0]), "actor.optim.") == [
        "actor.optim.lr: must be a finite number >= 0, got inf",
        "actor.optim.betas[1]: must be in [0, 1), got 1.0",
        "actor.optim.eps: must be a finite number > 0, got nan",
    ]
    assert domain_errors(
        TrainerConfig(save_every_minutes=nan, hang_timeout_s=-1, seed=2**40), "trainer."
    ) == [
        "trainer.save_every_minutes: must be in [0, 16666666], got nan",
        "trainer.hang_timeout_s: must be in [0, 1000000000], got -1",
        "trainer.seed: must be in [0, 2147483647], got 1099511627776",
    ]
    assert domain_errors(AlgorithmConfig(lam=1.5, dpo=DPOConfig(label_smoothing=0.5)), "algorithm.") == [
        "algorithm.lam: must be in [0, 1], got 1.5",
        "algorithm.dpo.label_smoothing: must be in [0, 0.5), got 0.5",
    ]
    # lambda_max declares that +inf (no cap) is a value; NaN is never one
    inf_ok = AlgorithmConfig(safe_rlhf=SafeRLHFConfig(lambda_max=inf))
    assert domain_errors(inf_ok) == []
    assert domain_errors(AlgorithmConfig(safe_rlhf=SafeRLHFConfig(lambda_max=nan)), "algorithm.") == [
        "algorithm.safe_rlhf.lambda_max: must be >= 0, got nan"
    ]
    assert domain_errors(TrainerConfig(rollout_ahead=2), "trainer.") == [
        "trainer.rollout_ahead: 2 is not one of [0, 1]"
    ]
    assert domain_errors(OptimConfig(lr="fast"), "critic.optim.") == [
        "critic.optim.lr: must be a number, got 'fast'"
    ]


def test_a_section_check_reads_only_its_section():
    assert trainer_errors(TrainerConfig(total_steps=0, total_epochs=0, experiment_name="/abs")) == [
        "trainer.total_steps: both total_steps and total_epochs are 0; set one of them",
        "trainer.experiment_name: '/abs' must be a relative name inside trainer.output_dir (no '..', not absolute)",
    ]
    assert optim_errors(OptimConfig(betas=[0.9], warmup_steps=-1), "critic.optim") == [
        "critic.optim.betas: expected two numbers in [0, 1), got [0.9]",
    ]  # warmup_steps: its domain
    assert parallel_errors(ParallelConfig(tp=2, dp=0), "ref.parallel") == []  # dp 0: derive
    assert parallel_errors(ParallelConfig(pp=0), "ref.parallel") == [
        "ref.parallel: tp and pp must be >= 1 and dp >= 0, got tp=1 pp=0 dp=0"
    ]


def test_collect_errors_runs_each_sections_check():
    bad = {"algorithm": "algorithm.gamma=2", "model": "model.share_prompt=true", "data": "data.max_prompt_length=0",
           "actor": "actor.clip_ratio_c=0.5", "rollout": "rollout.top_p=2", "critic": "critic.optim.lr=-1",
           "ref": "ref.micro_batch_size_per_device=0", "reward": "reward.max_abs_score=0",
           "resources": "resources.nnodes=0", "trainer": "trainer.keep_last=-1"}  # fmt: skip
    assert set(bad) == set(SECTION_CHECKS)
    for section, override in bad.items():
        extra = ["model.remove_padding=false"] if section == "model" else []
        cfg = load_config(None, ["model.path=m", "data.dataset=synthetic:arithmetic", override, *extra],
                          validate=False, check_model=False)  # fmt: skip
        errors = collect_errors(cfg, check_model=False)
        assert any(e.startswith(f"{section}.") for e in errors), (override, errors)


def test_more_cpu_ranks_than_cores_is_one_warning_line(monkeypatch, capsys):
    """verl scripts' n_gpus_per_node=8 on a 2-core machine: it runs, but `hybridflow train` says before Ray
    starts that 8 rank processes share 2 cores, and what to set instead."""
    import os

    from hybridflow.config.run_config import ResourcesConfig, machine_warnings
    from hybridflow.trainers.cli import check_this_machine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert machine_warnings(ResourcesConfig(device="cpu", n_gpus_per_node=2)) == []
    (warning,) = machine_warnings(ResourcesConfig(device="cpu", n_gpus_per_node=8))
    assert "8 of them share this machine's 2 cores (4 per core)" in warning
    assert "than with n_gpus_per_node=2; set that" in warning
    assert machine_warnings(ResourcesConfig(device="cpu", n_gpus_per_node=4, ray_address="auto")) == []
    cfg = load_config(
        None, ["model.path=m", "data.dataset=synthetic:arithmetic", "resources.device=cpu",
               "resources.n_gpus_per_node=8", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"],
        check_model=False,
    )  # fmt: skip
    check_this_machine(cfg)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("hybridflow train: warning: resources.n_gpus_per_node=8 x nnodes=1")
