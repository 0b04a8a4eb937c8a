"""The README's Python API example runs as written (read from README.md, so an edit there is tested), in a
directory laid out as `make demo` leaves it, as a script's `__main__`: its reward functions exist only there
and reach the reward worker process by value. One run, shared by the assertions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_python() -> str:
    """The ```python block under README.md's '## Python API'."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_example_is_short():
    lines = [line for line in readme_python().splitlines() if line.strip()]
    assert len(lines) <= 15, f"{len(lines)} lines"


@pytest.fixture(scope="module")
def example_run(ray_cluster, tiny_model_dir, tmp_path_factory):
    import os

    home = tmp_path_factory.mktemp("api_demo")
    (home / "runs" / "demo" / "models").mkdir(parents=True)
    (home / "runs" / "demo" / "models" / "sft").symlink_to(tiny_model_dir)
    cwd = os.getcwd()
    os.chdir(home)
    try:
        namespace = {"__name__": "__main__"}
        exec(compile(readme_python(), "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return home, namespace


def test_the_example_trains_with_both_rewards(example_run):
    home, ns = example_run
    steps = [h for h in ns["history"] if h["step"] > 0]  # step 0: the start's record
    assert [h["step"] for h in steps] == list(range(1, 11))
    for h in steps:
        # the score is the weighted sum; each function is logged (means of float32 scores of 8 x 8 samples)
        weighted = h["reward/exact/mean"] + 0.1 * h["reward/number/mean"]
        assert h["reward/mean"] == pytest.approx(weighted, abs=1e-6)
        assert 0 <= h["reward/number/mean"] <= 1 and 0 <= h["reward/exact/mean"] <= 1
        assert h["reward/num_errors"] == 0
    assert (home / ns["run"].run_dir / "report.png").is_file()


def test_the_run_dir_holds_the_rows_and_the_config(example_run):
    home, ns = example_run
    run_dir = home / ns["run"].run_dir
    (data_file,) = (run_dir / "data").glob("train-*.jsonl")
    first = json.loads(data_file.read_text().splitlines()[0])
    assert first["reward_model"]["ground_truth"] == first["extra_info"]["answer"]  # answer: the ground truth
    assert ns["run"].config.data.train_files == [str(data_file)]
    config = (run_dir / "config.yaml").read_text()
    assert "name: exact, weight: 1.0" in config and "name: number, weight: 0.1" in config
