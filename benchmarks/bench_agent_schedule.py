"""The agent loop's two schedules on the same engine and workload (agent/loop.py): continuous batching
(the built-in engine's, rollout/continuous.py) vs waves of `generate` calls (what the loop runs on an
engine without one), one rollout call of B prompts x n samples, alternated run by run.

Workload: a randomly initialised tiny Llama whose near-uniform characters hold a digit every few tokens;
the parser calls `echo` at a turn's first digit (tests/agent/agent_files.py), up to 4 turns, 96 response
tokens per trajectory; the tool answers after `--tool-ms`, and the first prompt's calls after
`--slow-s`. Reported per schedule: wall time of the call, model tokens kept, the mean and max of
agent/finish_s (when the trajectories finished). Waves also decode each row past its call's end until a
stop token or the turn's budget (those tokens are dropped), which continuous batching never samples.

    .venv/bin/python benchmarks/bench_agent_schedule.py [--size small] [--prompts 16] [--n 4]
        [--tool-ms 0 100] [--slow-s 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridflow.agent import AgentLimits, AgentLoop, Environment, StepResult, ToolCall  # noqa: E402
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from hybridflow.rollout import BuiltinEngine, SamplingParams  # noqa: E402
from tests.agent.agent_files import digit_parser, echo  # noqa: E402
from tests.rollout.gen_helpers import prompt_batch  # noqa: E402

TEXTS = ["hello world", "1+2=", "abc", "The quick brown fox jumps", "x", "What is 12*3?", "tool use", "ok"]


class Waves(BuiltinEngine):
    """The same engine without its continuous batch: the loop runs waves of generate calls."""

    continuous = None


def make_env(tool_s: float, slow_s: float):
    class Env(Environment):
        def reset(self, row: dict) -> None:
            self.wait = slow_s if row["uid"] == 0 else tool_s

        def step(self, call: ToolCall, timeout_s: float) -> StepResult:
            time.sleep(self.wait)
            return StepResult(echo(call.arguments["digit"]))

    return Env


def run_once(engine, loop, batch, params) -> dict:
    start = time.perf_counter()
    out = loop.generate(engine, batch, params)
    wall = time.perf_counter() - start
    finish = out["agent_finish_s"]
    return {"wall": wall, "model_tokens": int(out["response_mask"].sum()), "turns": float(out["agent_turns"].mean()),
            "finish_mean": float(finish.mean()), "finish_max": float(finish.max())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tool-ms", type=float, nargs="+", default=[0.0, 100.0])
    ap.add_argument("--slow-s", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok, model = build_char_tokenizer(), build_tiny_model(args.size, "llama", seed=0).eval()
    batch = prompt_batch(tok, [TEXTS[i % len(TEXTS)] for i in range(args.prompts)])
    params = SamplingParams(max_new_tokens=96, temperature=1.0, n=args.n, seed=1)
    limits = AgentLimits(max_turns=4, max_tool_output_tokens=12, max_parallel_calls=args.prompts * args.n,
                         tool_response_template="<r>{output}</r>")  # fmt: skip
    engines = {"waves": Waves(model), "continuous": BuiltinEngine(model)}
    print(f"tiny {args.size} llama fp32 CPU, 1 thread, {args.prompts} prompts x n={args.n}, 96 tokens, "
          f"first prompt's tool {args.slow_s:g} s, min wall of {args.repeats} alternated runs")  # fmt: skip
    print("| tool ms | schedule | wall s | model tokens | turns mean | finish_s mean | finish_s max |")
    print("|---|---|---|---|---|---|---|")
    for tool_ms in args.tool_ms:
        loop = AgentLoop(tok, digit_parser, make_env(tool_ms / 1000, args.slow_s), limits)
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                r = run_once(engine, loop, batch, params)
                if name not in best or r["wall"] < best[name]["wall"]:
                    best[name] = r
        for name, r in best.items():
            print(f"| {tool_ms:g} | {name} | {r['wall']:.2f} | {r['model_tokens']} | {r['turns']:.2f} | "
                  f"{r['finish_mean']:.2f} | {r['finish_max']:.2f} |")  # fmt: skip
        print(
            f"| {tool_ms:g} | waves / continuous wall | {best['waves']['wall'] / best['continuous']['wall']:.2f}x |"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
