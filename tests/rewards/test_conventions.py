"""Reward functions in TRL's and verl's conventions: told apart by signature, refused in one line when
they fit neither, and called with the columns they name (pure: no processes)."""

from __future__ import annotations

import pytest

from hybridflow.errors import RewardSpecError
from hybridflow.rewards.conventions import (
    TRL,
    VERL,
    VERL_BATCHED,
    call_trl,
    calling_convention,
    missing_columns,
)
from hybridflow.rewards.registry import Unscored, run_batched

# (index, data_source, solution_str, ground_truth, extra_info, prompt)
ITEMS = [
    (0, "dataset", " 7", "7", {"answer": "7", "level": 1}, "3+4="),
    (1, "dataset", "9", "8", {"answer": "8"}, "4+4="),
]


def trl_exact(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_conventions_by_signature():
    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    def verl_many(data_sources, solution_strs, ground_truths, extra_infos):
        return []

    def anything(**kwargs):  # reward files written for verl often take **kwargs only
        return 1.0

    assert calling_convention(verl, False, {}) == (VERL, ())
    assert calling_convention(verl_many, False, {}) == (VERL_BATCHED, ())
    assert calling_convention(anything, False, {}) == (VERL, ())
    assert calling_convention(anything, True, {}) == (VERL_BATCHED, ())
    # a TRL function's required parameters beyond prompts/completions are dataset columns
    assert calling_convention(trl_exact, False, {}) == (TRL, ("answer",))
    assert calling_convention(lambda prompts, completions, level, scale: [], False, {"scale": 2}) == (
        TRL,
        ("level",),
    )


def test_functions_fitting_neither_are_refused_in_one_line():
    with pytest.raises(RewardSpecError, match=r"neither TRL's convention .* nor verl's") as e:
        calling_convention(lambda text, target: 1.0, False, {})
    assert "\n" not in str(e.value) and "<lambda>(text, target)" in str(e.value)
    with pytest.raises(
        RewardSpecError, match=r"requires \['tolerance'\], which verl's convention never passes"
    ):
        calling_convention(lambda data_source, solution_str, ground_truth, tolerance: 1.0, False, {})
    calling_convention(
        lambda data_source, solution_str, ground_truth, tolerance: 1.0, False, {"tolerance": 1}
    )


def test_missing_columns_names_them():
    assert missing_columns("f", ("answer",), {"answer", "ground_truth"}) is None
    assert missing_columns("f", ("answer",), None) is None  # columns unknown: checked by the worker's call
    assert missing_columns("f", ("answer", "level"), {"ground_truth"}) == (
        "reward function f requires column(s) ['answer', 'level'] that the dataset lacks (it has ['ground_truth'])"
    )


def test_trl_call_passes_columns_per_sample():
    seen = {}

    def probe(prompts, completions, level=None, **kwargs):
        seen.update(prompts=prompts, completions=completions, level=level, **kwargs)
        return [0.5] * len(completions)

    assert call_trl(probe, ITEMS, {"scale": 3}) == [0.5, 0.5]
    assert seen["prompts"] == ["3+4=", "4+4="] and seen["completions"] == [" 7", "9"]
    assert seen["answer"] == ["7", "8"] and seen["level"] == [1, None]  # None where a row lacks the column
    assert seen["ground_truth"] == ["7", "8"] and seen["data_source"] == ["dataset", "dataset"]
    assert seen["scale"] == 3
    # without **kwargs, a function is passed only what it names
    assert run_batched(trl_exact, ITEMS, {}, TRL) == [1.0, 0.0]
    assert run_batched(lambda completions: [len(c) for c in completions], ITEMS, {}, TRL) == [2.0, 1.0]


def test_trl_forms_chat_prompts_token_ids_and_the_step():
    """As TRL passes them: a chat prompt's completions are message lists; completion_ids and
    trainer_state are passed, and a function naming them is not refused as wanting dataset columns."""
    chat = [{"role": "user", "content": "3+4="}]
    items = [
        (0, "dataset", " 7", "7", {"answer": "7", "prompt": chat}, "<rendered>", [5, 6], {"global_step": 3})
    ]
    seen = {}

    def probe(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(
            prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, **kwargs
        )
        return [float(completions[0][0]["content"].strip() == kwargs["answer"][0])]

    assert calling_convention(probe, False, {}) == (TRL, ())
    assert run_batched(probe, items, {}, TRL) == [1.0]
    assert seen["prompts"] == [chat] and seen["completions"] == [[{"role": "assistant", "content": " 7"}]]
    assert seen["ids"] == [[5, 6]] and seen["state"].global_step == 3 and "prompt" not in seen
    # a text prompt: the rendered text and the completion text, as before
    assert run_batched(trl_exact, [(*ITEMS[0], [1], None)], {}, TRL) == [1.0]


def test_none_is_unscored_not_an_error():
    """None: the function does not apply to the sample (TRL); it survives the worker pipe as such."""
    import math
    import pickle

    scores = run_batched(lambda completions, **kw: [None, 2.0], ITEMS, {}, TRL)
    assert isinstance(scores[0], Unscored) and math.isnan(scores[0]) and scores[1] == 2.0
    assert isinstance(pickle.loads(pickle.dumps(scores[0])), Unscored)
    with pytest.raises(TypeError, match="returned str 'x'; expected a number"):
        run_batched(lambda completions, **kw: ["x", 1.0], ITEMS, {}, TRL)


def test_weighted_sum_skips_unscored_as_trl_nansum():
    import numpy as np

    from hybridflow.workers.reward import weighted_sum

    nan = float("nan")
    total, unscored = weighted_sum([(1.0, np.array([1.0, nan, nan])), (0.5, np.array([2.0, 4.0, nan]))])
    assert total.tolist() == [2.0, 2.0, 0.0] and unscored.tolist() == [False, False, True]
