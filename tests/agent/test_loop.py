"""The agent loop on a real tiny model and the built-in engine, in both schedules (agent/loop.py):
continuous batching and waves of generate calls (where an engine has no continuous batch):
token in / token out turn by turn, tool tokens out of the loss, rollout log-probs equal to a training
forward over the same tokens, limits, and rows that do not wait for each other's tools.

A random tiny model emits near-uniform characters, so the test's parser calls a tool at the first digit a
turn produces (a pluggable parser, as a user's would be): most trajectories then hold several turns."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from hybridflow.agent.environment import Environment, StepResult, ToolEnvironment
from hybridflow.agent.loop import AgentLimits, AgentLoop
from hybridflow.agent.parsers import ToolCall, parse_hermes
from hybridflow.agent.tools import Tool
from hybridflow.agent.trajectory import Trajectory
from hybridflow.algorithms.advantages import compute_gae, compute_grpo_advantages
from hybridflow.algorithms.losses import policy_loss
from hybridflow.algorithms.utils import place_score_on_last_token
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, SamplingParams
from tests.agent.agent_files import digit_parser
from tests.rollout.gen_helpers import prompt_batch

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)

TEMPLATE = "<tool_response>{output}</tool_response>"


def echo(digit: int) -> str:
    """Repeat a digit.

    Args:
        digit: the digit
    """
    return f"got {digit}" * (digit // 3 + 1)  # 7..28 characters: some outputs are cut by the limit


class Recorder(BuiltinEngine):
    """The real built-in engine, keeping every generate call's input rows and output (waves) and every
    continuous batch's joins and samples, per row, with their times (continuous)."""

    def __init__(self, model, waves=False):
        super().__init__(model)
        self.calls, self.events, self.waves = [], {}, waves

    def generate(self, batch, params):
        out = super().generate(batch, params)
        self.calls.append((batch["input_ids"], batch["attention_mask"], out))
        return out

    @contextlib.contextmanager
    def continuous(self, params, rows, max_len, prompts=None):
        if self.waves:  # as on an engine without a continuous batch
            yield None
            return
        with super().continuous(params, rows, max_len, prompts) as cb:
            if cb is not None:
                self.events = {}
                join, step = cb.join, cb.step

                def joined(row, tokens):
                    self.events.setdefault(row, []).append(("join", list(tokens), time.perf_counter()))
                    join(row, tokens)

                def stepped():
                    rows, tokens, logps = step()
                    now = time.perf_counter()
                    for r, t, lp in zip(rows, tokens.tolist(), logps.tolist()):
                        self.events[r].append(("sample", (t, lp), now))
                    return rows, tokens, logps

                cb.join, cb.step = joined, stepped
            yield cb


LIMITS = AgentLimits(
    max_turns=4, tool_timeout_s=5.0, max_tool_output_tokens=12, tool_response_template=TEMPLATE
)
PARAMS = SamplingParams(max_new_tokens=160, temperature=1.0, n=2, seed=3)


def _echo_env():
    return ToolEnvironment({"echo": Tool.from_function(echo)})


@pytest.fixture(scope="module", params=["continuous", "waves"])
def run(request):
    tok = build_char_tokenizer()
    model = build_tiny_model("tiny", "llama", seed=0).eval()
    engine = Recorder(model, waves=request.param == "waves")
    loop = AgentLoop(tok, digit_parser, _echo_env, LIMITS)
    out = loop.generate(engine, prompt_batch(tok), PARAMS)
    return tok, model, engine, out


def _rows(out):
    lr = out["responses"].shape[1]
    lengths = out["attention_mask"][:, -lr:].sum(-1)
    for r in range(len(out)):
        prompt = out["prompts"][r][out["attention_mask"][r, :-lr].bool()].tolist()
        k = int(lengths[r])
        yield r, prompt, out["responses"][r, :k].tolist(), out["response_mask"][r, :k].tolist()


def test_several_turns_happen_within_the_limits(run):
    _, _, engine, out = run
    turns = out["agent_turns"]
    assert int(turns.max()) >= 3, turns
    assert int(turns.max()) <= LIMITS.max_turns
    assert (len(engine.calls) >= 2) != bool(engine.events)  # one schedule or the other ran
    assert torch.equal(out["agent_tool_calls"] <= out["agent_turns"], torch.ones(len(out), dtype=torch.bool))
    lr = out["responses"].shape[1]
    assert int(out["attention_mask"][:, -lr:].sum(-1).max()) <= 160
    assert int((out["response_mask"] == 0).logical_and(out["attention_mask"][:, -lr:] == 1).sum()) > 0


def _inserted(tok, digit: int, room: int) -> list[int]:
    """The tool's answer to a call at `digit`: exactly the template's tokens around the output's."""
    body = tok.encode(echo(digit), add_special_tokens=False)[: LIMITS.max_tool_output_tokens]
    before, after = (tok.encode(s, add_special_tokens=False) for s in TEMPLATE.split("{output}"))
    return (before + body + after)[:room]


def test_each_turn_sees_exactly_the_tokens_so_far_and_keeps_what_it_sampled(run):
    """Waves: every model run in the final row starts where a generate call's input (unpadded) ends, that
    input is exactly the row's tokens before it, and the run's tokens and log-probs are that call's own.
    Continuous: the row's response is exactly, in order, the tokens it sampled (with their log-probs) and
    the tokens joined after them, the tool's answers; the cache row holds exactly what was joined and
    sampled (tests/rollout/test_continuous.py)."""
    tok, _, engine, out = run
    if engine.events:
        return _check_continuous(tok, engine.events, out)
    inputs = {}
    for ids, mask, call_out in engine.calls:
        for j in range(ids.shape[0]):
            inputs.setdefault(tuple(ids[j][mask[j].bool()].tolist()), []).append((call_out, j))
    checked = 0
    for r, prompt, resp, mask in _rows(out):
        s = 0
        while s < len(resp):
            e = s
            while e < len(resp) and mask[e] == 1:
                e += 1
            found = inputs[tuple(prompt + resp[:s])]  # KeyError: no turn was given exactly this prefix
            assert any(o["responses"][j, : e - s].tolist() == resp[s:e]
                       and torch.equal(o["rollout_log_probs"][j, : e - s], out["rollout_log_probs"][r, s:e])
                       for o, j in found)  # fmt: skip
            checked += 1
            if e < len(resp):
                inserted = _inserted(tok, int(tok.decode(resp[e - 1 : e])), len(resp) - e)
                assert resp[e : e + len(inserted)] == inserted
                assert all(m == 0 for m in mask[e : e + len(inserted)])
                e += len(inserted)
            s = e
    assert checked > len(out)


def _check_continuous(tok, events, out):
    for r, prompt, resp, mask in _rows(out):
        (kind, first, _), *rest = events[r]
        assert kind == "join" and first == prompt
        tokens, model, logps = [], [], []
        for kind, what, _ in rest:
            if kind == "sample":
                tokens.append(what[0])
                model.append(1)
                logps.append(what[1])
            else:
                assert what == _inserted(tok, int(tok.decode(tokens[-1:])), 10**9)[: len(what)]
                tokens += what
                model += [0] * len(what)
                logps += [0.0] * len(what)
        if len(tokens) < len(resp):  # the last call's answer ended the trajectory: inserted, never fed
            tail = _inserted(tok, int(tok.decode(tokens[-1:])), len(resp) - len(tokens))
            tokens, model, logps = tokens + tail, model + [0] * len(tail), logps + [0.0] * len(tail)
        assert tokens == resp and model == mask
        assert out["rollout_log_probs"][r, : len(resp)].tolist() == logps


def test_rollout_log_probs_equal_the_training_forward_on_model_tokens(run):
    """fp32, a 2-layer model over <= 200 positions: the decode path and one full forward differ by float
    reassociation only (~1e-6); 1e-4 is the issue's bound."""
    _, model, _, out = run
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits  # fmt: skip
    lp = out["prompts"].shape[1]
    train = logits[:, lp - 1 : -1].float().log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    mask = out["response_mask"].bool()
    assert (train - out["rollout_log_probs"])[mask].abs().max() < 1e-4
    assert torch.all(out["rollout_log_probs"][~mask] == 0)


def test_tool_tokens_carry_no_advantage_and_no_gradient(run):
    """The algorithms read one mask, response_mask: GRPO and GAE advantages are 0 on tool tokens, the
    reward lands on the last model token, and the policy loss sends no gradient to tool tokens."""
    _, _, _, out = run
    mask = out["response_mask"]
    rewards = place_score_on_last_token(torch.arange(len(out), dtype=torch.float32), mask)
    assert torch.all(rewards[mask == 0] == 0)
    uid = [i // 2 for i in range(len(out))]
    adv, _ = compute_grpo_advantages(rewards, uid, mask)
    gae, _ = compute_gae(rewards, torch.rand(mask.shape), mask, 1.0, 0.95)
    for a in (adv, gae):
        assert torch.all(a[mask == 0] == 0) and a[mask == 1].abs().sum() > 0
    log_probs = out["rollout_log_probs"].clone().requires_grad_(True)
    loss, _ = policy_loss(log_probs, out["rollout_log_probs"], adv, mask)
    loss.backward()
    assert torch.all(log_probs.grad[mask == 0] == 0) and log_probs.grad[mask == 1].abs().sum() > 0


class OneShotEnv(Environment):
    """Gym style, one per trajectory: the first call ends the episode with a reward from the row."""

    def reset(self, row: dict) -> None:
        self.target = row["prompt_text"]

    def step(self, call: ToolCall, timeout_s: float) -> StepResult:
        return StepResult(f"{len(self.target)}", done=True, reward=float(call.arguments["digit"]))


@pytest.fixture(scope="module")
def continuous_run():
    """The continuous schedule's engine (the functional decoder), for the tests that need one."""
    return build_char_tokenizer(), Recorder(build_tiny_model("tiny", "llama", seed=0).eval())


def test_an_environment_ends_the_episode_and_its_reward_reaches_extra_info(continuous_run):
    tok, engine = continuous_run
    loop = AgentLoop(tok, digit_parser, OneShotEnv, LIMITS)
    out = loop.generate(
        engine, prompt_batch(tok), SamplingParams(max_new_tokens=160, temperature=1.0, seed=5)
    )
    called = out["agent_tool_calls"] > 0
    assert called.any() and int(out["agent_tool_calls"].max()) == 1
    assert torch.equal(
        out["agent_turns"][called], torch.ones(int(called.sum()))
    )  # done: no turn after the call
    infos = out.non_tensors["extra_info"]
    for i in range(len(out)):
        reward = infos[i]["env_reward"]
        assert (reward is None) == (not bool(called[i]))


SLOW_S = 2.0


class SlowForTheFirst(Environment):
    """echo's answers; the first prompt's trajectory waits SLOW_S seconds for each of its; `starts` keeps
    when each of those slow calls began."""

    starts: list[float] = []

    def reset(self, row: dict) -> None:
        self.slow = row["uid"] == 0

    def step(self, call: ToolCall, timeout_s: float) -> StepResult:
        if self.slow:
            SlowForTheFirst.starts.append(time.perf_counter())
            time.sleep(SLOW_S)
        return StepResult(echo(call.arguments["digit"]))


def test_a_slow_tool_does_not_hold_the_other_rows(continuous_run):
    """Continuous batching: row 0's call starts as soon as its own turn ends, while other rows are still
    in their first turn; every other trajectory with a call between two turns finishes before that call
    is over; and, the draws being per row, each row samples what it samples with a quick tool (the rows
    sharing each step differ entirely between the two runs)."""
    tok, engine = continuous_run
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=0)  # a seed whose rows call tools
    SlowForTheFirst.starts.clear()
    out = AgentLoop(tok, digit_parser, SlowForTheFirst, LIMITS).generate(engine, prompt_batch(tok), params)
    events = engine.events
    finish, calls, turns = out["agent_finish_s"], out["agent_tool_calls"], out["agent_turns"]
    assert calls[0] > 0 and finish[0] >= SLOW_S  # the slow row called and waited
    others = [i for i in range(1, len(out)) if turns[i] >= 2]  # a tool answered between two of its turns
    assert others and all(finish[i] < SLOW_S for i in others), (finish, turns)
    first_turns = [_first_turn(events[i]) for i in range(1, len(out))]
    assert any(max(times) > SlowForTheFirst.starts[0] for times in first_turns if times), first_turns
    quick = AgentLoop(tok, digit_parser, _echo_env, LIMITS).generate(engine, prompt_batch(tok), params)
    assert torch.equal(quick["responses"], out["responses"])


def _first_turn(events) -> list[float]:
    """When a row sampled the tokens of its first turn (before its second join)."""
    times = []
    for kind, _, at in events[1:]:
        if kind == "join":
            break
        times.append(at)
    return times


def test_a_seeded_rollout_repeats(run):
    """Continuous: the draws are a function of (seed, row, position). Waves: the next wave waits up to
    WAVE_WAIT_S for the last wave's calls, so with quick tools the rows share the same generate calls."""
    tok, _, engine, first = run
    again = AgentLoop(tok, digit_parser, _echo_env, LIMITS).generate(engine, prompt_batch(tok), PARAMS)
    assert torch.equal(again["responses"], first["responses"])


def test_a_hermes_turn_is_parsed_only_after_a_closing_character():
    """parse_hermes.end_chars: the loop parses after tokens whose text holds ">" only, and the turn still
    ends at the call's last token (the char tokenizer has no braces: the call is a malformed one, which
    ends a turn as well)."""
    tok = build_char_tokenizer()
    texts = []

    def parser(text):
        texts.append(text)
        return parse_hermes(text)

    parser.end_chars = parse_hermes.end_chars
    loop = AgentLoop(tok, parser, _echo_env, LIMITS)
    text = 'ok <tool_call>"name": "echo"</tool_call> more'
    ids = tok.encode(text, add_special_tokens=False)
    rows = type("Rows", (), {"stop_ids": frozenset()})
    ends = [k for k in range(1, len(ids) + 1) if loop._turn_end(rows, Trajectory([1], 1000), ids[:k])[0]]
    assert ends[0] == len('ok <tool_call>"name": "echo"</tool_call>')
    assert [t[-1] for t in texts] == [">"] * text.count(">")
