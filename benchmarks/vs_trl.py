"""End-to-end GRPO iteration speed, hybridflow vs TRL (`GRPOTrainer`, trl==1.16.0), same workload, one run.

Both sides load the same model directory (hybridflow.models.tiny.save_tiny_model: "small" ~0.8M and
"medium" ~25M params, char tokenizer with a chat template) and train on the same prompts
(synthetic:arithmetic, dataset order, no shuffling) with the same group size n, prompts per step,
response length, learning rate (constant, AdamW, no weight decay, grad clip 1.0), loss (clipped
ratio 0.2, token-mean over the batch, group-normalised advantages, KL loss beta with the k3 /
low_var_kl estimator, so both compute reference log-probs every step), one optimizer step per
iteration on one micro-batch, fp32 on CPU, the same cores and threads. hybridflow runs 1 worker
process (dp=1, actor + rollout + ref colocated) behind its Ray single controller.

Response lengths are forced equal, so both count the same tokens: TRL with
min_new_tokens = max_completion_length (EOS masked until the end), hybridflow with
eos_token_ids=() in the rollout (no stop token). Rewards: the arithmetic rule, first number in the
response (hybridflow.rewards.arithmetic, mode="first_number") on both sides.

Each (side, row) runs in its own subprocess (vs_trl_trl.py / vs_trl_hybridflow.py) under
`taskset -c --cores` with OMP_NUM_THREADS=--threads. Per-iteration wall time is the interval
between two step ends (median over the steps after --warmup); tokens/s = (prompt + response tokens of
the step) / that time; CPU s/iter = CPU seconds of the side's whole process tree per iteration
(steadier than wall time when the machine is shared), and the best iteration's speedup (the
least disturbed one). Each side keeps its own OpenMP wait (`--omp-wait passive`: both sleep at once;
see side_env). Neither side uses
activation checkpointing (TRL's GRPOConfig turns it on by default; the benchmark turns it off, as
hybridflow's default is off).

Learning alike (--learn-steps): a tiny model is SFT-warm-started once by hybridflow (as `make demo`
does), then both sides run GRPO from that same directory with the same settings, responses ending at
EOS, and the two reward curves are reported side by side.

Natural EOS (vs_trl_eos.py, issue 14): responses end at EOS at random lengths, TRL at its defaults
except activation checkpointing off, hybridflow through `hybridflow train`; the best synchronous
setting a user can choose by config, `trainer.rollout_ahead=1`, and the ideal overlap bound.

    .venv/bin/python benchmarks/vs_trl.py [--sizes small medium] [--lengths 32 128] [--ppo]
                                          [--natural-eos yes|no|only] [--eos-steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_limits import measure  # noqa: E402
from vs_trl_eos import headline_table, natural_rows, natural_table, summarize_eos, variants_table  # noqa: E402
from vs_trl_limits import REAL_SIZE, real_rows  # noqa: E402
from vs_trl_limits import report as limits_report  # noqa: E402

PHASES = ("generation", "ref", "old", "values", "reward", "update", "other")


def cpu_name() -> str:
    """The CPU's model name and whether it has AMX (ratios differ between CPUs: docs/bench/vs_trl.md)."""
    from hybridflow.models.cpu import this_cpu

    cpu = this_cpu()
    return f"{cpu.model or platform.machine()} ({'AMX' if 'amx_tile' in cpu.flags else 'no AMX'})"


def side_env(args) -> dict:
    """The environment both sides (and the warm start) run in."""
    env = dict(os.environ)
    # hybridflow's workers take their share of the cores (controller/process.py cpu_threads), as a user's
    # run does; a HYBRIDFLOW_CPU_THREADS left in the shell (the tests pin it to 1) would silently run them
    # on one thread against TRL's `--threads`.
    env.pop("HYBRIDFLOW_CPU_THREADS", None)
    # OpenMP's wait: "default" leaves each side its own, as its users run it (TRL: libgomp's ~300k-turn
    # spin; hybridflow: its workers' short spin, controller/resource_pool.py), so the shell's must go;
    # "passive" puts both to sleep at once, steadier on a shared machine, where spinning threads made the
    # same step vary 10x in wall and CPU time.
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(key, None)
    if args.omp_wait == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    env.update(
        OMP_NUM_THREADS=str(args.threads),
        MKL_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        RAY_AUTH_MODE="disabled",
        RAY_DEDUP_LOGS="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")])),
    )
    return env


def pinned(args, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", args.cores, *cmd] if args.cores and shutil.which("taskset") else cmd


def run_side(script: str, args, extra: list[str], log: Path) -> dict:
    """Run one side in a subprocess; returns its JSON result (stderr goes to `log`)."""
    env = side_env(args)
    cmd = pinned(args, [sys.executable, str(HERE / script), *extra])
    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{script} failed (exit {proc.returncode}); stderr tail:\n{tail}")
    return json.loads(lines[-1])


def sft_warm_start(args, workdir: Path) -> str:
    """The learning row's starting point, built once and loaded by both sides: a fresh tiny model after
    a short hybridflow SFT on "a+b=" answers (as in `make demo`): it answers with a number and gets
    most sums wrong, so GRPO has a reward signal to climb. Returns the exported HF directory."""
    from hybridflow.models.tiny import save_tiny_model

    base = save_tiny_model(workdir / "model_learn_base", args.learn_size)
    out = workdir / "model_learn"
    cli = [sys.executable, "-m", "hybridflow.cli"]
    train = [
        *cli, "train", str(HERE.parent / "examples" / "configs" / "sft_tiny.yaml"), f"model.path={base}",
        f"trainer.output_dir={workdir}", f"trainer.total_steps={args.learn_sft_steps}", "trainer.loggers=[]",
        "data.dataset_kwargs={num_samples: 0, val_size: 20, max_operand: 9}",
    ]  # fmt: skip
    export = [*cli, "export", str(workdir / "sft_tiny"), "--output", str(out)]
    with open(workdir / "learn_sft.log", "w") as log:
        for cmd in (train, export):
            proc = subprocess.run(pinned(args, cmd), stdout=log, stderr=log, env=side_env(args), check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"warm start failed: {' '.join(cmd)} (see {log.name})")
    return str(out)


def learning_curves(args, workdir: Path) -> dict[str, list[float]]:
    """Both sides' GRPO reward per iteration from the same warm start and settings; responses end at
    EOS here (fixed-length responses would train on the filler after the answer)."""
    model = sft_warm_start(args, workdir)
    extra = common_args(
        args, model, args.learn_length, args.learn_steps, workdir, args.learn_batch_size, args.learn_n
    ) + ["--stop-at-eos"]
    curves = {}
    for side in ("trl", "hybridflow"):
        print(f"[vs_trl] learning row: {side}, {args.learn_steps} steps ...", file=sys.stderr, flush=True)
        curves[side] = run_grpo_side(side, args, extra, workdir / f"{side}_learn.log")["rewards"]
    return curves


def summarize(result: dict, warmup: int) -> dict:
    """Medians over the measured steps (those after `warmup`)."""
    steps = result["steps"][warmup:] or result["steps"][-1:]
    out = {k: statistics.median(s[k] for s in steps) for k in (*PHASES, "iteration", "cpu")}
    out["best"] = min(s["iteration"] for s in steps)
    tokens = {s["tokens"] for s in steps}
    out["tokens"] = max(tokens)
    out["tokens_equal"] = len(tokens) == 1
    out["measured_steps"] = len(steps)
    return out


def common_args(
    args, model: str, length: int, steps: int, workdir: Path, batch_size: int = 0, n: int = 0
) -> list[str]:
    return [
        "--model", model, "--workdir", str(workdir), "--steps", str(steps),
        "--batch-size", str(batch_size or args.batch_size), "--n", str(n or args.n),
        "--response-length", str(length), "--lr", str(args.lr), "--kl-coef", str(args.kl_coef),
        "--seed", str(args.seed),
    ]  # fmt: skip


def run_grpo_side(side: str, args, extra: list[str], log: Path) -> dict:
    """One GRPO run of `side` ("trl" or "hybridflow") with the shared workload arguments `extra`."""
    if side == "trl":
        return run_side("vs_trl_trl.py", args, [*extra, "--threads", str(args.threads)], log)
    return run_side("vs_trl_hybridflow.py", args, extra, log)


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def throughput_table(rows: list[dict]) -> str:
    head = (
        "| model | Lr | seqs/iter | tokens/iter | TRL s/iter | hybridflow s/iter | TRL tok/s | "
        "hybridflow tok/s | **speedup (tok/s)** | speedup, best iteration | TRL CPU s/iter | "
        "hybridflow CPU s/iter | CPU ratio |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        t, h = r["trl"], r["hybridflow"]
        body += (
            f"| {r['size']} | {r['length']} | {r['seqs']} | {int(h['tokens'])} | {fmt(t['iteration'])} | "
            f"{fmt(h['iteration'])} | {fmt(t['tokens'] / t['iteration'], 0)} | "
            f"{fmt(h['tokens'] / h['iteration'], 0)} | **{fmt(t['iteration'] / h['iteration'])}x** | "
            f"{fmt(t['best'] / h['best'])}x | "
            f"{fmt(t['cpu'])} | {fmt(h['cpu'])} | {fmt(t['cpu'] / max(h['cpu'], 1e-9))}x |\n"
        )
    return head + body


def phase_table(rows: list[dict], sides=("trl", "hybridflow")) -> str:
    head = "| model | Lr | side | " + " | ".join(PHASES) + " | iteration |\n"
    head += "|---" * (len(PHASES) + 4) + "|\n"
    body = ""
    for r in rows:
        for side in sides:
            if side not in r:
                continue
            s = r[side]
            cells = " | ".join(fmt(s[p]) for p in PHASES)
            body += f"| {r['size']} | {r['length']} | {side} | {cells} | {fmt(s['iteration'])} |\n"
    return head + body


def curve_table(curves: dict[str, list[float]], tail: int, block: int = 5) -> str:
    """Mean reward per block of `block` iterations for each side, then first/last `tail` means (s.e.)."""
    names = list(curves)
    k = max(len(c) for c in curves.values())
    lines = ["| iterations | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for i in range(0, k, block):
        cells = [fmt(statistics.fmean(c[i : i + block]), 3) if i < len(c) else "" for c in curves.values()]
        lines.append(f"| {i + 1}-{min(i + block, k)} | " + " | ".join(cells) + " |")

    def mean_se(xs: list[float]) -> str:
        se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
        return f"{statistics.fmean(xs):.3f} +- {se:.3f}"

    summary = [
        f"{name}: mean reward, first {len(c[:tail])} iterations {mean_se(c[:tail])}, "
        f"last {len(c[-tail:])} {mean_se(c[-tail:])} (s.e.)"
        for name, c in curves.items()
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(summary) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["small", "medium"])
    p.add_argument("--lengths", nargs="+", type=int, default=[32, 128])
    p.add_argument("--steps", type=int, default=5, help="iterations per row (warm-up included)")
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the medians")
    p.add_argument(
        "--learn-steps", type=int, default=40, help="GRPO iterations of the learning row (0: skip)"
    )
    p.add_argument("--learn-size", default="tiny", help="model of the learning row")
    p.add_argument("--learn-sft-steps", type=int, default=40, help="SFT steps of its warm start")
    p.add_argument("--learn-batch-size", type=int, default=16, help="prompts per iteration, learning row")
    p.add_argument("--learn-n", type=int, default=8, help="responses per prompt, learning row")
    p.add_argument("--learn-length", type=int, default=6, help="max response tokens, learning row")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per iteration")
    p.add_argument("--n", type=int, default=4, help="responses per prompt (GRPO group size)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--kl-coef", type=float, default=0.01, help="KL loss beta (> 0: reference log-probs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cores", default="0,1", help="taskset CPU list for both sides ('' = no pinning)")
    p.add_argument(
        "--omp-wait",
        choices=("default", "passive"),
        default="default",
        help="OpenMP wait of both sides: each its own default (a quiet machine), or PASSIVE (a shared one)",
    )
    p.add_argument(
        "--ppo", action="store_true", help="also run hybridflow PPO on the small/32 and medium/32 rows"
    )
    p.add_argument(
        "--natural-eos",
        choices=("yes", "no", "only"),
        default="yes",
        help="the natural-EOS table through `hybridflow train` (vs_trl_eos.py); only = skip the other rows",
    )
    p.add_argument("--eos-sizes", nargs="+", default=["small", "medium"])
    p.add_argument("--eos-lengths", nargs="+", type=int, default=[32, 128], help="max response tokens")
    p.add_argument(
        "--eos-precision",
        nargs="+",
        choices=("bf16", "fp32"),
        default=["bf16", "fp32"],
        help="natural-EOS precisions: bf16 = TRL's default (bf16=True) with hybridflow model.dtype=bfloat16; "
        "fp32 = both sides fp32",
    )
    p.add_argument(
        "--eos-steps", type=int, default=5, help="iterations per natural-EOS run (warm-up included)"
    )
    p.add_argument(
        "--eos-settings",
        choices=("all", "default"),
        default="all",
        help="natural-EOS hybridflow runs: every setting, or only the synchronous default (dp=1)",
    )
    p.add_argument(
        "--real-row",
        choices=("yes", "no", "only"),
        default="yes",
        help="the realistic row: Qwen2.5-0.5B's shape through `hybridflow train` (vs_trl_limits.py); "
        "only = nothing else",
    )
    p.add_argument("--real-size", default=REAL_SIZE, help="model size of the realistic row (models/tiny.py)")
    p.add_argument("--real-precision", nargs="+", choices=("bf16", "fp32"), default=["bf16"])
    p.add_argument("--real-length", type=int, default=32, help="max response tokens, realistic row")
    p.add_argument("--real-steps", type=int, default=8, help="steps of the realistic row (warm-up included)")
    p.add_argument(
        "--real-warmup",
        type=int,
        default=4,
        help="realistic-row steps left out of its medians: its first steps page-fault their memory in "
        "(update 14.4, 9.4, 6.4, 5.8 s, then 5.1-5.3 s at Qwen2.5-0.5B's shape in bf16)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", default="", help="where models and logs go (default: a temp dir)")
    p.add_argument("--json", default="", help="also write all raw results here")
    args = p.parse_args(argv)

    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.trainers.perf import count_params

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vs_trl_"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows, curves, raw, eos_rows = [], {}, [], []
    if args.natural_eos == "only" or args.real_row == "only":
        args.sizes, args.learn_steps = [], 0
    if args.real_row == "only":
        args.natural_eos = "no"
    for i_size, size in enumerate(args.sizes):
        model = str(save_tiny_model(workdir / f"model_{size}", size))
        for i_len, length in enumerate(args.lengths):
            steps = args.steps
            row = {"size": size, "length": length, "seqs": args.batch_size * args.n}
            extra = common_args(args, model, length, steps, workdir)
            order = ["trl", "hybridflow"] if (i_size + i_len) % 2 == 0 else ["hybridflow", "trl"]
            for side in order:
                print(f"[vs_trl] {size}/{length}: {side}, {steps} steps ...", file=sys.stderr, flush=True)
                res = run_grpo_side(side, args, extra, workdir / f"{side}_{size}_{length}.log")
                raw.append({"size": size, "length": length, **res})
                row[side] = summarize(res, args.warmup)
            if args.ppo and length == 32:
                print(f"[vs_trl] {size}/{length}: hybridflow ppo ...", file=sys.stderr, flush=True)
                ppo_extra = common_args(args, model, length, args.steps, workdir) + ["--algorithm", "ppo"]
                res = run_side("vs_trl_hybridflow.py", args, ppo_extra, workdir / f"ppo_{size}_{length}.log")
                raw.append({"size": size, "length": length, **res})
                row["hybridflow_ppo"] = summarize(res, args.warmup)
            rows.append(row)
    if args.natural_eos != "no":
        eos_rows = natural_rows(args, workdir, run_grpo_side, common_args, summarize)
    real = []
    if args.real_row != "no":
        real = real_rows(args, workdir, run_grpo_side, common_args, summarize_eos, summarize)
    if args.learn_steps > 0:
        curves = learning_curves(args, workdir)
    limits = measure() if eos_rows or real else {}
    params = {size: count_params(workdir / f"model_{size}") for size in args.eos_sizes}

    print(report(args, rows, curves, time.time() - started, eos_rows, limits, real, params))
    if args.json:
        raw_out = {"rows": rows, "curves": curves, "raw": raw, "natural_eos": eos_rows, "real": real,
                   "limits": limits}  # fmt: skip
        Path(args.json).write_text(json.dumps(raw_out, indent=1))
    return 0


def gemm_library(threads: int) -> str:
    """What model.cpu_gemm=auto picks for a worker on `threads` threads here (models/cpu_gemm.py)."""
    import torch

    from hybridflow.models import cpu_gemm

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return "oneDNN" if cpu_gemm.resolve("auto", "cpu") else "MKL"
    finally:
        torch.set_num_threads(before)


def report(args, rows, curves, seconds, eos_rows=(), limits=None, real=(), params=None) -> str:
    try:
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    out = [
        f"## hybridflow vs TRL {_trl_version()}: GRPO iteration (fp32, CPU cores {args.cores or 'all'}, "
        f"{args.threads} threads)",
        "",
        f"{args.batch_size} prompts x n={args.n} per iteration, lr {args.lr}, KL beta {args.kl_coef}; medians "
        f"over {args.steps - args.warmup} iterations after {args.warmup} warm-up; "
        f"{cpu_name()}, {os.cpu_count()} CPUs, load average at the end {load}; OpenMP wait: "
        f"{'PASSIVE on both sides' if args.omp_wait == 'passive' else 'each side its own default'}; "
        f"hybridflow's fp32 GEMMs: {gemm_library(args.threads)} (model.cpu_gemm=auto), TRL's: PyTorch's own (MKL); "
        f"whole benchmark {seconds / 60:.1f} min.",
        "",
    ]
    if rows:
        out += [throughput_table(rows), "Phase split (median seconds per iteration):", "", phase_table(rows)]
    if eos_rows:
        out += [
            f"### Natural EOS: responses end at EOS at random lengths; hybridflow through `hybridflow train` "
            f"(tokens/s over {args.eos_steps - args.warmup} steps after {args.warmup} warm-up); bf16 rows: TRL "
            "at its default bf16=True, hybridflow model.dtype=bfloat16; fp32 rows: both sides fp32",
            "",
            "Headline: TRL at its defaults against hybridflow's fastest setting (either precision):",
            "",
            headline_table(eos_rows),
            "Per precision (bf16 = TRL's default; fp32 = both sides fp32):",
            "",
            natural_table(eos_rows),
            "Every run of the natural-EOS rows, phases in median seconds per step:",
            "",
            variants_table(eos_rows, PHASES),
        ]
    if limits:
        out += limits_report(limits, list(eos_rows), list(real), params or {})
    if any(not r[s]["tokens_equal"] for r in rows for s in ("trl", "hybridflow")):
        out.append("WARNING: token counts varied between iterations of a row.\n")
    if any(r["trl"]["tokens"] != r["hybridflow"]["tokens"] for r in rows):
        out.append("WARNING: the two sides counted different tokens per iteration.\n")
    ppo = [r for r in rows if "hybridflow_ppo" in r]
    if ppo:
        out += [
            "PPO (TRL 1.16 has no PPOTrainer): hybridflow PPO (actor + critic + ref, GAE) against "
            "hybridflow GRPO on the same rows:",
            "",
            phase_table(ppo, sides=("hybridflow", "hybridflow_ppo")),
        ]
    if curves:
        out += [
            f"Learning alike: GRPO from the same SFT warm start ({args.learn_size} model, "
            f"{args.learn_batch_size} prompts x n={args.learn_n}, responses up to {args.learn_length} tokens "
            f"ending at EOS, lr {args.lr}, KL beta {args.kl_coef}): mean reward per iteration",
            "",
            curve_table(curves, 10),
        ]
    return "\n".join(out)


def _trl_version() -> str:
    try:
        import trl

        return trl.__version__
    except ImportError:
        return "(not installed)"


if __name__ == "__main__":
    raise SystemExit(main())
