"""Generation (rollout): the engine interface, sampling parameters and the built-in engine."""

from hybridflow.rollout.base import GenerationEngine, SamplingParams, build_rollout_batch, load_named_weights
from hybridflow.rollout.engine import BuiltinEngine, BuiltinEngineConfig

__all__ = [
    "BuiltinEngine",
    "BuiltinEngineConfig",
    "GenerationEngine",
    "SamplingParams",
    "build_rollout_batch",
    "load_named_weights",
]
