"""The agent loop on rollout.engine=vllm, in both schedules (agent/loop.py): vLLM's continuous batch
(rollout/vllm_continuous.py, a request per turn) and waves of `generate` calls. With greedy decoding and
a deterministic tool, the same trajectories as on the built-in engine's continuous batch (tokens,
masks), and log-probs equal within 1e-4 (fp32; both against the same weights, decode kernels apart).
Runs in .venv-vllm (`make test-vllm`)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.agent import AgentLimits, AgentLoop, Tool, ToolCall, ToolEnvironment
from hybridflow.models.tiny import build_char_tokenizer
from hybridflow.rollout import BuiltinEngine, SamplingParams
from tests.rollout.gen_helpers import prompt_batch
from tests.rollout_vllm.test_vllm_engine import REASON, engine, model

pytestmark = pytest.mark.skipif(REASON is not None, reason=f"{REASON}")


def every_fifth(text: str) -> ToolCall | None:
    """A call after each turn's fifth character: greedy output of a random model has no natural call."""
    return ToolCall("count", {"n": len(text[:5])}, 5) if len(text) >= 5 else None


def count(n: int) -> str:
    """Count to n.

    Args:
        n: how far
    """
    return "".join(str(i) for i in range(n))


class WavesOf:
    """An engine's `generate` alone: the loop runs waves on it."""

    def __init__(self, engine):
        self.engine, self.pad_token_id = engine, engine.pad_token_id

    def generate(self, batch, params):
        return self.engine.generate(batch, params)


def test_builtin_and_vllm_give_the_same_greedy_trajectories():
    tok, m = build_char_tokenizer(), model("llama")
    limits = AgentLimits(max_turns=3, tool_response_template="<r>{output}</r>")
    loop = AgentLoop(tok, every_fifth, lambda: ToolEnvironment({"count": Tool.from_function(count)}), limits)
    params = SamplingParams(max_new_tokens=36, do_sample=False, eos_token_ids=())
    batch = prompt_batch(tok)
    vllm = engine("llama")
    requests = []
    llm_engine = vllm.llm.llm_engine
    add = llm_engine.add_request
    llm_engine.add_request = lambda rid, *a, **k: (requests.append(rid), add(rid, *a, **k))[1]
    ours = loop.generate(BuiltinEngine(m), batch, params)
    theirs = loop.generate(vllm, batch, params)
    assert len(requests) == int(theirs["agent_turns"].sum())  # continuous: one request per turn
    waves = loop.generate(WavesOf(vllm), batch, params)
    assert int(ours["agent_turns"].min()) == 3
    for out in (theirs, waves):
        for key in ("responses", "response_mask", "attention_mask", "position_ids", "agent_turns"):
            assert torch.equal(ours[key], out[key]), key
        torch.testing.assert_close(ours["rollout_log_probs"], out["rollout_log_probs"], atol=1e-4, rtol=0)
