"""pass@k (unbiased) and maj@n against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from hybridflow.algorithms.eval_metrics import maj_at_n, majority_correct, mean_pass_at_k, pass_at_k, pass_ks


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210 = 5/6
    assert pass_at_k(10, 3, 4) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n - c < k: always a correct one
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the mean
    # large n stays exact without huge binomials
    assert pass_at_k(1000, 10, 50) == pytest.approx(1 - math.comb(990, 50) / math.comb(1000, 50))
    assert mean_pass_at_k([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], 2) == pytest.approx((0.5 + 0 + 1) / 3)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_maj_at_n_hand_values():
    # majority "7" is right
    assert majority_correct(["7", "8", "7", "9"], [1, 0, 1, 0])
    # majority "8" is wrong although one sample was right
    assert not majority_correct(["7", "8", "8", "9"], [1, 0, 0, 0])
    # a 2-2 tie goes to the answer seen first
    assert majority_correct(["5", "6", "6", "5"], [1, 0, 0, 1])
    assert not majority_correct(["6", "5", "5", "6"], [0, 1, 1, 0])
    answers = [["7", "8", "7", "9"], ["7", "8", "8", "9"], ["1", "1", "1", "1"]]
    correct = [[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert maj_at_n(answers, correct) == pytest.approx(2 / 3)


def test_pass_ks():
    assert pass_ks(1) == [] and pass_ks(2) == [] and pass_ks(3) == [2]
    assert pass_ks(8) == [2, 4] and pass_ks(16) == [2, 4, 8]


def test_vote_metrics_names_and_values():
    from hybridflow.algorithms.eval_metrics import vote_metrics

    votes = [(["7", "8", "7", "9"], [1, 0, 1, 0]), (["1", "2", "3", "4"], [0, 0, 0, 1])]
    out = vote_metrics("val/src", votes, 4)
    assert out == {"val/src/maj@4": 0.5, "val/src/pass@2": pytest.approx((1 - 1 / 6 + 0.5) / 2)}
    assert vote_metrics("val/src", [], 4) == {}
