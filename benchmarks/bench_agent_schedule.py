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
        [--tool-ms 0 100] [--slow-s 1] [--repeats 2] [--tg 2]

--tg 2: both schedules under a generation tensor-parallel group of 2 gloo ranks (each holding its
Megatron shard, embeddings vocab-parallel), rank 0 reporting. Waves there run every tool call on each
rank and collect on each rank's clock, so keep the tools well within WAVE_WAIT_S (--tool-ms 0 --slow-s 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridflow.agent import AgentLimits, AgentLoop, Environment, StepResult, ToolCall  # noqa: E402
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from hybridflow.rollout import BuiltinEngine, SamplingParams  # noqa: E402
from hybridflow.rollout.tp_group import TPGroup  # noqa: E402
from tests.agent.agent_files import digit_parser, echo  # noqa: E402
from tests.rollout.gen_helpers import prompt_batch  # noqa: E402
from tests.rollout.test_tp_decoder import shard  # noqa: E402

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
    args = parse_args()
    if args.tg == 1:
        return bench(args, 0)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, os.path.join(tmp, "rdzv")), nprocs=args.tg)


def _rank(rank: int, args, rdzv: str) -> None:
    dist.init_process_group("gloo", init_method="file://" + rdzv, rank=rank, world_size=args.tg)
    bench(args, rank)
    dist.destroy_process_group()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tool-ms", type=float, nargs="+", default=[0.0, 100.0])
    ap.add_argument("--slow-s", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tg", type=int, default=1)
    return ap.parse_args()


def bench(args, rank: int) -> None:
    """Both schedules, alternated; rank 0 prints (the others run the same calls)."""
    say = print if rank == 0 else (lambda *a: None)
    torch.set_num_threads(1)
    tok, model = build_char_tokenizer(), build_tiny_model(args.size, "llama", seed=0).eval()
    batch = prompt_batch(tok, [TEXTS[i % len(TEXTS)] for i in range(args.prompts)])
    params = SamplingParams(max_new_tokens=96, temperature=1.0, n=args.n, seed=1)
    limits = AgentLimits(max_turns=4, max_tool_output_tokens=12, max_parallel_calls=args.prompts * args.n,
                         tool_response_template="<r>{output}</r>")  # fmt: skip
    engines = {"waves": Waves(model), "continuous": BuiltinEngine(model)}
    if args.tg > 1:
        for engine in engines.values():
            engine.set_shard(shard(model, rank, args.tg, vocab=True), TPGroup(dist.group.WORLD, args.tg, 0))
    say(f"tiny {args.size} llama fp32 CPU, 1 thread, tg={args.tg}, {args.prompts} prompts x n={args.n}, 96 "
        f"tokens, first prompt's tool {args.slow_s:g} s, min wall of {args.repeats} alternated runs")  # fmt: skip
    say("| tool ms | schedule | wall s | model tokens | turns mean | finish_s mean | finish_s max |")
    say("|---|---|---|---|---|---|---|")
    for tool_ms in args.tool_ms:
        loop = AgentLoop(tok, digit_parser, make_env(tool_ms / 1000, args.slow_s), limits)
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                r = run_once(engine, loop, batch, params)
                if name not in best or r["wall"] < best[name]["wall"]:
                    best[name] = r
        for name, r in best.items():
            say(f"| {tool_ms:g} | {name} | {r['wall']:.2f} | {r['model_tokens']} | {r['turns']:.2f} | "
                  f"{r['finish_mean']:.2f} | {r['finish_max']:.2f} |")  # fmt: skip
        say(
            f"| {tool_ms:g} | waves / continuous wall | {best['waves']['wall'] / best['continuous']['wall']:.2f}x |"
        )
    say(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
