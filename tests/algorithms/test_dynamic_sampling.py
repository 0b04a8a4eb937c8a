"""DAPO's pure pieces (algorithms/dynamic_sampling.py) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.dynamic_sampling import (
    GroupAccumulator,
    keep_groups,
    overlong_penalty,
    truncated_rows,
)
from hybridflow.batch import Batch


def test_keep_groups_drops_all_equal_groups_wherever_their_rows_are():
    # groups a: (1, 0) varies; b: (1, 1) all equal; c: (0, 0, 0) all equal; d: one sample (kept, as verl)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    uid = ["a", "b", "a", "c", "b", "c", "c", "d"]
    assert keep_groups(scores, uid).tolist() == [True, False, True, False, False, False, False, True]


def test_keep_groups_sees_a_difference_of_one_float32_ulp():
    one_up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert keep_groups(torch.stack([torch.tensor(1.0), one_up]), ["x", "x"]).tolist() == [True, True]


def test_overlong_penalty_hand_values():
    # cap 10, buffer 4: no penalty up to 6 tokens, then -(l - 6) / 4 * 0.5
    lengths = torch.tensor([0, 6, 7, 8, 10])
    got = overlong_penalty(lengths, max_len=10, buffer_len=4, factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    # the buffer is the whole response: every token costs factor / max_len
    assert overlong_penalty(torch.tensor([1, 4]), 4, 4, 1.0).tolist() == [-0.25, -1.0]


def test_overlong_penalty_refuses_a_buffer_outside_the_cap():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5, factor=1.0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=0, factor=1.0)


def test_truncated_rows_are_those_at_the_cap():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert truncated_rows(mask, 3).tolist() == [True, False, False, True]


def _gen_batch(first_prompt: int, prompts: int, n: int) -> Batch:
    """prompts x n rows; row value = 10 * prompt + sample."""
    rows = [10 * p + s for p in range(first_prompt, first_prompt + prompts) for s in range(n)]
    return Batch({"x": torch.tensor(rows)}, {"uid": [str(r // 10) for r in rows]})


def test_accumulator_fills_across_generation_batches_and_trims_whole_groups():
    acc = GroupAccumulator(prompts=3, n=2, concat=Batch.concat)
    acc.add(_gen_batch(0, 3, 2), torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.bool))  # keeps group 0
    assert not acc.full and acc.num_rows == 2
    acc.add(_gen_batch(3, 3, 2), torch.tensor([0, 0, 0, 0, 0, 0], dtype=torch.bool))  # keeps none
    assert not acc.full
    acc.add(_gen_batch(6, 3, 2), torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.bool))  # groups 6 and 8
    assert acc.full
    out = acc.take()
    assert out["x"].tolist() == [0, 1, 60, 61, 80, 81]
    assert (acc.num_gen_batches, acc.kept_groups, acc.dropped_groups) == (3, 3, 6)


def test_accumulator_trims_the_surplus_of_the_last_batch():
    acc = GroupAccumulator(prompts=2, n=2, concat=Batch.concat)
    acc.add(_gen_batch(0, 2, 2), torch.tensor([0, 0, 1, 1], dtype=torch.bool))
    acc.add(_gen_batch(2, 2, 2), torch.ones(4, dtype=torch.bool))
    assert acc.take()["x"].tolist() == [10, 11, 20, 21]  # group 3 is the surplus
    assert (acc.num_gen_batches, acc.kept_groups, acc.dropped_groups) == (2, 3, 1)


def test_accumulator_refuses_a_partial_group_and_an_early_take():
    acc = GroupAccumulator(prompts=1, n=2, concat=Batch.concat)
    with pytest.raises(ValueError, match="whole groups"):
        acc.add(_gen_batch(0, 1, 2), torch.tensor([1, 0], dtype=torch.bool))
    with pytest.raises(ValueError, match="0 of 2 rows"):
        acc.take()
