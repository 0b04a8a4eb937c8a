"""verl's composed PPO configs, as docs/verl.md tells users to pass them: the file verl generates
(`_generated_ppo_trainer.yaml` of 0.5.0, 0.6.1, 0.7.0 and main; 0.4.1's ppo_trainer.yaml, which needs no
composing, without its comments), unchanged, with verl's PPO and GRPO quick-start command lines on top.
Every key maps; the ~200 keys with no effect here are one line and a file, not a line each."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.config.verl import VerlNotes
from tests.config.test_verl import GRPO_QUICKSTART, PPO_QUICKSTART, command

FIXTURES = sorted((Path(__file__).parent / "verl_fixtures").glob("*.yaml"))
# verl splits 1024 prompts into mini-batches of 80 with a short last one; here they are equal (docs/verl.md)
GRPO = command(GRPO_QUICKSTART, **{"data.train_batch_size": "960"})
# verl >= 0.6 requires the rollout engine (`name: ???`); its quick-start page names vllm
PPO = command(PPO_QUICKSTART, **{"actor_rollout_ref.rollout.name": "vllm"})


def test_the_fixtures_are_verls_composed_configs():
    assert [f.name.split("_")[0] for f in FIXTURES] == ["main", "v0.4.1", "v0.5.0", "v0.6.1", "v0.7.0"]
    for f in FIXTURES:
        text = f.read_text()
        assert "defaults:" not in text and len(text.splitlines()) > 300  # whole: nothing left to compose


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.name.split("_")[0])
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_composed_config_loads_with_one_summary_line(fixture, algorithm, tmp_path):
    printed = io.StringIO()
    notes = VerlNotes(stream=printed)
    cfg = load_config(fixture, PPO if algorithm == "ppo" else GRPO, check_model=False, notes=notes)
    assert cfg.algorithm.name == algorithm and cfg.rollout.engine == "vllm"
    assert cfg.trainer.keep_last == 0  # verl's max_actor_ckpt_to_keep: null keeps every checkpoint
    # $HOME in the command line and ~ in verl's own defaults (val_files here, as the command line sets
    # train_files only) are expanded as a shell would
    home = os.path.expanduser("~")
    assert cfg.data.train_files == [f"{home}/data/gsm8k/train.parquet"]
    assert cfg.model.path == ("Qwen/Qwen3-1.7B" if algorithm == "grpo" else "Qwen/Qwen2.5-0.5B-Instruct")
    # what changed something is said (a line each); the keys without effect are only counted
    lines = printed.getvalue().splitlines()
    assert len(lines) <= 3, lines
    assert all("has no effect" not in ln and "have no effect" not in ln for ln in lines)
    assert len(notes.ignored) >= 100
    summary = notes.write(tmp_path)
    listed = (tmp_path / "verl_ignored.txt").read_text().splitlines()
    assert summary == (
        f"verl: {len(listed)} keys have no effect here and are ignored "
        f"(each listed in {tmp_path / 'verl_ignored.txt'})"
    )
    assert listed == notes.ignored


def test_tilde_and_variables_in_paths_are_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATA", str(tmp_path))
    fixture = next(f for f in FIXTURES if f.name.startswith("v0.7.0"))
    cfg = load_config(fixture, [*GRPO, "data.val_files=${oc.env:HF_DATA}/x.parquet", "trainer.default_local_dir=~/ckpt"],
                      check_model=False, notes=lambda n: None)  # fmt: skip
    assert cfg.data.val_files == [f"{tmp_path}/x.parquet"]
    assert cfg.trainer.output_dir == os.path.expanduser("~/ckpt")
    # our own keys too, verl or not
    cfg = load_config(None, ["model.path=$HF_DATA/m", "data.train_files=[~/a.parquet, $HF_DATA/b.parquet]",
                             "trainer.output_dir=~/runs"], check_model=False, validate=False)  # fmt: skip
    assert cfg.model.path == f"{tmp_path}/m" and cfg.trainer.output_dir == os.path.expanduser("~/runs")
    assert cfg.data.train_files == [os.path.expanduser("~/a.parquet"), f"{tmp_path}/b.parquet"]
