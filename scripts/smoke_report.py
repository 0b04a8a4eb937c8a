"""The GPU smoke test's bookkeeping (scripts/gpu_smoke.sh): one JSON per stage, then ONE result file.

    smoke_report.py stage NAME OUT.json 0|1 [key=value ...] [--merge F] a stage's pass/fail and figures
    smoke_report.py grpo NAME RUN_DIR OUT.json --rc RC --steps N ...   a `hybridflow train` run's figures
    smoke_report.py collect STAGES_DIR RESULT.json                     all stages -> RESULT.json + a table

Every stage gets `pass`; the result passes only if every stage that ran passed (a skipped stage, e.g.
vLLM not importable, says why and does not fail it). Standard library only: it runs before anything
is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path


def parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def read_metrics(run_dir: Path) -> list[dict]:
    rows = []
    for f in sorted(run_dir.glob("*/metrics.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [r for r in rows if "timing_s/step" in r]  # training steps (not validation-only rows)


def finite(xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def grpo_figures(rows: list[dict], memlog: Path | None) -> dict:
    """Per-run figures from metrics.jsonl (docs/metrics.md names) and the nvidia-smi samples."""
    tps = [r["perf/throughput"] for r in rows if "perf/throughput" in r]
    peak = [
        v for r in rows for k, v in r.items() if re.fullmatch(r"perf/memory/[^/]+/max_memory_allocated_gb", k)
    ]
    out = {
        "steps": len(rows),
        # step 1 pays for kernel compilation and allocator warm-up
        "tokens_per_s_after_step1": mean(tps[1:]) if len(tps) > 1 else (tps[0] if tps else None),
        "tokens_per_s_by_step": tps,
        "s_per_step_by_step": [r["timing_s/step"] for r in rows],
        "reward_mean_by_step": [r.get("reward/mean") for r in rows],
        "peak_memory_allocated_gb": max(peak) if peak else None,
        "host_peak_rss_gb": max(
            (
                v
                for r in rows
                for k, v in r.items()
                if k.startswith("perf/memory/") and k.endswith("host_peak_rss_gb")
            ),
            default=None,
        ),
    }
    # train-vs-rollout log-prob gap per step, where the trainer logs it
    for k in ("rollout/log_prob_diff_mean", "rollout/log_prob_diff_max"):
        vals = [r[k] for r in rows if k in r]
        out[k.split("/")[1] + "_by_step"] = vals if vals else "not logged by this version"
    if memlog is not None and memlog.is_file():
        mib = [int(x) for x in memlog.read_text().split() if x.strip().isdigit()]
        out["nvidia_smi_peak_mib"] = max(mib) if mib else None  # whole device, every process
    return out


def cmd_stage(args) -> int:
    fig = dict(kv.split("=", 1) for kv in args.kv)
    data = {"name": args.name, "pass": bool(int(args.passed)), **{k: parse_value(v) for k, v in fig.items()}}
    if args.merge and Path(args.merge).is_file():  # figures another step wrote as JSON
        data.update(json.loads(Path(args.merge).read_text()))
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


def cmd_grpo(args) -> int:
    run_dir = Path(args.run_dir)
    rows = read_metrics(run_dir)
    fig = grpo_figures(rows, Path(args.memlog) if args.memlog else None)
    ok = args.rc == 0 and fig["steps"] == args.steps and finite(fig["tokens_per_s_by_step"])
    data = {"name": args.name, "pass": ok, "exit_code": args.rc, "seconds": args.seconds,
            "engine": args.engine, "devices": args.devices, **fig}  # fmt: skip
    log = run_dir / "train.log"
    if not ok and log.is_file():
        data["log_tail"] = log.read_text(errors="replace").splitlines()[-25:]
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    gap = fig["log_prob_diff_mean_by_step"]
    gap_s = f"{gap[-1]:.2e}" if isinstance(gap, list) and gap else "not logged"
    tps = fig["tokens_per_s_after_step1"]
    mem = fig["peak_memory_allocated_gb"]
    mem_s = (
        f"peak memory {mem:.3f} GB (allocated, max over roles)"
        if mem is not None
        else (
            f"host peak RSS {fig['host_peak_rss_gb']:.2f} GB (max over roles)"
            if fig["host_peak_rss_gb"]
            else "no memory figure"
        )
    )
    print(f"{args.name}: {'PASS' if ok else 'FAIL'} | steps {fig['steps']}/{args.steps} | tokens/s "
          f"{tps if tps is None else round(tps)} | {mem_s} | nvidia-smi {fig.get('nvidia_smi_peak_mib', 'n/a')} MiB | "
          f"rollout/log_prob_diff_mean {gap_s} | {args.seconds} s")  # fmt: skip
    if not ok:
        print("\n".join(data.get("log_tail", [f"(no {log})"])))
    return 0


def cmd_collect(args) -> int:
    stages = []
    for f in sorted(Path(args.stages_dir).glob("*.json")):  # files NN_name.json, in stage order
        s = json.loads(f.read_text())
        s.setdefault("name", f.stem.split("_", 1)[-1])
        stages.append(s)
    ran = [s for s in stages if not s.get("skipped")]
    result = {
        "pass": bool(ran) and all(s["pass"] for s in ran),
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "stages": {s["name"]: s for s in stages},
    }
    Path(args.result).write_text(json.dumps(result, indent=1) + "\n")
    print("stage            result")
    for s in stages:
        verdict = f"skipped ({s['skipped']})" if s.get("skipped") else ("PASS" if s["pass"] else "FAIL")
        print(f"  {s['name']:<14} {verdict}")
    print(f"gpu_smoke: {'PASS' if result['pass'] else 'FAIL'}; every figure in {args.result}")
    return 0 if result["pass"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="GPU smoke test bookkeeping")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("name")
    s.add_argument("out")
    s.add_argument("passed", help="1 = pass, 0 = fail")
    s.add_argument("kv", nargs="*", help="key=value figures")
    s.add_argument("--merge", default="", help="a JSON file of more figures")
    g = sub.add_parser("grpo")
    g.add_argument("name")
    g.add_argument("run_dir")
    g.add_argument("out")
    g.add_argument("--rc", type=int, required=True)
    g.add_argument("--steps", type=int, required=True)
    g.add_argument("--seconds", type=int, default=0)
    g.add_argument("--engine", default="builtin")
    g.add_argument("--devices", type=int, default=1)
    g.add_argument("--memlog", default="")
    c = sub.add_parser("collect")
    c.add_argument("stages_dir")
    c.add_argument("result")
    args = p.parse_args(argv)
    return {"stage": cmd_stage, "grpo": cmd_grpo, "collect": cmd_collect}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
