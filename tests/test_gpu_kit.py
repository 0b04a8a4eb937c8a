"""The offline GPU kit (docs/bench/gpu.md) stays working on CPU: the Ray-free preflight of
scripts/gpu_smoke.sh, the Ray wheel trimmer and the smoke test's result bookkeeping."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import smoke_report  # noqa: E402
import trim_wheel  # noqa: E402


def test_preflight_on_cpu(tmp_path):
    """The preflight as gpu_smoke.sh runs it, on CPU: every stage passes, with the numbers it must give."""
    out = tmp_path / "preflight.json"
    cmd = [sys.executable, str(ROOT / "scripts/gpu_preflight.py"), "--device", "cpu", "--out", str(out),
           "--size", "tiny", "--prompts", "8", "--n", "4", "--response-length", "16"]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["pass"] and "PASS" in proc.stdout
    assert r["generate_bf16"]["response_tokens"] == 8 * 4 * 16  # no early stop: every token decoded
    # fp32: the rollout's log-probs and the training forward's are the same numbers up to summation order
    assert r["log_prob_gap_fp32"]["max"] < 1e-5
    assert r["log_prob_gap_fp32"]["tokens"] == 8 * 4 * 16
    # bf16: a real rounding gap (0 would mean one side did not compute in bf16), small
    assert 0 < r["log_prob_gap_bf16"]["mean"] < 0.02
    step = r["train_step_bf16"]
    assert step["compute_dtype"] == "torch.bfloat16" and step["param_dtype"] == "torch.float32"
    # Adam's first step moves each weight with a gradient by lr (m / sqrt(v) = sign(g)): lr = 1e-3
    assert abs(step["max_weight_change"] - 1e-3) < 1e-5
    assert step["surrogate_after"] < step["surrogate_before"]


def _fake_wheel(path: Path) -> Path:
    files = {
        "pkg/__init__.py": b"",
        "pkg/core/server": b"#!/bin/sh\necho serving\n",
        "pkg/jars/big.jar": b"x" * 1000,
        "pkg/serve/__init__.py": b"",
        "pkg/serve/scripts.py": b"def cli(): pass\n",
        "pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
        "pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "pkg-1.0.dist-info/entry_points.txt": b"[console_scripts]\npkgtool = pkg.cli:main\nserve = pkg.serve.scripts:cli\n",
    }
    whl = path / "pkg-1.0-py3-none-any.whl"
    record = [f"{n},{trim_wheel.record_hash(d)},{len(d)}" for n, d in files.items()]
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100755 if name == "pkg/core/server" else 0o100644) << 16
            z.writestr(info, data)
        z.writestr("pkg-1.0.dist-info/RECORD", "\n".join(record + ["pkg-1.0.dist-info/RECORD,,"]) + "\n")
    return whl


def test_trim_wheel_drops_folders_and_keeps_an_exact_record(tmp_path):
    whl = _fake_wheel(tmp_path)
    (tmp_path / "out").mkdir()
    out = trim_wheel.trim_wheel(whl, tmp_path / "out", ["pkg/jars", "pkg/serve"])
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert not any(n.startswith(("pkg/jars/", "pkg/serve/")) for n in names)
        record = [line.split(",") for line in z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()]
        listed = {name: (h, size) for name, h, size in record}
        assert set(listed) == names  # every file listed, nothing dropped still listed
        for name in names - {"pkg-1.0.dist-info/RECORD"}:
            data = z.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert listed[name] == (f"sha256={digest}", str(len(data))), name
        entry_points = z.read("pkg-1.0.dist-info/entry_points.txt").decode()
        assert "pkgtool = pkg.cli:main" in entry_points and "serve" not in entry_points
        assert (z.getinfo("pkg/core/server").external_attr >> 16) & 0o111
    # pip takes it, and the executable keeps its bit once installed
    target = tmp_path / "site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--target",
        str(target),
        str(out),
    ]
    subprocess.run(pip, check=True, timeout=120, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    assert (target / "pkg/core/server").stat().st_mode & stat.S_IXUSR
    assert not (target / "pkg/jars").exists()


def test_smoke_result_fails_on_a_failed_stage_not_on_a_skipped_one(tmp_path):
    stages = tmp_path / "stages"
    stages.mkdir()
    smoke_report.main(["stage", "install", str(stages / "1_install.json"), "1", "seconds=4"])
    smoke_report.main(["stage", "grpo_vllm", str(stages / "5_grpo_vllm.json"), "1", "skipped=no vllm"])
    (stages / "2_preflight.json").write_text(json.dumps({"pass": True, "wall_s": 3.5}))
    assert smoke_report.main(["collect", str(stages), str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["pass"] and r["stages"]["install"]["seconds"] == 4 and r["stages"]["preflight"]["wall_s"] == 3.5

    run = tmp_path / "run" / "grpo_tiny"
    run.mkdir(parents=True)
    rows = [{"timing_s/step": 1.0, "perf/throughput": t, "perf/memory/actor/max_memory_allocated_gb": m}
            for t, m in ((100.0, 0.5), (300.0, 0.7), (500.0, 0.6))]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 3 steps logged of the 4 asked: a failure, whatever the figures
    smoke_report.main(
        ["grpo", "grpo_1dev", str(run.parent), str(stages / "3_grpo_1dev.json"), "--rc", "0", "--steps", "4"]
    )
    g = json.loads((stages / "3_grpo_1dev.json").read_text())
    assert g["tokens_per_s_after_step1"] == 400.0 and g["peak_memory_allocated_gb"] == 0.7
    assert g["log_prob_diff_mean_by_step"] == "not logged by this version"
    assert not g["pass"]
    assert smoke_report.main(["collect", str(stages), str(tmp_path / "r.json")]) == 1
