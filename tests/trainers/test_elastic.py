"""A node lost mid-run (docs/operations.md, "Automatic recovery"): the restart waits
trainer.restart_wait_s for the devices, then continues on fewer dp ranks from the last checkpoint,
as trainer.min_devices allows; the batch arithmetic for the smaller dp is checked like at start."""

from __future__ import annotations

import re

import pytest

from hybridflow.config import load_config
from hybridflow.trainers.elastic import shrunk_config
from tests.trainers.lifecycle_helpers import comparable, grpo_config, metric_rows, start_train, wait_for


def test_shrunk_config_rederives_dp_and_checks_the_batch(tiny_model_dir, tmp_path):
    cfg = load_config(
        grpo_config(tmp_path, tiny_model_dir, resources="n_gpus_per_node: 2, nnodes: 2"),
        ["trainer.min_devices=1"],
    )
    assert cfg.actor.parallel.dp == 4 and cfg.ref.parallel.dp == 4
    two, problems = shrunk_config(cfg, 2)
    assert problems == [] and (two.resources.nnodes, two.resources.n_gpus_per_node) == (1, 2)
    assert (two.actor.parallel.dp, two.ref.parallel.dp, two.actor.num_mini_batches) == (2, 2, 1)
    assert cfg.actor.parallel.dp == 4  # the run's config is not touched
    _, problems = shrunk_config(cfg, 3)  # 4 prompts x 2 samples = 8 rows do not split over 3 ranks
    assert problems == [
        "a mini-batch of 8 rows (actor.ppo_mini_batch_size x rollout.n) does not split evenly over dp=3"
    ]
    tp2, _ = shrunk_config(load_config(cfg_path := tmp_path / "grpo.yaml", ["actor.parallel.tp=2"]), 2)
    assert tp2.actor.parallel.dp == 1 and cfg_path.is_file()


# tells any two different responses apart, so no group's advantages are all 0: every step really updates
VARIED = """def overlap(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 13 / 13.0
"""


@pytest.mark.slow
def test_lost_node_continues_on_fewer_dp_ranks_from_the_checkpoint(tiny_model_dir, tmp_path):
    """A real two-node Ray cluster on this machine: ray.cluster_utils.Cluster's second raylet is the
    node that goes away (remove_node kills it and its worker processes, as a lost machine would; one
    host cannot lose a real node). 4 CPU devices, 2 per node, dp=4; the node goes during step 3."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        node = cluster.add_node(num_cpus=2)
        config = grpo_config(
            tmp_path,
            tiny_model_dir,
            resources=f"n_gpus_per_node: 2, nnodes: 2, ray_address: '{cluster.address}'",
            trainer="experiment_name: run, total_steps: 4, save_every: 2, keep_last: 5, loggers: [jsonl], "
            "val_before_train: false, restart_wait_s: 2, min_devices: 2",
        )
        (tmp_path / "reward.py").write_text(VARIED)
        run = tmp_path / "run"
        proc = start_train(config, log=tmp_path / "run.log")
        wait_for(lambda: any(r["step"] == 2 for r in metric_rows(run)), proc, poll=0.01)
        cluster.remove_node(node)
        rc = proc.wait(timeout=900)
        log = (tmp_path / "run.log").read_text()
        assert rc == 0, log[-3000:]
        failed = int(re.search(r"hybridflow train: restart 1/3 at step (\d+)", log).group(1))
        assert failed in (3, 4) and "restart 2/3" not in log and "Traceback" not in log
        assert "waiting for devices: the cluster has 2 of the 4 this run needs" in log
        assert "continuing on 2 devices instead of 4" in log and "actor dp=2" in log
        assert "resumed from step 2 (restart 1/3)" in log
        rows = metric_rows(run)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert [r["trainer/restarts"] for r in rows] == [0, 0, 1, 1]

        # the reference: the same step-2 checkpoint resumed by hand on 2 ranks gives the same numbers
        ref = start_train(
            config,
            "trainer.experiment_name=ref",
            f"trainer.resume={run}/checkpoints/step_2",
            "resources.nnodes=1",
            log=tmp_path / "ref.log",
        )
        assert ref.wait(timeout=900) == 0, (tmp_path / "ref.log").read_text()[-3000:]
        resumed = [comparable(r) for r in metric_rows(tmp_path / "ref")]
        assert [r["step"] for r in resumed] == [3, 4]
        assert [comparable(r) for r in rows[2:]] == resumed
        # the curve goes on, not a copy: two real updates of different sizes
        assert 0 < rows[2]["actor/grad_norm"] != rows[3]["actor/grad_norm"] > 0
    finally:
        cluster.shutdown()


def test_restart_waits_then_shrinks_to_what_the_cluster_has_or_stops(
    ray_cluster, tiny_model_dir, tmp_path, capsys
):
    """fit_devices against the session's real Ray cluster, for a run placed on 1024 devices it never had:
    progress while waiting, then the largest device count that fits and splits the mini-batch evenly."""
    from types import SimpleNamespace

    from hybridflow.trainers.elastic import DevicesLost, cluster_devices, fit_devices
    from hybridflow.trainers.placement import Placement

    path = grpo_config(tmp_path, tiny_model_dir, resources="n_gpus_per_node: 8, nnodes: 128")
    cfg = load_config(path, ["trainer.restart_wait_s=1.2"])
    trainer = SimpleNamespace(cfg=cfg, placement=Placement.from_config(cfg))
    have = cluster_devices(False)
    assert 2 <= have < 1024
    with pytest.raises(DevicesLost, match=f"the cluster has {have} of the 1024 devices this run was placed on, "
                       "after waiting trainer.restart_wait_s=1.2; .* set trainer.min_devices"):  # fmt: skip
        fit_devices(trainer)
    assert (
        f"waiting for devices: the cluster has {have} of the 1024 this run needs" in capsys.readouterr().err
    )

    trainer.cfg = load_config(path, ["trainer.restart_wait_s=0", "trainer.min_devices=2"])
    fit_devices(trainer)
    n = max(k for k in range(2, have + 1) if 8 % k == 0)  # 4 prompts x 2 samples over dp=k
    assert trainer.placement.num_devices == n and trainer.cfg.actor.parallel.dp == n
    assert f"continuing on {n} devices instead of 1024" in capsys.readouterr().err
    trainer.placement = Placement.from_config(cfg)
    trainer.cfg = load_config(path, ["trainer.restart_wait_s=0", f"trainer.min_devices={have + 1}"])
    with pytest.raises(DevicesLost, match=f"fewer than trainer.min_devices={have + 1}; add devices"):
        fit_devices(trainer)
    if have >= 9:  # 8 rows per mini-batch split evenly over no dp from `have` down to 9
        trainer.cfg = load_config(path, ["trainer.restart_wait_s=0", "trainer.min_devices=9"])
        with pytest.raises(DevicesLost, match=f"no device count from {have} down to trainer.min_devices=9 fits "
                           f"the config \\(on {have}: a mini-batch of 8 rows"):  # fmt: skip
            fit_devices(trainer)
