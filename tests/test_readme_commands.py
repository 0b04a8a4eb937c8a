"""Every `hybridflow` command the README shows runs, as on a fresh clone after `make demo`: the "Using it"
block and the demo's own command lines, read from README.md itself (so an edit there is tested), each run
in a directory laid out as `make demo` leaves it (examples/ and runs/demo/models/...). Training commands
get a few overrides appended so they take seconds (fewer steps and problems); nothing else changes."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from hybridflow.cli import main

ROOT = Path(__file__).resolve().parents[1]
# appended to `train` commands only: the same configs, cut to seconds
FAST = [
    "trainer.total_steps=2",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "data.dataset_kwargs={num_samples: 16, val_size: 4, max_operand: 9}",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "trainer.loggers=[console, jsonl]",
]


def readme_commands() -> list[list[str]]:
    """argv of each `hybridflow ...` line in README.md's bash blocks and the demo's `$ hybridflow` lines."""
    text = (ROOT / "README.md").read_text()
    out = []
    for line in text.splitlines():
        m = re.match(r"^(?:\.venv/bin/hybridflow|\$ hybridflow)\s+(.*)$", line.strip())
        if m:
            out.append(shlex.split(m.group(1), comments=True))
    return out


def test_readme_lists_the_commands():
    cmds = readme_commands()
    names = [c[0] for c in cmds]
    assert {"train", "config", "plan", "report", "export", "--version"} <= set(names), names


@pytest.fixture
def demo_layout(tmp_path, tiny_model_dir, monkeypatch):
    """A working directory as `make demo` leaves it: examples/ and runs/demo/models/{tiny-llama,sft,grpo}."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    models = tmp_path / "runs" / "demo" / "models"
    models.mkdir(parents=True)
    for name in ("tiny-llama", "sft", "grpo"):  # a tiny model stands in for each (same tokenizer)
        (models / name).symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_readme_command_runs(ray_cluster, demo_layout, capsys):
    cmds = readme_commands()
    # the demo's lines write into runs/demo/models: let them write fresh directories there
    for name in ("sft", "grpo"):
        (demo_layout / "runs" / "demo" / "models" / name).unlink()
    # the demo's lines first (they make runs/demo/models/sft, which grpo_tiny.yaml starts from)
    cmds.sort(key=lambda c: 0 if "trainer.output_dir=runs/demo" in c or c[0] == "export" else 1)
    for argv in cmds:
        if argv[0] == "train":
            argv = [*argv, *FAST]
        if argv[0] == "--version":
            with pytest.raises(SystemExit) as e:
                main(argv)
            assert e.value.code == 0 and "hybridflow 0.1.0" in capsys.readouterr().out
            continue
        rc = main(argv)
        out = capsys.readouterr()
        assert rc == 0, f"`hybridflow {shlex.join(argv)}` exited {rc}: {out.err[-2000:]}"
        if argv[0] == "plan":  # its tables and explanations fit a 160-column terminal
            assert max(map(len, out.out.splitlines())) <= 160, shlex.join(argv)
    assert (demo_layout / "runs" / "grpo_tiny" / "report.png").is_file()
    assert (demo_layout / "runs" / "demo" / "models" / "grpo" / "config.json").is_file()
    assert os.path.isdir(demo_layout / "runs" / "demo" / "sft_tiny")
