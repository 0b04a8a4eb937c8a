"""Two sections of benchmarks/vs_trl.py beside the natural-EOS table (vs_trl_eos.py):

- the limit table: this machine's GEMM peak per dtype and copy bandwidth (machine_limits.py), and each
  phase of the natural-EOS rows' synchronous default run (dp=1) and of the realistic row against them;
- the realistic row: a model of Qwen2.5-0.5B's shape (494M parameters, vocabulary 151,936, tied
  embeddings; random weights built locally by hybridflow.models.tiny, size "qwen2.5-0.5b") through
  `hybridflow train` at the synchronous default, with per-phase seconds, achieved FLOP/s and peak memory.
  hybridflow only: at this size a TRL run of the same steps would double a benchmark that is already long.
"""

from __future__ import annotations

import sys
from pathlib import Path

from machine_limits import LIMITS_HEAD, limits_row, peaks_table, phase_rates
from vs_trl_eos import DEFAULT_SYNC

REAL_SIZE = "qwen2.5-0.5b"  # the realistic row's default size (vs_trl.py --real-size)
ITEMSIZE = {"bf16": 2, "fp32": 4}
REAL_PHASES = ("generation", "ref", "old", "reward", "update", "iteration")


def real_rows(args, workdir: Path, run_grpo_side, common_args, summarize_eos, summarize) -> list[dict]:
    """The realistic row at each of args.real_precision: GRPO, args.batch_size prompts x n, responses
    ending at EOS up to args.real_length tokens, hybridflow's synchronous default (1 worker, 2 threads)."""
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.trainers.perf import count_params

    model = str(save_tiny_model(workdir / "model_real", args.real_size, arch="qwen2"))
    rows = []
    for prec in args.real_precision:
        print(f"[vs_trl] realistic row {args.real_size} {prec} ...", file=sys.stderr, flush=True)
        base = common_args(args, model, args.real_length, args.real_steps, workdir)
        extra = [*base, "--stop-at-eos", "--precision", prec, "--cli", "--workers", "1"]
        res = run_grpo_side("hybridflow", args, extra, workdir / f"hf_real_{prec}.log")
        summary = summarize_eos(res, args.real_warmup, summarize)
        steps = res["steps"][args.real_warmup :] or res["steps"][-1:]
        summary["steps"] = steps
        rows.append({"size": args.real_size, "length": args.real_length, "precision": prec,
                     "params": count_params(model), "run": summary})  # fmt: skip
    return rows


def _memory(steps: list[dict]) -> str:
    """Peak host RSS of the worker and the driver (GiB), the max over the measured steps."""
    worker = max(s["perf"].get("perf/memory/actor_rollout/host_peak_rss_gb", 0.0) for s in steps)
    driver = max(s["perf"].get("perf/memory/driver/host_peak_rss_gb", 0.0) for s in steps)
    return f"{worker:.1f} / {driver:.1f}"


def real_table(rows: list[dict]) -> str:
    head = (
        "| model | params | precision | tok/s | " + " | ".join(f"{p} s" for p in REAL_PHASES)
        + " | update GFLOP/s | ref GFLOP/s | peak RSS GiB: worker / driver |\n" + "|---" * (len(REAL_PHASES) + 7) + "|\n"
    )  # fmt: skip
    body = ""
    for r in rows:
        s, rates = r["run"], phase_rates(r["run"]["steps"])
        cells = " | ".join(f"{s[p]:.2f}" for p in REAL_PHASES)
        flops = " | ".join(f"{rates[c] / 1e9:.0f}" if c in rates else "-" for c in ("update", "ref"))
        body += (
            f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['precision']} | {s['rate']:.0f} | {cells} | {flops} | "
            f"{_memory(s['steps'])} |\n"
        )
    return head + body


def limits_table(limits: dict, eos_rows: list[dict], real: list[dict], params: dict[str, int]) -> str:
    """Each synchronous-default run against this machine's limits: one worker on 2 threads, so the peak
    and the bandwidth at 2 threads; generation weights in the run's precision."""
    gemm, bandwidth = limits["gemm"][2], limits["bandwidth"][2]
    body = ""
    for r in eos_rows:
        run = r["sync"].get(DEFAULT_SYNC)
        if run is None or "steps" not in run:
            continue
        prec = r.get("precision", "fp32")
        label = f"{r['size']}/{r['length']} {prec}, {DEFAULT_SYNC}"
        body += limits_row(label, run["steps"], gemm[prec], params[r["size"]] * ITEMSIZE[prec], bandwidth)
    for r in real:
        prec = r["precision"]
        label = f"{r['size']}/{r['length']} {prec}, {DEFAULT_SYNC}"
        body += limits_row(label, r["run"]["steps"], gemm[prec], r["params"] * ITEMSIZE[prec], bandwidth)
    return LIMITS_HEAD + body


def report(limits: dict, eos_rows: list[dict], real: list[dict], params: dict[str, int]) -> list[str]:
    """The limit section's lines for vs_trl.py's report."""
    out = ["### This machine's limits (measured: square matmul n=1024, best of ~1 s; a 256 MiB copy)", "",
           peaks_table(limits)]  # fmt: skip
    if eos_rows or real:
        out += [
            "Each phase against them (achieved FLOP/s per worker: 6 N / 2 N per token over the phase's busy "
            "seconds, trainers/perf.py; the decode floor: longest response x weight bytes / bandwidth):",
            "",
            limits_table(limits, eos_rows, real, params),
        ]
    if real:
        out += [f"### A realistic row: {real[0]['size']} (random weights; qwen2.5-0.5b is Qwen2.5-0.5B's shape), "
                "`hybridflow train`, synchronous default", "", real_table(real)]  # fmt: skip
    return out
