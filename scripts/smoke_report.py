"""The GPU check's bookkeeping (scripts/gpu_check.sh): one JSON per stage, then ONE result file.

    smoke_report.py stage NAME OUT.json 0|1 [key=value ...] [--merge F] a stage's pass/fail and figures
    smoke_report.py run NAME RUN_DIR OUT.json --rc RC --steps N ...    a `hybridflow train` run's figures
    smoke_report.py collect STAGES_DIR RESULT.json [--table MD]        all stages -> RESULT.json + a table

Every stage gets `pass`; the result passes only if every stage that ran passed (a skipped stage, e.g.
vLLM not importable, says why and does not fail it). A run passes only with proof that it computed on
the GPU (run_device_problems): every role's perf/memory/<role>/max_memory_allocated_gb above 0 (the
workers report it only from a CUDA device) and resources.device cuda in its config.yaml. --rehearse
(the CPU rehearsal) inverts that part: the run must succeed and the proof must be refused.
Standard library only: it runs before anything is installed.
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


def config_device(run_dir: Path) -> str | None:
    """resources.device in the run's config.yaml (as `hybridflow train` writes it), without a YAML parser."""
    for f in sorted(run_dir.glob("*/config.yaml")):
        section = ""
        for line in f.read_text().splitlines():
            if line and not line[0].isspace():
                section = line.split(":")[0]
            elif section == "resources" and re.fullmatch(r"  device: *(\S+) *", line):
                return line.split(":", 1)[1].strip()
    return None


def run_device_problems(rows: list[dict], run_dir: Path, moved: list[str] = ()) -> list[str]:
    """Why a run's record is no proof that it computed on a GPU ([] = proof). `moved`: metrics of bytes
    moved between host and device (perf/actor_offload_bytes), 0 where the two are one memory."""
    roles = sorted({k.split("/")[2] for r in rows for k in r if k.startswith("perf/memory/")} - {"driver"})
    problems = [] if roles else ["no perf/memory/<role> figures in metrics.jsonl"]
    for role in roles:
        peak = [r.get(f"perf/memory/{role}/max_memory_allocated_gb", 0.0) for r in rows]
        if not max(peak, default=0.0) > 0:
            problems.append(f"{role}: max_memory_allocated_gb absent or 0 (it computed on the CPU)")
    for key in moved:
        if not max((r.get(key, 0.0) for r in rows), default=0.0) > 0:
            problems.append(f"{key}: 0 in every step (nothing moved between host and device)")
    device = config_device(run_dir)
    if device != "cuda":
        problems.append(f"config.yaml resources.device: {device}, not cuda")
    return problems


def lookup(data, dotted: str):
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def expectation_problems(
    rows: list[dict], run_dir: Path, require: list[str], placement: list[str], logged: list[str]
) -> list[str]:
    """The stage's own evidence: metrics that must be above 0 in some step (e.g. sync/bytes of a weight
    sync), metrics that must be logged (`logged`), placement.json entries (KEY=VALUE, dotted)."""
    problems = [f"{key}: not logged" for key in logged if not any(key in r for r in rows)]
    for key in require:
        if not max((r.get(key, 0.0) for r in rows), default=0.0) > 0:
            problems.append(f"{key}: absent or 0 in every step")
    files = sorted(run_dir.glob("*/placement.json"))
    record = json.loads(files[0].read_text()) if files else {}
    for item in placement:
        key, want = item.split("=", 1)
        got = lookup(record, key)
        if str(got) != want:
            problems.append(f"placement.json {key}: {got}, expected {want}")
    return problems


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


def cmd_run(args) -> int:
    run_dir = Path(args.run_dir)
    rows = read_metrics(run_dir)
    fig = grpo_figures(rows, Path(args.memlog) if args.memlog else None)
    ran = args.rc == 0 and fig["steps"] == args.steps and finite(fig["tokens_per_s_by_step"])
    expected = expectation_problems(rows, run_dir, args.require, args.placement, args.moved)
    device = run_device_problems(rows, run_dir, args.moved)
    # rehearsing on CPU, the GPU proof must be refused: the check would reject a CPU run
    ok = ran and not expected and (bool(device) if args.rehearse else not device)
    data = {"name": args.name, "pass": ok, "exit_code": args.rc, "seconds": args.seconds,
            "engine": args.engine, "devices": args.devices, "overrides": args.overrides,
            "expectations": {"checked": args.require + args.placement + args.moved, "problems": expected},
            "device_check": {"rehearsal": args.rehearse, "problems": device}, **fig}  # fmt: skip
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
    proof = ("refused, as it must be: " if args.rehearse else "NOT ON THE GPU: ") + "; ".join(device)
    print(f"{args.name}: {'PASS' if ok else 'FAIL'} | steps {fig['steps']}/{args.steps} | tokens/s "
          f"{tps if tps is None else round(tps)} | {mem_s} | nvidia-smi {fig.get('nvidia_smi_peak_mib', 'n/a')} MiB | "
          f"rollout/log_prob_diff_mean {gap_s} | {args.seconds} s")  # fmt: skip
    for line in ([f"  GPU proof {proof}"] if device else []) + [f"  expected: {p}" for p in expected]:
        print(line)
    if not ok:
        print("\n".join(data.get("log_tail", [f"(no {log})"])))
    return 0


# figures the table shows, where a stage has them: (label, dotted key in the stage's JSON, format)
TABLE_FIGURES = (
    ("s", "seconds", "{:.0f}"),
    ("s", "wall_s", "{:.0f}"),
    ("tokens/s", "tokens_per_s_after_step1", "{:,.0f}"),
    ("gen tokens/s bf16", "generate_bf16.tokens_per_s", "{:,.0f}"),
    ("built-in tokens/s", "builtin.tokens_per_s", "{:,.0f}"),
    ("transformers tokens/s", "hf.tokens_per_s", "{:,.0f}"),
    ("built-in / transformers", "ratio", "{:.2f}x"),
    ("peak GiB", "peak_memory_allocated_gb", "{:.2f}"),
    ("peak GiB", "peak_memory.device_max_allocated_gb", "{:.2f}"),
    ("measured GiB", "measured_gib", "{:.2f}"),
    ("planned GiB", "predicted_gib", "{:.2f}"),
    ("measured / planned", "measured_over_predicted", "{:.2f}"),
    ("bf16 log-prob gap", "log_prob_gap_bf16.mean", "{:.1e}"),
)


def lookup_any(stage: dict, dotted: str):
    value = lookup(stage, dotted)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def device_cell(stage: dict) -> str:
    """What the stage says about where it computed: the proof's verdict (rehearsal: the refusal)."""
    check = stage.get("device_check")
    if not isinstance(check, dict):
        return ""
    problems = check.get("problems") or []
    if check.get("rehearsal") or check.get("rehearse"):
        return f"refused ({problems[0]})" if problems else "NOT refused"
    return f"NOT ON THE GPU ({problems[0]})" if problems else "on the GPU"


def table(result: dict) -> str:
    """The markdown table of docs/bench/gpu.md: a row per stage."""
    lines = ["| stage | result | where it computed | figures |", "|---|---|---|---|"]
    for name, s in result["stages"].items():
        verdict = f"skipped ({s['skipped']})" if s.get("skipped") else ("PASS" if s["pass"] else "**FAIL**")
        figs = []
        for label, key, fmt in TABLE_FIGURES:
            value = lookup_any(s, key)
            if value is not None and label not in (f.split(" ", 1)[1] for f in figs):
                figs.append(f"{fmt.format(value)} {label}")
        lines.append(f"| {name} | {verdict} | {device_cell(s)} | {', '.join(figs)} |")
    return "\n".join(lines) + "\n"


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
    text = table(result)
    if args.table:
        Path(args.table).write_text(text)
    print(text, end="")
    print(f"gpu_check: {'PASS' if result['pass'] else 'FAIL'}; every figure in {args.result}")
    return 0 if result["pass"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="GPU check bookkeeping")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("name")
    s.add_argument("out")
    s.add_argument("passed", help="1 = pass, 0 = fail")
    s.add_argument("kv", nargs="*", help="key=value figures")
    s.add_argument("--merge", default="", help="a JSON file of more figures")
    g = sub.add_parser("run")
    g.add_argument("name")
    g.add_argument("run_dir")
    g.add_argument("out")
    g.add_argument("--rc", type=int, required=True)
    g.add_argument("--steps", type=int, required=True)
    g.add_argument("--seconds", type=int, default=0)
    g.add_argument("--engine", default="builtin")
    g.add_argument("--devices", type=int, default=1)
    g.add_argument("--memlog", default="")
    g.add_argument("--overrides", default="", help="what the stage set, for the record")
    g.add_argument("--require", action="append", default=[], help="a metric above 0 in some step")
    g.add_argument("--placement", action="append", default=[], help="KEY=VALUE of placement.json (dotted)")
    g.add_argument(
        "--moved", action="append", default=[], help="bytes moved host<->device: logged; > 0 on a GPU"
    )
    g.add_argument("--rehearse", action="store_true", help="CPU rehearsal: the GPU proof must be refused")
    c = sub.add_parser("collect")
    c.add_argument("stages_dir")
    c.add_argument("result")
    c.add_argument("--table", default="", help="also write the markdown table here")
    args = p.parse_args(argv)
    return {"stage": cmd_stage, "run": cmd_run, "collect": cmd_collect}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
