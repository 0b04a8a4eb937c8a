"""Rule rewards for verifiable tasks, and the executor that runs them safely over a batch.

Files:
  gsm8k.py        GSM8K final-answer match (`#### 42`, or the last number in flexible mode)
  math_answer.py  MATH answer equivalence: \\boxed{} extraction, normalisation, math-verify fallback
  arithmetic.py   exact match for the synthetic arithmetic task (hybridflow/data/synthetic.py)
  formats.py      format rewards (think/answer tags, `####` marker, \\boxed{})
  registry.py     reward functions by data_source name; user functions from 'file.py:function_name'
  executor.py     RewardExecutor: scores a batch; checks every score; reported failures, max_error_fraction
  pool.py         the worker processes: per-sample timeouts, concurrent once a sample of a batch is slow
  _worker.py      one worker process: imports the user's reward code, dies with its parent
  sandbox.py      reward code's limits, temp dir and process containment (PID namespace or subreaper)

Kept free of torch imports so reward worker processes start in a fraction of a second.
"""

from hybridflow._lazy import lazy_exports

__all__ = [
    "FORMATS",
    "RewardConfig",
    "RewardError",
    "RewardExecutor",
    "RewardFailureError",
    "RewardFunctionError",
    "RewardResult",
    "RewardSpecError",
    "absolute_spec",
    "batched_reward",
    "default_compute_score",
    "format_reward",
    "get_reward_fn",
    "list_rewards",
    "load_reward_fn",
    "register_reward",
    "to_score",
]
# loaded on first use (PEP 562): a reward worker imports registry.py only, not the executor, whose
# config types pull in torch (seconds of start-up per worker, and a heavier process to fork per sample)
_FROM = {"FORMATS": "formats", "format_reward": "formats"}
_FROM.update(dict.fromkeys(["RewardConfig", "RewardError", "RewardExecutor", "RewardFailureError",
                            "RewardFunctionError", "RewardResult"], "executor"))  # fmt: skip
__getattr__ = lazy_exports(__name__, {name: _FROM.get(name, "registry") for name in __all__})
