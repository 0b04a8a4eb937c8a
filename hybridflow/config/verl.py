"""verl's config layout and dotted keys -> ours (`hybridflow train --verl`, or detected automatically).

A verl run is described by its sections (actor_rollout_ref.{model,actor,rollout,ref}, critic,
reward_model, custom_reward_function, algorithm, data, trainer); `from_verl` rewrites such a mapping
(a YAML file merged with dotted overrides) into our tree. Each verl key is either
- mapped: renamed and, where verl's meaning differs, converted (adv_estimator -> algorithm.name,
  save_freq=-1 -> save_every=0, custom_reward_function.{path,name} -> reward.fn 'path:name', ...);
- without an equivalent here: reported in a printed note, never dropped silently; when its value
  would change what verl does (e.g. trainer.critic_warmup=5), the config is rejected instead.
docs/verl.md is the table for users; tests/config/test_verl.py runs verl's GSM8K PPO and GRPO
quick-start command lines through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.config.loader import ConfigError, apply_overrides, leaf_paths

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


def _remove_padding(v, out):
    # one setting here for every model (actor, reference, critic): verl's two keys must agree
    if out.get("model.remove_padding", bool(v)) != bool(v):
        raise ConfigError(
            ["verl keys actor_rollout_ref.model.use_remove_padding and critic.model.use_remove_padding differ; "
             "here one setting (model.remove_padding) covers every model: give them the same value"]
        )  # fmt: skip
    return {"model.remove_padding": bool(v)}


def _do_sample(v, out):
    return {} if v else {"rollout.val.temperature": 0.0}


def _resume_mode(v, out):
    return {"trainer.resume": {"disable": "never", "auto": "auto"}.get(v, v)}


def _clip_ratio(v, out):
    return {"actor.clip_ratio_low": float(v), "actor.clip_ratio_high": float(v)}


# verl key -> our key (str) or a converter (value, mapped so far) -> {our key: value}
RENAMES: dict[str, str | Callable[[Any, dict], dict]] = {
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
    "actor_rollout_ref.model.use_remove_padding": _remove_padding,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size_per_device",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_loss_kind",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coeff",
    "actor_rollout_ref.actor.clip_ratio": _clip_ratio,
    "actor_rollout_ref.actor.grad_clip": "actor.optim.grad_clip",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": _freq("actor.optim.warmup_steps"),
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.schedule",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.optim.schedule",
    "actor_rollout_ref.actor.fsdp_config.param_offload": _offload("actor"),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": _offload("actor"),
    "actor_rollout_ref.rollout.name": _engine,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tg",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": _do_sample,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size_per_device",
    "actor_rollout_ref.ref.fsdp_config.param_offload": _offload("ref"),
    "critic.model.path": "model.critic_path",
    "critic.model.enable_gradient_checkpointing": "critic.gradient_checkpointing",
    "critic.model.use_remove_padding": _remove_padding,
    "critic.model.fsdp_config.param_offload": _offload("critic"),
    "critic.model.fsdp_config.optimizer_offload": _offload("critic"),
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size_per_device",
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.optim.lr_warmup_steps": _freq("critic.optim.warmup_steps"),
    "critic.optim.warmup_style": "critic.optim.schedule",
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
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_last",
    "trainer.resume_mode": _resume_mode,
    "trainer.resume_from_path": "trainer.resume",
    "trainer.default_local_dir": "trainer.output_dir",
}

# verl keys with no equivalent here -> (why, the values that keep verl's behaviour or None = any).
# A value outside that set is rejected: accepting it and then doing something else would be a defect.
NO_EQUIVALENT: dict[str, tuple[str, tuple | None]] = {
    "actor_rollout_ref.model.use_liger": ("no Liger kernels; the HF model's own ops run", None),
    "actor_rollout_ref.model.use_fused_kernels": ("no fused kernels", None),
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": ("no fused kernels", None),
    "actor_rollout_ref.model.external_lib": ("import it in a reward or model module", (None, "")),
    "actor_rollout_ref.actor.ppo_micro_batch_size": (
        "deprecated in verl; set ppo_micro_batch_size_per_gpu",
        None,
    ),
    "actor_rollout_ref.actor.fsdp_config.grad_offload": (
        "deprecated in verl; gradients stay on device",
        None,
    ),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ("no sequence parallelism", (1,)),
    "actor_rollout_ref.actor.shuffle": ("mini-batches keep the rollout order", (False,)),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": ("set actor.optim.warmup_steps", (0, 0.0)),
    "actor_rollout_ref.rollout.micro_batch_size": ("deprecated in verl", None),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": ("deprecated in verl", None),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (
        "old log-probs use actor.micro_batch_size_per_device",
        None,
    ),
    "actor_rollout_ref.rollout.enforce_eager": ("vllm engine setting, chosen by the engine", None),
    "actor_rollout_ref.rollout.free_cache_engine": ("the KV cache is freed after each generate", None),
    "actor_rollout_ref.rollout.load_format": ("weights come from the actor in memory", None),
    "actor_rollout_ref.rollout.dtype": ("generation uses model.dtype", None),
    "actor_rollout_ref.rollout.max_num_batched_tokens": ("vllm engine setting, chosen by the engine", None),
    "actor_rollout_ref.rollout.enable_chunked_prefill": ("vllm engine setting, chosen by the engine", None),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": ("deprecated in verl", None),
    "actor_rollout_ref.ref.fsdp_config.optimizer_offload": ("the reference has no optimizer", None),
    "critic.ppo_micro_batch_size": ("deprecated in verl; set ppo_micro_batch_size_per_gpu", None),
    "critic.model.tokenizer_path": ("the critic uses the policy's tokenizer", None),
    "critic.model.fsdp_config.grad_offload": ("deprecated in verl", None),
    "reward_model.reward_manager": (
        "rule rewards run in the reward executor (reward.num_workers)",
        ("naive", "prime"),
    ),
    "reward_model.model.input_tokenizer": ("the reward model reads the decoded text re-tokenized", None),
    "data.val_batch_size": ("kept: prompts per validation batch", None),
    "data.return_raw_chat": ("prompts are rendered with the chat template when loaded", None),
    "data.return_raw_input_ids": ("prompts are rendered with the chat template when loaded", None),
    "data.reward_fn_key": ("rewards dispatch on data_source", ("data_source",)),
    "data.tokenizer": ("set actor_rollout_ref.model.tokenizer_path", (None, "")),
    "trainer.critic_warmup": ("no critic-only warm-up steps", (0,)),
    "trainer.default_hdfs_dir": ("no HDFS copy; checkpoints go to trainer.output_dir", (None, "")),
    "trainer.del_local_ckpt_after_load": ("checkpoints are kept per trainer.keep_last", (False,)),
    "trainer.balance_batch": ("rollouts are split in order", None),
    "trainer.log_val_generations": ("see trainer.val_generations_to_log", None),
    "trainer.device": ("see resources.device", None),
}


def is_verl_config(data: dict, overrides=()) -> bool:
    """True when the mapping or the dotted overrides use a section only verl has."""
    keys = set(data) | {o.lstrip("+").partition("=")[0].split(".")[0] for o in overrides}
    return any(k in keys for k in VERL_SECTIONS)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _ours(path: str) -> str | None:
    for theirs, mine in PREFIXES.items():
        if path.startswith(theirs):
            candidate = mine + path[len(theirs) :]
            return candidate if candidate in _OUR_KEYS else None
    return path if path in _OUR_KEYS else None


_OUR_KEYS = set(leaf_paths())


def from_verl(data: dict, overrides=()) -> tuple[dict, list[str]]:
    """(verl mapping, verl dotted overrides) -> (our nested mapping, notes for keys without an
    equivalent). Raises ConfigError for values that cannot be honoured here."""
    flat = _flatten(apply_overrides(data, overrides))
    mapped: dict[str, Any] = {"algorithm.name": "ppo"}  # verl's default estimator is gae (PPO)
    notes, errors = [], []
    fn_path, fn_name = (
        flat.pop("custom_reward_function.path", None),
        flat.pop("custom_reward_function.name", None),
    )
    if fn_path:
        mapped["reward.fn"] = f"{fn_path}:{fn_name or 'compute_score'}"
    # verl packs micro-batches by tokens only under use_dynamic_bsz; here the token budget is the switch
    for role, dynamic_key, budget_key in (
        (
            "actor",
            "actor_rollout_ref.actor.use_dynamic_bsz",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        ),
        ("critic", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu"),
        (
            "ref",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        ),
    ):
        dynamic, budget = flat.pop(dynamic_key, False), flat.pop(budget_key, None)
        if dynamic and budget:
            mapped[f"{role}.max_tokens_per_micro_batch"] = int(budget)
        elif budget is not None:
            notes.append(
                f"verl key {budget_key} is ignored, as in verl, without {dynamic_key.rpartition('.')[2]}"
            )
    for key, value in flat.items():
        rule = RENAMES.get(key)
        if key == "data.filter_overlong_prompts":
            continue  # applied after the loop
        if isinstance(rule, str):
            mapped[rule] = value
        elif rule is not None:
            try:
                mapped.update(rule(value, mapped))
            except ConfigError as e:
                errors.extend(e.errors)
        elif (ours := _ours(key)) is not None:
            mapped[ours] = value
        elif key in NO_EQUIVALENT:
            why, keeps = NO_EQUIVALENT[key]
            if keeps is not None and value not in keeps:
                errors.append(
                    f"verl key {key}={value!r} has no equivalent here ({why}); remove it or use {keeps[0]!r}"
                )
            else:
                notes.append(f"verl key {key}={value!r} has no equivalent here and is ignored: {why}")
        else:
            notes.append(f"verl key {key}={value!r} is not known here and is ignored (see docs/verl.md)")
    if mapped.get("rollout.engine", "builtin") != "vllm" and "rollout.gpu_memory_utilization" in mapped:
        # a vLLM setting; validation rejects it for the builtin engine (docs/rollout.md)
        value = mapped.pop("rollout.gpu_memory_utilization")
        notes.append(
            f"verl key actor_rollout_ref.rollout.gpu_memory_utilization={value!r} is a vLLM setting and is "
            "dropped: rollout.engine is builtin here (set actor_rollout_ref.rollout.name=vllm for vLLM)"
        )
    if flat.get("data.filter_overlong_prompts"):  # verl filters at load, before truncation could apply
        mapped["data.truncation"] = "filter"
    if "trainer.logger" in flat and "jsonl" not in str(flat["trainer.logger"]):
        notes.append("trainer.logger: 'jsonl' added (metrics.jsonl feeds `hybridflow report`)")
    if errors:
        raise ConfigError(errors)
    out: dict = {}
    for k, v in mapped.items():
        *parents, leaf = k.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out, notes
