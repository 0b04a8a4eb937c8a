"""The check shared by the built-in and vLLM agent loops under a generation TP group of two ranks."""

from __future__ import annotations

import torch


def assert_tg2_ranks_hold(runs: dict, ref: dict) -> None:
    """Both tg = 2 ranks' greedy trajectories ("greedy", rank) equal the tg = 1 batch `ref` (tokens equal;
    log-probs within 1e-4: fp32, a 2-layer model whose tg = 2 partial sums over hidden/2 features round
    differently, ~1e-6), and the first rank ran every tool call, the second none."""
    assert int(ref["agent_turns"].max()) >= 2  # tools answered between turns
    for rank in (0, 1):
        got = runs[("greedy", rank)]
        for key in ("responses", "response_mask", "agent_turns", "agent_tool_calls"):
            assert torch.equal(got[key], ref[key]), (key, rank)
        torch.testing.assert_close(got["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-4, rtol=0)
    calls = int(ref["agent_tool_calls"].sum())
    assert runs[("greedy", 0)]["calls_here"] == calls and runs[("greedy", 1)]["calls_here"] == 0
