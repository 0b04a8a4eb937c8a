"""The 3D-HybridEngine inside `hybridflow train`: GRPO on the "medium" tiny Llama (~25M params, fp32) with
actor tp = 4, generation tg = 2, on 4 and 8 CPU ranks (dp = 1 and 2), per `rollout.reshard` method.

Each row is one `hybridflow train` run (the CLI's entry point, in this process, on one shared local Ray
cluster). Per step the actor worker logs
`reshard/bytes_per_rank` (counted at the collectives, max over ranks), the documented formula for that
layout and method (hybrid_engine/cost.fsdp_switch_cost), `reshard/gen_weight_bytes_per_rank` (peak
generation weights a rank holds) and `timing_s/reshard` (train -> generate -> train, slowest rank).
The table shows the median over the steps after the first (warm-up), and ratios to the allgather row
(the DeepSpeed-Chat switch) of the same world size. Then the paper's Table 2 for 7B-70B from the same
cost module.

    .venv/bin/python benchmarks/bench_hybrid_engine.py [--steps 4] [--worlds 4 8] [--size medium]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import ray

from hybridflow.cli import main as cli_main
from hybridflow.hybrid_engine import paper_table
from hybridflow.models.tiny import build_tiny_model, save_tiny_model

METHODS = ("hybridflow", "allgather", "two_copy")
MIB = 1 << 20
KEYS = {
    "bytes": "reshard/bytes_per_rank",
    "formula": "reshard/formula_bytes_per_rank",
    "held": "reshard/gen_weight_bytes_per_rank",
    "held_formula": "reshard/formula_gen_weight_bytes_per_rank",
    "reshard_s": "timing_s/reshard",
    "gen_s": "timing_s/gen",
}


def run(model: Path, out: Path, world: int, method: str, steps: int, tp: int, tg: int) -> dict:
    name = f"w{world}_{method}"
    overrides = [
        f"model.path={model}", "data.dataset=synthetic:arithmetic",
        "data.dataset_kwargs={num_samples: 256, val_size: 8, max_operand: 19}", "data.max_prompt_length=16",
        "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "rollout.n=4", "rollout.response_length=8",
        f"actor.parallel.tp={tp}", f"rollout.tg={tg}", f"rollout.reshard={method}",
        "reward.num_workers=0", "resources.device=cpu", f"resources.n_gpus_per_node={world}",
        f"trainer.total_steps={steps}", "trainer.val_before_train=false", "trainer.val_every=0",
        "trainer.loggers=[jsonl]", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
        "trainer.resume=never",
    ]  # fmt: skip
    cfg = out / "grpo.yaml"
    cfg.write_text("algorithm: {name: grpo}\n")
    if cli_main(["train", str(cfg), *overrides]) != 0:
        sys.exit(f"{name}: hybridflow train failed")
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if KEYS["bytes"] in r][1:]  # the first step warms up
    return {k: statistics.median(r[key] for r in rows) for k, key in KEYS.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--tg", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HYBRIDFLOW_CPU_THREADS", "1")
    # one local Ray cluster for every run (the runs join it instead of starting their own)
    ray.init(
        address="local",
        num_cpus=2 * max(args.worlds),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = save_tiny_model(tmp / "model", size=args.size)
        n_params = sum(p.numel() for p in build_tiny_model(args.size).parameters())
        print(
            f"model: {args.size} Llama, {n_params / 1e6:.1f}M params, M = {4 * n_params / MIB:.1f} MiB fp32; "
            f"GRPO via `hybridflow train`, actor tp={args.tp}, rollout.tg={args.tg}; median of steps 2..{args.steps}\n"
        )
        for world in args.worlds:
            res = {m: run(model, tmp, world, m, args.steps, args.tp, args.tg) for m in METHODS}
            base = res["allgather"]
            print(f"{world} ranks: training t-d {args.tp}-{world // args.tp} -> generation tg {args.tg}, "
                  f"{world // args.tg} replicas\n")  # fmt: skip
            print("| method | MiB received / rank | formula MiB | measured / formula | gen weights MiB / rank "
                  "(formula) | reshard ms | gen s | bytes vs allgather | gen weights vs allgather | "
                  "reshard time vs allgather |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|---|")
            for m, r in res.items():
                print(
                    f"| {m} | {r['bytes'] / MIB:.2f} | {r['formula'] / MIB:.2f} | "
                    f"{r['bytes'] / r['formula']:.4f} | {r['held'] / MIB:.2f} ({r['held_formula'] / MIB:.2f}) | "
                    f"{1e3 * r['reshard_s']:.1f} | {r['gen_s']:.2f} | {r['bytes'] / base['bytes']:.3f}x | "
                    f"{r['held'] / base['held']:.3f}x | {r['reshard_s'] / base['reshard_s']:.3f}x |"
                )
            print()
    print(
        "Analytic Table 2 (bf16 weights, per GPU; Megatron-style training; hybrid_engine/cost.switch_cost):\n"
    )
    print(paper_table())


if __name__ == "__main__":
    main()
