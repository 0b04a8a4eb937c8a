"""Model names -> local directories, on the driver, before any worker starts.

A local directory is made absolute (Ray workers do not share the driver's working directory). A name
that is not a local directory, such as `Qwen/Qwen2.5-0.5B-Instruct`, is looked up in the local Hugging
Face cache (HF_HUB_CACHE / HF_HOME), offline: its snapshot directory is what the workers load with
from_pretrained, so no worker ever reaches the network. A name not in the cache is a one-line error.
"""

from __future__ import annotations

import os
import re

from hybridflow.errors import ModelNotFound

# org/name as the Hub spells repository ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_KEYS = ("path", "tokenizer_path", "critic_path", "reward_model_path", "cost_model_path")


def resolve_model_path(path: str) -> str:
    """An absolute local directory for `path` (a directory or a cached Hub id); other paths unchanged."""
    if not path or os.path.isdir(path):
        return os.path.abspath(path) if path else path
    if not _HUB_ID.match(path) or os.path.exists(path) or path.startswith((".", "/")):
        return path  # a missing local path: validation names it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir()
    try:
        return snapshot_download(path, local_files_only=True, cache_dir=cache)
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise ModelNotFound(
            f"{path!r} is not a local directory and not in the local Hugging Face cache ({cache}); "
            f"download it first (`huggingface-cli download {path}`) or pass a directory"
        ) from None


def cache_dir() -> str:
    """The hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def resolve_model_paths(model_cfg) -> list[str]:
    """Resolve every path field of the `model` config section in place; -> errors, one line each."""
    errors = []
    for key in MODEL_KEYS:
        try:
            setattr(model_cfg, key, resolve_model_path(getattr(model_cfg, key)))
        except ModelNotFound as e:
            errors.append(f"model.{key}: {e}")
    return errors
