"""Checks of a model directory's files on the driver, before Ray or any worker starts.

Why: a truncated or hand-edited tokenizer.json, tokenizer_config.json, config.json or safetensors
file otherwise fails deep inside transformers or a worker's `init_model`, as a traceback that does
not name the file. Here each JSON file is parsed and each safetensors header is read (8 bytes of
length, then the header's JSON; its offsets must fit the file), which costs a few KiB of reading
per file however large the weights are. The tensors themselves are not read. Each problem is one
line naming the setting and the file (the README's "Using it", docs/operations.md).
"""

from __future__ import annotations

import json
import os
import struct

# the JSON files transformers reads from a model or tokenizer directory
JSON_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "model.safetensors.index.json",
)
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header size


def _short(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def json_file_error(path: str) -> str | None:
    """Why `path` is not a readable JSON object, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        return f"{path} is not a readable JSON file ({_short(e)})"
    if not isinstance(value, dict):
        return f"{path} holds {type(value).__name__}, not a JSON object"
    return None


def _read_header(path: str) -> tuple[dict | None, str | None, int]:
    """(the safetensors header of `path`, None, its length) or (None, why it cannot be read, 0)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None, f"{path} is not a safetensors file ({size} bytes, shorter than its header)", 0
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                why = f"{path} is not a safetensors file (header length {n} exceeds the file's {size} bytes)"
                return None, why, 0
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{path} has an unreadable safetensors header ({_short(e)})", 0
    if not isinstance(header, dict):
        return None, f"{path} has an unreadable safetensors header (not a JSON object)", 0
    return header, None, n


def safetensors_error(path: str) -> str | None:
    """Why `path` is not a readable safetensors file (header and sizes only), or None."""
    header, why, n = _read_header(path)
    if why:
        return why
    size = os.path.getsize(path)
    end = max(
        (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and _entry(t)), default=0
    )
    bad = [k for k, t in header.items() if k != "__metadata__" and not _entry(t)]
    if bad:
        return (
            f"{path} has an unreadable safetensors header (entry {bad[0]!r} has no dtype/shape/data_offsets)"
        )
    if 8 + n + end > size:
        return f"{path} is truncated: its header needs {8 + n + end} bytes, the file has {size}"
    return None


def _entry(t) -> bool:
    offsets = t.get("data_offsets") if isinstance(t, dict) else None
    return (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
        and "dtype" in t and "shape" in t
    )  # fmt: skip


def model_dir_errors(directory: str, key: str) -> list[str]:
    """One line per unreadable file of `directory` (the value of setting `key`); [] when all read."""
    if not directory or not os.path.isdir(directory):
        return []  # a missing directory is reported by the config checks
    errors = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        why = None
        if name in JSON_FILES:
            why = json_file_error(path)
        elif name.endswith(".safetensors"):
            why = safetensors_error(path)
        if why:
            errors.append(f"{key}: {why}")
    return errors


# the files transformers loads a model's weights from: one file, or the index of its shards
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# the input embedding's name per family (Llama/Qwen/Mistral, GPT-2, BLOOM): its shape is (vocab, hidden)
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def weight_files_error(directory: str) -> str | None:
    """One line when `directory`, a model directory (it has a config.json), holds no weight file: only
    training loads the weights, so `hybridflow plan` and `config show` take a config.json alone."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return None  # not a model directory: the config checks say so
    if any(n in WEIGHT_FILES or n.endswith(".safetensors") for n in os.listdir(directory)):
        return None
    return (
        f"{directory} has no weight files (none of {', '.join(WEIGHT_FILES)}); save the model there with "
        "model.save_pretrained(dir)"
    )


def embedding_shape_error(directory: str) -> str | None:
    """One line when config.json's hidden_size or vocab_size is not the input embedding's shape in the
    safetensors headers (the weights of another model, or a hand-edited config): loading them would fail in
    each worker, after Ray started. Reads the headers only; a directory without safetensors passes."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # reported by model_dir_errors / the config checks
    if not isinstance(config, dict) or "text_config" in config:
        return None  # a multimodal config's sizes are its parts'
    want = {
        "hidden_size": config.get("hidden_size", config.get("n_embd")),
        "vocab_size": config.get("vocab_size"),
    }
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".safetensors")):
        header, why, _ = _read_header(os.path.join(directory, name))
        for key, t in (header or {}).items():
            if key.endswith(_EMBEDDINGS) and _entry(t) and len(t["shape"]) == 2:
                return _shape_mismatch(directory, name, key, t["shape"], want)
    return None


def _shape_mismatch(directory: str, file: str, key: str, shape: list, want: dict) -> str | None:
    got = {"vocab_size": shape[0], "hidden_size": shape[1]}
    for label, value in want.items():
        if isinstance(value, int) and value != got[label]:
            return (
                f"{directory}/config.json has {label} {value}, but {file} holds {key} of shape "
                f"{shape[0]} x {shape[1]} ({label} {got[label]}): the config and the weights are of different models"
            )
    return None


# files a Hugging Face tokenizer loads from; a directory with none of them has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")  # fmt: skip


def tokenizer_files_error(directory: str | os.PathLike) -> str | None:
    """One line when `directory` (an existing model or tokenizer directory) holds no tokenizer file: a
    weights-only save (`model.save_pretrained` without the tokenizer) would otherwise load as something
    else (transformers falls back on the config) and fail later with a chat-template hint beside the point."""
    if not os.path.isdir(directory) or any(
        os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES
    ):
        return None
    return (
        f"{directory} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:4])}, ...); save the "
        "tokenizer beside the weights (tokenizer.save_pretrained(dir)) or set model.tokenizer_path to a "
        "directory that has them"
    )


# model types whose attention builds a per-sequence (block-diagonal) causal mask from position_ids
# restarts, so model.remove_padding can pack them (engines/packing.py; checked numerically against the
# padded forward in tests/engines/test_packing.py). GPT-2 ignores the restarts: its sequences would mix.
PACKABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def model_type(directory: str) -> str | None:
    """config.json's model_type, or None where the directory or the file cannot say."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None  # reported by model_dir_errors / the config checks
    return hf.get("model_type") if isinstance(hf, dict) else None


def remove_padding_errors(model_cfg) -> list[str]:
    """model.remove_padding=true (or share_prompt=true, which needs it) on a model directory whose type
    cannot pack: one line each."""
    share = getattr(model_cfg, "share_prompt", None) is True and model_cfg.remove_padding is None
    if model_cfg.remove_padding is not True and not share:
        return []
    errors = []
    for key in ("path", "critic_path", "reward_model_path", "cost_model_path"):
        kind = model_type(getattr(model_cfg, key)) if getattr(model_cfg, key) else None
        if kind is not None and kind not in PACKABLE_MODEL_TYPES:
            setting = "remove_padding" if model_cfg.remove_padding else "share_prompt"
            errors.append(
                f"model.{setting}: true, but model.{key} is a {kind!r} model, which cannot run packed "
                f"sequences (supported: {', '.join(PACKABLE_MODEL_TYPES)}); set it to false or null"
            )
    return errors
