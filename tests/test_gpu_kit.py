"""The offline GPU kit (docs/bench/gpu.md) stays working on CPU: the Ray-free preflight of
scripts/gpu_check.sh and its device proof, the check's CPU rehearsal, the Ray wheel trimmer and the
check's result bookkeeping."""

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

import gpu_preflight  # noqa: E402
import smoke_report  # noqa: E402
import torch  # noqa: E402
import trim_wheel  # noqa: E402

from hybridflow.models.tiny import build_tiny_model  # noqa: E402

CPU_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_preflight_on_cpu(tmp_path):
    """The preflight as gpu_check.sh runs it, on CPU: every stage passes, with the numbers it must give."""
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
    assert r["device_check"]["pass"] and r["device_check"]["device_types"] == ["cpu"]
    assert r["device_check"]["problems"] == []


def test_device_proof_accepts_a_gpu_computation_and_names_what_a_cpu_one_lacks():
    gpu = {"parameter w": torch.device("cuda", 0), "generation": torch.device("cuda", 0)}
    assert gpu_preflight.device_problems("cuda", gpu, peak_bytes=2**20) == []
    # on the GPU, but nothing allocated there: no proof either
    assert gpu_preflight.device_problems("cuda", gpu, peak_bytes=0) == [
        "torch.cuda.max_memory_allocated() is 0: nothing was computed on the GPU"
    ]
    cpu = {"parameter w": torch.device("cpu"), "generation": torch.device("cpu")}
    assert gpu_preflight.device_problems("cuda", cpu, 0)[:2] == [
        "parameter w on cpu, not cuda",
        "generation on cpu, not cuda",
    ]
    assert gpu_preflight.device_problems("cpu", cpu, 0) == []


def test_preflight_refuses_a_cuda_run_that_computed_on_the_cpu(monkeypatch, tmp_path):
    """The defect the check guards against: `--device cuda` on a machine with a GPU, the engine left on
    its CPU default (the preflight once built TrainEngine(model, cfg) with no device). Every numeric stage
    passes on the CPU, and the result carries the GPU's name; the device check must fail it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)  # nothing ever reached the GPU
    build = gpu_preflight.build_engine
    monkeypatch.setattr(gpu_preflight, "build_engine", lambda size, mp, *device: build(size, mp, "cpu"))
    args = gpu_preflight.parse_args(["--device", "cuda", "--out", str(tmp_path / "p.json"), "--size", "tiny",
                                     "--prompts", "4", "--n", "2", "--response-length", "8"])  # fmt: skip
    r = gpu_preflight.run(args)
    assert r["device"] == "NVIDIA H100 80GB HBM3"
    assert all(
        r[s]["pass"] for s in ("log_prob_gap_fp32", "generate_bf16", "log_prob_gap_bf16", "train_step_bf16")
    )
    check = r["device_check"]
    assert not check["pass"] and not r["pass"]
    assert check["device_types"] == ["cpu"] and check["max_memory_allocated_bytes"] == 0
    n_params = len(list(build_tiny_model("tiny", arch="qwen2").parameters()))
    assert check["problems"] == [
        f"{n_params} parameters on cpu, not cuda",
        "train engine on cpu, not cuda",
        "generation on cpu, not cuda",
        "torch.cuda.max_memory_allocated() is 0: nothing was computed on the GPU",
    ]


def test_rehearsal_of_the_gpu_check_refuses_its_cpu_stages(tmp_path):
    """scripts/gpu_check.sh --rehearse, Ray-free stages only (the `hybridflow train` stages are rehearsed
    in full by hand: docs/bench/gpu.md): each computes on the CPU and passes only because the GPU proof
    refuses it."""
    env = {
        **CPU_ENV,
        "CHECK_PY": sys.executable,
        "CHECK_DIR": str(tmp_path),
        "CHECK_ONLY": "preflight decode",
    }
    proc = subprocess.run([str(ROOT / "scripts/gpu_check.sh"), "--rehearse"], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert set(r["stages"]) == {"env", "install", "preflight", "decode"}
    for name in ("preflight", "decode"):
        check = r["stages"][name]["device_check"]
        assert check["pass"] and check["rehearsal"], (name, check)
        assert any("on cpu, not cuda" in p for p in check["problems"])
        assert any("max_memory_allocated() is 0" in p for p in check["problems"])
    decode = r["stages"]["decode"]
    assert decode["builtin"]["tokens"] == decode["hf"]["tokens"] == 2 * 8 * 16  # repeats x prompts x length
    table = (tmp_path / "result.md").read_text()
    assert "| decode | PASS | refused (model on cpu, not cuda) |" in table


def _run_dir(tmp_path: Path, name: str, device: str, rows: list[dict]) -> Path:
    """What `hybridflow train` leaves for smoke_report: metrics.jsonl, config.yaml, placement.json."""
    run = tmp_path / name / "exp"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(
        f"trainer:\n  device: ignored\nresources:\n  device: {device}\n  n_gpus_per_node: 1\n"
    )
    (run / "placement.json").write_text(json.dumps({"roles": {"actor_rollout": {"train": {"tp": 2}}}}))
    return run.parent


def _verdict(run: Path, out: Path, *extra: str) -> dict:
    smoke_report.main(["run", "r", str(run), str(out), "--rc", "0", "--steps", "2", *extra])
    return json.loads(out.read_text())


def test_a_run_passes_only_with_proof_of_the_gpu_and_rehearsing_only_without(tmp_path):
    step = {"timing_s/step": 1.0, "perf/throughput": 10.0, "perf/memory/actor_rollout/host_peak_rss_gb": 1.0}
    gpu = [{**step, "perf/memory/actor_rollout/max_memory_allocated_gb": 3.5, "sync/bytes": 8.0}] * 2
    gpu_run = _run_dir(tmp_path, "gpu", "cuda", gpu)
    cpu_run = _run_dir(tmp_path, "cpu", "cpu", [step, step])  # what a CPU run logs: no device memory
    assert _verdict(gpu_run, tmp_path / "a.json")["pass"]
    cpu = _verdict(cpu_run, tmp_path / "b.json")
    assert not cpu["pass"] and cpu["device_check"]["problems"] == [
        "actor_rollout: max_memory_allocated_gb absent or 0 (it computed on the CPU)",
        "config.yaml resources.device: cpu, not cuda",
    ]
    # a CPU run that says cuda in its config but logged no device memory is refused too
    claimed = _run_dir(tmp_path, "claimed", "cuda", [step, step])
    assert not _verdict(claimed, tmp_path / "c.json")["pass"]
    # the rehearsal inverts the proof: the CPU run passes because it is refused; a GPU record fails it
    assert _verdict(cpu_run, tmp_path / "d.json", "--rehearse")["pass"]
    assert not _verdict(gpu_run, tmp_path / "e.json", "--rehearse")["pass"]
    # a stage's own evidence: a metric above 0, a placement.json entry
    ok = _verdict(gpu_run, tmp_path / "f.json", "--require", "sync/bytes", "--placement",
                  "roles.actor_rollout.train.tp=2")  # fmt: skip
    assert ok["pass"] and ok["expectations"]["problems"] == []
    bad = _verdict(gpu_run, tmp_path / "g.json", "--require", "perf/actor_offload_bytes", "--placement",
                   "roles.actor_rollout.train.tp=4")  # fmt: skip
    assert not bad["pass"] and bad["expectations"]["problems"] == [
        "perf/actor_offload_bytes: absent or 0 in every step",
        "placement.json roles.actor_rollout.train.tp: 2, expected 4",
    ]
    # offload: bytes moved between host and device are 0 where both are one memory (a CPU run)
    moved = {**step, "perf/actor_offload_bytes": 0.0}
    cpu_offload = _run_dir(tmp_path, "cpu_offload", "cpu", [moved, moved])
    gpu_offload = _run_dir(
        tmp_path, "gpu_offload", "cuda", [{**g, "perf/actor_offload_bytes": 5e8} for g in gpu]
    )
    assert _verdict(gpu_offload, tmp_path / "h.json", "--moved", "perf/actor_offload_bytes")["pass"]
    rehearsed = _verdict(
        cpu_offload, tmp_path / "i.json", "--moved", "perf/actor_offload_bytes", "--rehearse"
    )
    assert (
        rehearsed["pass"]
        and "perf/actor_offload_bytes: 0 in every step" in rehearsed["device_check"]["problems"][1]
    )
    assert not _verdict(gpu_run, tmp_path / "j.json", "--moved", "perf/actor_offload_bytes")[
        "pass"
    ]  # not logged


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
    smoke_report.main(["stage", "vllm", str(stages / "5_vllm.json"), "1", "skipped=no vllm"])
    (stages / "2_preflight.json").write_text(json.dumps({"pass": True, "wall_s": 3.5}))
    assert smoke_report.main(["collect", str(stages), str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["pass"] and r["stages"]["install"]["seconds"] == 4 and r["stages"]["preflight"]["wall_s"] == 3.5

    rows = [{"timing_s/step": 1.0, "perf/throughput": t, "perf/memory/actor/max_memory_allocated_gb": m}
            for t, m in ((100.0, 0.5), (300.0, 0.7), (500.0, 0.6))]  # fmt: skip
    run = _run_dir(tmp_path, "run", "cuda", rows)
    smoke_report.main(["run", "grpo", str(run), str(stages / "3_grpo.json"), "--rc", "0", "--steps", "3"])
    assert json.loads((stages / "3_grpo.json").read_text())["pass"]
    # 3 steps logged of the 4 asked: a failure, whatever the figures
    smoke_report.main(["run", "grpo", str(run), str(stages / "3_grpo.json"), "--rc", "0", "--steps", "4"])
    g = json.loads((stages / "3_grpo.json").read_text())
    assert g["tokens_per_s_after_step1"] == 400.0 and g["peak_memory_allocated_gb"] == 0.7
    assert g["log_prob_diff_mean_by_step"] == "not logged by this version"
    assert not g["pass"] and g["device_check"]["problems"] == []
    assert smoke_report.main(["collect", str(stages), str(tmp_path / "r.json")]) == 1
