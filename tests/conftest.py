"""Shared fixtures. One local Ray cluster per test session (starting Ray costs seconds)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYBRIDFLOW_CPU_THREADS", "1")  # one thread per rank: many ranks share 2 cores
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HYBRIDFLOW_VERIFY_SYNC", "1")  # every rollout_ahead weight sync checks its buckets


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster with 16 logical CPUs (more than the 2 cores: 4-8 rank groups fit, and the
    controller tests keep their shared groups for the session)."""
    import ray

    from hybridflow.controller import ensure_ray

    # ensure_ray: the user's path, which starts the node again if it misses Ray's 30 s (two test workers)
    ensure_ray(address="local", num_cpus=16, log_to_driver=False, configure_logging=False)
    yield ray
    # Left running for the rest of the session; tests needing their own cluster call ray.shutdown().


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama + char tokenizer saved as a normal HF directory."""
    from hybridflow.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), size="tiny", arch="llama", seed=0)
