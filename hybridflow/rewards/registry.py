"""Reward functions by name: built-ins registered per `data_source`, user functions loaded from a file.

The calling convention is verl's, so reward files written for verl work unchanged:
  per-sample: fn(data_source, solution_str, ground_truth, extra_info=None, **fn_kwargs) -> float | {"score": float, ...}
  batched:    fn(data_sources, solution_strs, ground_truths, extra_infos, **fn_kwargs) -> list of the above
A function is batched when it carries `batched = True` (the `batched_reward` decorator sets it) or the
reward config says so. Arguments are passed by keyword.

TRL's convention (prompts, completions, **columns) is accepted too (conventions.py tells them apart).
Either may return None for a sample it does not apply to: that function does not score it (Unscored).

A reward spec (RewardConfig.fn) is one of: "" (dispatch on each sample's data_source), a registered
name ("gsm8k", "math", "synthetic:arithmetic", ...), "path/to/file.py:function_name", or
"package.module:function_name". File and module specs are resolved by the worker processes themselves
(such functions need not be picklable). A function the user registers (`@register_reward`, or a callable
given to hybridflow.api) exists only in the process that registered it: the executor sends it to its
workers by value (cloudpickle), so it works from a notebook or a `python -c` script too.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import os
from collections.abc import Callable
from typing import Any

from hybridflow.errors import RewardSpecError
from hybridflow.rewards import arithmetic, gsm8k, math_answer, reasoning_tasks
from hybridflow.rewards.conventions import TRL, VERL_BATCHED, call_trl
from hybridflow.rewards.formats import format_reward

__all__ = [
    "register_reward",
    "batched_reward",
    "get_reward_fn",
    "list_rewards",
    "default_compute_score",
    "load_reward_fn",
    "absolute_spec",
    "check_spec",
    "is_builtin_spec",
    "is_registered",
    "user_registered",
    "RewardSpecError",
    "to_score",
    "Unscored",
    "run_per_sample",
    "run_batched",
]

RewardFn = Callable[..., Any]


# (index, data_source, solution_str, ground_truth, extra_info, prompt[, completion_ids, trainer_state]):
# one sample as the executor passes it (the last two for TRL's convention, when the trainer has them).
Item = tuple
_REGISTRY: dict[str, RewardFn] = {}
_BUILTIN: set[str] = set()  # names registered by hybridflow's own modules: trusted, may run in-process
_FLOAT32_MAX = 3.4028234663852886e38


def register_reward(*names: str):
    """Decorator registering a per-sample reward fn(data_source, solution_str, ground_truth, extra_info, **kw)."""

    def deco(fn: RewardFn) -> RewardFn:
        for name in names:
            _REGISTRY[name] = fn
            if getattr(fn, "__module__", "").startswith("hybridflow."):
                _BUILTIN.add(name.lower())
            else:  # the user's function under a built-in's name replaces it, and is user code
                _BUILTIN.discard(name.lower())
        return fn

    return deco


def batched_reward(fn: RewardFn) -> RewardFn:
    """Mark a user reward function as batched (it receives lists and returns a list of scores)."""
    fn.batched = True
    return fn


@register_reward("gsm8k", "openai/gsm8k")
def _gsm8k(data_source, solution_str, ground_truth, extra_info=None, method="strict", format_score=0.0):
    return gsm8k.compute_score(solution_str, ground_truth, method=method, format_score=format_score)


@register_reward(
    "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math500"
)
def _math(data_source, solution_str, ground_truth, extra_info=None, use_math_verify=True):
    return math_answer.compute_score(solution_str, ground_truth, use_math_verify=use_math_verify)


@register_reward("synthetic:arithmetic", "arithmetic")
def _arithmetic(data_source, solution_str, ground_truth, extra_info=None, mode="exact"):
    return arithmetic.compute_score(solution_str, ground_truth, mode=mode)


@register_reward("format")
def _format(data_source, solution_str, ground_truth, extra_info=None, fmt="think_answer"):
    return format_reward(solution_str, fmt)


def _reasoning_gym(data_source, solution_str, ground_truth, extra_info=None):
    return reasoning_tasks.compute_score(data_source, solution_str, ground_truth, extra_info)


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> RewardFn:
    """The registered per-sample reward function for a data_source (case-insensitive), or a clear error.
    `reasoning_gym:<task>` sources are scored by reasoning-gym's verifier of the task."""
    if name.startswith(reasoning_tasks.PREFIX):
        return _reasoning_gym
    if name in _REGISTRY:
        return _REGISTRY[name]
    lowered = {k.lower(): v for k, v in _REGISTRY.items()}
    if name.lower() in lowered:
        return lowered[name.lower()]
    near = difflib.get_close_matches(name, list(_REGISTRY), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise KeyError(
        f"no reward function registered for data_source {name!r}{hint}; registered: {list_rewards()}. "
        "Register one with @register_reward(name) or set reward.fn='path/to/file.py:function_name'"
    )


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, **fn_kwargs):
    """Dispatch on data_source to the registered function (verl's default_compute_score)."""
    return get_reward_fn(str(data_source))(data_source, solution_str, ground_truth, extra_info, **fn_kwargs)


def is_builtin_spec(spec: str) -> bool:
    """True for "" and hybridflow's registered names: trusted code that may run in-process without a
    timeout guard (a name the user registered is user code: it runs in the workers)."""
    return spec == "" or spec.lower() in _BUILTIN or spec.startswith(reasoning_tasks.PREFIX)


def is_registered(spec: str) -> bool:
    return spec in _REGISTRY or spec.lower() in {k.lower() for k in _REGISTRY}


def user_registered(spec: str) -> dict[str, RewardFn]:
    """The user-registered functions a worker needs for `spec` (sent there by value): the one it names,
    or for "" (dispatch by data_source) all of them; {} for built-ins and file/module specs."""
    users = {k: fn for k, fn in _REGISTRY.items() if k.lower() not in _BUILTIN}
    if spec == "":
        return users
    return {k: fn for k, fn in users.items() if k.lower() == spec.lower()}


def _split_spec(spec: str) -> tuple[str, str, bool]:
    """'target:name' -> (target, name, target is a file)."""
    target, name = spec.rsplit(":", 1)
    return target, name, target.endswith(".py") or os.sep in target or os.path.isfile(target)


def check_spec(spec: str) -> None:
    """Check the form of a user spec without importing anything: 'path/to/file.py:function_name' naming
    an existing .py file, or 'package.module:function_name'. Raises RewardSpecError in one line."""
    if is_builtin_spec(spec) or is_registered(spec):
        return
    if ":" not in spec:
        near = difflib.get_close_matches(spec, list(_REGISTRY), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise RewardSpecError(
            f"reward.fn={spec!r} is neither a registered reward{hint} nor 'path/to/file.py:function_name'; "
            f"registered: {list_rewards()}"
        )
    target, name, is_file = _split_spec(spec)
    if not name.isidentifier():
        raise RewardSpecError(f"reward.fn={spec!r}: {name!r} after the ':' is not a function name")
    if is_file:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise RewardSpecError(f"reward.fn={spec!r}: the file {path} does not exist")
        if not path.endswith((".py", PICKLED)):
            raise RewardSpecError(f"reward.fn={spec!r}: {path} is not a Python file (.py)")
    elif not all(part.isidentifier() for part in target.split(".")):
        raise RewardSpecError(f"reward.fn={spec!r}: {target!r} is neither a .py file nor a module name")


PICKLED = ".reward.pkl"  # a Python API callable's copy in its run directory (api.py pickled_rewards)


def _load_from_file(path: str, name: str) -> RewardFn:
    path = os.path.abspath(os.path.expanduser(path))
    if path.endswith(PICKLED):  # written by the run's own Run(...), so as trusted as the run directory
        import cloudpickle

        with open(path, "rb") as f:
            return cloudpickle.load(f)
    if not os.path.isfile(path) or not path.endswith(".py"):
        raise RewardSpecError(f"reward function file {path!r} does not exist or is not a .py file")
    # A stable, path-derived module name: two files both called reward.py must not collide.
    mod_name = "hybridflow_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return _get_attr(module, name, path)


def _get_attr(module, name: str, where: str) -> RewardFn:
    fn = getattr(module, name, None)
    if not callable(fn):
        candidates = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        near = difflib.get_close_matches(name, candidates, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise RewardSpecError(
            f"{where} has no function {name!r}{hint}; callables there: {sorted(candidates)}"
        )
    return fn


def absolute_spec(spec: str) -> str:
    """'rel/file.py:fn' -> '/abs/rel/file.py:fn'; other specs unchanged.

    Resolve specs on the driver before they travel: Ray workers run in another working directory.
    """
    if is_registered(spec) or ":" not in spec:
        return spec
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py") or os.sep in target or os.path.isfile(target):
        return f"{os.path.abspath(os.path.expanduser(target))}:{name}"
    return spec


def load_reward_fn(spec: str) -> tuple[RewardFn, bool]:
    """Resolve a reward spec (see the module docstring) to (function, declared_batched). This imports user
    code: the executor calls it only in its worker processes for user specs (hybridflow/rewards/pool.py)."""
    if spec == "":
        return default_compute_score, False
    if is_registered(spec):
        fn = get_reward_fn(spec)
        return fn, bool(getattr(fn, "batched", False))
    check_spec(spec)
    target, name, is_file = _split_spec(spec)
    if is_file:
        fn = _load_from_file(target, name)
    else:
        fn = _get_attr(importlib.import_module(target), name, f"module {target!r}")
    return fn, bool(getattr(fn, "batched", False))


class Score(float):
    """A score carrying the reward function's other returned keys (verl's reward_extra_info, e.g.
    {"score": 1.0, "acc": True, "pred": "42"}) in `.extra`; pickles across the worker pipe."""

    extra: dict

    def __new__(cls, value: float, extra: dict | None = None):
        obj = super().__new__(cls, value)
        obj.extra = extra or {}
        return obj


class Unscored(float):
    """None from a reward function: it does not score this sample (TRL's convention), so the weighted
    sum of reward.fns leaves it out (workers/reward.py). A NaN told apart from a NaN score by its type."""

    def __new__(cls):
        return super().__new__(cls, math.nan)

    def __reduce__(self):  # crosses the worker pipe as itself
        return (Unscored, ())

    def __repr__(self) -> str:
        return "None"


def to_score(value: Any) -> float:
    """A reward function's return value as a finite float, or Unscored for None; raises on anything else
    (never guesses). A dict's keys besides 'score' (numbers, bools, strings) ride along as a Score's
    `.extra`."""
    if value is None:
        return Unscored()
    extra = None
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"reward function returned a dict without a 'score' key: {sorted(value)}")
        extra = {k: v for k, v in value.items() if k != "score" and isinstance(v, (bool, int, float, str))}
        value = value["score"]
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"reward function returned {type(value).__name__} {value!r}; expected a number"
        ) from None
    if not math.isfinite(score) or abs(score) > _FLOAT32_MAX:  # scores travel as float32
        raise ValueError(f"reward function returned {score!r}, which is not finite as float32")
    return Score(score, extra) if extra else score


def run_per_sample(fn, item: Item, fn_kwargs: dict) -> float:
    _, data_source, solution_str, ground_truth, extra_info = item[:5]
    return to_score(
        fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **fn_kwargs,
        )
    )


def run_batched(fn, items: list[Item], fn_kwargs: dict, convention: str = VERL_BATCHED) -> list[float]:
    """One call on a batch, in verl's batched convention or TRL's (conventions.py)."""
    if convention == TRL:
        out = call_trl(fn, items, fn_kwargs)
    else:
        out = fn(
            data_sources=[it[1] for it in items],
            solution_strs=[it[2] for it in items],
            ground_truths=[it[3] for it in items],
            extra_infos=[it[4] for it in items],
            **fn_kwargs,
        )
    out = list(out)
    if len(out) != len(items):
        raise ValueError(f"batched reward function returned {len(out)} scores for {len(items)} samples")
    return [to_score(v) for v in out]
