"""A dense rule reward for driver tests: an untrained model never solves arithmetic, so exact match
would give all-zero advantages; counting digits gives every sample a different, non-trivial score."""


def digit_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return sum(c.isdigit() for c in solution_str) / 4.0
