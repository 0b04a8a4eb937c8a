"""Training engine: parallel layout (mesh + TP/AC/FSDP2), micro-batching, RL forward passes, updates.

The configs import without torch (config/schema.py composes them); the rest loads on first use.
"""

from hybridflow.engines.config import EngineConfig, OptimConfig, ParallelConfig

_LAZY = {
    "build_mesh": "hybridflow.engines.mesh",
    "parallelize": "hybridflow.engines.parallelize",
    "TrainEngine": "hybridflow.engines.train_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridflow.engines' has no attribute {name!r}")


__all__ = ["EngineConfig", "OptimConfig", "ParallelConfig", "TrainEngine", "build_mesh", "parallelize"]
