"""Write HF safetensors files one tensor at a time: peak host memory is one tensor, not the model.

safetensors' own `save_file` needs every tensor in memory at once. The format is simple enough to
stream: an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
byte range, then the raw bytes in that order. Shapes and dtypes are known before any data is read
(from shard headers or DTensor metadata), so the header goes first and each tensor is produced,
written and dropped in turn. Files above `max_file_bytes` are split the way `save_pretrained` splits
them (model-0000i-of-0000n.safetensors + model.safetensors.index.json), so `from_pretrained` loads
the result (docs/checkpoints.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from hybridflow.checkpoint.shards import ST_NAMES

INDEX_JSON = "model.safetensors.index.json"
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _groups(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], max_file_bytes: int) -> list[list[str]]:
    groups, size = [[]], 0
    for name, (shape, dtype) in specs.items():
        n = _nbytes(shape, dtype)
        if groups[-1] and size + n > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def write_safetensors(
    out_dir: str | Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    *,
    file_name: str | None = None,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write tensors `specs` (name -> (shape, dtype), in file order) into out_dir, asking `produce(name)`
    for each tensor just before writing it. Returns the files written (plus the index when split).
    file_name: one file of that name, never split; metadata: extra header `__metadata__` strings."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = [list(specs)] if file_name else _groups(specs, max_file_bytes)
    files, weight_map, total = [], {}, 0
    for i, names in enumerate(groups, start=1):
        fname = file_name or (
            "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        )
        header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
        for name in names:
            shape, dtype = specs[name]
            n = _nbytes(shape, dtype)
            header[name] = {
                "dtype": ST_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        with open(out_dir / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in names:
                shape, dtype = specs[name]
                t = produce(name)
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(
                        f"{name}: produced {tuple(t.shape)} {t.dtype}, header says {shape} {dtype}"
                    )
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no copy
                del t
        total += offset
        files.append(out_dir / fname)
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_JSON).write_text(json.dumps(index, indent=2))
        files.append(out_dir / INDEX_JSON)
    return files
