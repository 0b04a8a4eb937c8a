"""Export a checkpoint's model to a plain Hugging Face directory (config + safetensors + tokenizer).

The checkpoint holds each rank's parameter shards (`<step>/<role>/model/`, engine_state.py); export
assembles one tensor at a time from their slices and streams it into HF safetensors files
(stream_write.py), so its peak host memory is one tensor, not the model, and no process group or
GPU is needed. It undoes the engine's layout changes (GPT-2's fused qkv permuted under tp > 1, see
engines/parallelize.py), leaves out a tied lm_head (transformers re-ties it on load), and switches
`use_cache` back on (training turns it off; generation wants it). The result is written atomically
(temp dir + rename): an interrupted export leaves no half directory at `out_dir`. Checkpoints of
earlier versions that carry a full copy in `<role>/hf/` are exported by copying it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from hybridflow.checkpoint.engine_state import HF_CONFIG, read_engine_info
from hybridflow.checkpoint.export_lora import read_lora, write_adapter, write_merged
from hybridflow.checkpoint.manager import CheckpointError, find_checkpoint, fsync_tree, read_manifest
from hybridflow.checkpoint.shards import read_full, tensor_index
from hybridflow.checkpoint.stream_write import DEFAULT_MAX_FILE_BYTES, write_safetensors


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()


def _find_tokenizer(tokenizer_dir, hf_dir: Path, manifest: dict) -> Path:
    if tokenizer_dir is not None:
        path = Path(tokenizer_dir)
        if not _has_tokenizer(path):
            raise CheckpointError(f"tokenizer directory {path} holds no tokenizer (no tokenizer_config.json)")
        return path
    candidates = [hf_dir, manifest.get("meta", {}).get("tokenizer_dir")]
    for c in candidates:
        if c and _has_tokenizer(Path(c)):
            return Path(c)
    raise CheckpointError(
        f"no tokenizer found in {hf_dir} or the checkpoint's meta; pass tokenizer_dir (CLI: --tokenizer DIR), "
        "e.g. the model directory the run started from"
    )


def export_hf(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    step: int | None = None,
    role: str = "actor",
    overwrite: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    merge: bool = False,
) -> Path:
    """Write the `role` model of a checkpoint to `out_dir` as an HF directory; returns out_dir.

    source: a run directory, its checkpoints/ directory, or a step directory; `step` picks a step
    (default: the latest). tokenizer_dir: where the tokenizer comes from (default: the checkpoint's own
    copy, then the `tokenizer_dir` recorded in the manifest meta by the driver). A LoRA checkpoint
    exports as a PEFT adapter directory, or with `merge` as the base model's weights with the adapters
    merged in (export_lora.py).
    """
    step_dir = find_checkpoint(source, step)
    manifest = read_manifest(step_dir, require=[role])
    role_dir = step_dir / role
    legacy = role_dir / "hf"
    sharded = (role_dir / "model").is_dir()
    config_dir = role_dir / HF_CONFIG if sharded else legacy
    if not (config_dir / "config.json").is_file() or not (sharded or any(legacy.glob("*.safetensors"))):
        raise CheckpointError(f"{role_dir} holds no model weights to export (no model/ shards)")
    tok = _find_tokenizer(tokenizer_dir, config_dir, manifest)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another output or pass overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        lora = read_lora(read_engine_info(role_dir), merge) if sharded else None
        if lora is not None and not merge:
            write_adapter(role_dir, lora, tmp)
            _copy_tokenizer(tok, config_dir, tmp)
            return _publish(tmp, out)
        if lora is not None:
            write_merged(
                role_dir, lora, json.loads((config_dir / "config.json").read_text()), tmp, max_file_bytes
            )
        elif sharded:
            _stream_weights(role_dir, config_dir, tmp, max_file_bytes)
        else:
            for f in [*legacy.glob("*.safetensors"), legacy / "model.safetensors.index.json"]:
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
        for name in ("config.json", "generation_config.json"):
            if (config_dir / name).is_file():
                shutil.copy2(config_dir / name, tmp / name)
        config = json.loads((tmp / "config.json").read_text())
        config["use_cache"] = True
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        _copy_tokenizer(tok, config_dir, tmp)
        return _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy_tokenizer(tok: Path, config_dir: Path, tmp: Path) -> None:
    if tok != config_dir:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tok).save_pretrained(tmp)
        return
    for f in config_dir.iterdir():
        if (
            f.is_file()
            and not (tmp / f.name).exists()
            and f.suffix != ".safetensors"
            and f.name != "config.json"
        ):
            shutil.copy2(f, tmp / f.name)


def _publish(tmp: Path, out: Path) -> Path:
    """The finished temp dir renamed to `out` (replacing it), durable."""
    fsync_tree(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _stream_weights(role_dir: Path, config_dir: Path, out: Path, max_file_bytes: int) -> None:
    """HF safetensors in `out` from the shards of `role_dir/model`, one tensor in memory at a time."""
    info = read_engine_info(role_dir)
    config = json.loads((config_dir / "config.json").read_text())
    entries = tensor_index(role_dir / "model")
    if config.get("tie_word_embeddings") and "lm_head.weight" in entries and len(entries) > 1:
        del entries["lm_head.weight"]  # the same tensor as the input embedding; re-tied on load
    inverse = {}
    if info["model_class"].startswith("GPT2") and info["tp"] > 1:
        from hybridflow.models.fused_qkv import fused_qkv_permutation

        inv = torch.argsort(fused_qkv_permutation(config["n_embd"], info["tp"]))
        inverse = {n: (1 if n.endswith("weight") else 0, inv) for n in entries if ".attn.c_attn." in n}

    def produce(name: str) -> torch.Tensor:
        t = read_full(name, entries[name])
        if name in inverse:
            dim, perm = inverse[name]
            t = t.index_select(dim, perm)
        return t

    specs = {n: (e.shape, e.dtype) for n, e in entries.items()}
    write_safetensors(out, specs, produce, max_file_bytes)
