"""verl's config layout and dotted keys -> ours (`hybridflow train --verl`, or detected automatically).

A verl run is described by its sections (actor_rollout_ref.{model,actor,rollout,ref}, critic,
reward_model, custom_reward_function, algorithm, data, trainer); `from_verl` rewrites such a mapping
(a YAML file merged with dotted overrides) into our tree. Each verl key is either
- mapped: renamed and, where verl's meaning differs, converted (adv_estimator -> algorithm.name,
  save_freq=-1 -> save_every=0, custom_reward_function.{path,name} -> reward.fn 'path:name', ...);
  keys whose meaning depends on other keys (clip_ratio vs clip_ratio_low/high, val_kwargs.do_sample,
  DAPO, rollout correction) are read together by config/verl_rules.py;
- without an equivalent here (config/verl_keys.py): noted when it cannot change the results, refused
  in one line when its value would make verl do something other than what runs here (lora_adapter_path=a dir,
  strategy=megatron, trainer.critic_warmup=5, ...). A key in none of the tables is refused, as verl's
  struct config refuses it. Nothing is dropped silently.
docs/verl.md is the table for users (tests/config/test_verl_keys.py checks it against these tables);
tests/config/test_verl.py runs verl's GSM8K PPO and GRPO quick-start command lines through it.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from typing import Any

from hybridflow.config.loader import ConfigError, apply_overrides
from hybridflow.config.verl_keys import NOTED, NOTED_TREES, REFUSED, classify
from hybridflow.config.verl_rules import OUR_KEYS, OUR_MAPPINGS, RULES

# sections only verl has: any of them (in the YAML or the overrides) means "this is a verl config"
VERL_SECTIONS = ("actor_rollout_ref", "custom_reward_function", "reward_model")

# verl path prefix -> ours; a key whose rewritten path is one of our keys maps as is
PREFIXES = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.val_kwargs.": "rollout.val.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.ref.": "ref.",
    "actor_rollout_ref.model.": "model.",
    "critic.": "critic.",
    "reward_model.": "reward.",
    "algorithm.": "algorithm.",
    "data.": "data.",
    "trainer.": "trainer.",
}

ADV_ESTIMATORS = {
    "gae": "ppo",
    "grpo": "grpo",
    "reinforce_plus_plus": "reinforce_pp",
    "rloo": "rloo",
    "remax": "remax",
}


class NoEffect(str):
    """A note on a verl key that changes nothing here (a noted key, a sub-tree of them, a refused key at
    a value under which verl does what runs here): `hybridflow train` counts these in one line and lists
    them in the run dir (VerlNotes); a composed verl config has two hundred of them."""


class VerlNotes:
    """The `notes` of load_config for `hybridflow train`: a note that says something changed is printed at
    once; the NoEffect ones are kept, for one summary line and run_dir/verl_ignored.txt (write)."""

    FILE = "verl_ignored.txt"

    def __init__(self, stream=None):
        self.stream, self.ignored = stream, []

    def __call__(self, note: str) -> None:
        if isinstance(note, NoEffect):
            self.ignored.append(str(note))
        else:
            print(f"hybridflow: {note}", file=self.stream or sys.stderr, flush=True)

    def write(self, run_dir: str | os.PathLike) -> str:
        """run_dir/verl_ignored.txt (one note a line) -> the summary line naming it."""
        path = os.path.join(run_dir, self.FILE)
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(f"{note}\n" for note in self.ignored))
        return f"verl: {len(self.ignored)} keys have no effect here and are ignored (each listed in {path})"


def _offload(role: str):
    return lambda v, out: {f"{role}.offload": bool(v) or out.get(f"{role}.offload", False)}


def _logger(v, out):
    names = [v] if isinstance(v, str) else list(v or [])
    # jsonl feeds `hybridflow report`; verl has no such sink, so it is kept (and said so in the note)
    return {"trainer.loggers": [*dict.fromkeys([*names, "jsonl"])]}


def _freq(key: str):
    return lambda v, out: {key: max(int(v), 0)}  # verl's -1 (never / only at the end) is our 0


def _estimator(v, out):
    if v not in ADV_ESTIMATORS:
        raise ConfigError(
            [f"algorithm.adv_estimator={v!r}: not available here; choose one of {list(ADV_ESTIMATORS)}"]
        )
    return {"algorithm.name": ADV_ESTIMATORS[v]}


def _reward_enable(v, out):
    return {"reward.kind": "model" if v else "rule"}


def _engine(v, out):
    return {"rollout.engine": {"hf": "builtin"}.get(v, v)}


def _resume_mode(v, out):
    return {"trainer.resume": {"disable": "never", "auto": "auto"}.get(v, v)}


def _turns(v, out):
    return {} if v is None else {"rollout.multi_turn.max_turns": int(v)}  # verl's null: ours (4) stays


def _tool_format(v, out):
    if v != "hermes":
        raise ConfigError([f"actor_rollout_ref.rollout.multi_turn.format={v!r}: only hermes is built in; give "
                           "another as rollout.multi_turn.parser=path/file.py:function"])  # fmt: skip
    return {"rollout.multi_turn.parser": "hermes"}


def _keep(v, out):
    return {"trainer.keep_last": 0 if v is None else int(v)}  # verl's null keeps every checkpoint


def _target_modules(v, out):
    return {
        "model.lora.target_modules": [v] if isinstance(v, str) else list(v)
    }  # verl: "all-linear" or a list


def _critic_lora(v, out):
    """verl's critic rank: here the critic's adapters are model.lora's (same rank) or none."""
    actor = out.get("model.lora.rank")
    if v and actor is not None and int(v) != int(actor):
        raise ConfigError([f"verl key critic.model.lora_rank={v!r}: the critic's adapters take the actor's rank "
                           f"here (actor_rollout_ref.model.lora_rank={actor}); set the same rank or 0"])  # fmt: skip
    return {"model.lora.critic": bool(v)}


# verl key -> our key (str) or a converter (value, mapped so far) -> {our key: value}
RENAMES: dict[str, str | Callable[[Any, dict], dict]] = {
    "actor_rollout_ref.model.lora_rank": "model.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.model.target_modules": _target_modules,
    "critic.model.lora_rank": _critic_lora,
    "algorithm.adv_estimator": _estimator,
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_ctrl.type": "algorithm.kl.controller",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl.target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl.horizon",
    "algorithm.use_kl_in_reward": "algorithm.kl.in_reward",
    "algorithm.kl_penalty": "algorithm.kl.kind",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_by_std",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.tokenizer_path": "model.tokenizer_path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "actor.gradient_checkpointing",
    "actor_rollout_ref.model.use_remove_padding": "model.remove_padding",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size_per_device",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_loss_kind",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coeff",
    "actor_rollout_ref.actor.grad_clip": "actor.optim.grad_clip",
    "actor_rollout_ref.actor.optim.clip_grad": "actor.optim.grad_clip",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": _freq("actor.optim.warmup_steps"),
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.schedule",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.optim.schedule",
    "actor_rollout_ref.actor.fsdp_config.param_offload": _offload("actor"),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": _offload("actor"),
    "actor_rollout_ref.rollout.name": _engine,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tg",
    "actor_rollout_ref.rollout.multi_turn.enable": "rollout.multi_turn.enable",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": _turns,
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "rollout.multi_turn.max_parallel_calls",
    "actor_rollout_ref.rollout.multi_turn.format": _tool_format,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size_per_device",
    "actor_rollout_ref.ref.fsdp_config.param_offload": _offload("ref"),
    "critic.model.path": "model.critic_path",
    "critic.model.enable_gradient_checkpointing": "critic.gradient_checkpointing",
    "critic.model.fsdp_config.param_offload": _offload("critic"),
    "critic.model.fsdp_config.optimizer_offload": _offload("critic"),
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size_per_device",
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.optim.clip_grad": "critic.optim.grad_clip",
    "critic.optim.lr_warmup_steps": _freq("critic.optim.warmup_steps"),
    "critic.optim.warmup_style": "critic.optim.schedule",
    "critic.optim.lr_scheduler_type": "critic.optim.schedule",
    "reward_model.enable": _reward_enable,
    "reward_model.model.path": "model.reward_model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.micro_batch_size_per_device",
    "data.max_response_length": "rollout.response_length",
    "trainer.test_freq": _freq("trainer.val_every"),
    "trainer.save_freq": _freq("trainer.save_every"),
    "trainer.logger": _logger,
    "trainer.n_gpus_per_node": "resources.n_gpus_per_node",
    "trainer.nnodes": "resources.nnodes",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.max_actor_ckpt_to_keep": _keep,
    "trainer.log_val_generations": "trainer.val_generations_to_log",
    "ray_kwargs.ray_init.num_cpus": "resources.ray_num_cpus",
    "ray_init.num_cpus": "resources.ray_num_cpus",
    "trainer.resume_mode": _resume_mode,
    "trainer.resume_from_path": "trainer.resume",
    "trainer.default_local_dir": "trainer.output_dir",
}


def is_verl_config(data: dict, overrides=()) -> bool:
    """True when the mapping or the dotted overrides use a section only verl has."""
    keys = set(data) | {o.lstrip("+").partition("=")[0].split(".")[0] for o in overrides}
    return any(k in keys for k in VERL_SECTIONS)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """verl's dotted keys -> values; a mapping that is one setting (ours, or refused unless empty) whole."""
    out = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        whole = _ours(path) in OUR_MAPPINGS or ({} in REFUSED.get(path, ((), ()))[1])
        if isinstance(v, dict) and v and not whole:
            out.update(_flatten(v, f"{path}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _ours(path: str) -> str | None:
    for theirs, mine in PREFIXES.items():
        if path.startswith(theirs):
            candidate = mine + path[len(theirs) :]
            return candidate if candidate in OUR_KEYS else None
    return path if path in OUR_KEYS else None


MISSING = "???"  # OmegaConf's mandatory value, not given


# verl packs micro-batches by tokens only under use_dynamic_bsz; here the token budget is the switch
TOKEN_BUDGETS = (
    ("actor", "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("critic", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu"),
    ("ref", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
)  # fmt: skip


def _token_budgets(flat: dict, mapped: dict, notes: list[str]) -> None:
    for role, dynamic_key, budget_key in TOKEN_BUDGETS:
        dynamic, budget = flat.pop(dynamic_key, False), flat.pop(budget_key, None)
        if dynamic and budget:
            mapped[f"{role}.max_tokens_per_micro_batch"] = int(budget)
        elif budget is not None:
            notes.append(
                NoEffect(
                    f"verl key {budget_key} is ignored, as in verl, without {dynamic_key.rpartition('.')[2]}"
                )
            )


def _map_key(key: str, value: Any, mapped: dict, notes: list, errors: list[str], trees: dict) -> None:
    """One verl key: renamed or converted, moved by prefix, noted, or refused (config/verl_keys.py)."""
    rule = RENAMES.get(key)
    ours = None if rule is not None else _ours(key)
    if value is None and (isinstance(rule, str) or ours is not None):
        return  # verl's null means "not set": our default (or derived value) stands
    if value == MISSING and (rule is not None or ours is not None):
        errors.append(f"verl key {key} is ??? (a value verl requires): set it")
        return
    if isinstance(rule, str):
        mapped[rule] = value
    elif rule is not None:
        try:
            mapped.update(rule(value, mapped))
        except ConfigError as e:
            errors.extend(e.errors)
    elif ours is not None:
        mapped[ours] = value
    elif (kind := classify(key, value)) is None:  # as verl's struct config does with a key it lacks
        errors.append(
            f"verl key {key}={value!r} is not known here{_near(key)}; remove it (docs/verl.md lists them)"
        )
    elif kind[0] == "tree":
        trees.setdefault(kind[1], []).append(key)
    elif kind[0] == "error":
        errors.append(kind[1])
    else:
        notes.append(NoEffect(kind[1]))


def _near(key: str) -> str:
    """' (did you mean ...?)' for a misspelt key: the closest verl key of the tables, or of ours."""
    moved = [
        theirs + k[len(mine) :] for theirs, mine in PREFIXES.items() for k in OUR_KEYS if k.startswith(mine)
    ]
    near = difflib.get_close_matches(key, [*RENAMES, *REFUSED, *NOTED, *moved], n=1, cutoff=0.85)
    return f" (did you mean {near[0]}?)" if near else ""


def from_verl(data: dict, overrides=()) -> tuple[dict, list[str]]:
    """(verl mapping, verl dotted overrides) -> (our nested mapping, notes for keys without an
    equivalent). `${...}` interpolations are resolved as verl's OmegaConf does, after the overrides.
    Raises ConfigError (one line per key) for values that cannot be honoured here."""
    flat = _flatten(resolve_interpolations(apply_overrides(data, overrides)))
    mapped: dict[str, Any] = {"algorithm.name": "ppo"}  # verl's default estimator is gae (PPO)
    notes, errors, late, trees = [], [], {}, {}
    fn_path, fn_name = (
        flat.pop("custom_reward_function.path", None),
        flat.pop("custom_reward_function.name", None),
    )
    if fn_path:
        mapped["reward.fn"] = f"{fn_path}:{fn_name or 'compute_score'}"
    _token_budgets(flat, mapped, notes)
    for rule in RULES:  # keys read together (verl_rules.py); what they map wins over the loop's
        rule(flat, late, errors)
    filter_overlong = flat.pop("data.filter_overlong_prompts", None)
    for key, value in flat.items():
        if not key.endswith("._target_"):  # verl's dataclass names, not settings
            _map_key(key, value, mapped, notes, errors, trees)
    mapped.update(late)
    for pattern, keys in trees.items():
        notes.append(NoEffect(f"verl keys {pattern} ({len(keys)}) have no effect on results here and are "
                              f"ignored: {NOTED_TREES[pattern]}"))  # fmt: skip
    if mapped.get("rollout.engine", "builtin") != "vllm" and "rollout.gpu_memory_utilization" in mapped:
        # a vLLM setting; validation rejects it for the builtin engine (docs/rollout.md)
        value = mapped.pop("rollout.gpu_memory_utilization")
        notes.append(
            f"verl key actor_rollout_ref.rollout.gpu_memory_utilization={value!r} is a vLLM setting and is "
            "dropped: rollout.engine is builtin here (set actor_rollout_ref.rollout.name=vllm for vLLM)"
        )
    if filter_overlong:  # verl filters at load, before truncation could apply
        mapped["data.truncation"] = "filter"
    if "trainer.logger" in flat and "jsonl" not in str(flat["trainer.logger"]):
        notes.append("trainer.logger: 'jsonl' added (metrics.jsonl feeds `hybridflow report`)")
    if errors:
        raise ConfigError(errors)
    return _nest(mapped), notes


def _nest(mapped: dict) -> dict:
    out: dict = {}
    for k, v in mapped.items():
        *parents, leaf = k.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def resolve_interpolations(data: dict) -> dict:
    """verl's YAMLs are OmegaConf configs: `${a.b}`, `${oc.select:a.b,default}` and `???` (a value verl
    requires) resolve against the whole tree after the overrides, as in verl. A Hydra defaults list
    cannot be composed here: verl's composed config (`--cfg job`) can."""
    if "defaults" in data:
        raise ConfigError(["verl config: a Hydra `defaults` list is not composed here; pass the composed "
                           "config (verl's `python -m verl.trainer.main_ppo --cfg job` prints it)"])  # fmt: skip
    if not _has_interpolation(data):
        return data
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        # a ??? stays: verl fails on one only where it reads it, and so does _map_key
        return OmegaConf.to_container(OmegaConf.create(data), resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as e:
        first = str(e.msg if hasattr(e, "msg") else e).splitlines()[0]
        raise ConfigError([f"verl config: {getattr(e, 'full_key', '') or '?'}: {first}"]) from None


def _has_interpolation(node) -> bool:
    if isinstance(node, dict):
        return any(_has_interpolation(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_interpolation(v) for v in node)
    return isinstance(node, str) and "${" in node
