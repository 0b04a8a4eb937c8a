"""The two calling conventions a reward function may follow, told apart by its signature at start-up.

  verl (per sample): fn(data_source, solution_str, ground_truth, extra_info=None, **fn_kwargs) -> score
  verl (batched):    fn(data_sources, solution_strs, ground_truths, extra_infos, **fn_kwargs) -> scores
  TRL (batched):     fn(prompts, completions, **columns) -> scores, each dataset column a keyword
                     argument holding one value per sample (TRL's GRPOTrainer reward_funcs)

A function that names neither `solution_str(s)` nor `completions` is refused in one line when the
reward workers start, and so is one that requires an argument its convention never passes (a TRL
function's dataset columns are checked against the dataset where the trainer knows them), so a
mismatch fails before the first step rather than on every sample of it.

TRL's columns are the row's `extra_info` entries (hybridflow.api keeps every dataset column there) plus
`ground_truth` and `data_source`. As TRL passes them: `prompts` and `completions` are message lists when
the row's prompt is (hybridflow.api keeps a chat prompt in extra_info['prompt']: `completions[i]` is then
[{'role': 'assistant', 'content': text}]), else the rendered prompt text and the completion text;
`completion_ids` the response's token ids and `trainer_state` the step (global_step, max_steps), where
the trainer gives them (None elsewhere).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.errors import RewardSpecError

VERL, VERL_BATCHED, TRL = "verl", "verl_batched", "trl"
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCHED_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
TRL_ARGS = ("prompts", "completions", "completion_ids", "trainer_state")
CHAT_PROMPT = "prompt"  # the extra_info key of a row's chat messages (data/columns.py)


def _params(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return None


def describe(fn: Callable) -> str:
    """'name(a, b, **kw)': how a refusal names the function."""
    try:
        return f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def calling_convention(fn: Callable, batched: bool, fn_kwargs: dict) -> tuple[str, tuple[str, ...]]:
    """-> (VERL | VERL_BATCHED | TRL, the dataset columns a TRL function requires); a function that
    fits neither convention is a one-line RewardSpecError. `batched`: declared (fn.batched or
    reward.batched); it applies to verl functions (a TRL function is always batched)."""
    params = _params(fn)
    if params is None:
        return (VERL_BATCHED if batched else VERL), ()
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = {p.name for p in named}
    if batched and "solution_str" in names and "solution_strs" not in names:
        raise RewardSpecError(
            f"reward function {describe(fn)} is declared batched (reward.batched or fn.batched) but takes "
            "solution_str, one sample; a batched one takes solution_strs"
        )
    if "completions" in names:
        convention, passed = TRL, TRL_ARGS
    elif "solution_strs" in names or (batched and "solution_str" not in names):
        convention, passed = VERL_BATCHED, VERL_BATCHED_ARGS
    elif "solution_str" in names or not named:
        convention, passed = VERL, VERL_ARGS
    else:
        raise RewardSpecError(
            f"reward function {describe(fn)} follows neither TRL's convention (prompts, completions, **columns) "
            "nor verl's (data_source, solution_str, ground_truth, extra_info=None)"
        )
    positional = [p.name for p in named if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise RewardSpecError(
            f"reward function {describe(fn)}: {positional} are positional-only; it is called by keyword"
        )
    required = [
        p.name for p in named if p.default is p.empty and p.name not in passed and p.name not in fn_kwargs
    ]
    if convention != TRL and required:
        raise RewardSpecError(
            f"reward function {describe(fn)} requires {required}, which verl's convention never passes "
            f"(it passes {list(passed)} and reward fn_kwargs {sorted(fn_kwargs)})"
        )
    return convention, tuple(required)


def missing_columns(fn_name: str, required: tuple[str, ...], columns: set[str] | None) -> str | None:
    """The one-line refusal when a TRL function requires columns the dataset lacks (None: it has them,
    or the columns are not known)."""
    if columns is None:
        return None
    missing = [c for c in required if c not in columns]
    if not missing:
        return None
    return f"reward function {fn_name} requires column(s) {missing} that the dataset lacks (it has {sorted(columns)})"


def trl_columns(items: list, accepts: Callable[[str], bool]) -> dict[str, list[Any]]:
    """TRL's keyword arguments besides prompts/completions: ground_truth, data_source and every
    extra_info key, one value per sample (None where a sample lacks it), those the function takes."""
    columns: dict[str, list[Any]] = {
        "ground_truth": [it[3] for it in items],
        "data_source": [it[1] for it in items],
    }
    keys = dict.fromkeys(k for it in items for k in (it[4] or {}) if k != CHAT_PROMPT)
    columns.update({k: [(it[4] or {}).get(k) for it in items] for k in keys})
    return {k: v for k, v in columns.items() if accepts(k)}


@dataclass(frozen=True)
class TrainerState:
    """What a TRL reward function reads of `trainer_state` (transformers' TrainerState): the step."""

    global_step: int = 0
    max_steps: int = 0


def trl_inputs(items: list) -> dict[str, Any]:
    """prompts, completions, completion_ids and trainer_state as TRL passes them (see the module doc)."""
    chats = [(it[4] or {}).get(CHAT_PROMPT) if isinstance(it[4], dict) else None for it in items]
    if items and all(isinstance(c, list) for c in chats):  # a conversational dataset
        prompts = chats
        completions = [[{"role": "assistant", "content": it[2]}] for it in items]
    else:
        prompts, completions = [it[5] for it in items], [it[2] for it in items]
    state = items[0][7] if items and len(items[0]) > 7 and items[0][7] is not None else None
    return {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [it[6] if len(it) > 6 else None for it in items],
        "trainer_state": TrainerState(**state) if state is not None else None,
    }


def call_trl(fn: Callable, items: list, fn_kwargs: dict) -> list:
    """One TRL-convention call on a batch of items (registry.Item) -> the function's list of scores."""
    params = _params(fn) or []
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params}
    columns = trl_columns(items, lambda k: takes_any or k in names)
    inputs = {k: v for k, v in trl_inputs(items).items() if takes_any or k in names}
    return fn(**{**columns, **inputs, **fn_kwargs})
