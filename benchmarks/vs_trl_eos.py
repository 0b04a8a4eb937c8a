"""The natural-EOS table of benchmarks/vs_trl.py (issue 14): responses end at EOS at random lengths.

No forced lengths on either side: TRL's GRPOTrainer at its defaults except activation checkpointing off
(and the shared workload: batch, group size, lengths, learning rate, KL beta); hybridflow through
`hybridflow train` in a subprocess, as users run it, its per-step figures read from metrics.jsonl.

Precision (--eos-precision): TRL's GRPOConfig defaults to bf16=True (autocast; its generation stays in
the fp32 weights), so its defaults are the "bf16" rows, where hybridflow runs model.dtype=bfloat16 (the
actor in FSDP2 mixed precision over fp32 master weights, generation and the reference in bf16). The
"fp32" rows run both sides in fp32 (TRL bf16=False, hybridflow model.dtype=float32).

Per row (model x response length) hybridflow runs each synchronous setting of `SYNC_VARIANTS` (what a
user can choose by config on this machine) and the best one is reported with its name; then the
one-step-ahead schedule (`trainer.rollout_ahead=1`: rollout on its own pool, one step off-policy) when
this build has the setting, else the row says "n/a (rollout_ahead not built)"; it runs the frozen models
(here the reference of the KL term) where the build's default puts them (resources.frozen_pool=rollout:
on the rollout pool, scoring batch k+1 while the actor trains on batch k), a second one-step-ahead
run keeps them in the training pool (`AHEAD_TRAINING`) and a third splits the reference's rows between
the pools (`AHEAD_BOTH`, resources.frozen_pool=both); the headline shows the fastest of the three, named.
TRL runs twice per row, before and after hybridflow's runs, and its rate is the two runs' pooled (the
machine's speed drifts by up to ~25% over minutes; each run's rate is listed).

Tokens/s = (prompt + response tokens of the step) / the step's wall time, median over the steps after
the warm-up; the two sides sample different lengths (separate RNG streams), which the rate absorbs.
The ideal bound is what perfect overlap of generation with the rest of the step would give, from the
best synchronous run's own phases: tokens / max(generation, rest) against tokens / (generation + rest).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

# name -> (worker processes, extra overrides): the synchronous settings tried on each row
# (model.remove_padding is on by default for these llama models: the padded forward is the setting's
# other value, kept as a row so one run shows what removing padding gains)
SYNC_VARIANTS = {
    "dp=1 (1 worker, 2 threads)": (1, []),
    "dp=1, padded (model.remove_padding=false)": (1, ["model.remove_padding=false"]),
    "dp=2 (2 workers, 1 thread each)": (2, []),
}
DEFAULT_SYNC = "dp=1 (1 worker, 2 threads)"  # the synchronous default: one worker, padding removed
AHEAD = ("rollout_ahead=1 (rollout pool 1 | actor pool 1)", 2, ["trainer.rollout_ahead=1"])
AHEAD_TRAINING = (
    "rollout_ahead=1, ref in the training pool (resources.frozen_pool=training)",
    2,
    ["trainer.rollout_ahead=1", "resources.frozen_pool=training"],
)
AHEAD_BOTH = (
    "rollout_ahead=1, ref rows split between the pools (resources.frozen_pool=both)",
    2,
    ["trainer.rollout_ahead=1", "resources.frozen_pool=both"],
)
AHEAD_KEYS = {"ahead": AHEAD[0], "ahead_training": AHEAD_TRAINING[0], "ahead_both": AHEAD_BOTH[0]}
# the headline table's name of each (no "|": it is a table cell)
AHEAD_SHORT = {"ahead": "frozen_pool default (rollout)", "ahead_training": "frozen_pool=training",
               "ahead_both": "frozen_pool=both"}  # fmt: skip


def ahead_built() -> bool:
    """Whether this build's config has trainer.rollout_ahead (issue 14 item 2)."""
    from hybridflow.config.schema import TrainerConfig

    return any(f.name == "rollout_ahead" for f in dataclasses.fields(TrainerConfig))


def frozen_pool_built() -> bool:
    """Whether this build can place the frozen models on the rollout pool (resources.frozen_pool)."""
    from hybridflow.config.schema import ResourcesConfig

    return any(f.name == "frozen_pool" for f in dataclasses.fields(ResourcesConfig))


def frozen_pool_both_built() -> bool:
    """Whether resources.frozen_pool takes `both` (the reference's rows split between the pools)."""
    from hybridflow.config.schema import ResourcesConfig

    field = next((f for f in dataclasses.fields(ResourcesConfig) if f.name == "frozen_pool"), None)
    return field is not None and "both" in (field.metadata.get("choices") or ())


def natural_rows(args, workdir: Path, run_grpo_side, common_args, summarize) -> list[dict]:
    from hybridflow.models.tiny import save_tiny_model

    rows = []
    models = {size: str(save_tiny_model(workdir / f"model_{size}", size)) for size in args.eos_sizes}
    cells = [
        (size, length, prec)
        for prec in args.eos_precision
        for size in args.eos_sizes
        for length in args.eos_lengths
    ]
    for size, length, prec in cells:
        base = common_args(args, models[size], length, args.eos_steps, workdir) + [
            "--stop-at-eos",
            "--precision",
            prec,
        ]
        row = {
            "size": size,
            "length": length,
            "precision": prec,
            "seqs": args.batch_size * args.n,
            "sync": {},
        }
        tag = f"eos_{size}_{length}_{prec}"
        cell = f"{size}/{length} {prec}"
        print(f"[vs_trl] natural EOS {cell}: trl ...", file=sys.stderr, flush=True)
        trl_runs = [run_grpo_side("trl", args, base, workdir / f"trl_{tag}.log")]
        runs = [
            (name, workers, sets, f"{i}") for i, (name, (workers, sets)) in enumerate(SYNC_VARIANTS.items())
        ]
        if args.eos_settings == "default":  # TRL and the synchronous default only (repeats of the short rows)
            runs = runs[:1]
        else:
            runs += [(*AHEAD, "ahead")] if ahead_built() else []
            runs += [(*AHEAD_TRAINING, "ahead_training")] if frozen_pool_built() else []
            runs += [(*AHEAD_BOTH, "ahead_both")] if frozen_pool_both_built() else []
        for name, workers, sets, suffix in runs:
            print(
                f"[vs_trl] natural EOS {cell}: hybridflow {name} ...",
                file=sys.stderr,
                flush=True,
            )
            extra = [*base, "--cli", "--workers", str(workers), *(f"--set={s}" for s in sets)]
            res = run_grpo_side("hybridflow", args, extra, workdir / f"hf_{tag}_{suffix}.log")
            summary = summarize_eos(res, args.warmup, summarize)
            if suffix.startswith("ahead"):
                row[suffix] = summary
            else:
                row["sync"][name] = summary
        # TRL again after hybridflow's runs: the machine's speed drifts by up to ~25% over minutes, and
        # its runs before and after, pooled, bracket hybridflow's (each run's rate is listed too)
        print(f"[vs_trl] natural EOS {cell}: trl again ...", file=sys.stderr, flush=True)
        trl_runs.append(run_grpo_side("trl", args, base, workdir / f"trl_{tag}_after.log"))
        row["trl_runs"] = [summarize_eos(r, args.warmup, summarize) for r in trl_runs]
        row["trl"] = summarize_eos(
            {**trl_runs[0], "steps": pooled_steps(trl_runs, args.warmup)}, 0, summarize
        )
        rows.append(row)
        # partial results survive an interrupted run (the machine may be shared and slow)
        (workdir / "natural_eos_rows.json").write_text(json.dumps(rows, indent=1))
        print(natural_table(rows), file=sys.stderr, flush=True)
    return rows


def _rate(s: dict) -> float:
    return s["rate"]


def _precision(row: dict) -> str:
    """The row's precision cell: bf16 is TRL's default (bf16=True), fp32 sets both sides to fp32."""
    prec = row.get("precision", "fp32")  # rows saved before the precision column were fp32
    return "bf16 (TRL default)" if prec == "bf16" else prec


def pooled_steps(runs: list[dict], warmup: int) -> list[dict]:
    """The measured steps (after `warmup`) of several runs of one side, as one run's."""
    return [step for r in runs for step in (r["steps"][warmup:] or r["steps"][-1:])]


def best_ahead(row: dict) -> tuple[str, dict] | None:
    """The fastest one-step-ahead setting of a row, by its short name (None: this build has none)."""
    runs = [(AHEAD_SHORT[key], row[key]) for key in AHEAD_KEYS if key in row]
    return max(runs, key=lambda kv: _rate(kv[1])) if runs else None


def best_sync(row: dict) -> tuple[str, dict]:
    return max(row["sync"].items(), key=lambda kv: _rate(kv[1]))


def headline_table(rows: list[dict]) -> str:
    """One line per (model, length): TRL at its defaults (the bf16 row's TRL runs, pooled) against
    hybridflow's fastest run of that cell at either precision, named (model.dtype is a setting a user
    chooses by config: the smallest models run faster in fp32, whose ops are too small for bf16 to pay)."""
    head = (
        "| model | Lr (max) | TRL tok/s (defaults: bf16) | hybridflow best tok/s | **best / TRL** | "
        "hybridflow's best setting |\n" + "|---" * 6 + "|\n"
    )
    body = ""
    cells = dict.fromkeys((r["size"], r["length"]) for r in rows)
    for size, length in cells:
        mine = [r for r in rows if (r["size"], r["length"]) == (size, length)]
        trl = next((r["trl"] for r in mine if r.get("precision") == "bf16"), None)
        if trl is None:
            continue  # no row at TRL's defaults for this cell
        runs = []
        for r in mine:
            dtype = "model.dtype=bfloat16" if r.get("precision") == "bf16" else "model.dtype=float32"
            runs += [(f"{dtype}, {name}", v) for name, v in r["sync"].items()]
            runs += [(f"{dtype}, rollout_ahead=1, {AHEAD_SHORT[k]}", r[k]) for k in AHEAD_KEYS if k in r]
        name, best = max(runs, key=lambda kv: _rate(kv[1]))
        body += (
            f"| {size} | {length} | {_rate(trl):.0f} | {_rate(best):.0f} | **{_rate(best) / _rate(trl):.2f}x** | "
            f"{name} |\n"
        )
    return head + body


def ideal_bound(s: dict) -> tuple[float, float, float]:
    """(generation s, rest s, ideal tokens/s) of a synchronous run: the step if generation overlapped
    the rest perfectly takes max(generation, rest) instead of their sum."""
    gen = s["generation"]
    rest = max(s["iteration"] - gen, 0.0)
    return gen, rest, s["rate"] * s["iteration"] / max(gen, rest, 1e-9)


def natural_table(rows: list[dict]) -> str:
    head = (
        "| model | Lr (max) | precision | resp. tokens TRL / hf | TRL tok/s | sync default tok/s (/ TRL) | "
        "hybridflow sync tok/s | **sync / TRL** | "
        "best sync setting | rollout_ahead=1 tok/s | **ahead / TRL** | best ahead setting | gen s / rest s (sync) | "
        "ideal overlap tok/s (/ TRL) | CPU tokens/s: TRL, hybridflow sync (ratio) | TRL runs tok/s |\n"
        + "|---" * 16
        + "|\n"
    )
    body = ""
    for r in rows:
        trl = r["trl"]
        name, hf = best_sync(r)
        gen, rest, ideal = ideal_bound(hf)
        best = best_ahead(r)
        if best is not None:
            ahead_name, a = best
            ahead, ahead_ratio = f"{_rate(a):.0f}", f"**{_rate(a) / _rate(trl):.2f}x**"
        else:
            why = "not run (--eos-settings default)" if ahead_built() else "rollout_ahead not built"
            ahead, ahead_ratio, ahead_name = f"n/a ({why})", "n/a", ""
        trl_runs = ", ".join(f"{_rate(t):.0f}" for t in r.get("trl_runs", [trl]))
        default = r["sync"].get(DEFAULT_SYNC)  # what `hybridflow train` runs unless told otherwise
        default = f"{_rate(default):.0f} ({_rate(default) / _rate(trl):.2f}x)" if default else "-"
        body += (
            f"| {r['size']} | {r['length']} | {_precision(r)} | {trl['response_mean']:.1f} / {hf['response_mean']:.1f} | "
            f"{_rate(trl):.0f} | {default} | {_rate(hf):.0f} | **{_rate(hf) / _rate(trl):.2f}x** | {name} | {ahead} | "
            f"{ahead_ratio} | {ahead_name} | {gen:.2f} / {rest:.2f} | {ideal:.0f} ({ideal / _rate(trl):.2f}x) | "
            f"{trl['cpu_rate']:.0f}, {hf['cpu_rate']:.0f} ({hf['cpu_rate'] / trl['cpu_rate']:.2f}x) | {trl_runs} |\n"
        )
    return head + body


def variants_table(rows: list[dict], phases) -> str:
    """Every hybridflow run of the natural-EOS rows with its phases (median s per step)."""
    head = "| model | Lr | precision | setting | tok/s | " + " | ".join(phases) + " | iteration |\n"
    head += "|---" * (len(phases) + 6) + "|\n"
    body = ""
    for r in rows:
        trl = r.get("trl_runs", [r["trl"]])
        runs = [("TRL" if len(trl) == 1 else f"TRL (run {i + 1})", t) for i, t in enumerate(trl)]
        runs += [*r["sync"].items(), *((name, r[key]) for key, name in AHEAD_KEYS.items() if key in r)]
        for name, s in runs:
            cells = " | ".join(f"{s[p]:.2f}" for p in phases)
            body += (
                f"| {r['size']} | {r['length']} | {_precision(r)} | {name} | {_rate(s):.0f} | {cells} | "
                f"{s['iteration']:.2f} |\n"
            )
    return head + body


def summarize_eos(result: dict, warmup: int, summarize) -> dict:
    """`summarize`'s medians plus, since token counts vary per step at natural EOS, the rate over the
    measured steps (their tokens / their seconds) and the mean response length per sequence. A
    one-step-ahead run's last step is left out too: it issues no next rollout, so it only trains and
    would flatter the steady-state rate."""
    if len(result["steps"]) > warmup + 1 and any(s.get("policy_lag", 0.0) > 0 for s in result["steps"]):
        result = {**result, "steps": result["steps"][:-1]}
    out = summarize(result, warmup)
    steps = result["steps"][warmup:] or result["steps"][-1:]
    out["rate"] = sum(s["tokens"] for s in steps) / sum(s["iteration"] for s in steps)
    timed = [s for s in steps if s["cpu"] == s["cpu"] and s["cpu"] > 0]  # nan: CPU not read for that step
    out["cpu_rate"] = (
        sum(s["tokens"] for s in timed) / sum(s["cpu"] for s in timed) if timed else float("nan")
    )
    out["response_mean"] = statistics.fmean(s.get("response_len", 0.0) for s in steps)
    out["policy_lag"] = statistics.fmean(s.get("policy_lag", 0.0) for s in steps)
    out["steps"] = steps  # per-step perf/ metrics, for the limit table (vs_trl_limits.py)
    return out
