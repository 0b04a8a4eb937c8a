"""Planner test fixtures: searches on the paper's setting are shared (each takes about a second)."""

from __future__ import annotations

import functools

import pytest

from hybridflow.planner import ClusterSpec, ModelSpec, WorkloadSpec, build_dataflow, plan


@functools.cache
def _paper_plan(size: str, gpus: int, algorithm: str = "ppo"):
    """The paper's setting (sec. 8.1): A100-80GB, 8 per node, 1024 prompts, 1024 + 1024 tokens."""
    dataflow = build_dataflow(algorithm, ModelSpec.from_param_count(size))
    return plan(dataflow, ClusterSpec.build("a100-80", gpus), WorkloadSpec())


@pytest.fixture(scope="session")
def paper_plan():
    return _paper_plan
