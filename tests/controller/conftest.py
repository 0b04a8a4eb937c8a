"""Worker groups shared by the controller tests (starting processes costs seconds on 2 cores).

Two disjoint pools of 2 and 4 devices; on each, three colocated roles of the same worker class with
different meshes: "dp" (pure data parallel), "tp" (tp=2: dp = world/2) and "pp" (pp=2). Colocation
keeps it to 6 processes in all. Package scope: the pools are released when tests/controller ends.
"""

from __future__ import annotations

import pytest

from hybridflow.controller import ResourcePool, create_colocated_groups
from tests.controller.workers import DataWorker


def _build(n: int, ray_cluster):
    pool = ResourcePool(n, name=f"pool{n}")
    groups = create_colocated_groups(
        pool,
        {
            "dp": (DataWorker, {"scale": 2.0}),
            "tp": (DataWorker, {"scale": 3.0, "tp": 2, "tg": 2}),
            "pp": (DataWorker, {"pp": 2}),
        },
        group_name=f"colocated{n}",
    )
    return pool, groups


@pytest.fixture(scope="package")
def groups2(ray_cluster):
    pool, groups = _build(2, ray_cluster)
    yield groups
    groups["dp"].shutdown()
    pool.shutdown()


@pytest.fixture(scope="package")
def groups4(ray_cluster):
    pool, groups = _build(4, ray_cluster)
    yield groups
    groups["dp"].shutdown()
    pool.shutdown()


@pytest.fixture(params=[2, 4], ids=["world2", "world4"])
def groups(request, groups2, groups4):
    return groups2 if request.param == 2 else groups4
