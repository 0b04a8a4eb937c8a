"""Training engine: parallel layout (mesh + TP/AC/FSDP2), micro-batching, RL forward passes, updates."""

from hybridflow.engines.config import EngineConfig, OptimConfig, ParallelConfig
from hybridflow.engines.mesh import build_mesh
from hybridflow.engines.parallelize import parallelize
from hybridflow.engines.train_engine import TrainEngine

__all__ = ["EngineConfig", "OptimConfig", "ParallelConfig", "TrainEngine", "build_mesh", "parallelize"]
