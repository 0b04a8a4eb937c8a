"""Export a checkpoint's model to a plain Hugging Face directory (config + safetensors + tokenizer).

The checkpoint already holds the full weights as an HF directory (`<step>/<role>/hf/`, see
engine_state.py), so export copies those files, adds the tokenizer, and switches `use_cache` back on
(training turns it off; generation wants it). The result is written atomically (temp dir + rename):
an interrupted export leaves no half directory at `out_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from hybridflow.checkpoint.manager import CheckpointError, find_checkpoint, fsync_tree, read_manifest

_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


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
) -> Path:
    """Write the `role` model of a checkpoint to `out_dir` as an HF directory; returns out_dir.

    source: a run directory, its checkpoints/ directory, or a step directory; `step` picks a step
    (default: the latest). tokenizer_dir: where the tokenizer comes from (default: the checkpoint's own
    copy, then the `tokenizer_dir` recorded in the manifest meta by the driver).
    """
    step_dir = find_checkpoint(source, step)
    manifest = read_manifest(step_dir, require=[role])
    hf_dir = step_dir / role / "hf"
    weights = sorted(hf_dir.glob("*.safetensors"))
    if not (hf_dir / "config.json").is_file() or not weights:
        raise CheckpointError(
            f"{step_dir / role} has no full HF weights (saved with hf_weights=False?); export needs a "
            "checkpoint written with hf_weights=True"
        )
    tok = _find_tokenizer(tokenizer_dir, hf_dir, manifest)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another output or pass overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        for f in [*weights, *(hf_dir / n for n in _MODEL_FILES)]:
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        config = json.loads((tmp / "config.json").read_text())
        config["use_cache"] = True
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if tok != hf_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tok).save_pretrained(tmp)
        else:
            for f in hf_dir.iterdir():
                if f.is_file() and not (tmp / f.name).exists():
                    shutil.copy2(f, tmp / f.name)
        fsync_tree(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
