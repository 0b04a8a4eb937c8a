"""The agent loop inside the rollout: generate until a tool call or a stop token, run the call, insert its
output as tokens, continue; per trajectory, token in, token out (agent/trajectory.py).

Scheduling. On an engine that runs a continuous batch (`engine.continuous`: the built-in engine's
functional decoder, rollout/continuous.py; vLLM's scheduler, rollout/vllm_continuous.py), each
trajectory moves on its own: the text of its turn is parsed after every token it samples; when a call
is complete (or a stop token or the budget ends the turn) the row leaves the decode batch and its call
goes to a thread pool (`max_parallel_calls`) at once; when the call returns, the row rejoins, its
inserted tokens are prefilled, and it decodes alongside rows that are mid-turn. The engines' draws are
per row (counter-based; per-request seeds on vLLM), so a seeded run's samples do not depend on which
rows share a step.

Under a generation tensor-parallel group (rollout.tg > 1, either engine) every rank of the group runs
this loop over the same rows, and the group's first rank alone runs the tool calls: between two steps it
shares which rows' calls answered, with their tokens and figures (agent/answers.py, `share`), and every
rank joins those rows in that order; the sampled tokens are alike on every rank (the built-in engine
broadcasts the first rank's; vLLM's engines, kept in lockstep, sample alike), so the ranks' turns end
alike. A group of one shares with itself: the same code path.

Elsewhere (the HF fallback, which serves no TP group; an engine without `continuous`): waves of turns.
Each wave is one `engine.generate` over the trajectories ready for a turn (their exact token lists,
left-padded). When it returns, each row's call is submitted at once, and the next wave starts with the
rows whose calls are done, after waiting up to WAVE_WAIT_S for the calls the last wave made (so that,
with quick tools, the waves and hence the draws repeat run to run). A row's call starts when the wave's
call returns, and rows join only between calls. Any GenerationEngine serves, on whatever weights the
caller switched it to (the 3D-HybridEngine's generation shard).

Where a turn's text holds a complete call, the generated tokens are kept up to the call's closing marker
(the smallest prefix the parser still finds it in) and the rest of the turn is dropped (waves) or never
sampled (continuous): the kept tokens and their log-probs are exactly what was sampled.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import time
from collections.abc import Callable

from hybridflow.agent.answers import Answer, pack, unpack
from hybridflow.agent.environment import Environment, StepResult, timed_step
from hybridflow.agent.parsers import Parser, ToolCall
from hybridflow.agent.trajectory import Trajectory, build_agent_batch, left_padded
from hybridflow.batch import Batch
from hybridflow.rollout.base import GenerationEngine, SamplingParams, check_prompt_batch, prompt_ids
from hybridflow.rollout.continuous import ContinuousBatch  # or rollout/vllm_continuous.py's, same calls

_TURN_SEED_STRIDE = 15_485_863  # each wave its own draws: the same seed would repeat the first wave's
WAVE_WAIT_S = 0.5
"""How long the next wave waits for the last wave's tool calls: quick tools (a calculator, a lookup)
answer well within it, so their rows go on together and the waves, hence the draws, are the same run to
run; a slower call lets the others go ahead without it."""


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
        self._end_chars = getattr(parser, "end_chars", None)
        self._may_end: dict[int, bool] = {}  # token id -> whether its text holds one of end_chars

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
        continuous = getattr(engine, "continuous", None)
        longest = max(len(r) for r in rows) + params.max_new_tokens
        with cf.ThreadPoolExecutor(self.limits.max_parallel_calls) as pool:
            with (
                continuous(params, len(trajs), longest, prompt_ids(batch))
                if continuous
                else contextlib.nullcontext() as batch_rows
            ):
                if batch_rows is None:
                    self._waves(engine, pool, trajs, envs, params, pad)
                else:
                    self._continuous(batch_rows, pool, trajs, envs)
        for env in envs:
            env.close()
        return build_agent_batch(batch, trajs, params, pad)

    def _continuous(self, batch_rows: ContinuousBatch, pool, trajs: list[Trajectory], envs) -> None:
        """Each row samples, calls and rejoins on its own (module docstring)."""
        start = time.perf_counter()
        calls: dict[int, cf.Future | None] = {}  # row -> its call: a future on the deciding rank, else None
        turns: list[tuple[list[int], list[float]]] = [([], []) for _ in trajs]
        for i, t in enumerate(trajs):
            batch_rows.join(i, t.context())
        while any(not t.done for t in trajs):
            if not batch_rows.ready and batch_rows.decides:
                cf.wait(list(calls.values()), return_when=cf.FIRST_COMPLETED)
            for answer in self._answered(batch_rows, calls):
                i = answer.row
                inserted = self._apply(trajs[i], answer)
                if trajs[i].done:
                    _finish(batch_rows, trajs[i], i, start)
                else:
                    batch_rows.join(i, inserted)
            if not batch_rows.ready:
                continue
            rows, tokens, logps = batch_rows.step()
            for i, token, logp in zip(rows, tokens.tolist(), logps.tolist()):
                tokens_i, logps_i = turns[i]
                tokens_i.append(token)
                logps_i.append(logp)
                ended, call = self._turn_end(batch_rows, trajs[i], tokens_i)
                if not ended:
                    continue
                batch_rows.leave(i)
                trajs[i].add_model(tokens_i, logps_i)
                turns[i] = ([], [])
                if call is not None and trajs[i].remaining > 0 and trajs[i].turns < self.limits.max_turns:
                    calls[i] = (
                        pool.submit(timed_step, envs[i], call, self.limits.tool_timeout_s)
                        if batch_rows.decides
                        else None
                    )
                else:  # a stop token, the budget spent, a turn without a call, or a call in the last turn
                    _finish(batch_rows, trajs[i], i, start)

    def _answered(self, batch_rows: ContinuousBatch, calls: dict[int, cf.Future | None]) -> list[Answer]:
        """The calls that answered since the last look, on the deciding rank, and those same answers, in
        its order, on every rank of a TP group; each is removed from `calls`."""
        done = [i for i, f in calls.items() if f is not None and f.done()]
        answers = unpack(batch_rows.share(pack([self._answer(i, calls[i]) for i in done])))
        for a in answers:
            del calls[a.row]
        return answers

    def _turn_end(
        self, batch_rows: ContinuousBatch, t: Trajectory, tokens: list[int]
    ) -> tuple[bool, ToolCall | None]:
        """The turn so far -> (whether it ended, the call it ended with or None). The first token at which
        the parser finds a call is the call's end: no later token is sampled."""
        call = None
        if self._may_end_call(tokens[-1]):
            call = self.parser(self.tokenizer.decode(tokens, skip_special_tokens=False))
        ended = call is not None or tokens[-1] in batch_rows.stop_ids or len(tokens) >= t.remaining
        return ended, call

    def _may_end_call(self, token: int) -> bool:
        """Whether a call's text can end at `token`: always, unless the parser names the characters its
        calls end with (`end_chars`, parsers.py) and the token's own text holds none of them."""
        if self._end_chars is None:
            return True
        hit = self._may_end.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            hit = self._may_end[token] = any(c in text for c in self._end_chars)
        return hit

    def _waves(self, engine, pool, trajs, envs, params, pad) -> None:
        """Generate for the ready rows, submit their calls, go on with the rows whose calls are done."""
        start, timeout = time.perf_counter(), self.limits.tool_timeout_s
        ready, pending, wave = list(range(len(trajs))), {}, 0
        while ready or pending:
            if ready:
                calls = self._turn(engine, trajs, ready, params, wave, pad)
                wave += 1
                for i in ready:
                    if trajs[i].turns >= self.limits.max_turns:
                        calls.pop(i, None)  # a call in the row's last turn is not run
                        trajs[i].done = True
                fresh = {pool.submit(timed_step, envs[i], call, timeout): i for i, call in calls.items()}
                pending.update(fresh)
                _stamp(trajs, start)
                cf.wait(fresh, timeout=WAVE_WAIT_S)
            else:
                cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            ready = self._collect(pending, trajs)
            _stamp(trajs, start)

    def _collect(self, pending: dict, trajs: list[Trajectory]) -> list[int]:
        """Inserts the answers of the calls that are done -> their rows that go on, in row order."""
        ready = []
        for future in [f for f in pending if f.done()]:
            i = pending.pop(future)
            self._apply(trajs[i], self._answer(i, future))
            if not trajs[i].done:
                ready.append(i)
        return sorted(ready)

    def _turn(self, engine, trajs, live, params, wave, pad) -> dict[int, ToolCall]:
        """One generate call over the live rows; -> {row: the call it ended with}."""
        ids, mask = left_padded([trajs[i].context() for i in live], pad)
        budget = max(trajs[i].remaining for i in live)
        seed = None if params.seed is None else params.seed + _TURN_SEED_STRIDE * wave
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

    def _answer(self, row: int, future) -> Answer:
        """A finished call's result with its observation as tokens, cut to max_tool_output_tokens."""
        result, seconds = _result(future)
        body = self._encode(result.observation)[: self.limits.max_tool_output_tokens]
        return Answer(row, body, result.done, result.error, result.timed_out, result.reward, seconds)

    def _apply(self, t: Trajectory, answer: Answer) -> list[int]:
        """An answer inserted as tokens (within the template), its figures counted; -> the tokens
        inserted (fewer where the budget ends)."""
        t.tool_calls += 1
        t.tool_errors += int(answer.error)
        t.tool_timeouts += int(answer.timed_out)
        t.tool_time_s += answer.seconds
        if answer.reward is not None:
            t.reward = answer.reward
        before = len(t.tokens)
        t.add_inserted(self._before + answer.tokens + self._after)
        t.done = t.done or answer.done
        return t.tokens[before:]


def _finish(batch_rows: ContinuousBatch, t: Trajectory, row: int, start: float) -> None:
    t.done = True
    t.finished_s = time.perf_counter() - start
    batch_rows.finish(row)


def _stamp(trajs: list[Trajectory], start: float) -> None:
    now = time.perf_counter() - start
    for t in trajs:
        if t.done and t.finished_s is None:
            t.finished_s = now


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
