"""The agent loop on a real tiny model and the built-in engine: token in / token out turn by turn, tool
tokens out of the loss, rollout log-probs equal to a training forward over the same tokens, limits.

A random tiny model emits near-uniform characters, so the test's parser calls a tool at the first digit a
turn produces (a pluggable parser, as a user's would be): most trajectories then hold several turns."""

from __future__ import annotations

import time

import pytest
import torch

from hybridflow.agent.environment import Environment, StepResult, ToolEnvironment
from hybridflow.agent.loop import AgentLimits, AgentLoop
from hybridflow.agent.parsers import ToolCall
from hybridflow.agent.tools import Tool
from hybridflow.algorithms.advantages import compute_gae, compute_grpo_advantages
from hybridflow.algorithms.losses import policy_loss
from hybridflow.algorithms.utils import place_score_on_last_token
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, SamplingParams
from tests.agent.agent_files import digit_parser
from tests.rollout.gen_helpers import prompt_batch

TEMPLATE = "<tool_response>{output}</tool_response>"


def echo(digit: int) -> str:
    """Repeat a digit.

    Args:
        digit: the digit
    """
    return f"got {digit}" * (digit // 3 + 1)  # 7..28 characters: some outputs are cut by the limit


class Recorder(BuiltinEngine):
    """The real built-in engine, keeping every call's input rows and output."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = []

    def generate(self, batch, params):
        out = super().generate(batch, params)
        self.calls.append((batch["input_ids"], batch["attention_mask"], out))
        return out


LIMITS = AgentLimits(
    max_turns=4, tool_timeout_s=5.0, max_tool_output_tokens=12, tool_response_template=TEMPLATE
)


@pytest.fixture(scope="module")
def run():
    tok = build_char_tokenizer()
    model = build_tiny_model("tiny", "llama", seed=0).eval()
    engine = Recorder(model)
    loop = AgentLoop(tok, digit_parser, lambda: ToolEnvironment({"echo": Tool.from_function(echo)}), LIMITS)
    params = SamplingParams(max_new_tokens=160, temperature=1.0, n=2, seed=3)
    out = loop.generate(engine, prompt_batch(tok), params)
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
    assert len(engine.calls) >= 2 and int(turns.max()) >= 3, turns
    assert int(turns.max()) <= LIMITS.max_turns
    assert torch.equal(out["agent_tool_calls"] <= out["agent_turns"], torch.ones(len(out), dtype=torch.bool))
    lr = out["responses"].shape[1]
    assert int(out["attention_mask"][:, -lr:].sum(-1).max()) <= 160
    assert int((out["response_mask"] == 0).logical_and(out["attention_mask"][:, -lr:] == 1).sum()) > 0


def test_each_turn_sees_exactly_the_tokens_so_far_and_keeps_what_it_sampled(run):
    """Every model run in the final row starts where a generate call's input (unpadded) ends, that input
    is exactly the row's tokens before it, and the run's tokens and log-probs are that call's own."""
    tok, _, engine, out = run
    inputs = {}
    for ids, mask, call_out in engine.calls:
        for j in range(ids.shape[0]):
            inputs.setdefault(tuple(ids[j][mask[j].bool()].tolist()), []).append((call_out, j))
    body = lambda d: tok.encode(echo(d), add_special_tokens=False)[: LIMITS.max_tool_output_tokens]  # noqa: E731
    before, after = (tok.encode(s, add_special_tokens=False) for s in TEMPLATE.split("{output}"))
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
            if e < len(resp):  # the tool's answer: exactly the template's tokens around the output's
                digit = int(tok.decode(resp[e - 1 : e]))
                inserted = (before + body(digit) + after)[: len(resp) - e]
                assert resp[e : e + len(inserted)] == inserted
                assert all(m == 0 for m in mask[e : e + len(inserted)])
                e += len(inserted)
            s = e
    assert checked > len(out)


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


def test_an_environment_ends_the_episode_and_its_reward_reaches_extra_info(run):
    tok, _, engine, _ = run
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


SLOW_S = 3.0


class SlowForTheFirst(Environment):
    """echo's answers; the first prompt's trajectories wait SLOW_S seconds for each of theirs."""

    def reset(self, row: dict) -> None:
        self.slow = row["uid"] == 0

    def step(self, call: ToolCall, timeout_s: float) -> StepResult:
        if self.slow:
            time.sleep(SLOW_S)
        return StepResult(echo(call.arguments["digit"]))


def test_a_slow_tool_does_not_hold_the_other_rows(run):
    """Waves (agent/loop.py): the rows whose tools answered go on without the one whose tool sleeps, so
    every other trajectory, several turns with a tool call between them, finishes before that sleep is
    over (turn-synchronous, each would wait SLOW_S at its first call)."""
    tok, _, engine, _ = run
    loop = AgentLoop(tok, digit_parser, SlowForTheFirst, LIMITS)
    out = loop.generate(engine, prompt_batch(tok), SamplingParams(max_new_tokens=40, temperature=1.0, seed=3))
    finish, calls, turns = out["agent_finish_s"], out["agent_tool_calls"], out["agent_turns"]
    assert calls[0] > 0 and finish[0] >= SLOW_S  # the slow row called and waited
    others = [i for i in range(1, len(out)) if turns[i] >= 2]  # a tool answered between two of its turns
    assert others and all(finish[i] < SLOW_S for i in others), (finish, turns)


def test_quick_tools_give_the_same_waves_run_to_run(run):
    """The next wave waits up to WAVE_WAIT_S for the last wave's calls: with quick tools the rows share the
    same generate calls, so a seeded rollout repeats."""
    tok, _, engine, first = run
    loop = AgentLoop(tok, digit_parser, lambda: ToolEnvironment({"echo": Tool.from_function(echo)}), LIMITS)
    again = loop.generate(
        engine, prompt_batch(tok), SamplingParams(max_new_tokens=160, temperature=1.0, n=2, seed=3)
    )
    assert torch.equal(again["responses"], first["responses"])
