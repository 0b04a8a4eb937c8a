"""The natural-EOS table of benchmarks/vs_trl.py (issue 14): responses end at EOS at random lengths.

No forced lengths on either side: TRL's GRPOTrainer at its defaults except activation checkpointing off
(and the shared workload: batch, group size, lengths, learning rate, KL beta); hybridflow through
`hybridflow train` in a subprocess, as users run it, its per-step figures read from metrics.jsonl.

Per row (model x response length) hybridflow runs each synchronous setting of `SYNC_VARIANTS` (what a
user can choose by config on this machine) and the best one is reported with its name; then the
one-step-ahead schedule (`trainer.rollout_ahead=1`: rollout on its own pool, one step off-policy) when
this build has the setting, else the row says "n/a (rollout_ahead not built)"; it runs the frozen models
(here the reference of the KL term) where the build's default puts them (resources.frozen_pool=rollout:
on the rollout pool, scoring batch k+1 while the actor trains on batch k), and a second one-step-ahead
run keeps them in the training pool (`AHEAD_TRAINING`, listed with the phases).

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
AHEAD = ("rollout_ahead=1 (rollout pool 1 | actor pool 1)", 2, ["trainer.rollout_ahead=1"])
AHEAD_TRAINING = (
    "rollout_ahead=1, ref in the training pool (resources.frozen_pool=training)",
    2,
    ["trainer.rollout_ahead=1", "resources.frozen_pool=training"],
)


def ahead_built() -> bool:
    """Whether this build's config has trainer.rollout_ahead (issue 14 item 2)."""
    from hybridflow.config.schema import TrainerConfig

    return any(f.name == "rollout_ahead" for f in dataclasses.fields(TrainerConfig))


def frozen_pool_built() -> bool:
    """Whether this build can place the frozen models on the rollout pool (resources.frozen_pool)."""
    from hybridflow.config.schema import ResourcesConfig

    return any(f.name == "frozen_pool" for f in dataclasses.fields(ResourcesConfig))


def natural_rows(args, workdir: Path, run_grpo_side, common_args, summarize) -> list[dict]:
    from hybridflow.models.tiny import save_tiny_model

    rows = []
    for size in args.eos_sizes:
        model = str(save_tiny_model(workdir / f"model_{size}", size))
        for length in args.eos_lengths:
            base = common_args(args, model, length, args.eos_steps, workdir) + ["--stop-at-eos"]
            row = {"size": size, "length": length, "seqs": args.batch_size * args.n, "sync": {}}
            tag = f"eos_{size}_{length}"
            print(f"[vs_trl] natural EOS {size}/{length}: trl ...", file=sys.stderr, flush=True)
            res = run_grpo_side("trl", args, base, workdir / f"trl_{tag}.log")
            row["trl"] = summarize_eos(res, args.warmup, summarize)
            runs = [
                (name, workers, sets, f"{i}")
                for i, (name, (workers, sets)) in enumerate(SYNC_VARIANTS.items())
            ]
            runs += [(*AHEAD, "ahead")] if ahead_built() else []
            runs += [(*AHEAD_TRAINING, "ahead_training")] if frozen_pool_built() else []
            for name, workers, sets, suffix in runs:
                print(
                    f"[vs_trl] natural EOS {size}/{length}: hybridflow {name} ...",
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
            rows.append(row)
            # partial results survive an interrupted run (the machine may be shared and slow)
            (workdir / "natural_eos_rows.json").write_text(json.dumps(rows, indent=1))
            print(natural_table(rows), file=sys.stderr, flush=True)
    return rows


def _rate(s: dict) -> float:
    return s["rate"]


def best_sync(row: dict) -> tuple[str, dict]:
    return max(row["sync"].items(), key=lambda kv: _rate(kv[1]))


def ideal_bound(s: dict) -> tuple[float, float, float]:
    """(generation s, rest s, ideal tokens/s) of a synchronous run: the step if generation overlapped
    the rest perfectly takes max(generation, rest) instead of their sum."""
    gen = s["generation"]
    rest = max(s["iteration"] - gen, 0.0)
    return gen, rest, s["rate"] * s["iteration"] / max(gen, rest, 1e-9)


def natural_table(rows: list[dict]) -> str:
    head = (
        "| model | Lr (max) | resp. tokens TRL / hf | TRL tok/s | hybridflow sync tok/s | **sync / TRL** | "
        "best sync setting | rollout_ahead=1 tok/s | **ahead / TRL** | gen s / rest s (sync) | "
        "ideal overlap tok/s (/ TRL) | CPU tokens/s: TRL, hybridflow sync (ratio) |\n" + "|---" * 12 + "|\n"
    )
    body = ""
    for r in rows:
        trl = r["trl"]
        name, hf = best_sync(r)
        gen, rest, ideal = ideal_bound(hf)
        if "ahead" in r:
            a = r["ahead"]
            ahead, ahead_ratio = f"{_rate(a):.0f}", f"**{_rate(a) / _rate(trl):.2f}x**"
        else:
            ahead, ahead_ratio = "n/a (rollout_ahead not built)", "n/a"
        body += (
            f"| {r['size']} | {r['length']} | {trl['response_mean']:.1f} / {hf['response_mean']:.1f} | "
            f"{_rate(trl):.0f} | {_rate(hf):.0f} | **{_rate(hf) / _rate(trl):.2f}x** | {name} | {ahead} | "
            f"{ahead_ratio} | {gen:.2f} / {rest:.2f} | {ideal:.0f} ({ideal / _rate(trl):.2f}x) | "
            f"{trl['cpu_rate']:.0f}, {hf['cpu_rate']:.0f} ({hf['cpu_rate'] / trl['cpu_rate']:.2f}x) |\n"
        )
    return head + body


def variants_table(rows: list[dict], phases) -> str:
    """Every hybridflow run of the natural-EOS rows with its phases (median s per step)."""
    head = "| model | Lr | setting | tok/s | " + " | ".join(phases) + " | iteration |\n"
    head += "|---" * (len(phases) + 5) + "|\n"
    body = ""
    for r in rows:
        runs = [("TRL", r["trl"]), *r["sync"].items()]
        runs += [
            (name, r[key])
            for name, key in ((AHEAD[0], "ahead"), (AHEAD_TRAINING[0], "ahead_training"))
            if key in r
        ]
        for name, s in runs:
            cells = " | ".join(f"{s[p]:.2f}" for p in phases)
            body += f"| {r['size']} | {r['length']} | {name} | {_rate(s):.0f} | {cells} | {s['iteration']:.2f} |\n"
    return head + body


def summarize_eos(result: dict, warmup: int, summarize) -> dict:
    """`summarize`'s medians plus, since token counts vary per step at natural EOS, the rate over the
    measured steps (their tokens / their seconds) and the mean response length per sequence."""
    out = summarize(result, warmup)
    steps = result["steps"][warmup:] or result["steps"][-1:]
    out["rate"] = sum(s["tokens"] for s in steps) / sum(s["iteration"] for s in steps)
    timed = [s for s in steps if s["cpu"] == s["cpu"] and s["cpu"] > 0]  # nan: CPU not read for that step
    out["cpu_rate"] = (
        sum(s["tokens"] for s in timed) / sum(s["cpu"] for s in timed) if timed else float("nan")
    )
    out["response_mean"] = statistics.fmean(s.get("response_len", 0.0) for s in steps)
    out["policy_lag"] = statistics.fmean(s.get("policy_lag", 0.0) for s in steps)
    return out
