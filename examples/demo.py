"""The quickstart (`make demo`): SFT warm start, then GRPO, on CPU, through the real CLI.

    .venv/bin/python examples/demo.py            # ~3-5 minutes on 2 CPU cores

1. starts an embedded local Ray cluster (every command below joins it);
2. builds the tiny char-level Llama (~86K parameters) locally — nothing is downloaded;
3. `hybridflow train examples/configs/sft_tiny.yaml`: a short SFT warm start on correct answers of
   "a+b=" (a, b in 0..19): the model learns to answer with a bare number but gets most sums wrong;
4. `hybridflow export` turns the SFT checkpoint into an HF directory;
5. `hybridflow train examples/configs/grpo_tiny.yaml model.path=<that directory>`: GRPO with an
   exact-match reward (live progress, JSONL, TensorBoard, checkpoints, report.png);
6. prints greedy accuracy on 100 held-out problems before and after RL, what the change is made
   of (right sums vs. answer format), and the reward curve.

Everything is seeded; outputs go to runs/demo/ (deleted at the start, so a rerun starts fresh
rather than resuming the previous run's checkpoints).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
OUT = Path("runs/demo")
ACC = "val/synthetic:arithmetic/acc@1"
BARS = "▁▂▃▄▅▆▇█"


def hybridflow(*argv: str) -> None:
    """Run one `hybridflow` command in this process (the same code path as the console script)."""
    from hybridflow.cli import main

    print(f"\n$ hybridflow {' '.join(argv)}", flush=True)
    if main(list(argv)) != 0:
        sys.exit(f"demo: `hybridflow {argv[0]}` failed")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sparkline(values: list[float], lo: float = 0.0, hi: float = 1.0) -> str:
    span = max(hi - lo, 1e-9)
    return "".join(BARS[min(len(BARS) - 1, int((v - lo) / span * len(BARS)))] for v in values)


def answer_breakdown(model_dir: Path) -> dict:
    """Greedy answers of a model on the held-out problems (the same validation as in training):
    exact-match accuracy, and how many answers are a bare integer (the format) at all."""
    from hybridflow.trainers.eval_cli import evaluate

    _, rows = evaluate(
        str(model_dir),
        ["trainer.val_generations_to_log=100000", "trainer.loggers=[]"],
        config=str(CONFIGS / "grpo_tiny.yaml"),
    )
    bare = [bool(re.fullmatch(r"\d+", r["response_text"].strip())) for r in rows]
    right = [r["score"] == 1.0 for r in rows]
    return {"n": len(rows), "acc": sum(right) / len(rows), "bare_integer": sum(bare) / len(rows)}


def main() -> int:
    import ray

    start = time.time()
    shutil.rmtree(OUT, ignore_errors=True)
    from hybridflow.trainers.lifecycle import start_local_ray

    start_local_ray(4, configure_logging=False)  # 127.0.0.1 only, token auth (docs/operations.md)
    try:
        from hybridflow.models.tiny import save_tiny_model

        base = save_tiny_model(OUT / "models" / "tiny-llama", size="tiny", arch="llama", seed=0)
        print(f"built the tiny model in {base}")
        common = [f"trainer.output_dir={OUT}"]
        hybridflow("train", str(CONFIGS / "sft_tiny.yaml"), f"model.path={base}", *common)
        hybridflow("export", str(OUT / "sft_tiny"), "--output", str(OUT / "models" / "sft"))
        hybridflow("train", str(CONFIGS / "grpo_tiny.yaml"), f"model.path={OUT / 'models' / 'sft'}", *common)
        hybridflow("export", str(OUT / "grpo_tiny"), "--output", str(OUT / "models" / "grpo"))
        before = answer_breakdown(OUT / "models" / "sft")
        after = answer_breakdown(OUT / "models" / "grpo")
    finally:
        ray.shutdown()
    summarize(metrics(OUT / "sft_tiny"), metrics(OUT / "grpo_tiny"), before, after, time.time() - start)
    return 0


def summarize(sft: list[dict], grpo: list[dict], before: dict, after: dict, seconds: float) -> None:
    steps = [r for r in grpo if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in steps]
    val = [(r["step"], r[ACC]) for r in grpo if ACC in r]
    print("\n" + "=" * 78)
    print("hybridflow demo: GRPO on 'a+b=' (a, b in 0..19), tiny char-level Llama, CPU")
    print("=" * 78)
    print(f"SFT warm start ({sft[-1]['step']} steps on correct answers): held-out acc "
          f"{sft[0][ACC]:.2f} (random init) -> {sft[-1][ACC]:.2f}")  # fmt: skip
    print(f"\ngreedy accuracy on {before['n']} held-out problems (never trained on):")
    print(f"  before GRPO {before['acc']:.2f}   after GRPO {after['acc']:.2f}   "
          f"({100 * (after['acc'] - before['acc']):+.0f} points)")  # fmt: skip
    print(
        f"  answers that are a bare number: before {before['bare_integer']:.2f}, after {after['bare_integer']:.2f}"
    )
    if before["bare_integer"] >= 0.9:
        print("  -> the warm start already answers in the right format; the gain is sums it now gets right.")
    else:
        print("  -> part of the gain is answer format (a bare number), not only right sums.")
    print("\nvalidation acc@1 by step: " + "  ".join(f"{s}: {a:.2f}" for s, a in val))
    print(f"\ntrain reward (mean exact match of 8 samples x 64 prompts) per step, {len(rewards)} steps:")
    print(
        f"  {sparkline(rewards, min(rewards), max(rewards))}  (min {min(rewards):.2f} .. max {max(rewards):.2f})"
    )
    print("  steps     reward  s/step")
    for i in range(0, len(steps), 10):
        chunk = steps[i : i + 10]
        mean = sum(r["reward/mean"] for r in chunk) / len(chunk)
        secs = sum(r["timing_s/step"] for r in chunk) / len(chunk)
        print(f"  {chunk[0]['step']:>3}-{chunk[-1]['step']:<3}   {mean:.3f}   {secs:.2f}")
    print(f"\nreport: {OUT / 'grpo_tiny' / 'report.png'} (and report.html); "
          f"TensorBoard: tensorboard --logdir {OUT}")  # fmt: skip
    print(f"checkpoints: {OUT / 'grpo_tiny' / 'checkpoints'}; exported model: {OUT / 'models' / 'grpo'}")
    print(f"total wall time {seconds:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
