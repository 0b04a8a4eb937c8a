"""Fixtures of the driver tests."""

from __future__ import annotations

import pytest

from tests.trainers.configs import tiny_config


@pytest.fixture
def make_config(tiny_model_dir, tmp_path):
    """make_config(algorithm, *overrides, devices=1) -> a resolved, validated HybridFlowConfig."""

    def make(algorithm: str, *overrides: str, devices: int = 1):
        return tiny_config(tiny_model_dir, tmp_path / "runs", algorithm, *overrides, devices=devices)

    return make
