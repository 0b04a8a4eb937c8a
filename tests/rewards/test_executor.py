"""RewardExecutor with real worker processes: user functions, raising and hanging functions, batching."""

from __future__ import annotations

import logging
import textwrap

import numpy as np
import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.rewards import RewardConfig, RewardExecutor, RewardFunctionError, RewardSpecError

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)

USER_REWARDS = textwrap.dedent(
    """
    import os, time
    from hybridflow.rewards import batched_reward

    def score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        if solution_str == "raise":
            raise ValueError("cannot score this one")
        if solution_str == "hang":
            time.sleep(60)
        if solution_str == "die":
            os._exit(3)
        if solution_str == "bad":
            return "not a number"
        return float(solution_str == ground_truth) + bonus + (extra_info or {}).get("extra", 0.0)

    @batched_reward
    def score_many(data_sources, solution_strs, ground_truths, extra_infos):
        if "raise" in solution_strs:
            raise RuntimeError("batch failed")
        return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "user_reward.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_user_function_scores_in_workers_with_kwargs_and_extra_info(reward_file):
    cfg = RewardConfig(fn=f"{reward_file}:score", fn_kwargs={"bonus": 0.5}, num_workers=2)
    with RewardExecutor(cfg) as ex:
        n = 200  # more chunks than workers, so chunks are re-dispatched
        result = ex.score(["src"] * n, [str(i % 3) for i in range(n)], ["0"] * n)
        expected = np.array([1.5 if i % 3 == 0 else 0.5 for i in range(n)], dtype=np.float32)
        np.testing.assert_array_equal(result.scores, expected)
        assert result.errors == [] and result.metrics["reward/num_errors"] == 0
        # Same workers serve a second call; extra_info reaches the function.
        again = ex.score("src", ["a", "b"], ["a", "a"], extra_infos=[{"extra": 2.0}, None])
        np.testing.assert_array_equal(again.scores, [3.5, 0.5])


def test_raising_and_hanging_functions_are_reported_and_the_rest_scored(reward_file, caplog):
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=2, timeout_s=1.5, on_error=-1.0, chunk_size=3)
    responses = ["a", "raise", "a", "hang", "a", "b", "bad", "a", "die", "a"]
    with RewardExecutor(cfg) as ex, caplog.at_level(logging.WARNING, logger="hybridflow.rewards"):
        result = ex.score("src", responses, ["a"] * len(responses), sample_ids=[f"s{i}" for i in range(10)])
    expected = [1, -1, 1, -1, 1, 0, -1, 1, -1, 1]
    np.testing.assert_array_equal(result.scores, np.array(expected, dtype=np.float32))
    kinds = {e.sample_id: e.kind for e in result.errors}
    assert kinds == {"s1": "exception", "s3": "timeout", "s6": "exception", "s8": "worker_died"}
    by_id = {e.sample_id: e.message for e in result.errors}
    assert "ValueError: cannot score this one" in by_id["s1"] and "Traceback" in by_id["s1"]
    assert "expected a number" in by_id["s6"]
    assert "exit code 3" in by_id["s8"]
    assert result.metrics["reward/num_timeouts"] == 1 and result.metrics["reward/num_errors"] == 3
    assert "sample s1 (exception)" in caplog.text and "sample s3 (timeout)" in caplog.text
    assert "failed on 4 of 10 samples" in caplog.text


def test_on_error_raise_lists_the_failed_sample(reward_file):
    with RewardExecutor(RewardConfig(fn=f"{reward_file}:score", on_error="raise")) as ex:
        with pytest.raises(RewardFunctionError, match="sample 1 \\(exception\\)") as info:
            ex.score("src", ["a", "raise"], ["a", "a"])
    assert [e.index for e in info.value.errors] == [1]


def test_batched_function_chunks_and_failures(reward_file):
    cfg = RewardConfig(fn=f"{reward_file}:score_many", num_workers=2, chunk_size=2)
    with RewardExecutor(cfg) as ex:
        ok = ex.score("src", ["a", "b", "a", "a", "c"], ["a"] * 5)
        np.testing.assert_array_equal(ok.scores, [1, 0, 1, 1, 0])
        bad = ex.score("src", ["a", "a", "raise", "a"], ["a"] * 4)
    # The chunk holding the raising sample fails as a whole; the other chunk is scored.
    np.testing.assert_array_equal(bad.scores, [1, 1, 0, 0])
    assert sorted(e.index for e in bad.errors) == [2, 3]
    assert all("RuntimeError: batch failed" in e.message for e in bad.errors)


def test_in_process_builtin_by_data_source_and_score_batch():
    batch = Batch.from_dict(
        tensors={"response_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])},
        non_tensors={
            "response_text": ["#### 42", "17", "\\boxed{3}"],
            "ground_truth": ["42", "17", "4"],
            "data_source": ["gsm8k", "synthetic:arithmetic", "math"],
            "uid": ["u0", "u1", "u2"],
        },
    )
    with RewardExecutor(RewardConfig(num_workers=0)) as ex:
        assert ex.in_process
        result = ex.score_batch(batch)
        np.testing.assert_array_equal(result.scores, [1, 1, 0])
        tls = result.token_level_scores(batch.tensors["response_mask"])
        torch.testing.assert_close(tls, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
        # An unknown data_source is a reported per-sample error naming the registry, not a crash.
        unknown = ex.score(["gsm8k", "nope"], ["#### 1", "1"], ["1", "1"], sample_ids=["a", "b"])
    np.testing.assert_array_equal(unknown.scores, [1, 0])
    assert unknown.errors[0].sample_id == "b" and "no reward function registered" in unknown.errors[0].message


def test_user_function_with_zero_workers_still_gets_a_timeout(reward_file):
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=0, timeout_s=1.0)
    with RewardExecutor(cfg) as ex:
        assert not ex.in_process
        result = ex.score("src", ["hang", "a"], ["a", "a"])
    np.testing.assert_array_equal(result.scores, [0, 1])
    assert [e.kind for e in result.errors] == ["timeout"]


def test_config_errors_are_clear(reward_file):
    with pytest.raises(ValueError, match="on_error"):
        RewardExecutor(RewardConfig(on_error="ignore"))
    with pytest.raises(RewardSpecError, match="did you mean 'score'"):
        RewardExecutor(RewardConfig(fn=f"{reward_file}:scroe"))
    with pytest.raises(ValueError, match="batch size"):
        RewardExecutor(RewardConfig(num_workers=0)).score("gsm8k", ["a", "b"], ["1"])
