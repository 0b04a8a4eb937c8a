"""The Python API: a run from a model, reward callables and a dataset, as TRL's trainers take them.

    from hybridflow import Run

    def exact(completions, answer, **kw):            # TRL's convention: one score per completion
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    run = Run("grpo", model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[exact, "format"],
              reward_weights=[1.0, 0.1], train_dataset=rows, args={"trainer.total_steps": 100})
    history = run.train()                            # per-step metrics, as `hybridflow train` logs them

It builds the config tree `hybridflow train` reads (config/schema.py; `args` is a dict of dotted keys, a
nested dict, a HybridFlowConfig or a YAML file) and runs the same trainer on it: `Run(...).config` is
that config, checked at construction, before Ray starts. What the API adds:
- reward_funcs: callables in TRL's convention (prompts, completions, **columns) or verl's
  (data_source, solution_str, ground_truth, extra_info), told apart and checked against the dataset's
  columns now (rewards/conventions.py), and reward specs by name ('gsm8k', 'file.py:function'). They
  become reward.fns entries with reward_weights; a callable is written by value (cloudpickle) to
  run_dir/rewards/<name>.reward.pkl, which its entry names, so functions defined in a notebook or
  `python -c` work, and `hybridflow eval` or a resumed `hybridflow train` of the run finds them.
- tools / environment: typed Python functions the model may call (TRL's `tools=`; each one's JSON schema,
  from its signature and docstring, is checked now and given to the chat template) or an environment
  class / factory (one per trajectory); they turn rollout.multi_turn on and reach the rollout workers by
  value (agent/registry.py), as reward callables reach theirs.
- train_dataset / eval_dataset: a datasets.Dataset, a list of dicts or a file, mapped to verl rows
  (data/columns.py) and written under the run directory, which data.train_files then names.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.agent.registry import checked_environment, checked_tool, register
from hybridflow.agent.registry import pickled as pickled_agent_objects
from hybridflow.config import ConfigError, HybridFlowConfig, config_to_dict, load_config
from hybridflow.config.loader import config_from_dict, load_yaml
from hybridflow.data.columns import ground_truth_column, rows_of, to_prompt_rows
from hybridflow.data.files import write_jsonl
from hybridflow.errors import RewardSpecError
from hybridflow.rewards.conventions import CHAT_PROMPT, calling_convention, describe, missing_columns
from hybridflow.rewards.registry import PICKLED, get_reward_fn, is_registered, register_reward

__all__ = ["Run"]

Reward = Callable[..., Any] | str


class Run:
    """One training run. algorithm: config/algorithms.py's names (grpo, ppo, dapo, rloo, remax,
    reinforce_plus_plus, safe_rlhf, dpo, sft); model: a directory or a Hub id in the local cache;
    reward_funcs: one or a list of callables / reward specs, weighted by reward_weights (default 1 each);
    prompt_column: the prompt (text or chat messages); ground_truth_column: default the first of
    ground_truth, answer, solution the rows have. Every other column reaches TRL-convention rewards.
    tools: typed functions the model may call (or tool specs as rollout.multi_turn.tools takes them);
    environment: an Environment class or factory instead (agent/environment.py).
    As TRL's trainers take them: model may be a loaded transformers model (saved as run_dir/model);
    peft_config a peft LoraConfig (-> model.lora); processing_class a tokenizer (saved as
    run_dir/tokenizer; default the model's own)."""

    def __init__(
        self,
        algorithm: str = "grpo",
        *,
        model: str | os.PathLike | None = None,
        reward_funcs: Reward | Sequence[Reward] = (),
        reward_weights: Sequence[float] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        args: dict | HybridFlowConfig | str | os.PathLike | None = None,
        prompt_column: str = "prompt",
        ground_truth_column: str | None = None,
        tools: Sequence[Callable | str] = (),
        environment: Callable | None = None,
        peft_config: Any = None,
        processing_class: Any = None,
    ):
        data = config_data(args)
        _set(data, "algorithm.name", algorithm)
        loaded = model if model is not None and not isinstance(model, (str, os.PathLike)) else None
        if loaded is not None and not hasattr(loaded, "save_pretrained"):
            raise ConfigError(
                [
                    f"model: expected a directory, a Hub id or a loaded transformers model, got {type(model).__name__}"
                ]
            )
        if model is not None and loaded is None:
            _set_once(data, "model.path", str(model), "model")
        if peft_config is not None:
            _set_once(data, "model.lora", lora_settings(peft_config), "peft_config")
        datasets = {"train": train_dataset, "val": eval_dataset}
        targets = target_columns(config_from_dict(data))
        rows = {split: _prompt_rows(ds, prompt_column, ground_truth_column, f"{split}_dataset", targets)
                for split, ds in datasets.items() if ds is not None}  # fmt: skip
        funcs = (
            [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        )
        if funcs:
            columns = reward_columns(rows.get("train"))
            _set_once(data, "reward.fns", reward_entries(funcs, reward_weights, columns), "reward_funcs")
        for key, value in agent_settings(tools, environment).items():
            _set_once(data, f"rollout.multi_turn.{key}", value, key if key != "enable" else "tools")
        trainer = config_from_dict(data).trainer  # bad keys in args fail here, before any file is written
        if not _given(data, "trainer.experiment_name"):  # a run of its own, as TRL's trainers start
            _set(data, "trainer.experiment_name", fresh_name(trainer.output_dir, algorithm))
        run_dir = config_from_dict(data).run_dir
        pickled_rewards(data, run_dir)
        if loaded is not None:  # saved where the workers load it from, as TRL's trainers take it in memory
            _set_once(data, "model.path", save_pretrained(loaded, run_dir, "model"), "model")
        tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor holds one
        if isinstance(tokenizer, (str, os.PathLike)):
            _set_once(data, "model.tokenizer_path", str(tokenizer), "processing_class")
        elif tokenizer is not None:
            _set_once(
                data,
                "model.tokenizer_path",
                save_pretrained(tokenizer, run_dir, "tokenizer"),
                "processing_class",
            )
        elif loaded is not None and not _given(data, "model.tokenizer_path"):  # TRL: the model's own name
            _set(data, "model.tokenizer_path", getattr(loaded.config, "_name_or_path", "") or "")
        for split, prompt_rows in rows.items():
            _set_once(
                data, f"data.{split}_files", [write_rows(prompt_rows, run_dir, split)], f"{split}_dataset"
            )
            if not any(r["reward_model"]["ground_truth"] is not None for r in prompt_rows):
                data.setdefault("data", {}).setdefault(
                    "missing_ground_truth", "ignore"
                )  # rewards needing none
        self.config = load_config(data=data)
        pickled_agent_objects(self.config.rollout.multi_turn)  # what cannot reach the workers fails now

    @property
    def run_dir(self) -> str:
        return self.config.run_dir

    def train(self) -> list[dict]:
        """Train as `hybridflow train` does (an embedded Ray cluster unless one is running or
        resources.ray_address names one; the report written at the end) -> the per-step metrics.
        Ctrl-C (SIGINT) or SIGTERM, as in `hybridflow train`: the step in flight and a checkpoint are
        finished, one line says where, and the rows trained so far are returned (a later Run with the
        same arguments and trainer.experiment_name resumes there); a second signal stops at once
        (KeyboardInterrupt). Signals are handled so only when train() runs in the main thread."""
        import ray

        from hybridflow.compat.versions import log_and_check_versions
        from hybridflow.trainers import build_trainer
        from hybridflow.trainers.cli import check_this_machine, write_report_if_logged
        from hybridflow.trainers.lifecycle import Abandoned, Preempted, StopSignals

        log_and_check_versions()  # a too-old torch / transformers: one line, before Ray starts
        check_this_machine(self.config)
        embedded = not self.config.resources.ray_address and not ray.is_initialized()
        trainer = None
        try:
            trainer = build_trainer(self.config)
            # resume=auto moves a run whose directory holds another or a finished run (trainers/base.py)
            self.config.trainer.experiment_name = trainer.cfg.trainer.experiment_name
            # entered once the trainer started Ray: lifecycle.start_ray would otherwise take this process
            # (a notebook's, a script's) for the run's own and reap everything below it at the end
            with StopSignals(self.config.trainer.stop_grace_s) as signals, signals.running():
                history = trainer.fit()
        except Preempted as e:
            print(f"hybridflow: {e}", file=sys.stderr, flush=True)
            history = getattr(e, "history", [])
        except Abandoned as e:
            latest = trainer.latest_checkpoint() if trainer is not None else None
            raise KeyboardInterrupt(f"{e}; latest checkpoint: {latest}") from None
        finally:
            if trainer is not None:
                trainer.close()
            if embedded and ray.is_initialized():
                ray.shutdown()
        write_report_if_logged(self.config)
        return history


def config_data(args) -> dict:
    """args -> the nested mapping load_config takes: dotted keys ({'actor.optim.lr': 1e-5}) are nested."""
    if args is None:
        return {}
    if isinstance(args, HybridFlowConfig):
        return config_to_dict(args)
    if isinstance(args, (str, os.PathLike)):
        return load_yaml(args)
    if not isinstance(args, dict):
        raise ConfigError(
            [
                f"args: expected a dict of config keys, a HybridFlowConfig or a YAML file, got {type(args).__name__}"
            ]
        )
    data: dict = {}
    for key, value in args.items():
        _set(data, str(key), value)
    return data


def _set(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            raise ConfigError([f"args: {dotted!r} sets a key inside {part!r}, which args gives a value"])
    if isinstance(value, dict) and isinstance(data.get(leaf), dict):
        for k, v in value.items():
            _set(data[leaf], k, v)
    else:
        data[leaf] = value


def _set_once(data: dict, dotted: str, value: Any, argument: str) -> None:
    """An argument of Run sets a config key; args setting it too (to something else) is refused."""
    node = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node not in (None, "", [], value):
        raise ConfigError([f"{argument} and args' {dotted}={node!r} both say it; give one"])
    _set(data, dotted, value)


def _given(data: dict, dotted: str) -> bool:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def save_pretrained(obj: Any, run_dir: str, name: str) -> str:
    """A loaded model or tokenizer saved as run_dir/<name> (an HF directory, as model.path takes one)."""
    if not hasattr(obj, "save_pretrained"):
        what = "processing_class" if name == "tokenizer" else name
        raise ConfigError(
            [f"{what}: expected a loaded transformers {name} or a path, got {type(obj).__name__}"]
        )
    path = os.path.abspath(os.path.join(run_dir, name))
    obj.save_pretrained(path)
    return path


LORA_KEYS = {
    "r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "target_modules": "target_modules",
}


def lora_settings(peft_config: Any) -> dict:
    """A peft LoraConfig -> model.lora's keys: r, lora_alpha, lora_dropout and target_modules (None:
    every linear layer); a setting model.lora has no equivalent for is refused in one line."""
    if type(peft_config).__name__ != "LoraConfig" or not hasattr(peft_config, "r"):
        raise ConfigError([f"peft_config: expected a peft LoraConfig, got {type(peft_config).__name__}"])
    unsupported = {
        k: getattr(peft_config, k, None)
        for k in ("use_dora", "use_rslora", "modules_to_save", "layers_to_transform")
        if getattr(peft_config, k, None)
    }
    if getattr(peft_config, "bias", "none") != "none":
        unsupported["bias"] = peft_config.bias
    if unsupported:
        k, v = next(iter(unsupported.items()))
        raise ConfigError(
            [f"peft_config: {k}={v!r} has no model.lora equivalent (it takes {list(LORA_KEYS)})"]
        )
    out = {ours: getattr(peft_config, theirs) for theirs, ours in LORA_KEYS.items()}
    targets = out["target_modules"]
    out["target_modules"] = (
        ["all-linear"] if targets is None else [targets] if isinstance(targets, str) else sorted(targets)
    )
    return out


def fresh_name(output_dir: str, algorithm: str) -> str:
    """'<algorithm>-<UTC date>-<time>', with -2, -3, ... when output_dir already has that directory."""
    base = f"{algorithm}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    name, k = base, 1
    while os.path.exists(os.path.join(output_dir, name)):
        k += 1
        name = f"{base}-{k}"
    return name


def target_columns(cfg: HybridFlowConfig) -> tuple[str, ...]:
    """The columns an offline algorithm trains toward (SFT's response, DPO's chosen and rejected)."""
    name, d = cfg.algorithm.name, cfg.data
    return (d.response_key,) if name == "sft" else (d.chosen_key, d.rejected_key) if name == "dpo" else ()


def _prompt_rows(source, prompt_column: str, truth_column: str | None, what: str, targets=()) -> list[dict]:
    rows = rows_of(source, what)
    return to_prompt_rows(rows, prompt_column, ground_truth_column(rows, truth_column), what, targets)


def reward_columns(rows: list[dict] | None) -> set[str] | None:
    """What a TRL-convention reward may ask for, as the trainer passes it (data/prompts.py reward_columns)."""
    if rows is None:
        return None
    keys = {k for r in rows for k in (r.get("extra_info") or {}) if k != CHAT_PROMPT}  # that one: `prompts`
    return {"ground_truth", "data_source"} | keys


def reward_entries(
    funcs: list[Reward], weights: Sequence[float] | None, columns: set[str] | None
) -> list[dict]:
    """reward.fns entries: a callable is checked against its convention and the columns, then registered
    under its qualified name; a string is a reward spec as reward.fn takes it."""
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ConfigError([f"reward_weights: {len(weights)} weights for {len(funcs)} reward_funcs"])
    entries, names = [], set()
    for i, (fn, weight) in enumerate(zip(funcs, weights)):
        if isinstance(fn, str):
            entries.append({"fn": fn, "weight": float(weight)})
            continue
        if not callable(fn):
            raise RewardSpecError(f"reward_funcs[{i}]: {fn!r} is neither a callable nor a reward spec")
        _, required = calling_convention(fn, bool(getattr(fn, "batched", False)), {})
        refusal = missing_columns(describe(fn), required, columns)
        if refusal:
            raise RewardSpecError(refusal)
        name = getattr(fn, "__name__", "")
        name = name if name.isidentifier() and name not in names else f"reward_{i}"
        names.add(name)
        key = f"{getattr(fn, '__module__', None) or 'api'}.{getattr(fn, '__qualname__', name)}#{i}"
        register_reward(key)(fn)
        entries.append({"fn": key, "weight": float(weight), "name": name})
    return entries


def pickled_rewards(data: dict, run_dir: str) -> None:
    """Each registered reward callable is also written by value to run_dir/rewards/<name>.reward.pkl, which
    its reward.fns entry then names ('<file>:<name>'), so that `hybridflow eval` and a resumed
    `hybridflow train` of the run find it from config.yaml, in a process where no Run registered it."""
    import cloudpickle

    for entry in (data.get("reward") or {}).get("fns") or []:
        if not is_registered(entry["fn"]) or "name" not in entry:
            continue  # a spec by name or file: the config names it already
        blob = cloudpickle.dumps(get_reward_fn(entry["fn"]))
        path = os.path.abspath(os.path.join(run_dir, "rewards", f"{entry['name']}{PICKLED}"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(blob)
        os.replace(path + ".tmp", path)
        entry["fn"] = f"{path}:{entry['name']}"


def agent_settings(tools: Sequence[Callable], environment: Callable | None) -> dict:
    """rollout.multi_turn keys for a Run's tools / environment, each checked and registered by name."""
    tools = [tools] if callable(tools) else list(tools)
    if not tools and environment is None:
        return {}
    if tools and environment is not None:
        raise ConfigError(["tools and environment: give one (an environment answers the calls itself)"])
    if environment is not None:
        env = checked_environment(environment, "environment")
        name = f"{getattr(env, '__module__', None) or 'api'}.{getattr(env, '__qualname__', 'environment')}"
        return {"enable": True, "environment": register(env, name)}
    # a string is a spec as rollout.multi_turn.tools takes it ('python', 'file.py:function')
    checked = [fn if isinstance(fn, str) else checked_tool(fn, f"tools[{i}]") for i, fn in enumerate(tools)]
    names = [t.name for t in checked if not isinstance(t, str)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError([f"tools: two tools are named {twice}; the model calls them by name"])
    return {"enable": True, "tools": [t if isinstance(t, str) else register(t, t.name) for t in checked]}


def write_rows(rows: list[dict], run_dir: str, split: str) -> str:
    """run_dir/data/<split>-<digest>.jsonl: named by content, so a rerun with the same rows writes the
    same file and a run still reading an earlier file never sees it change."""
    text = "\n".join(json.dumps(r, sort_keys=True) for r in rows)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = os.path.abspath(os.path.join(run_dir, "data", f"{split}-{digest}.jsonl"))
    if not os.path.exists(path):
        write_jsonl(rows, path + ".tmp")
        os.replace(path + ".tmp", path)
    return path
