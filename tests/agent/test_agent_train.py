"""`hybridflow train` with rollout.multi_turn, end to end on 2 CPU ranks with actor.parallel.tp=2 and
rollout.tg=2 (the 3D-HybridEngine switches the actor to its generation layout around the agent loop,
whose continuous batch then runs tensor-parallel over both ranks: agent/loop.py): tools and parser given
by file path, tool outputs inserted into the responses the reward and the dumps see, agent/* metrics
logged, and the rollout's log-probs equal to the training forward's (the train-vs-rollout gap) on the
model's tokens. tg = 1 through the trainer: tests/agent/test_agent_ahead.py."""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.cli import main as cli_main

HERE = Path(__file__).parent
FILES = HERE / "agent_files.py"
# echo that also logs which process ran each call (a line per call, next to the file)
LOGGED_ECHO = '''
import os
from pathlib import Path


def echo(digit: int) -> str:
    """Repeat a digit.

    Args:
        digit: the digit
    """
    with open(Path(__file__).with_name("calls.txt"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    return f"got {digit}"
'''


def test_grpo_with_tools_through_the_cli(ray_cluster, tiny_model_dir, tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text(LOGGED_ECHO)
    args = [
        "algorithm.name=grpo", f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic",
        "data.dataset_kwargs={num_samples: 16, val_size: 4, max_operand: 9}", "data.max_prompt_length=16",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.response_length=40",
        "reward.num_workers=0", "resources.device=cpu", "resources.n_gpus_per_node=2", "actor.parallel.tp=2", "rollout.tg=2",
        "trainer.total_steps=2", "trainer.val_every=0", "trainer.loggers=[jsonl]", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=agent", f"trainer.rollout_data_dir={tmp_path / 'dump'}",
        "rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{tools}:echo]",
        f"rollout.multi_turn.parser={FILES}:digit_parser", "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.tool_response_template=<r>{output}</r>",
    ]  # fmt: skip
    assert cli_main(["train", *args]) == 0
    rows = [json.loads(x) for x in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/turns/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert (
            1 < r["agent/turns/mean"] <= 3
            and r["agent/tool_calls/mean"] > 0
            and r["agent/tool_tokens/mean"] > 0
        )
        assert r["response_length/mean"] == r["agent/model_tokens/mean"] + r["agent/tool_tokens/mean"]
        # fp32 on CPU: the agent loop's per-turn decode vs the packed training forward, same tokens
        assert r["rollout/log_prob_diff_max"] < 1e-4
    dumped = [
        json.loads(x) for f in sorted((tmp_path / "dump").glob("*.jsonl")) for x in f.read_text().splitlines()
    ]
    assert any("<r>got " in d["output"] for d in dumped)
    # the continuous batch's tg = 2 group: its first rank alone ran each row's calls, once (4 prompts x n=2)
    pids = (tmp_path / "calls.txt").read_text().split()
    assert len(set(pids)) == 1 and len(pids) == round(sum(r["agent/tool_calls/mean"] * 8 for r in steps))
