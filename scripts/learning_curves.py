"""Learning shown end to end: SFT warm start, then each RL algorithm, on the synthetic arithmetic task.

    .venv/bin/python scripts/learning_curves.py                       # all algorithms -> docs/learning.md
    .venv/bin/python scripts/learning_curves.py --algorithms grpo ppo --steps 20 --out /tmp/l.md

The task: "a+b=" with a, b in 0..9; exact-match reward (the whole response must be the number).
The warm start imitates *sloppy* demonstrations: 60% of the SFT answers carry a trailing ".", so
the SFT policy often writes "12." (exact match 0) even when it knows the sum. RL on the exact-match
reward has to learn to stop right after the number, and to get more sums right; validation is greedy
accuracy on 30 held-out problems the warm start never saw. Everything is seeded and runs on CPU
(local Ray cluster, the tiny ~86K-parameter Llama, one worker process per model).

The pytest tests/trainers/test_learning.py runs a shorter version of the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = {"num_samples": 0, "val_size": 30, "max_operand": 9}
DATA_SEED = 1  # data.seed: the train/val split of the synthetic task
SLOPPY = 0.6  # share of SFT answers with a trailing "."
COST_FN = f"{ROOT / 'examples/rewards/arithmetic_cost.py'}:non_numeric_cost"
RL_ALGORITHMS = ("ppo", "grpo", "remax", "rloo", "reinforce_pp", "safe_rlhf")


def write_sloppy_sft_data(path: Path, sloppy: float = SLOPPY, seed: int = 0) -> Path:
    """SFT rows of the task's *training* split (the held-out validation problems never appear),
    with a trailing "." on a `sloppy` share of the answers."""
    from hybridflow.data import get_dataset, write_jsonl

    rows = get_dataset("synthetic:arithmetic_sft")(split="train", seed=DATA_SEED, **TASK)
    rng = random.Random(seed)
    for row in rows:
        if rng.random() < sloppy:
            row["response"] += "."
    return write_jsonl(rows, path)


def common_overrides(model_dir, run_dir: Path, name: str, steps: int) -> list[str]:
    return [
        f"model.path={model_dir}",
        "data.dataset=synthetic:arithmetic",
        f"data.dataset_kwargs={json.dumps(TASK)}",
        f"data.seed={DATA_SEED}",
        "data.max_prompt_length=16",
        "rollout.response_length=4",
        "reward.num_workers=0",
        "resources.device=cpu",
        "resources.n_gpus_per_node=1",
        f"trainer.total_steps={steps}",
        f"trainer.val_every={max(1, steps // 4)}",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={run_dir}",
        f"trainer.experiment_name={name}",
        "trainer.resume=never",
        "trainer.seed=1",
        f"trainer.val_generations_to_log={TASK['val_size']}",  # all of them: see answer_accuracy
    ]


def sft_overrides(model_dir, run_dir: Path, data: Path, steps: int) -> list[str]:
    return common_overrides(model_dir, run_dir, "sft", steps) + [
        "algorithm.name=sft",
        f"data.train_files=[{data}]",
        "data.train_batch_size=32",
        "actor.ppo_mini_batch_size=32",
        "actor.micro_batch_size_per_device=64",
        "actor.optim.lr=3e-3",
        "actor.optim.weight_decay=0.0",
        "actor.optim.schedule=cosine",
        "actor.optim.min_lr_ratio=0.1",
    ]


def rl_overrides(algorithm: str, model_dir, run_dir: Path, steps: int) -> list[str]:
    """One setting for every RL algorithm: 32 prompts x 8 samples per step, one on-policy update."""
    out = common_overrides(model_dir, run_dir, algorithm, steps) + [
        f"algorithm.name={algorithm}",
        "data.train_batch_size=32",
        "actor.ppo_mini_batch_size=32",
        "actor.micro_batch_size_per_device=256",
        "actor.optim.lr=1e-3",
        "actor.optim.weight_decay=0.0",
        "actor.optim.warmup_steps=3",
        "rollout.n=8",
        "rollout.temperature=1.0",
    ]
    if algorithm in ("ppo", "safe_rlhf"):
        out += [
            "critic.optim.lr=1e-3",
            "critic.optim.weight_decay=0.0",
            "critic.micro_batch_size_per_device=256",
        ]
    if algorithm == "safe_rlhf":
        out += [f"algorithm.safe_rlhf.cost_fn={COST_FN}", "algorithm.safe_rlhf.cost_limit=0.1",
                "algorithm.safe_rlhf.lambda_init=0.0", "algorithm.safe_rlhf.lambda_lr=0.5"]  # fmt: skip
    return out


def train(overrides: list[str]):
    """Build, fit and close a trainer; returns (history, trainer)."""
    from hybridflow.config import load_config
    from hybridflow.trainers import build_trainer

    trainer = build_trainer(load_config(None, overrides))
    try:
        history = trainer.fit()
    except BaseException:
        trainer.close()
        raise
    return history, trainer


def warm_start(workdir: Path, steps: int) -> tuple[Path, list[dict]]:
    """Tiny model -> SFT on sloppy demonstrations -> an HF directory to start RL from."""
    from hybridflow.models.tiny import save_tiny_model

    base = save_tiny_model(workdir / "base", size="tiny", arch="llama", seed=0)
    data = write_sloppy_sft_data(workdir / "data" / "sft.jsonl")
    history, trainer = train(sft_overrides(base, workdir / "runs", data, steps))
    try:
        trainer.actor.save_hf_model(str(workdir / "sft"))
    finally:
        trainer.close()
    return workdir / "sft", history


def val_acc(row: dict) -> float:
    return row["val/synthetic:arithmetic/acc@1"]


def answer_accuracy(run_dir: Path, step: int) -> float:
    """Share of validation answers whose leading number is right, whatever follows it ("12." counts):
    separates "knows the sum" from "also stops after it" (the exact-match accuracy)."""
    from hybridflow.rewards.arithmetic import compute_score

    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] == step]
    return sum(compute_score(r["response_text"], r["ground_truth"], mode="first_number") for r in rows) / len(
        rows
    )


def summarize(algorithm: str, history: list[dict], run_dir: Path | None = None) -> dict:
    """Before/after numbers of one run: validation accuracy and the training reward (first / last 5 steps)."""
    steps = [h for h in history if h["step"] > 0]
    first, last = steps[:5], steps[-5:]
    out = {
        "algorithm": algorithm,
        "steps": len(steps),
        "val_before": val_acc(history[0]),
        "val_after": val_acc(history[-1]),
        "val_best": max(val_acc(h) for h in history if "val/synthetic:arithmetic/acc@1" in h),
        "reward_first": sum(h["reward/mean"] for h in first) / len(first),
        "reward_last": sum(h["reward/mean"] for h in last) / len(last),
        "step_seconds": sum(h["timing_s/step"] for h in steps) / len(steps),
    }
    if run_dir is not None:
        out["answer_before"] = answer_accuracy(run_dir, 0)
        out["answer_after"] = answer_accuracy(run_dir, history[-1]["step"])
    if algorithm == "safe_rlhf":
        out["cost_first"] = sum(h["safe_rlhf/cost_mean"] for h in first) / len(first)
        out["cost_last"] = sum(h["safe_rlhf/cost_mean"] for h in last) / len(last)
        out["lambda_last"] = steps[-1]["safe_rlhf/lambda"]
        out["lambda_peak"] = max(h["safe_rlhf/lambda"] for h in steps)
    return out


def write_report(path: Path, sft: list[dict], rows: list[dict], command: str, seconds: float) -> None:
    lines = [
        "# Learning shown end to end",
        "",
        "Generated by `scripts/learning_curves.py` (numbers from one seeded CPU run; rerun to refresh):",
        "",
        f"    {command}",
        "",
        "Task: `a+b=` with a, b in 0..9, exact-match reward, greedy validation accuracy (`val/synthetic:arithmetic/acc@1`)",
        "on 30 held-out problems. Model: the tiny char-level Llama (~86K parameters), warm-started by SFT on",
        f'demonstrations of the 70 training problems of which {int(SLOPPY * 100)}% end in a stray "." — so the warm',
        "start often answers `12.` and exact match gives 0. RL must learn to stop after the number (and may get",
        "more sums right). Each RL run: 32 prompts x 8 samples per step, one on-policy update per step (lr 1e-3),",
        'one worker process per model on a local Ray cluster. "Leading number right" ignores what follows the',
        "number (`12.` counts): the gap between it and val acc is the format error RL removes; its own rise is",
        "sums RL got right that the warm start got wrong. With 30 validation problems one problem is 3.3 points.",
        "",
        f"SFT warm start: val acc {val_acc(sft[0]):.3f} (random init) -> {val_acc(sft[-1]):.3f} after {sft[-1]['step']} steps.",
        "",
        "| algorithm | steps | val acc before | val acc after | change | best val | leading number right before -> after | train reward first 5 -> last 5 steps | s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['steps']} | {r['val_before']:.3f} | {r['val_after']:.3f} | "
            f"{100 * (r['val_after'] - r['val_before']):+.1f} pts | {r['val_best']:.3f} | "
            f"{r['answer_before']:.3f} -> {r['answer_after']:.3f} | "
            f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} | {r['step_seconds']:.2f} |"
        )
    if rows:
        lo, hi = min(r["answer_after"] for r in rows), max(r["answer_after"] for r in rows)
        lines += [
            "",
            f"What the gain is made of: the leading number was right on {rows[0]['answer_before']:.3f} of the validation",
            f"problems before RL and on {lo:.3f}-{hi:.3f} after, so on these held-out problems the exact-match gain is",
            "the format (stopping after the number), not new sums; on the training problems the sampled reward rises",
            "as the table shows. (Shorter probes without the sloppy warm start gave held-out gains within the noise",
            "of 30 problems: a model this small mostly memorises the 70 training sums.)",
        ]
    safe = [r for r in rows if r["algorithm"] == "safe_rlhf"]
    if safe:
        s = safe[0]
        lines += [
            "",
            "Safe-RLHF cost: the share of responses that are not a bare integer (examples/rewards/arithmetic_cost.py),",
            f"limit 0.1. Mean cost {s['cost_first']:.3f} (first 5 steps) -> {s['cost_last']:.3f} (last 5 steps). The",
            f"Lagrange multiplier (initial 0) rose to {s['lambda_peak']:.3f} while the cost exceeded the limit and was",
            f"{s['lambda_last']:.3f} at the end. This cost is partly aligned with the reward (a stray character also",
            "fails exact match), so the constraint is easy to satisfy here; the run shows the mechanism, not a hard trade-off.",
        ]
    lines += ["", f"Total wall time: {seconds:.0f} s on this machine.", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithms", nargs="+", default=list(RL_ALGORITHMS), choices=RL_ALGORITHMS)
    p.add_argument("--steps", type=int, default=80, help="RL steps per algorithm")
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--workdir", default="runs/learning")
    p.add_argument("--out", default="docs/learning.md")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray

    start = time.time()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir / "runs", ignore_errors=True)  # metric and generation logs append across runs
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        sft_dir, sft_history = warm_start(workdir, args.sft_steps)
        rows = []
        for algo in args.algorithms:
            history, trainer = train(rl_overrides(algo, sft_dir, workdir / "runs", args.steps))
            trainer.close()
            rows.append(summarize(algo, history, workdir / "runs" / algo))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    command = "python scripts/learning_curves.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(Path(args.out), sft_history, rows, command.strip(), time.time() - start)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
