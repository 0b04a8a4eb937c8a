"""Row streams (rollout.cpu_streams, rollout/row_streams.py) through `hybridflow train`: the built-in
engine generating on 2 threads as 2 streams trains exactly as with the streams off on the same 2 threads
and as on 1 thread, step for step (responses, rewards, losses, gradient norms, greedy validation), and the
run logs that the streams ran.

The streams' claim is "same bits as 1 thread". Streams off on 2 threads (every op split by OpenMP) is the
setting a user compares against; on the tiny model's shapes it rounds as 1 thread does here, though 2
OpenMP threads need not on larger GEMMs (docs/bench/generation.md, "Row streams")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli import main as cli_main
from tests.trainers.lifecycle_helpers import comparable, grpo_config

# 8 prompts x n=2: the decode batch starts at 16 rows, 2 streams of 8; long enough for rows to finish
# at different steps (compaction moves rows between the streams' parts).
OVERRIDES = [
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8",
    "rollout.response_length=12",
    "trainer.total_steps=3",
    "trainer.seed=3",
]


@pytest.fixture
def config_file(tiny_model_dir, tmp_path):
    return grpo_config(
        tmp_path, tiny_model_dir, trainer="experiment_name: run, save_every: 0, loggers: [jsonl]"
    )


def _train(config: Path, name: str, *overrides: str) -> list[dict]:
    args = ["train", str(config), *OVERRIDES, f"trainer.experiment_name={name}", *overrides]
    assert cli_main(args) == 0
    run = config.parent / name
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_streams_train_exactly_as_streams_off_and_one_thread(ray_cluster, config_file):
    streams = _train(config_file, "streams", "rollout.cpu_threads=2", "rollout.cpu_streams=2")
    off = _train(config_file, "two_threads", "rollout.cpu_threads=2", "rollout.cpu_streams=1")
    one = _train(config_file, "one", "rollout.cpu_threads=1")
    assert [r["step"] for r in streams] == [0, 1, 2, 3]
    train = [r for r in streams if r["step"] > 0]
    assert all(r["rollout/cpu_streams"] == 2 for r in train), "the rollout ran as 2 row streams"
    assert all(r["rollout/cpu_streams"] == 1 for run in (off, one) for r in run if r["step"] > 0)
    # the run is not degenerate: sampled lengths vary, and the compared numbers move
    assert any(r["response_length/min"] < r["response_length/max"] for r in train)
    assert len({r["actor/pg_loss"] for r in train}) > 1
    for other in (off, one):
        for a, b in zip(streams, other, strict=True):
            a, b = comparable(a), comparable(b)
            a.pop("rollout/cpu_streams", None), b.pop("rollout/cpu_streams", None)
            assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
