"""The agent loop's continuous batch under a generation tensor-parallel group of 2 gloo ranks
(tests/engines/dist_workers.py, no Ray; each rank holds its Megatron shard of a tiny Llama, embeddings and
lm_head vocab-parallel): the group's ranks agree on every step's rows, only the first rank runs the tool
calls, the trajectories equal the tg = 1 continuous batch's, and a slow tool does not hold the other rows.
One spawn for all the runs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from hybridflow.agent.answers import Answer, pack, unpack
from hybridflow.agent.environment import Environment, StepResult
from hybridflow.agent.loop import AgentLimits, AgentLoop
from hybridflow.agent.parsers import ToolCall
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, SamplingParams
from hybridflow.rollout.tp_group import TPGroup
from tests.agent.agent_files import digit_parser
from tests.agent.tp_checks import assert_tg2_ranks_hold
from tests.engines.dist_workers import run_group
from tests.rollout.gen_helpers import prompt_batch
from tests.rollout.test_tp_decoder import shard

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)

LIMITS = AgentLimits(max_turns=4, max_tool_output_tokens=12, tool_response_template="<r>{output}</r>")
GREEDY = SamplingParams(max_new_tokens=60, do_sample=False)
SAMPLED = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
FIELDS = ("responses", "response_mask", "rollout_log_probs", "agent_turns", "agent_tool_calls")
SLOW_S = 2.0


class Echo(Environment):
    """Deterministic answers; counts the calls this process ran. With `slow`, the first prompt's first
    call sleeps SLOW_S seconds."""

    calls = 0
    slow = False

    def reset(self, row: dict) -> None:
        self.wait = Echo.slow and row["uid"] == 0

    def step(self, call: ToolCall, timeout_s: float) -> StepResult:
        Echo.calls += 1
        if self.wait:
            self.wait = False
            time.sleep(SLOW_S)
        return StepResult(f"got {call.arguments['digit']}" * (call.arguments["digit"] // 3 + 1))


def _model():
    return build_tiny_model("tiny", "llama", seed=0).eval()


def _run(engine, params: SamplingParams, slow: bool) -> dict:
    Echo.calls, Echo.slow = 0, slow
    out = AgentLoop(build_char_tokenizer(), digit_parser, Echo, LIMITS).generate(
        engine, prompt_batch(build_char_tokenizer()), params
    )
    return {**{k: out[k] for k in FIELDS}, "finish": out["agent_finish_s"], "calls_here": Echo.calls}


def _ranks(case: dict, out_dir) -> dict:
    """On each rank of the group (tests/engines/dist_workers.py): both runs; -> every rank's results."""
    rank = dist.get_rank()
    model = _model()
    engine = BuiltinEngine(model)
    engine.set_shard(shard(model, rank, 2, vocab=True), TPGroup(dist.group.WORLD, 2, 0))
    mine = {
        ("greedy", rank): _run(engine, GREEDY, slow=False),
        ("slow", rank): _run(engine, SAMPLED, slow=True),
    }
    every = [None, None]
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_group(2, [{"name": "agent_tp"}], tmp_path_factory.mktemp("agent_tp"), runner=_ranks)[
        "agent_tp"
    ]


def test_tg2_trajectories_equal_tg1_and_tools_run_once(runs):
    """Greedy with a deterministic tool: both ranks hold the tg = 1 continuous batch's trajectories
    (tokens equal; log-probs within 1e-4: fp32, a 2-layer model whose tg = 2 partial sums over
    hidden/2 features round differently, ~1e-6); the first rank ran every call, the second none."""
    ref = _run(BuiltinEngine(_model()), GREEDY, slow=False)
    assert_tg2_ranks_hold(runs, ref)


def test_tg2_slow_tool_does_not_hold_the_other_rows(runs):
    """Row 0 waits SLOW_S for its first call; every other row with a call between two turns finishes
    before that, on both ranks, and the ranks hold the same rows (the first rank's answers)."""
    first, second = runs[("slow", 0)], runs[("slow", 1)]
    for key in FIELDS:
        assert torch.equal(first[key], second[key]), key
    turns, finish = first["agent_turns"], first["finish"]
    assert first["agent_tool_calls"][0] > 0 and finish[0] >= SLOW_S
    others = [i for i in range(1, len(turns)) if turns[i] >= 2]
    assert others, turns
    for run in (first, second):
        assert all(run["finish"][i] < SLOW_S for i in others), (run["finish"], turns)
    assert first["calls_here"] == int(first["agent_tool_calls"].sum()) and second["calls_here"] == 0


def test_answers_travel_as_floats_exactly():
    """What the first rank broadcasts: each answer's head of 7 numbers then its tokens; no reward is NaN."""
    answers = [
        Answer(3, [17, 2, 40], done=True, reward=None, seconds=0.25),
        Answer(0, [], error=True, reward=-1.5),
    ]
    flat = pack(answers)
    assert flat[:10] == [3, 3, True, False, False, flat[5], 0.25, 17, 2, 40] and flat[5] != flat[5]
    assert flat[10:] == [0, 0, False, True, False, -1.5, 0.0]
    assert unpack(flat) == answers and unpack([]) == []
