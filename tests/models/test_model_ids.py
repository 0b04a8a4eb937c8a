"""Model names: a local directory becomes absolute; a Hub id found in the local HF cache (HF_HUB_CACHE,
the layout huggingface_hub writes) becomes its snapshot directory, offline; one that is not cached is a
one-line error from the real CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hybridflow.models.resolve import resolve_model_path

ROOT = Path(__file__).resolve().parents[2]


def hub_cache(tmp_path: Path, model_dir: Path, repo_id: str) -> Path:
    """A cache holding `repo_id` at one commit, as `huggingface-cli download` leaves it."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return cache


def test_local_dir_becomes_absolute(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(Path(tiny_model_dir).parent)
    assert resolve_model_path(Path(tiny_model_dir).name) == str(tiny_model_dir)
    assert resolve_model_path("no/such/dir/") == "no/such/dir/"  # left for validation to name
    assert resolve_model_path("") == ""


def test_hub_id_from_the_local_cache(tiny_model_dir, tmp_path):
    cache = hub_cache(tmp_path, Path(tiny_model_dir), "tiny-org/tiny-llama")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "hybridflow.cli", "config", "show"]
    args = ["algorithm.name=grpo", "rollout.n=2", "data.dataset=synthetic:arithmetic", "data.max_prompt_length=16",
            "rollout.response_length=4"]  # fmt: skip
    done = subprocess.run(
        [*cli, *args, "model.path=tiny-org/tiny-llama"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots"
    assert f"path: {snapshot}/" in done.stdout  # the cached snapshot directory is what the workers load
    done = subprocess.run(
        [*cli, *args, "model.path=tiny-org/not-cached"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") <= 2 and "not in the local Hugging Face cache" in done.stderr
    assert "huggingface-cli download tiny-org/not-cached" in done.stderr
    # `hybridflow eval` takes the same names
    done = subprocess.run([sys.executable, "-m", "hybridflow.cli", "eval", "tiny-org/not-cached"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "not in the local Hugging Face cache" in done.stderr
