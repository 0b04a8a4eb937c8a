"""The planner against measurement on this machine: every placement it would consider, run for real.

For the PPO and GRPO recipes (examples/configs/ppo_tiny.yaml, grpo_tiny.yaml) at two tiny model sizes, on
`--devices` CPU ranks: the planner (priced with a device profile measured here, `hybridflow calibrate
--out`) ranks its candidates - each synchronous placement's best allocation and layouts (colocate,
split, standalone, ... as set partitions of the models), a one-pool placement at every other device count,
and the one-step-ahead schedule - and each one
is written as a plan file and run through `hybridflow train` for a few steps (`--repeats` times, in rounds
over the candidates; the run of the fastest iteration is kept). The first step is warm-up; the rest give the
measured medians of timing_s/stage/<stage> and timing_s/step beside the plan's
plan/predicted_s/<stage> and iteration. Prints per case the predicted and measured ranking and per
candidate the per-stage error. Each JSON row also holds the measured phases' medians ("phases":
timing_s/<phase>, e.g. values, update_critic, reshard) and the plan's per-model seconds ("models"), to find
which pass a stage's error is in.

    .venv/bin/python benchmarks/bench_planner_accuracy.py --profile cpu.yaml [--steps 5] [--devices 2] [--repeats 3]
    .venv/bin/python benchmarks/bench_planner_accuracy.py --report run.log   # the tables of a logged run

docs/bench/planner.md has one run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("generation", "preparation", "training")
RECIPES = {"ppo": "examples/configs/ppo_tiny.yaml", "grpo": "examples/configs/grpo_tiny.yaml"}


def overrides(model_dir: str, devices: int, steps: int, out: str, name: str, profile: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "data.dataset_kwargs={num_samples: 0, val_size: 4, max_operand: 19}",
        f"resources.n_gpus_per_node={devices}",
        f"resources.planner_profile={profile}",
        "resources.placement=auto",
        f"trainer.total_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.save_every_minutes=0",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={out}",
        f"trainer.experiment_name={name}",
        "trainer.resume=never",
    ]


def candidates(recipe: str, args: list[str], variants: bool = True) -> list[tuple[str, object, int]]:
    """(label, Plan, rollout_ahead) for every placement the planner ranks under the config, best first by
    its own prediction; the one-step-ahead plan last (ranked by its prediction too). Without `variants`,
    each placement's best layouts only (no tp/dp variants)."""
    from hybridflow.config import load_config
    from hybridflow.planner.ahead import search_ahead
    from hybridflow.planner.dataflow import with_old_log_probs
    from hybridflow.planner.plan import build_plan
    from hybridflow.planner.search import search, strategy_name
    from hybridflow.trainers.auto_placement import (
        ENGINE_LIMITS,
        build_planner_cluster,
        build_planner_dataflow,
        build_planner_workload,
    )
    from hybridflow.trainers.plan_schedule import planner_old_log_probs

    cfg = load_config(ROOT / recipe, args)
    wl = build_planner_workload(cfg, prompt_lengths(cfg))  # as `hybridflow train` prices it
    df, cluster = build_planner_dataflow(cfg, 0), build_planner_cluster(cfg)
    results = search(df, cluster, wl, ENGINE_LIMITS)
    results += other_allocations(results, df, cluster, wl)
    out = []
    for r in [
        v for best in results for v in layout_variants(best, df, cluster, wl)[: None if variants else 1]
    ]:
        p = build_plan(df, cluster, wl, [r], ENGINE_LIMITS)
        layouts = ",".join(f"{m.role[:3]}:{f'p{m.p}' if m.p > 1 else ''}t{m.t}d{m.d}" for m in p.models)
        label = (
            f"{strategy_name([list(s) for s in r.placement], list(df.roles))} {list(r.allocation)} {layouts}"
        )
        out.append((label, p, 0))
    ahead_df = with_old_log_probs(df, planner_old_log_probs(cfg, 1))
    ahead = search_ahead(ahead_df, cluster, wl, ENGINE_LIMITS, None, "auto")
    if ahead is not None:
        p = build_plan(df, cluster, wl, results, ENGINE_LIMITS, ahead, "ahead")
        out.append(
            (f"one step ahead, rollout pool {p.ahead.n_devices}, frozen on {p.ahead.frozen_pool}", p, 1)
        )
    return sorted(out, key=lambda c: c[1].iteration_seconds)


def prompt_lengths(cfg):
    """The training prompts' mean and longest token counts, loaded as the trainer loads them (trainers/base.py)."""
    from hybridflow.agent import tool_schemas
    from hybridflow.data import build_prompt_dataset
    from hybridflow.models import load_tokenizer
    from hybridflow.trainers.auto_placement import PromptLengths

    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
    rule, tools = cfg.reward.kind == "rule", tool_schemas(cfg.rollout.multi_turn)
    return PromptLengths.of(build_prompt_dataset(cfg.data, tokenizer, "train", rule, tools))


def other_allocations(results: list, df, cluster, wl) -> list:
    """A one-pool placement (colocate) at every other device count the cluster has: the search keeps
    one count per placement and drops a larger one that is no faster in any stage, so a plan on one of
    two devices would never be measured against the same placement on both."""
    from hybridflow.planner.search import PlacementResult, pool_candidates
    from hybridflow.trainers.auto_placement import ENGINE_LIMITS

    out = []
    for r in (r for r in results if len(r.placement) == 1):
        tasks = tuple(df.model(role) for role in r.placement[0])
        c = pool_candidates(tasks, cluster, wl, cluster.num_devices, False, ENGINE_LIMITS, alone=True)
        for n, cost, choice in zip(c.ns, c.costs, c.choices):
            if n != r.allocation[0]:
                stage = tuple(float(x) for x in cost)
                out.append(PlacementResult(r.placement, sum(stage), (int(n),), (choice,), stage))
    return out


def layout_variants(best, df, cluster, wl) -> list:
    """`best` (a PlacementResult) and the same placement and allocation with every other (t, d) of its
    models (the fastest option of each, priced by the same simulator): the tp/dp variants."""
    import itertools

    from hybridflow.planner.parallel import enumerate_options
    from hybridflow.planner.search import PlacementResult, pool_stage_costs
    from hybridflow.trainers.auto_placement import ENGINE_LIMITS

    per_model = []
    for roles, n, chosen in zip(best.placement, best.allocation, best.choices):
        for role, picked in zip(roles, chosen):
            fastest = {}
            for o in enumerate_options(df.model(role), cluster, wl, n, ENGINE_LIMITS):
                key = (o.t, o.d)
                if key != (picked.t, picked.d) and (
                    key not in fastest or o.total_time < fastest[key].total_time
                ):
                    fastest[key] = o
            per_model.append([picked, *fastest.values()])
    out = []
    for combo in itertools.product(*per_model):
        it, choices = iter(combo), []
        for roles in best.placement:
            choices.append(tuple(next(it) for _ in roles))
        stage = tuple(float(x) for x in np.max([pool_stage_costs(c) for c in choices], axis=0))
        out.append(PlacementResult(best.placement, sum(stage), best.allocation, tuple(choices), stage))
    return out


def run_one(recipe: str, args: list[str], plan_path: Path, ahead: int, run_dir: Path) -> dict:
    """Medians over the steps after the first of the measured stage and step seconds."""
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", str(ROOT / recipe), *args]
    cmd += [
        f"resources.placement={plan_path}",
        f"trainer.rollout_ahead={ahead}",
        "resources.planner_profile=",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return {
            "error": (proc.stdout + proc.stderr).strip().splitlines()[-1],
            "wall_s": time.perf_counter() - start,
        }
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r][1:]
    measured = {
        s: statistics.median(r[f"timing_s/stage/{s}"] for r in rows)
        for s in STAGES
        if f"timing_s/stage/{s}" in rows[0]
    }
    measured["iteration"] = statistics.median(r["timing_s/step"] for r in rows)
    # each phase's busy seconds (timing_s/<phase>: values, ref, update_critic, reshard, ...), to set beside
    # the plan's per-model figures where a stage is off
    phases = {
        k.removeprefix("timing_s/"): statistics.median(r.get(k, 0.0) for r in rows)
        for k in rows[0]
        if k.startswith("timing_s/") and k.count("/") == 1 and k != "timing_s/step"
    }
    if not ahead:  # the step less its stages: what plan.rest_seconds prices
        stages = [k for k in STAGES if k in measured]
        measured["rest"] = statistics.median(
            r["timing_s/step"] - sum(r[f"timing_s/stage/{s}"] for s in stages) for r in rows
        )
    return {"measured": measured, "phases": phases, "wall_s": time.perf_counter() - start}


def bench_case(
    algo: str,
    size: str,
    devices: int,
    steps: int,
    profile: str,
    tmp: Path,
    variants: bool = True,
    repeats: int = 1,
) -> list[dict]:
    from hybridflow.models.tiny import save_tiny_model

    model_dir = tmp / f"model-{size}"
    if not model_dir.exists():
        save_tiny_model(model_dir, size, "llama", seed=0)
    probe = overrides(str(model_dir), devices, steps, str(tmp), "probe", profile)
    cands = candidates(RECIPES[algo], probe, variants)
    runs: list[list[dict]] = [[] for _ in cands]
    # round-robin: a slow minute of a shared machine falls on different candidates in each round
    for r in range(repeats):
        for i, (label, plan, ahead) in enumerate(cands):
            name = f"{algo}-{size}-{i}-{r}"
            path = plan.save(tmp / f"{name}.yaml")
            args = overrides(str(model_dir), devices, steps, str(tmp), name, profile)
            runs[i].append(run_one(RECIPES[algo], args, path, ahead, tmp / name))
            print(
                f"{algo}/{size} {label} round {r + 1}: {json.dumps(runs[i][-1])}", file=sys.stderr, flush=True
            )
    rows = []
    for (label, plan, _), results in zip(cands, runs):
        predicted = {**plan.stage_seconds, "rest": plan.rest_seconds, "iteration": plan.iteration_seconds}
        models = {m.role: {**m.stage_seconds, "switch": m.switch_seconds} for m in plan.models}
        rows.append(
            {"case": f"{algo}/{size}", "candidate": label, "predicted": predicted, "models": models,
             **combine(results)}
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def combine(results: list[dict]) -> dict:
    """One candidate's runs as one row: the run of the fastest iteration, its figures as they are (an error if
    none ran). The profile holds each coefficient's fastest samples, which a busy host's other work did not
    slow (microbench.best_seconds); a run's figures are compared the same way (docs/bench/planner.md: on the
    AMD VM one plan's two runs measured 0.31 and 0.91 s)."""
    ok = [r for r in results if "measured" in r]
    wall = sum(r["wall_s"] for r in results)
    if not ok:
        return {"error": next(r["error"] for r in results), "wall_s": wall}
    fastest = min(ok, key=lambda r: r["measured"]["iteration"])
    return {"measured": fastest["measured"], "phases": fastest["phases"], "runs": len(ok), "wall_s": wall}


def _compared(row: dict, key: str) -> bool:
    """A figure both sides have: a stage the plan prices at 0 (GRPO's preparation without a reference:
    only the rule reward in the driver, which the planner does not price) has no ratio."""
    return key in row["measured"] and row["predicted"][key] > 0


def report(rows: list[dict]) -> None:
    """Per case: the candidates in the planner's order with predicted and measured iteration, and the
    per-stage ratio measured / predicted; then whether the planner's first choice measured fastest."""
    print(
        "\n| case | candidate (planner's order) | predicted s | measured s | measured / predicted: "
        "generation, preparation, training, rest, iteration | measured rank |"
    )
    print("|---|---|---|---|---|---|")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case and "measured" in r]
        order = sorted(mine, key=lambda r: r["measured"]["iteration"])
        for r in [r for r in rows if r["case"] == case]:
            if "measured" not in r:
                print(
                    f"| {case} | {r['candidate']} | {r['predicted']['iteration']:.3f} | failed: {r['error']} | | |"
                )
                continue
            ratios = ", ".join(
                f"{r['measured'][k] / r['predicted'][k]:.2f}x" if _compared(r, k) else "-"
                for k in (*STAGES, "rest", "iteration")
            )
            rank = order.index(r) + 1
            print(
                f"| {case} | {r['candidate']} | {r['predicted']['iteration']:.3f} | "
                f"{r['measured']['iteration']:.3f} | {ratios} | {rank} |"
            )
        if mine:
            first, fastest = mine[0], order[0]
            gap = first["measured"]["iteration"] / fastest["measured"]["iteration"] - 1
            print(f"| {case} | planner's first choice vs measured fastest: {100 * gap:+.1f}% | | | | |")
    errors = [r["measured"][k] / r["predicted"][k] - 1 for r in rows if "measured" in r
              for k in (*STAGES, "iteration") if _compared(r, k)]  # fmt: skip
    if errors:
        within = sum(abs(e) <= 0.15 for e in errors)
        q = statistics.quantiles(errors, n=4) if len(errors) > 1 else [errors[0]] * 3
        print(
            f"\nstage and iteration errors (measured / predicted - 1): {len(errors)} figures, {within} within "
            f"+-15%; quartiles {100 * q[0]:+.0f}% / {100 * q[1]:+.0f}% / {100 * q[2]:+.0f}%"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", help="device profile from `hybridflow calibrate --out` (required to run)"
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the first is warm-up")
    parser.add_argument("--cases", default="ppo/tiny,ppo/small,grpo/tiny,grpo/small")
    parser.add_argument(
        "--layouts",
        default="all",
        choices=("all", "best"),
        help="all: every placement's tp/dp variants too; best: each placement's best layouts (fewer runs)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per candidate, in rounds over them; figures: the fastest run's",
    )
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    parser.add_argument(
        "--report", nargs="+", default=None, help="only print the tables from the rows logged by earlier runs"
    )
    args = parser.parse_args()
    if args.report:  # each run prints its row as one JSON line
        lines = [line for f in args.report for line in Path(f).read_text().splitlines()]
        report([json.loads(line) for line in lines if line.startswith('{"case"')])
        return 0
    if not args.profile:
        parser.error("--profile is required to run the cases")
    profile = str(Path(args.profile).resolve())
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            algo, size = case.split("/")
            rows += bench_case(
                algo, size, args.devices, args.steps, profile, Path(tmp), args.layouts == "all", args.repeats
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    report(rows)
    print(f"\nbenchmark took {time.perf_counter() - start:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
