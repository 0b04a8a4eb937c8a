"""A rule *cost* for the synthetic arithmetic task, used by the Safe-RLHF demo and tests.

Cost 1.0 when the response is not a bare integer (stray letters or symbols: the "unsafe" output the
constraint should suppress), else 0.0. Use it with `algorithm.safe_rlhf.cost_fn=examples/rewards/arithmetic_cost.py:non_numeric_cost`.
Same calling convention as a reward function (verl's), so it runs in the reward executor's processes.
"""


def non_numeric_cost(data_source, solution_str, ground_truth, extra_info=None) -> float:
    text = solution_str.strip()
    return 0.0 if text.lstrip("-").isdigit() else 1.0
