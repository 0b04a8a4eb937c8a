"""The agent loop inside the rollout: generate until a tool call or a stop token, run the call, insert its
output as tokens, continue; per trajectory, token in, token out (agent/trajectory.py).

Scheduling, as built: turn-synchronous. Each turn is one `engine.generate` over the trajectories still
running (their exact token lists, left-padded), so rows that finished drop out and the engine's own
batching applies within the turn; the turn's tool calls then run concurrently in a thread pool
(`max_parallel_calls`). A row waiting for its tool therefore waits for the turn's slowest row and call:
continuous batching (adding and resuming rows inside one decode loop) is not built. Any GenerationEngine
serves (the built-in one, vLLM), on whatever weights the caller switched it to (the 3D-HybridEngine's
generation shard).

Where a turn's text holds a complete call, the generated tokens are kept up to the call's closing marker
(the smallest prefix the parser still finds it in) and the rest of the turn is dropped: the kept tokens
and their log-probs are exactly what was sampled, so the trajectory stays the sampling's own.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable

from hybridflow.agent.environment import Environment, StepResult, timed_step
from hybridflow.agent.parsers import Parser, ToolCall
from hybridflow.agent.trajectory import Trajectory, build_agent_batch, left_padded
from hybridflow.batch import Batch
from hybridflow.rollout.base import GenerationEngine, SamplingParams, check_prompt_batch

_TURN_SEED_STRIDE = 15_485_863  # each turn its own draws: the same seed would repeat the first turn's


@dataclasses.dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4
    tool_timeout_s: float = 10.0
    max_tool_output_tokens: int = 256
    max_parallel_calls: int = 8
    tool_response_template: str = "<tool_response>{output}</tool_response>"


class AgentLoop:
    """tokenizer: the policy's (encode/decode only; never a chat template between turns); parser: text ->
    ToolCall | None; make_env: () -> Environment, called once per trajectory."""

    def __init__(self, tokenizer, parser: Parser, make_env: Callable[[], Environment], limits: AgentLimits):
        self.tokenizer, self.parser, self.make_env, self.limits = tokenizer, parser, make_env, limits
        before, _, after = limits.tool_response_template.partition("{output}")
        self._before, self._after = self._encode(before), self._encode(after)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def generate(self, engine: GenerationEngine, batch: Batch, params: SamplingParams) -> Batch:
        """As GenerationEngine.generate (rollout/base.py fields), with multi-turn responses."""
        ids, mask = check_prompt_batch(batch)
        n, pad = params.n, _pad_id(engine, self.tokenizer)
        rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
        trajs = [Trajectory(rows[i // n], params.max_new_tokens) for i in range(len(rows) * n)]
        envs = [self.make_env() for _ in trajs]
        extra = _row_dicts(batch)
        for i, env in enumerate(envs):
            env.reset(extra[i // n])
        with cf.ThreadPoolExecutor(self.limits.max_parallel_calls) as pool:
            for turn in range(self.limits.max_turns):
                live = [i for i, t in enumerate(trajs) if not t.done]
                if not live:
                    break
                calls = self._turn(engine, trajs, live, params, turn, pad)
                last = turn == self.limits.max_turns - 1
                self._run_tools(pool, trajs, envs, calls if not last else {})
        for t in trajs:
            t.done = True
        for env in envs:
            env.close()
        return build_agent_batch(batch, trajs, params, pad)

    def _turn(self, engine, trajs, live, params, turn, pad) -> dict[int, ToolCall]:
        """One generate call over the live rows; -> {row: the call it ended with}."""
        ids, mask = left_padded([trajs[i].context() for i in live], pad)
        budget = max(trajs[i].remaining for i in live)
        seed = None if params.seed is None else params.seed + _TURN_SEED_STRIDE * turn
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=budget, seed=seed)
        out = engine.generate(Batch({"input_ids": ids, "attention_mask": mask}), turn_params)
        lengths = out["attention_mask"][:, -out["responses"].shape[1] :].sum(-1).tolist()
        calls = {}
        for row, i in enumerate(live):
            t = trajs[i]
            k = min(lengths[row], t.remaining)
            tokens, logps = out["responses"][row, :k].tolist(), out["rollout_log_probs"][row, :k].tolist()
            call = self.parser(self.tokenizer.decode(tokens, skip_special_tokens=False))
            if call is not None:
                k = self._call_end(tokens)
                tokens, logps = tokens[:k], logps[:k]
            t.add_model(tokens, logps)
            if call is not None and t.remaining > 0:
                calls[i] = call
            else:  # a stop token, the budget spent, or a turn that ended without a call
                t.done = True
        return calls

    def _call_end(self, tokens: list[int]) -> int:
        """The fewest leading tokens whose text still holds a complete call (a prefix has one iff every
        longer prefix does: binary search)."""
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.parser(self.tokenizer.decode(tokens[:mid], skip_special_tokens=False)) is None:
                lo = mid + 1
            else:
                hi = mid
        return hi

    def _run_tools(self, pool, trajs, envs, calls: dict[int, ToolCall]) -> None:
        """The turn's calls at once; each answer inserted as tokens (cut to max_tool_output_tokens)."""
        timeout = self.limits.tool_timeout_s
        futures = {i: pool.submit(timed_step, envs[i], call, timeout) for i, call in calls.items()}
        for i, future in futures.items():
            t = trajs[i]
            result, seconds = _result(future)
            t.tool_calls += 1
            t.tool_errors += int(result.error)
            t.tool_timeouts += int(result.timed_out)
            t.tool_time_s += seconds
            if result.reward is not None:
                t.reward = result.reward
            body = self._encode(result.observation)[: self.limits.max_tool_output_tokens]
            t.add_inserted(self._before + body + self._after)
            t.done = t.done or result.done


def _result(future) -> tuple[StepResult, float]:
    try:
        return future.result()
    except Exception as e:  # an environment's own failure is the model's observation, not the run's
        return StepResult(f"error: {type(e).__name__}: {e}", error=True), 0.0


def _pad_id(engine, tokenizer) -> int:
    pad = getattr(engine, "pad_token_id", None)
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)


def _row_dicts(batch: Batch) -> list[dict]:
    """Each prompt row's non-tensor fields (ground truth, extra info, ...), for Environment.reset."""
    b = len(batch)
    return [{k: v[i] for k, v in batch.non_tensors.items() if len(v) == b} for i in range(b)]
