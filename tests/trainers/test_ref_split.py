"""resources.frozen_pool=both: the split of each batch's reference rows between the pools
(trainers/ref_split.py) against hand-computed values, and the join of row slices (trainers/experience.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.trainers.experience import join
from hybridflow.trainers.ref_split import RefSplit, balanced_rows


def test_balanced_rows_evens_the_two_sides_in_whole_groups():
    # rollout: 4 s + 0.1 s/row * m; training: 5.2 s -> m = 12 rows, 3 groups of 4
    assert balanced_rows(32, 4, 4.0, 0.1, 5.2) == 12
    # m = 13.5 rows -> 14 rows with groups of 2, 12 (3.375 groups) with groups of 4
    assert balanced_rows(32, 2, 4.0, 0.1, 5.35) == 14
    assert balanced_rows(32, 4, 4.0, 0.1, 5.35) == 12
    # the training side is the longer even with every row on the rollout pool: all of them there
    assert balanced_rows(32, 4, 1.0, 0.1, 9.0) == 32
    # generation alone outlasts the training side: the training pool scores everything
    assert balanced_rows(32, 4, 6.0, 0.1, 5.0) == 0


def test_ref_split_predicts_the_training_side_from_the_batch_it_trains_on():
    split = RefSplit(group=4, smoothing=0.5)
    assert split.rows_for(32, 1000.0, 16) == 16  # nothing measured: half the batch
    # rollout 3 s (generate), its reference 1.6 s on 16 rows (0.1 s/row); training: reference 1.6 s on 16
    # rows (0.1 s/row), update 4 s on 2000 tokens (2 ms/token)
    split.observe(rollout_rows=16, rollout_s=3.0, rollout_ref_s=1.6, training_rows=16, training_ref_s=1.6,
                  update_tokens=2000.0, update_s=4.0)  # fmt: skip
    assert split.estimate == pytest.approx(
        {"rollout_s": 3.0, "rollout_row_s": 0.1, "training_row_s": 0.1, "update_token_s": 0.002}
    )
    # training now: 2 ms * 1500 tokens + 0.1 s * 8 rows = 3.8 s; rollout 3 s + 0.1 s * m -> m = 8
    assert split.rows_for(32, 1500.0, 8) == 8
    # a step with no rows on the training side keeps its per-row cost; the others move halfway
    split.observe(rollout_rows=32, rollout_s=5.0, rollout_ref_s=6.4, training_rows=0, training_ref_s=0.0,
                  update_tokens=1000.0, update_s=4.0)  # fmt: skip
    assert split.estimate == pytest.approx(
        {"rollout_s": 4.0, "rollout_row_s": 0.15, "training_row_s": 0.1, "update_token_s": 0.003}
    )
    # training: 3 ms * 2000 + 0 = 6 s; rollout 4 s + 0.15 s * m -> m = 13.3 -> 12 (3 groups)
    assert split.rows_for(32, 2000.0, 0) == 12


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
