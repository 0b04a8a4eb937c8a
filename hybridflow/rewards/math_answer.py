"""MATH-style rule reward: is the response's final (\\boxed{...}) answer mathematically equal to the gold one?

Two tiers, cheapest first: (1) string normalisation of the last \\boxed{} answer (the Hendrycks MATH
`is_equiv` recipe: strip spaces, \\left/\\right, units, `\\dfrac` -> `\\frac`, ...) plus numeric
comparison; (2) `math-verify` (symbolic equivalence via sympy: 1/2 == 0.5 == \\frac{1}{2}, intervals,
sets, ...) when the strings differ. Tier 1 answers most cases in microseconds; tier 2 costs milliseconds
and runs only on a mismatch. math-verify's own timeout uses SIGALRM, which works only on the main
thread; elsewhere we disable it and rely on the reward executor's per-sample timeout.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

__all__ = ["last_boxed_answer", "normalize_answer", "is_equiv", "compute_score"]


def last_boxed_answer(text: str) -> str | None:
    """Contents of the last \\boxed{...} (or \\fbox{...}) with balanced braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed ") and "{" not in rest.split(" ", 1)[1][:1]:  # "\boxed 5"
        return rest[len("\\boxed ") :].split("$")[0].strip()
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[open_at + 1 : i]
    return None


_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%")
_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_FRAC_HALF = re.compile(r"\\frac\{([^{}]+)\}(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")


def normalize_answer(answer: str) -> str:
    """Canonical string form of a short LaTeX answer (Hendrycks et al. 2021 `strip_string`, condensed)."""
    s = answer.strip().replace("\n", "").replace("\\\\", "\\")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = _TEXT.sub(r"\1", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace(" ", "").rstrip(".")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    if re.fullmatch(r"[a-zA-Z]\w*=.+", s) and len(s.split("=")[0]) <= 2:  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    if s.startswith("."):
        s = "0" + s
    s = s.replace("{.", "{0.")
    return s


def _as_number(s: str) -> Fraction | None:
    """'3', '-0.5', '1/2', '\\frac{1}{2}', '1,000' -> exact Fraction; anything else -> None."""
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?(/\d+)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _math_verify_equal(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    # SIGALRM-based timeouts only work on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
    answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))


def is_equiv(gold: str, answer: str, use_math_verify: bool = True) -> bool:
    """True when two short answers are equal: as normalised strings, as numbers, or (optionally) symbolically."""
    g, a = normalize_answer(gold), normalize_answer(answer)
    if g == a:
        return True
    gn, an = _as_number(g), _as_number(a)
    if gn is not None and an is not None:
        return gn == an
    if not use_math_verify:
        return False
    try:
        return _math_verify_equal(gold, answer)
    except Exception:  # math-verify raises on unparsable LaTeX: that is "not equal", not a reward error
        return False


def compute_score(solution_str: str, ground_truth: str, use_math_verify: bool = True) -> float:
    """1.0 if the last \\boxed{} answer in solution_str equals ground_truth, else 0.0.

    ground_truth may itself contain \\boxed{} (a full MATH solution); its last boxed answer is used.
    """
    answer = last_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    gold = str(ground_truth)
    gold = last_boxed_answer(gold) or gold
    return 1.0 if is_equiv(gold, answer, use_math_verify) else 0.0
