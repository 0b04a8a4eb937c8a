"""resources.frozen_pool=both: the split of each batch's reference rows between the pools
(trainers/ref_split.py) against hand-computed values, and the join of row slices (trainers/experience.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.trainers.experience import join
from hybridflow.trainers.ref_split import RefSplit, balanced_rows


def test_balanced_rows_evens_the_two_sides_in_whole_groups():
    # rollout 4 s + 0.1 s/row * m; training 3.6 s + 0.1 s/row * (32 - m) -> m = 14 rows
    assert balanced_rows(32, 2, 4.0, 0.1, 3.6, 0.1) == 14
    assert balanced_rows(32, 4, 4.0, 0.1, 3.6, 0.1) == 16  # 3.5 groups of 4 -> 4 groups
    # different costs per row: 2 + 0.05 m = 5 + 0.1 (32 - m) -> m = 6.2 / 0.15 = 41.3: all 32 rows
    assert balanced_rows(32, 4, 2.0, 0.05, 5.0, 0.1) == 32
    # generation alone outlasts the training side with every row: the training pool scores everything
    assert balanced_rows(32, 4, 9.0, 0.1, 4.0, 0.1) == 0


def test_ref_split_predicts_the_update_from_the_batch_the_driver_holds():
    split = RefSplit(group=4, smoothing=0.5)
    assert split.rows_for(32, 1000.0, 30.0) == 16  # nothing measured: half the batch
    # rollout: 3 s (generate) and its reference 1.6 s on 800 tokens (2 ms/token); training: reference
    # 1.6 s on 800 tokens (2 ms/token), update 4 s on 2000 tokens (2 ms/token)
    split.observe(rollout_s=3.0, rollout_ref_s=1.6, rollout_tokens=800.0, training_ref_s=1.6,
                  training_tokens=800.0, update_s=4.0, update_tokens=2000.0)  # fmt: skip
    assert split.estimate == pytest.approx(
        {
            "rollout_s": 3.0,
            "rollout_ref_token_s": 0.002,
            "training_ref_token_s": 0.002,
            "update_token_s": 0.002,
        }
    )
    # rows of 50 tokens: 0.1 s each side; update 2 ms * 1500 = 3 s: 3 + 0.1 m = 3 + 0.1 (32 - m) -> 16
    assert split.rows_for(32, 1500.0, 50.0) == 16
    # update 2 ms * 2000 = 4 s: 3 + 0.1 m = 4 + 0.1 (32 - m) -> m = 21 -> 20
    assert split.rows_for(32, 2000.0, 50.0) == 20
    # a step with no rows on the training side keeps its cost per token; the others move halfway
    split.observe(rollout_s=5.0, rollout_ref_s=6.4, rollout_tokens=1600.0, training_ref_s=0.0,
                  training_tokens=0.0, update_s=4.0, update_tokens=1000.0)  # fmt: skip
    assert split.estimate == pytest.approx(
        {
            "rollout_s": 4.0,
            "rollout_ref_token_s": 0.003,
            "training_ref_token_s": 0.002,
            "update_token_s": 0.003,
        }
    )
    # rows of 50 tokens: 0.15 s on the rollout pool, 0.1 s on training; update 3 ms * 2000 = 6 s:
    # 4 + 0.15 m = 6 + 0.1 (32 - m) -> m = 5.2 / 0.25 = 20.8 -> 20
    assert split.rows_for(32, 2000.0, 50.0) == 20


def test_join_stacks_row_slices_in_order_until_they_cover_the_batch():
    local = Batch({"x": torch.arange(6.0)})
    scores = Batch({"s": torch.arange(6.0) * 10})
    head, tail = Batch({"ref": torch.tensor([0.0, 1.0])}), Batch({"ref": torch.tensor([2.0, 3.0, 4.0, 5.0])})
    out = join(local, head, tail, scores)
    assert out["ref"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and out["s"].tolist() == scores["s"].tolist()
    with pytest.raises(ValueError, match="do not cover"):
        join(local, head)
    with pytest.raises(ValueError, match="has 8 rows"):
        join(local, head, Batch({"ref": torch.zeros(6)}))
