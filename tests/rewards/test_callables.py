"""Reward functions that exist only in the trainer's process (`@register_reward` in a script or notebook,
callables given to the Python API) reach the reward worker processes by value and score there with the
default reward.num_workers; a TRL-convention function gets its dataset columns; a signature or a column
that does not fit is refused when the executor starts, in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import RewardFnConfig
from hybridflow.rewards import RewardConfig, RewardExecutor, RewardSpecError, register_reward
from hybridflow.workers.reward import RuleReward

# Defined as a notebook cell or `python -c` defines them: in __main__, which the workers cannot import.
MAIN_SOURCE = """
import re

def exact(completions, answer, **kwargs):
    return [float(re.sub(r"\\s", "", c) == a) for c, a in zip(completions, answer)]

def scaled_length(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * len(solution_str)

def prompt_length(prompts, completions):
    return [len(p) for p in prompts]
"""


@pytest.fixture(scope="module")
def main_fns():
    namespace = {"__name__": "__main__"}
    exec(compile(MAIN_SOURCE, "<notebook cell>", "exec"), namespace)
    register_reward("test_callables.exact")(namespace["exact"])
    register_reward("test_callables.length")(namespace["scaled_length"])
    register_reward("test_callables.prompt_length")(namespace["prompt_length"])
    return namespace


def test_registered_main_functions_score_in_the_workers(main_fns):
    cfg = RewardConfig(fn="test_callables.exact")  # num_workers=1: a separate process
    assert cfg.num_workers == 1
    with RewardExecutor(cfg, columns={"answer", "ground_truth"}) as ex:
        assert ex._pool is not None and ex.convention == "trl"
        result = ex.score("dataset", [" 7", "9", "1 2"], ["7", "8", "12"], [{"answer": "7"}, {"answer": "8"},
                          {"answer": "12"}], prompts=["3+4=", "4+4=", "6+6="])  # fmt: skip
        np.testing.assert_array_equal(result.scores, [1.0, 0.0, 1.0])
        assert result.errors == []
    # "" dispatches on data_source: the user's registered name is found in the worker too
    with RewardExecutor(RewardConfig(fn="")) as ex:
        result = ex.score(["test_callables.length", "synthetic:arithmetic"], ["abcd", "5"], ["", "5"])
        np.testing.assert_array_equal(result.scores, [4.0, 1.0])
        assert result.errors == []


def test_a_column_the_dataset_lacks_is_refused_at_start(main_fns):
    with pytest.raises(RewardSpecError, match=r"requires column\(s\) \['answer'\] that the dataset lacks"):
        RewardExecutor(RewardConfig(fn="test_callables.exact"), columns={"ground_truth", "data_source"})


def test_a_file_function_fitting_neither_convention_is_refused_at_start(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def score(text, target):\n    return 1.0\n")
    with pytest.raises(RewardSpecError, match=r"score\(text, target\) follows neither TRL's convention") as e:
        RewardExecutor(RewardConfig(fn=f"{path}:score"))
    assert "\n" not in str(e.value)


def test_weighted_rewards_sum_and_log_each(main_fns):
    cfg = RewardConfig(
        num_workers=0,  # built-ins in-process; the registered function still gets its worker
        fns=[
            RewardFnConfig(fn="synthetic:arithmetic", weight=1.0),
            RewardFnConfig(fn="test_callables.length", weight=-0.1, name="length", fn_kwargs={"scale": 2.0}),
            RewardFnConfig(fn="test_callables.prompt_length", weight=0.0),  # logged, not scored
        ],
    )
    batch = Batch(
        {"input_ids": torch.zeros(3, 1, dtype=torch.long)},
        {
            "response_text": ["7", "8", "12"],
            "ground_truth": ["7", "7", "12"],
            "data_source": ["d"] * 3,
            "prompt_text": ["3+4=", "3+4=", "10+2="],  # the batch's rendered prompts: TRL's `prompts`
        },
    )
    rule = RuleReward(cfg, columns={"ground_truth", "data_source"})
    try:
        scores, metrics = rule(batch)
    finally:
        rule.close()
    # exact match minus 0.1 x (2 x length): 1 - 0.2, 0 - 0.2, 1 - 0.4 (float32 of float64 sums)
    np.testing.assert_allclose(scores.numpy(), [0.8, -0.2, 0.6], rtol=0, atol=1e-7)
    assert metrics["reward/arithmetic/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/length/mean"] == pytest.approx((2 + 2 + 4) / 3)
    assert metrics["reward/prompt_length/mean"] == pytest.approx((4 + 4 + 5) / 3)
    assert metrics["reward/num_errors"] == 0.0
