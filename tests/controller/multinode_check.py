"""Run by test_multinode.py in a subprocess: a two-node simulated cluster needs its own Ray instance."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from hybridflow.batch import Batch  # noqa: E402
from hybridflow.controller import ResourcePool, WorkerGroup  # noqa: E402
from tests.controller.workers import DataWorker  # noqa: E402


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        with ResourcePool(4, name="two_nodes") as pool:
            group = WorkerGroup(DataWorker, pool, scale=2.0)
            infos = group.info()
            out = group.dp(Batch({"x": torch.arange(5, dtype=torch.float32)}))
            result = {
                "pool_nodes": pool.node_of_rank,
                "worker_nodes": [i["node"] for i in infos],
                "ranks": [i["rank"] for i in infos],
                "y": out["y"].tolist(),
                "world": out["world"].tolist(),
                "cluster_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            }
            group.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
