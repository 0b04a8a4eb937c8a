"""The agent demo (`make demo-agent`): GRPO with a calculator tool on CPU, through the real CLI.

    .venv/bin/python examples/agent/demo.py            # about 5 minutes on 2 CPU cores
    .venv/bin/python examples/agent/demo.py --seed 2   # another seed: SFT data order and GRPO sampling

1. writes the task's data (examples/agent/task.py: "a*b=" with a, b in 10..99; 100 held-out problems)
   and builds the tiny char-level Llama locally (nothing is downloaded);
2. `hybridflow train examples/agent/sft.yaml`: a short SFT warm start on tool-use traces (call the
   calculator, copy its answer), stopped while it still miscopies most answers (imperfect on purpose);
3. `hybridflow train examples/agent/grpo.yaml`: GRPO with multi-turn rollouts, the calculator a typed
   Python function (rollout.multi_turn.tools), its output inserted as tokens, an exact-match reward;
4. the same GRPO run without the tool (rollout.multi_turn.enable=false), from the same warm start;
5. prints greedy held-out accuracy before and after, with and without the tool, and the tool metrics.

Seeded (`--seed N`, default 1: data.seed and trainer.seed of every run); other arguments are overrides
of the GRPO runs. Outputs go to runs/agent/ (deleted at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import task  # noqa: E402  (examples/agent/task.py, beside this file)

OUT = Path("runs/agent")
ACC = f"val/{task.DATA_SOURCE}/acc@1"
NO_TOOLS = ["rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]", "rollout.multi_turn.parser=hermes",
            "trainer.experiment_name=agent_grpo_no_tools"]  # fmt: skip


def hybridflow(*argv: str) -> None:
    from hybridflow.cli import main

    print(f"\n$ hybridflow {' '.join(argv)}", flush=True)
    if main(list(argv)) != 0:
        sys.exit(f"demo-agent: `hybridflow {argv[0]}` failed")


def write_data(out: Path, sft_rows: int = 2000) -> None:
    """The task's files: held-out val (100 problems), the RL prompts and the SFT traces (the rest)."""
    pairs = task.problems(seed=0)
    val, train = pairs[:100], pairs[100:]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("val", task.rows(val, "val")), ("train", task.rows(train, "train")),
                       ("sft", task.rows(train[:sft_rows], "train", traces=True))):  # fmt: skip
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(seed: int, extra: list[str]) -> None:
    from hybridflow.models.tiny import save_tiny_model

    shutil.rmtree(OUT, ignore_errors=True)
    write_data(OUT / "data")
    base = save_tiny_model(OUT / "models" / "tiny-llama", size="tiny", arch="llama", seed=0)
    common = [f"trainer.output_dir={OUT}", f"data.seed={seed}", f"trainer.seed={seed}"]
    hybridflow("train", str(HERE / "sft.yaml"), f"model.path={base}", *common)
    hybridflow("export", str(OUT / "agent_sft"), "--output", str(OUT / "models" / "sft"))
    sft = f"model.path={OUT / 'models' / 'sft'}"
    hybridflow("train", str(HERE / "grpo.yaml"), sft, *common, *extra)
    hybridflow("train", str(HERE / "grpo.yaml"), sft, *common, *extra, *NO_TOOLS)


def summarize(seed: int, tools: list[dict], no_tools: list[dict], seconds: float) -> None:
    val = [(r["step"], r[ACC]) for r in tools if ACC in r]
    bare = [(r["step"], r[ACC]) for r in no_tools if ACC in r]
    last = [r for r in tools if "agent/turns/mean" in r][-10:]
    mean = lambda k: sum(r[k] for r in last) / len(last)  # noqa: E731
    print("\n" + "=" * 78)
    print(
        f"hybridflow demo-agent: GRPO with a calculator tool on 'a*b=' (a, b in 10..99), tiny Llama, CPU, seed {seed}"
    )
    print("=" * 78)
    print(f"held-out accuracy before {val[0][1]:.2f} after {val[-1][1]:.2f}")
    print(f"  greedy, with the tool, on 100 held-out problems never trained on: "
          f"{100 * (val[-1][1] - val[0][1]):+.0f} points over {val[-1][0]} GRPO steps")  # fmt: skip
    print(f"  the same GRPO without the tool: before {bare[0][1]:.2f} after {bare[-1][1]:.2f}")
    print("  validation acc@1 by step (tool): " + "  ".join(f"{s}: {a:.2f}" for s, a in val))
    print(f"tool metrics (mean of the last {len(last)} steps, per trajectory): turns {mean('agent/turns/mean'):.2f}, "
          f"tool calls {mean('agent/tool_calls/mean'):.2f}, tool errors {mean('agent/tool_errors/mean'):.3f}, "
          f"timeouts {mean('agent/tool_timeouts/mean'):.3f}, tool time {1000 * mean('agent/tool_time_s/mean'):.2f} ms, "
          f"model tokens {mean('agent/model_tokens/mean'):.1f}, tool tokens {mean('agent/tool_tokens/mean'):.1f}")  # fmt: skip
    print(f"total wall time {seconds:.0f} s")


def main() -> int:
    import ray

    from hybridflow.trainers.lifecycle import start_local_ray

    parser = argparse.ArgumentParser(description="GRPO with a calculator tool on CPU (examples/agent/)")
    parser.add_argument("--seed", type=int, default=1, help="data.seed and trainer.seed of every run")
    args, overrides = parser.parse_known_args()
    start = time.time()
    start_local_ray(4, configure_logging=False)
    try:
        run(args.seed, overrides)
    finally:
        ray.shutdown()
    summarize(
        args.seed, metrics(OUT / "agent_grpo"), metrics(OUT / "agent_grpo_no_tools"), time.time() - start
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
