"""`data.dataset=reasoning_gym:<task>` offline: rows built deterministically from the seed, training and
validation from disjoint parts of the generator's stream, and each row scored by reasoning-gym's verifier
through the reward registry's data_source dispatch (what `reward.fn=''` runs)."""

from __future__ import annotations

import pytest

from hybridflow.data.registry import build_rows
from hybridflow.errors import DatasetError
from hybridflow.rewards.registry import default_compute_score, is_builtin_spec, to_score

pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra (`make venv` installs it)")

KW = {"size": 6, "val_size": 3, "min_terms": 2, "max_terms": 2, "system_prompt": False}


def _score(row: dict, response: str):
    return to_score(default_compute_score(row["data_source"], response, None, row["extra_info"]))


def test_rows_are_the_generators_own_and_deterministic():
    import reasoning_gym

    train = build_rows("reasoning_gym:chain_sum", "train", 7, KW)
    assert train == build_rows("reasoning_gym:chain_sum", "train", 7, KW)
    assert train != build_rows("reasoning_gym:chain_sum", "train", 8, KW)
    val = build_rows("reasoning_gym:chain_sum", "val", 7, KW)
    assert (len(train), len(val)) == (6, 3)
    # entry i of a split is the generator's problem seed + i: training 7..12, validation 13..15
    stream = reasoning_gym.create_dataset("chain_sum", seed=7, size=9, min_terms=2, max_terms=2)
    for row, i in [*zip(train, range(6)), *zip(val, range(6, 9))]:
        assert row["prompt"] == [{"role": "user", "content": stream[i]["question"]}]
        assert row["reward_model"]["ground_truth"] == stream[i]["answer"]
        assert row["data_source"] == "reasoning_gym:chain_sum"
    with_system = build_rows("reasoning_gym:leg_counting", "train", 0, {"size": 2, "val_size": 1})
    assert (
        with_system[0]["prompt"][0]["role"] == "system"
        and "<answer>" in with_system[0]["prompt"][0]["content"]
    )


@pytest.mark.parametrize("task", ["chain_sum", "leg_counting"])
def test_the_tasks_verifier_is_the_reward(task):
    rows = build_rows(f"reasoning_gym:{task}", "train", 3, {"size": 4, "val_size": 1})
    assert is_builtin_spec(f"reasoning_gym:{task}")  # not read as module:function
    for row in rows:
        answer = row["reward_model"]["ground_truth"]
        right = _score(row, answer)
        assert right == 1.0 and right.extra == {"acc": True}
        assert _score(row, f"thinking... <answer> {answer} </answer>") == 1.0  # the default prompt's format
        wrong = _score(row, str(int(answer) + 1))
        assert wrong < 1.0 and wrong.extra == {"acc": False}


def test_mistakes_are_one_line():
    with pytest.raises(DatasetError, match="no task 'chain_sun' \\(did you mean 'reasoning_gym:chain_sum'"):
        build_rows("reasoning_gym:chain_sun", "train", 0, {})
    with pytest.raises(DatasetError, match="unexpected keyword argument 'min_term'"):
        build_rows("reasoning_gym:chain_sum", "train", 0, {"min_term": 2})
    with pytest.raises(DatasetError, match="min_terms must be positive"):
        build_rows("reasoning_gym:chain_sum", "train", 0, {"min_terms": 0})
    with pytest.raises(ValueError, match="no 'reasoning_gym' entry"):
        default_compute_score("reasoning_gym:chain_sum", "3", "3", {})
