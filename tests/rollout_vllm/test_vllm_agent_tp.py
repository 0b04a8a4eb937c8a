"""The agent loop on rollout.engine=vllm with rollout.tg=2: vLLM's tensor parallel over 2 gloo ranks
(its external launcher; tests/engines/dist_workers.py, no Ray), each rank running its own vLLM engine
in lockstep (rollout/vllm_continuous.py). Only the group's first rank runs the tool calls and every rank
takes its answers: a tool that answers differently in each process still leaves both ranks with the same
trajectories, the first rank's; with a deterministic tool the greedy trajectories equal tg = 1's. One
spawn for both runs. Runs in .venv-vllm (`make test-vllm`)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hybridflow.agent.environment import Environment, StepResult
from hybridflow.agent.loop import AgentLimits, AgentLoop
from hybridflow.agent.parsers import ToolCall
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, SamplingParams
from hybridflow.rollout.vllm_engine import available
from tests.agent.agent_files import digit_parser
from tests.agent.tp_checks import assert_tg2_ranks_hold
from tests.engines.dist_workers import run_group
from tests.rollout.gen_helpers import prompt_batch

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"{REASON}")

LIMITS = AgentLimits(max_turns=4, max_tool_output_tokens=12, tool_response_template="<r>{output}</r>")
GREEDY = SamplingParams(max_new_tokens=40, do_sample=False, eos_token_ids=())
SAMPLED = SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_ids=())  # seed: each rank's own
FIELDS = ("responses", "response_mask", "rollout_log_probs", "agent_turns", "agent_tool_calls")


class Answers(Environment):
    """Deterministic answers, or (`per_process`) the answering process's id; counts this process's calls."""

    calls = 0
    per_process = False

    def reset(self, row: dict) -> None:
        pass

    def step(self, call: ToolCall, timeout_s: float) -> StepResult:
        Answers.calls += 1
        return StepResult(str(os.getpid()) if Answers.per_process else f"got {call.arguments['digit']}")


def _model():
    # 2 kv heads: vLLM's tg = 2 splits them; head_dim 32, which vLLM's CPU attention serves as is
    return build_tiny_model("tiny", "llama", seed=0, num_attention_heads=2, num_key_value_heads=2).eval()


def _run(engine, params: SamplingParams, per_process: bool) -> dict:
    Answers.calls, Answers.per_process = 0, per_process
    out = AgentLoop(build_char_tokenizer(), digit_parser, Answers, LIMITS).generate(
        engine, prompt_batch(build_char_tokenizer()), params
    )
    return {**{k: out[k] for k in FIELDS}, "calls_here": Answers.calls, "pid": os.getpid()}


def _ranks(case: dict, out_dir) -> dict:
    """On each rank (tests/engines/dist_workers.py): both runs on one tg = 2 vLLM engine."""
    from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    rank = dist.get_rank()
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2")
    engine = VLLMEngine(
        _model(), VLLMEngineConfig(max_model_len=128, max_num_seqs=32, tensor_parallel_size=2)
    )
    mine = {
        ("greedy", rank): _run(engine, GREEDY, per_process=False),
        ("per_process", rank): _run(engine, SAMPLED, per_process=True),
    }
    every = [None, None]  # (not engine.close(): it takes the process group with vLLM's)
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_agent_tp")
    return run_group(2, [{"name": "vllm_agent_tp"}], out, runner=_ranks)["vllm_agent_tp"]


def test_tg2_greedy_trajectories_equal_tg1(runs):
    """Greedy, deterministic tool: both ranks hold the tg = 1 trajectories (the built-in engine's, which
    vLLM's tg = 1 equals: test_vllm_agent.py); tokens equal, log-probs within 1e-4 (fp32; vLLM's tg = 2
    partial sums over hidden/2 features round differently, ~1e-6). The first rank ran every call."""
    ref = _run(BuiltinEngine(_model()), GREEDY, per_process=False)
    assert_tg2_ranks_hold(runs, ref)


def test_tg2_per_process_tool_gives_both_ranks_the_first_ranks_answers(runs):
    """Sampled, each rank drawing its own seed, and a tool that answers with its process id: both ranks
    hold the same trajectories, whose tool tokens are the first rank's id; the second rank ran no call."""
    first, second = runs[("per_process", 0)], runs[("per_process", 1)]
    for key in FIELDS:
        assert torch.equal(first[key], second[key]), key
    assert first["pid"] != second["pid"] and int(first["agent_tool_calls"].sum()) > 0
    text = "".join(build_char_tokenizer().decode(r.tolist()) for r in first["responses"])
    assert f"<r>{first['pid']}</r>" in text and str(second["pid"]) not in text
    assert first["calls_here"] == int(first["agent_tool_calls"].sum()) and second["calls_here"] == 0


@pytest.mark.skipif(
    not os.environ.get("HYBRIDFLOW_VLLM_LONG"), reason="2 vLLM ranks on Ray: HYBRIDFLOW_VLLM_LONG=1"
)
def test_train_with_tools_on_vllm_tg2(ray_cluster, tmp_path):
    """`hybridflow train` with rollout.multi_turn on vLLM with actor.parallel.tp=2 rollout.tg=2: the agent
    loop's continuous batch runs on both ranks in lockstep, the first rank alone running every call."""
    from hybridflow.models.tiny import save_tiny_model
    from tests.agent.test_agent_train import LOGGED_ECHO, agent_steps

    tools = tmp_path / "tools.py"
    tools.write_text(LOGGED_ECHO)
    model = save_tiny_model(
        tmp_path / "tiny", "tiny", "llama", seed=0, num_attention_heads=2, num_key_value_heads=2
    )
    steps = agent_steps(tmp_path, model, tools, "rollout.engine=vllm")
    pids = (tmp_path / "calls.txt").read_text().split()
    # one process ran every call: the training steps' (4 prompts x n=2) and the final validation's
    assert len(set(pids)) == 1 and len(pids) >= round(sum(r["agent/tool_calls/mean"] * 8 for r in steps))
