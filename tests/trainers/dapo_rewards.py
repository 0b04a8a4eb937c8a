"""Rule rewards of the DAPO driver tests: groups that are all-equal for a known half of the prompts."""


def half_constant(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """0 for every sample of a prompt with an even answer (an all-equal group, to be dropped); the
    share of digits in the response otherwise (samples differ, so the group mostly varies)."""
    if int(ground_truth) % 2 == 0:
        return 0.0
    return sum(c.isdigit() for c in solution_str) / 4.0


def half_constant_acc(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """half_constant's score, and an `acc` that is 1 for every odd answer: all-equal in every group."""
    score = half_constant(data_source, solution_str, ground_truth, extra_info)
    return {"score": score, "acc": float(int(ground_truth) % 2)}
