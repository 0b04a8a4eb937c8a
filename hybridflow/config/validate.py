"""Derived values and consistency checks, run before any worker starts.

`resolve_config` fills the fields documented as "0 / '' = derive" so the trainer reads concrete
numbers. `validate_config` collects every inconsistency (each naming its key and a fix) and raises
one ConfigError: failing at step 0 with a clear message beats failing at step 1 inside a worker.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re

from hybridflow.config.loader import ConfigError
from hybridflow.config.schema import ADV_ESTIMATORS, LOGGERS, HybridFlowConfig, ParallelConfig
from hybridflow.hybrid_engine.layout import generation_layout_errors
from hybridflow.rollout.factory import rollout_engine_errors

# algorithms that sample a group of responses per prompt and need at least two of them
GROUP_ALGORITHMS = ("grpo", "rloo")
CRITIC_ALGORITHMS = ("ppo", "safe_rlhf")
OFFLINE_ALGORITHMS = ("dpo", "sft")


def resolve_config(cfg: HybridFlowConfig) -> HybridFlowConfig:
    """Return a copy with derived values filled in (adv_estimator, critic mini-batch/epochs, dp sizes)."""
    cfg = _copy(cfg)
    a = cfg.algorithm
    if not a.adv_estimator and a.name in ADV_ESTIMATORS:
        a.adv_estimator = ADV_ESTIMATORS[a.name]
    if cfg.critic.ppo_mini_batch_size == 0:
        cfg.critic.ppo_mini_batch_size = cfg.actor.ppo_mini_batch_size
    if cfg.critic.ppo_epochs == 0:
        cfg.critic.ppo_epochs = cfg.actor.ppo_epochs
    if cfg.algorithm.sft.max_length == 0:
        cfg.algorithm.sft.max_length = cfg.data.max_prompt_length + cfg.rollout.response_length
    # dp derives only for colocated placement, where every model spans all devices; other
    # placements leave 0 for the planner / controller to fill from the pool sizes.
    if cfg.resources.placement == "colocate":
        n = cfg.resources.num_devices
        for p in _parallel_configs(cfg).values():
            if p.dp == 0 and p.tp * p.pp > 0 and n % (p.tp * p.pp) == 0:
                p.dp = n // (p.tp * p.pp)
    return cfg


def _copy(cfg):
    from hybridflow.config.loader import config_from_dict, config_to_dict

    return config_from_dict(config_to_dict(cfg), type(cfg))


def _parallel_configs(cfg: HybridFlowConfig) -> dict[str, ParallelConfig]:
    return {
        "actor.parallel": cfg.actor.parallel,
        "critic.parallel": cfg.critic.parallel,
        "ref.parallel": cfg.ref.parallel,
        "reward.parallel": cfg.reward.parallel,
    }


def _check_choices(obj, prefix: str, errors: list[str]) -> None:
    """Every field with `choices` metadata holds one of them (recursing into nested configs)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_choices(value, path + ".", errors)
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            choices = [c for c in f.metadata["choices"] if c]
            near = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            errors.append(f"{path}: {value!r} is not one of {choices}{hint}")


def model_max_positions(model_dir: str | os.PathLike) -> int | None:
    """The context length from an HF config.json, or None if the directory or the field is missing."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:  # a truncated or hand-edited file: name it, no traceback
        raise ConfigError([f"model.path: {path} is not a readable JSON file ({_short(e)})"]) from None
    if not isinstance(hf, dict):
        raise ConfigError([f"model.path: {path} holds {type(hf).__name__}, not a JSON object"])
    hf = {**hf.get("text_config", {}), **hf}  # multimodal configs nest the language model's
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(hf.get(key), int):
            return hf[key]
    return None


def collect_errors(cfg: HybridFlowConfig, check_model: bool = True) -> list[str]:
    """All problems of a resolved config, as messages that start with the offending key."""
    errors: list[str] = []
    _check_choices(cfg, "", errors)
    a, d, act, r, t = cfg.algorithm, cfg.data, cfg.actor, cfg.rollout, cfg.trainer

    # sizes
    for key, v in {
        "data.train_batch_size": d.train_batch_size,
        "data.max_prompt_length": d.max_prompt_length,
        "actor.ppo_mini_batch_size": act.ppo_mini_batch_size,
        "actor.ppo_epochs": act.ppo_epochs,
        "actor.micro_batch_size_per_device": act.micro_batch_size_per_device,
        "critic.micro_batch_size_per_device": cfg.critic.micro_batch_size_per_device,
        "ref.micro_batch_size_per_device": cfg.ref.micro_batch_size_per_device,
        "rollout.n": r.n,
        "rollout.val.n": r.val.n,
        "rollout.response_length": r.response_length,
        "rollout.tg": r.tg,
        "rollout.pg": r.pg,
        "resources.n_gpus_per_node": cfg.resources.n_gpus_per_node,
        "resources.nnodes": cfg.resources.nnodes,
        "trainer.keep_last": t.keep_last,
        "trainer.max_skipped_steps": t.max_skipped_steps,
    }.items():
        if v < 1:
            errors.append(f"{key}: must be >= 1, got {v}")
    for key, v in {
        "data.val_batch_size": d.val_batch_size,
        "trainer.total_steps": t.total_steps,
        "trainer.total_epochs": t.total_epochs,
        "trainer.val_every": t.val_every,
        "trainer.save_every": t.save_every,
        "actor.max_tokens_per_micro_batch": act.max_tokens_per_micro_batch,
        "reward.num_workers": cfg.reward.num_workers,
        "reward.chunk_size": cfg.reward.chunk_size,
    }.items():
        if v < 0:
            errors.append(f"{key}: must be >= 0, got {v}")
    if not 0.0 <= cfg.reward.max_error_fraction <= 1.0:
        errors.append(f"reward.max_error_fraction: must be in [0, 1], got {cfg.reward.max_error_fraction}")
    for key, v in {
        "reward.max_abs_score": cfg.reward.max_abs_score,
        "reward.startup_timeout_s": cfg.reward.startup_timeout_s,
    }.items():
        if not v > 0:
            errors.append(f"{key}: must be > 0, got {v}")
    if t.total_steps == 0 and t.total_epochs == 0:
        errors.append("trainer.total_steps: both total_steps and total_epochs are 0; set one of them")

    # mini-batches (prompts) must tile the batch exactly
    for section in ("actor", "critic"):
        if section == "critic" and (
            a.name not in CRITIC_ALGORITHMS or cfg.critic.ppo_mini_batch_size == act.ppo_mini_batch_size
        ):
            continue  # no critic, or the same number already checked for the actor
        mini = getattr(cfg, section).ppo_mini_batch_size
        if mini > d.train_batch_size:
            errors.append(
                f"{section}.ppo_mini_batch_size: {mini} is larger than data.train_batch_size "
                f"{d.train_batch_size}; lower it or raise the batch"
            )
        elif mini >= 1 and d.train_batch_size % mini:
            errors.append(
                f"{section}.ppo_mini_batch_size: data.train_batch_size {d.train_batch_size} is not divisible "
                f"by {mini}; choose a divisor (e.g. {_nearest_divisor(d.train_batch_size, mini)})"
            )

    # algorithm
    if a.name in GROUP_ALGORITHMS and r.n < 2:
        errors.append(
            f"rollout.n: {a.name} normalises rewards within a group of samples and needs n >= 2, got {r.n}"
        )
    if a.name not in OFFLINE_ALGORITHMS and a.adv_estimator == "none":
        errors.append(f"algorithm.adv_estimator: 'none' only suits dpo/sft, not {a.name!r}")
    if a.adv_estimator == "gae" and a.name not in CRITIC_ALGORITHMS:
        errors.append(f"algorithm.adv_estimator: 'gae' needs a critic, which {a.name!r} does not train")
    for key, v in {"algorithm.gamma": a.gamma, "algorithm.lam": a.lam}.items():
        if not 0.0 <= v <= 1.0:
            errors.append(f"{key}: must be in [0, 1], got {v}")
    if act.clip_ratio_low < 0 or act.clip_ratio_high < 0:
        errors.append("actor.clip_ratio_low/high: clip ratios must be >= 0")
    if act.clip_ratio_c <= 1.0:
        errors.append(f"actor.clip_ratio_c: the dual-clip constant must be > 1, got {act.clip_ratio_c}")
    if not 0.0 <= a.dpo.label_smoothing < 0.5:
        errors.append(f"algorithm.dpo.label_smoothing: must be in [0, 0.5), got {a.dpo.label_smoothing}")
    for key, optim in {"actor.optim": act.optim, "critic.optim": cfg.critic.optim}.items():
        if optim.lr <= 0:
            errors.append(f"{key}.lr: must be > 0, got {optim.lr}")
        if len(optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in optim.betas):
            errors.append(f"{key}.betas: expected two numbers in [0, 1), got {optim.betas}")

    # sampling
    for key, v in {
        "rollout.temperature": r.temperature,
        "rollout.val.temperature": r.val.temperature,
    }.items():
        if v < 0:
            errors.append(f"{key}: must be >= 0, got {v}")
    for key, v in {"rollout.top_p": r.top_p, "rollout.val.top_p": r.val.top_p}.items():
        if not 0.0 < v <= 1.0:
            errors.append(f"{key}: must be in (0, 1], got {v}")

    errors += rollout_engine_errors(cfg)

    # data and models
    if not d.train_files and not d.dataset:
        errors.append("data.train_files: no training data; set data.train_files or data.dataset")
    for key, files in {"data.train_files": d.train_files, "data.val_files": d.val_files}.items():
        if check_model:  # on disk, like the model directory (`hybridflow config show` checks them too)
            errors += [
                f"{key}[{i}]: {f!r} does not exist" for i, f in enumerate(files) if not os.path.exists(f)
            ]
    if not cfg.model.path:
        errors.append("model.path: no policy model; set it to a local HF model directory")
    if cfg.reward.kind == "model" and not cfg.model.reward_model_path and a.name not in OFFLINE_ALGORITHMS:
        errors.append("model.reward_model_path: reward.kind is 'model' but no reward model directory is set")
    if check_model and cfg.model.path:
        if not os.path.exists(cfg.model.path):
            errors.append(
                f"model.path: {cfg.model.path!r} does not exist (expected a local HF model directory)"
            )
        elif not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
            errors.append(
                f"model.path: {cfg.model.path!r} has no config.json (not a Hugging Face model directory)"
            )
        try:
            max_pos = model_max_positions(cfg.model.path) if os.path.isdir(cfg.model.path) else None
        except ConfigError as e:
            errors += e.errors
            max_pos = None
        total = d.max_prompt_length + r.response_length
        if max_pos is not None and total > max_pos:
            errors.append(
                f"rollout.response_length: data.max_prompt_length {d.max_prompt_length} + "
                f"rollout.response_length {r.response_length} = {total} exceeds the model's context "
                f"(max_position_embeddings {max_pos} in {cfg.model.path}/config.json)"
            )

    tok = cfg.model.tokenizer_path
    if check_model and tok and not os.path.isdir(tok):
        errors.append(f"model.tokenizer_path: {tok!r} is not a directory (expected a saved HF tokenizer)")

    # parallelism
    n = cfg.resources.num_devices
    for key, p in _parallel_configs(cfg).items():
        if p.tp < 1 or p.pp < 1 or p.dp < 0:
            errors.append(f"{key}: tp and pp must be >= 1 and dp >= 0, got tp={p.tp} pp={p.pp} dp={p.dp}")
            continue
        if cfg.resources.placement == "colocate" and n % (p.tp * p.pp):
            errors.append(f"{key}: tp*pp = {p.tp * p.pp} does not divide the {n} devices")
        elif p.dp and p.tp * p.pp * p.dp > n:
            errors.append(f"{key}: tp*pp*dp = {p.tp * p.pp * p.dp} exceeds the {n} devices")
    model_dir = cfg.model.path if os.path.isdir(cfg.model.path) else None
    errors += generation_layout_errors(cfg.actor.parallel, r.tg, r.pg, model_dir, r.reshard)

    # run
    for name in t.loggers:
        if name not in LOGGERS:
            errors.append(f"trainer.loggers: unknown logger {name!r}; choose from {list(LOGGERS)}")
    resume = str(t.resume).strip()
    if (
        resume not in ("auto", "never")
        and not re.fullmatch(r"(step_)?\d+", resume)
        and not os.path.exists(resume)
    ):
        errors.append(
            f"trainer.resume: {t.resume!r} is neither 'auto', 'never', a step number nor an existing checkpoint path"
        )
    name = t.experiment_name
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        errors.append(
            f"trainer.experiment_name: {name!r} must be a relative name inside trainer.output_dir (no '..', not absolute)"
        )
    for key in ("max_restarts", "save_every_minutes", "stop_grace_s"):
        if getattr(t, key) < 0:
            errors.append(f"trainer.{key}: must be >= 0, got {getattr(t, key)}")
    placement = cfg.resources.placement
    if placement not in ("colocate", "split", "auto") and not os.path.isfile(placement):
        errors.append(
            f"resources.placement: {placement!r} is not colocate|split|auto or an existing plan file"
        )
    if placement not in ("colocate", "split") and a.name in OFFLINE_ALGORITHMS:
        errors.append(
            f"resources.placement: the planner ('auto' or a plan file) has no dataflow for {a.name!r}, "
            "which only trains the actor; use colocate"
        )
    return errors


def _short(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _nearest_divisor(total: int, near: int) -> int:
    divisors = [k for k in range(1, total + 1) if total % k == 0]
    return min(divisors, key=lambda k: (abs(k - near), -k))


def validate_config(cfg: HybridFlowConfig, check_model: bool = True) -> None:
    """Raise ConfigError listing every problem of a resolved config (see `collect_errors`)."""
    errors = collect_errors(cfg, check_model=check_model)
    if errors:
        raise ConfigError(errors)
