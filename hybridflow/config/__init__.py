"""Typed configuration: the component dataclasses, the YAML/override loader and the checks.

from hybridflow.config import load_config
cfg = load_config("examples/configs/grpo_tiny.yaml", ["actor.optim.lr=1e-5"])
cfg.actor.optim.lr, cfg.rollout.n, cfg.run_dir
"""

from hybridflow._lazy import lazy_exports
from hybridflow.config.loader import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    leaf_paths,
    load_config,
    parse_override,
)
from hybridflow.config.model_checks import model_max_positions
from hybridflow.config.roles import ActorWorkerConfig, CriticWorkerConfig, RewardWorkerConfig, worker_config
from hybridflow.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DPOConfig,
    HybridFlowConfig,
    KLConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RefConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RolloutValConfig,
    SafeRLHFConfig,
    SFTConfig,
    TrainerConfig,
)
from hybridflow.errors import ConfigError

# the checks import the rollout engines (torch): only when used, so a command can print before that
__getattr__ = lazy_exports(
    __name__, dict.fromkeys(["collect_errors", "resolve_config", "validate_config"], "validate")
)

__all__ = [
    "ActorConfig",
    "ActorWorkerConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "CriticWorkerConfig",
    "DPOConfig",
    "DataConfig",
    "HybridFlowConfig",
    "KLConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RefConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RewardWorkerConfig",
    "RolloutConfig",
    "RolloutValConfig",
    "SFTConfig",
    "SafeRLHFConfig",
    "TrainerConfig",
    "apply_overrides",
    "collect_errors",
    "config_from_dict",
    "config_to_dict",
    "leaf_paths",
    "load_config",
    "model_max_positions",
    "parse_override",
    "resolve_config",
    "validate_config",
    "worker_config",
]
