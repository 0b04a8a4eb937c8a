"""Validation of the config's data files and model directories (config/validate.py collect_errors
calls it): what must exist on disk, what the model's config.json allows, and every JSON file and
safetensors header the workers will read (hybridflow/models/files.py), all before Ray starts.
"""

from __future__ import annotations

import json
import os

from hybridflow.errors import ConfigError


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


def data_and_model_errors(cfg, spec, check_model: bool) -> list[str]:
    """Problems of `cfg`'s data and model settings (a resolved HybridFlowConfig; `spec` its algorithm's
    AlgorithmSpec or None). check_model=False skips what reads the disk."""
    errors: list[str] = []
    d, r = cfg.data, cfg.rollout
    if not d.train_files and not d.dataset:
        errors.append("data.train_files: no training data; set data.train_files or data.dataset")
    for key, files in {"data.train_files": d.train_files, "data.val_files": d.val_files}.items():
        if check_model:  # on disk, like the model directory (`hybridflow config show` checks them too)
            errors += [
                f"{key}[{i}]: {f!r} does not exist" for i, f in enumerate(files) if not os.path.exists(f)
            ]
    if not cfg.model.path:
        errors.append("model.path: no policy model; set it to a local HF model directory")
    if cfg.reward.kind == "model" and not cfg.model.reward_model_path and spec and spec.generation:
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
    if check_model:  # every JSON file and safetensors header the workers will read (models/files.py)
        from hybridflow.models.files import model_dir_errors, remove_padding_errors
        from hybridflow.models.resolve import MODEL_KEYS

        errors += remove_padding_errors(cfg.model)
        for key in MODEL_KEYS:
            errors += [
                e for e in model_dir_errors(getattr(cfg.model, key), f"model.{key}") if e not in errors
            ]
        errors += size_errors(cfg) + embedding_errors(cfg) + tp_shape_errors(cfg) + lora_model_errors(cfg)
    return errors


# config.json sizes a model is built from (Llama-style names, then GPT-2's): 0 or less builds no layer,
# or one that fails in each worker, often first in the tokenizer's checks, which then takes the blame
POSITIVE_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                  "intermediate_size", "vocab_size", "n_embd", "n_head", "n_layer")  # fmt: skip


def size_errors(cfg) -> list[str]:
    """One line per model directory whose config.json has a size that is not a positive integer."""
    errors = []
    for key, path in _model_dirs(cfg).items():
        config = _read_json(os.path.join(path, "config.json"))
        if not isinstance(config, dict):
            continue
        bad = [f"{n}={config[n]!r}" for n in POSITIVE_SIZES if n in config and not _positive(config[n])]
        if bad:
            errors.append(f"{key}: {path}/config.json has {', '.join(bad)}; each must be an integer >= 1")
    return errors


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _model_dirs(cfg) -> dict[str, str]:
    """key -> directory of each model the config names (the tokenizer directory is not one)."""
    m = cfg.model
    keys = ("path", "critic_path", "reward_model_path", "cost_model_path")
    return {f"model.{k}": getattr(m, k) for k in keys if getattr(m, k) and os.path.isdir(getattr(m, k))}


def embedding_errors(cfg) -> list[str]:
    """config.json's sizes against the weights' shapes, read from the safetensors headers (models/files.py)."""
    from hybridflow.models.files import embedding_shape_error

    found = {key: embedding_shape_error(path) for key, path in _model_dirs(cfg).items()}
    return [f"{key}: {why}" for key, why in found.items() if why]


def model_weight_errors(cfg) -> list[str]:
    """Each model directory holds weights: checked by `hybridflow train` only, since `hybridflow plan` and
    `config show` need no more than its config.json."""
    from hybridflow.models.files import weight_files_error

    found = {key: weight_files_error(path) for key, path in _model_dirs(cfg).items()}
    return [f"{key}: {why}" for key, why in found.items() if why]


# model types whose generation reads merged LoRA weights: the built-in engine's functional decoder
# (rollout/llama_decoder.py FAMILY), which takes weights by HF name from the 3D-HybridEngine
LORA_MODEL_TYPES = ("llama", "qwen2", "mistral")


def lora_model_errors(cfg) -> list[str]:
    """model.lora on a policy whose generation could not read the merged weights: one line before Ray."""
    config = _read_json(os.path.join(cfg.model.path, "config.json")) if cfg.model.lora.enabled else None
    kind = config.get("model_type") if isinstance(config, dict) else None
    hidden = config.get("hidden_size") if isinstance(config, dict) else None
    if isinstance(hidden, int) and cfg.model.lora.rank > hidden:  # B @ A would be larger than the weight
        return [f"model.lora.rank={cfg.model.lora.rank}: exceeds the model's hidden_size {hidden} "
                f"({cfg.model.path}/config.json); a rank is at most that, usually 8-64"]  # fmt: skip
    if kind is None or kind in LORA_MODEL_TYPES:
        return []
    return [
        f"model.lora.rank={cfg.model.lora.rank}: LoRA generation supports model types {list(LORA_MODEL_TYPES)} "
        f"(the built-in engine's functional decoder), not {kind!r} ({cfg.model.path}/config.json); use rank 0"
    ]


# what tensor parallelism splits (engines/parallelize.py), per model family, and how a user calls it
_TP_SPLIT = {
    "gpt2": (("n_head", "attention heads"), ("n_embd", "hidden size")),
    "": (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads"),
         ("intermediate_size", "MLP width")),
}  # fmt: skip


def tp_shape_errors(cfg) -> list[str]:
    """Each training section's tp must divide what it splits in its model (read from config.json), so
    a mismatch is one line here instead of a ValueError inside a worker after Ray started."""
    m = cfg.model
    roles = {"actor": m.path, "ref": m.path, "critic": m.critic_path or m.path}
    errors = []
    for section, path in roles.items():
        tp = getattr(cfg, section).parallel.tp
        config = _read_json(os.path.join(path, "config.json")) if tp > 1 and path else None
        if not isinstance(config, dict):
            continue
        for name, label in _TP_SPLIT.get(config.get("model_type"), _TP_SPLIT[""]):
            value = config.get(name)
            if isinstance(value, int) and value % tp:
                fits = [k for k in range(1, value + 1) if value % k == 0]
                errors.append(
                    f"{section}.parallel.tp={tp} does not divide the model's {value} {label} ({name} in "
                    f"{path}/config.json); choose tp in {fits}"
                )
                break
    return errors


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # reported by model_dir_errors


def _short(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__
