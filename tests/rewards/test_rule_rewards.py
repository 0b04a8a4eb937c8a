"""Rule rewards on hand-picked cases: GSM8K, MATH equivalence, arithmetic exact match, formats, registry."""

from __future__ import annotations

import pytest

from hybridflow.rewards import (
    absolute_spec,
    arithmetic,
    default_compute_score,
    format_reward,
    get_reward_fn,
    gsm8k,
    load_reward_fn,
    math_answer,
    to_score,
)
from hybridflow.rewards.registry import RewardSpecError


@pytest.mark.parametrize(
    "response, gold, method, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "strict", 1.0),
        ("#### 1,000", "1000", "strict", 1.0),
        ("#### $18.00", "18", "strict", 1.0),
        ("#### -3", "-3", "strict", 1.0),
        ("first #### 5 then corrected #### 6", "6", "strict", 1.0),  # the last marker counts
        ("#### 8", "7", "strict", 0.0),
        ("The answer is 7.", "7", "strict", 0.0),  # strict needs the marker
        ("The answer is 7.", "7", "flexible", 1.0),
        ("I think 5, no wait, 7", "7", "flexible", 1.0),
        ("no numbers here", "7", "flexible", 0.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", "strict", 1.0),  # gold as a full solution
    ],
)
def test_gsm8k(response, gold, method, expected):
    assert gsm8k.compute_score(response, gold, method=method) == expected


def test_gsm8k_format_score_and_extraction():
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "7", format_score=0.1) == 0.0
    assert gsm8k.extract_solution("x #### 3,5 y") == "3,5"
    with pytest.raises(ValueError, match="flexible"):
        gsm8k.extract_solution("#### 1", method="loose")


@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac12", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{10^\\circ}", "10", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces
        ("\\boxed{3}", "4", 0.0),
        ("the answer is 3", "3", 0.0),  # no \boxed{}
        ("\\boxed{3", "3", 0.0),  # unbalanced
        ("\\boxed{5}", "The total is $\\boxed{5}$.", 1.0),  # gold as a full solution
    ],
)
def test_math_string_tier(response, gold, expected):
    assert math_answer.compute_score(response, gold, use_math_verify=False) == expected


def test_math_verify_tier_catches_symbolic_equivalence():
    # Different strings, equal values: only the math-verify tier can tell.
    assert math_answer.compute_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", use_math_verify=False) == 0.0
    assert math_answer.compute_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
    assert math_answer.compute_score("\\boxed{2\\sqrt{3}}", "\\sqrt{8}") == 0.0
    assert math_answer.compute_score("\\boxed{\\frac{}{}}", "1") == 0.0  # unparsable: wrong, not an error


def test_arithmetic_exact_match():
    assert arithmetic.compute_score("12", "12") == 1.0
    assert arithmetic.compute_score(" 12\n", "12") == 1.0
    assert arithmetic.compute_score("12 and more", "12") == 0.0
    assert arithmetic.compute_score("121", "12") == 0.0
    assert arithmetic.compute_score("it is 12 and more", "12", mode="first_number") == 1.0
    assert arithmetic.compute_score("", "0") == 0.0


def test_format_rewards():
    assert format_reward("<think>hmm</think>\n<answer>4</answer>") == 1.0
    assert format_reward("<answer>4</answer>") == 0.0
    assert format_reward("<think>a</think><answer>4</answer> extra") == 0.0
    assert format_reward("so #### 4", "gsm8k") == 1.0
    assert format_reward("x \\boxed{4} y", "boxed") == 1.0
    assert format_reward("ANSWER: 4", r"ANSWER: \d+") == 1.0


def test_registry_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "3") == 1.0
    assert default_compute_score("synthetic:arithmetic", "7", "7") == 1.0
    assert default_compute_score("GSM8K", "#### 3", "3") == 1.0  # case-insensitive
    assert default_compute_score("gsm8k", "it is 3", "3", method="flexible") == 1.0
    with pytest.raises(KeyError, match="did you mean 'gsm8k'"):
        get_reward_fn("gsm8kk")


def test_load_reward_fn_specs(tmp_path):
    fn, batched = load_reward_fn("math")
    assert fn("math", "\\boxed{1}", "1") == 1.0 and batched is False
    path = tmp_path / "my_reward.py"
    path.write_text(
        "from hybridflow.rewards import batched_reward\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str)\n"
        "@batched_reward\ndef many(data_sources, solution_strs, ground_truths, extra_infos):\n"
        "    return [1.0] * len(solution_strs)\n"
    )
    fn, batched = load_reward_fn(f"{path}:score")
    assert fn("x", "abc", "") == 3 and batched is False
    assert load_reward_fn(f"{path}:many")[1] is True
    with pytest.raises(RewardSpecError, match="did you mean 'score'"):
        load_reward_fn(f"{path}:scor")
    with pytest.raises(RewardSpecError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/missing.py:score")
    with pytest.raises(ValueError, match="neither a registered reward"):
        load_reward_fn("no_such_reward")
    fn, _ = load_reward_fn("hybridflow.rewards.arithmetic:compute_score")  # module:function
    assert fn("5", "5") == 1.0


def test_to_score_rejects_bad_values():
    assert to_score(True) == 1.0 and to_score({"score": 0.5, "acc": 1}) == 0.5
    with pytest.raises(TypeError, match="expected a number"):
        to_score("high")
    with pytest.raises(ValueError, match="not finite as float32"):
        to_score(float("nan"))
    with pytest.raises(ValueError, match="not finite as float32"):
        to_score(1e300)  # finite as float64, inf once stored as float32
    with pytest.raises(TypeError, match="'score' key"):
        to_score({"acc": 1.0})


def test_absolute_spec(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text("def f(**kw):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("r.py:f") == f"{tmp_path}/r.py:f"
    assert absolute_spec("gsm8k") == "gsm8k" and absolute_spec("") == ""
    assert absolute_spec("synthetic:arithmetic") == "synthetic:arithmetic"
    assert absolute_spec("hybridflow.rewards.arithmetic:compute_score").startswith("hybridflow.")
