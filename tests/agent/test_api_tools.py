"""Tools and environments from Python (hybridflow.Run's `tools=` / `environment=`): checked when the Run is
built (one line each), their schemas given to the chat template, and a function defined inside a test (so
importable by no worker) reaching the rollout workers by value and answering the model's calls there."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from hybridflow import Run
from hybridflow.agent import Environment, StepResult, tool_schemas
from hybridflow.errors import ConfigError

FILES = Path(__file__).parent / "agent_files.py"


def make(tmp_path, model, **kwargs):
    args = {"trainer.output_dir": str(tmp_path), "trainer.experiment_name": "api_tools",
            "data.dataset": "synthetic:arithmetic", "rollout.n": 2, **kwargs.pop("args", {})}  # fmt: skip
    return Run("grpo", model=model, args=args, **kwargs)


def add(a: int, b: float = 0.5) -> float:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Lookup(Environment):
    def step(self, call, timeout_s):
        return StepResult("42", done=True)


def untyped(a):
    """Untyped."""


def undocumented(a: int):
    return a


def test_tools_become_the_config_and_the_chat_template_schemas(tmp_path, tiny_model_dir):
    run = make(tmp_path, tiny_model_dir, tools=[add, "python"])
    m = run.config.rollout.multi_turn
    assert m.enable and m.tools == ["api:add", "python"]
    add_schema = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                  "parameters": {"type": "object", "required": ["a"], "properties": {
                      "a": {"type": "integer", "description": "the first"},
                      "b": {"type": "number", "description": "the second"}}}}}  # fmt: skip
    assert tool_schemas(m)[0] == add_schema  # what the trainer gives the chat template (data/prompts.py)
    env_run = make(tmp_path, tiny_model_dir, environment=Lookup)
    assert env_run.config.rollout.multi_turn.environment == f"api:{__name__}.Lookup"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tools": [lambda a: a]}, "tools[0]: '<lambda>' has no function name"),
        ({"tools": [add, untyped]}, "tools[1]: untyped's parameters ['a'] need type hints"),
        ({"tools": [undocumented]}, "tools[0]: undocumented has no docstring"),
        ({"tools": [add, add]}, "tools: two tools are named ['add']"),
        ({"tools": [add], "environment": Lookup}, "tools and environment: give one"),
        ({"environment": lambda seed: None}, "environment: it is called with no arguments"),
        ({"environment": int}, "environment: int has no step(call, timeout_s) method"),
        ({"tools": [add], "args": {"rollout.multi_turn.enable": False}}, "tools and args'"),
    ],
)
def test_bad_tools_fail_in_one_line_before_ray(tmp_path, tiny_model_dir, kwargs, message):
    with pytest.raises(ConfigError) as e:
        make(tmp_path, tiny_model_dir, **kwargs)
    (line,) = e.value.errors
    assert line.startswith(message) and "\n" not in line


def test_a_tool_that_cannot_be_pickled_fails_at_construction(tmp_path, tiny_model_dir):
    lock = threading.Lock()

    def locked(digit: int) -> str:
        """Uses a lock."""
        with lock:
            return str(digit)

    with pytest.raises(ConfigError) as e:
        make(tmp_path, tiny_model_dir, tools=[locked])
    assert e.value.errors[0].startswith(
        "rollout.multi_turn: ['api:locked'] cannot be sent to the rollout workers"
    )


def test_a_callable_tool_answers_calls_in_the_rollout_workers(ray_cluster, tiny_model_dir, tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()

    def echo(digit: int) -> str:
        """Repeat a digit.

        Args:
            digit: the digit
        """
        (calls / f"{os.getpid()}-{digit}").touch()  # which process ran it
        return f"got {digit}"

    args = {
        "data.dataset_kwargs": {"num_samples": 8, "val_size": 2, "max_operand": 9}, "data.max_prompt_length": 16,
        "data.train_batch_size": 2, "actor.ppo_mini_batch_size": 2, "rollout.n": 2, "rollout.response_length": 24,
        "reward.num_workers": 0, "resources.device": "cpu", "resources.n_gpus_per_node": 1,
        "trainer.total_steps": 2, "trainer.val_every": 0, "trainer.loggers": ["jsonl"],
        "rollout.multi_turn.parser": f"{FILES}:digit_parser", "rollout.multi_turn.max_turns": 2,
    }  # fmt: skip
    run = make(tmp_path, tiny_model_dir, tools=[echo], args=args)
    steps = [h for h in run.train() if h["step"] > 0]
    assert len(steps) == 2 and all(
        h["agent/tool_calls/mean"] > 0 and h["agent/tool_errors/mean"] == 0 for h in steps
    )
    ran = [p.name.split("-") for p in calls.iterdir()]
    assert ran and all(int(pid) != os.getpid() for pid, _ in ran)  # in the worker, not in the driver
    rows = [json.loads(x) for x in (Path(run.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert sum("agent/tool_calls/mean" in r for r in rows) == 2
