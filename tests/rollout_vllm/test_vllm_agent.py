"""The agent loop on rollout.engine=vllm: with greedy decoding and a deterministic tool, the same
trajectories as on the built-in engine (tokens, masks), and log-probs equal within 1e-4 (fp32; both
against the same weights, decode kernels apart). Runs in .venv-vllm (`make test-vllm`)."""

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


def test_builtin_and_vllm_give_the_same_greedy_trajectories():
    tok, m = build_char_tokenizer(), model("llama")
    limits = AgentLimits(max_turns=3, tool_response_template="<r>{output}</r>")
    loop = AgentLoop(tok, every_fifth, lambda: ToolEnvironment({"count": Tool.from_function(count)}), limits)
    params = SamplingParams(max_new_tokens=36, do_sample=False, eos_token_ids=())
    batch = prompt_batch(tok)
    ours, theirs = (
        loop.generate(BuiltinEngine(m), batch, params),
        loop.generate(engine("llama"), batch, params),
    )
    assert int(ours["agent_turns"].min()) == 3
    for key in ("responses", "response_mask", "attention_mask", "position_ids", "agent_turns"):
        assert torch.equal(ours[key], theirs[key]), key
    torch.testing.assert_close(ours["rollout_log_probs"], theirs["rollout_log_probs"], atol=1e-4, rtol=0)
