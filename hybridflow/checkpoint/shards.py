"""Sharded tensor files without pickle: what a checkpoint's model and optimizer tensors are written as.

Saving: every rank streams one file, `shard-<rank+1>-model-00001-of-00001.safetensors`, holding only
the chunks it owns (replicated chunks once), tensor by tensor; the header (JSON) records each chunk's
global offset in the layout of torch.distributed.checkpoint's safetensors storage. Loading reads the plan from those
headers (`HuggingFaceStorageReader`), never from DCP's pickled `.metadata` (none is written, and one
planted beside the shards is not opened); each rank reads just the slices its own shards need, so a
checkpoint resumes onto any dp/tp layout. A torch without that reader loads the same files through
`load_slices`, which plans from the same headers itself (hybridflow/compat/dcp.py). Only tensors travel
this way; the rest of a checkpoint is JSON (docs/checkpoints.md).

`tensor_index` / `read_full` read the same files without any process group, one tensor at a time: the
streaming export and the memory-bounded tools build on them.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

SUFFIX = ".safetensors"
_SHARDING_KEY = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY

# safetensors dtype names (the format's spec) <-> torch dtypes
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def save_tensors(
    state: dict[str, torch.Tensor], directory: str | os.PathLike, writes_plain: bool | None = None
) -> None:
    """Write a flat {name: tensor or DTensor} dict, each rank its own chunks, streamed tensor by tensor
    (no copy of the rank's state in memory, unlike DCP's own safetensors writer, which builds each file
    in memory first). Collective over the default group if there is one. A chunk replicated over ranks
    (a Replicate mesh dimension, or a plain tensor) is written by the first of its holders only.
    writes_plain: whether this rank writes its plain tensors (None: rank 0 only; a pipeline stage's
    first rank writes its stage's)."""
    from hybridflow.checkpoint.stream_write import write_safetensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mine: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
    for name, t in state.items():
        chunk = _own_chunk(t, rank == 0 if writes_plain is None else writes_plain)
        if chunk is not None:
            mine[name] = chunk
    specs = {n: (tuple(c.shape), c.dtype) for n, (c, _) in mine.items()}
    sharding = {n: {"saved_offsets": list(off)} for n, (_, off) in mine.items()}
    write_safetensors(
        directory,
        specs,
        lambda n: mine[n][0].detach().cpu(),
        file_name=f"shard-{rank + 1:05d}-model-00001-of-00001{SUFFIX}",
        metadata={_SHARDING_KEY: json.dumps(sharding), "DCP_VERSION": "1.0"},
    )
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _own_chunk(t: torch.Tensor, writes_plain: bool) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(this rank's chunk, its global offset) if this rank is the one that writes it, else None."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return (t, (0,) * t.dim()) if writes_plain else None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coord = t.device_mesh.get_coordinate()
    if coord is None or any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coord)):
        return None
    local = t.to_local()
    if local.dim() > 0 and local.numel() == 0:
        return None  # an uneven shard left this rank nothing
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return local, tuple(offset)


def load_tensors(state: dict[str, torch.Tensor], directory: str | os.PathLike) -> None:
    """Fill `state`'s tensors (DTensors: their local shards) in place from `directory`; collective.
    Through DCP's HuggingFaceStorageReader where this torch has one, else `load_slices` (compat/dcp.py)."""
    from hybridflow.compat.dcp import hf_storage_reader

    directory = Path(directory)
    if not any(directory.glob(f"*{SUFFIX}")):
        raise FileNotFoundError(f"{directory} holds no {SUFFIX} shard files")
    reader = hf_storage_reader()
    if reader is None:
        load_slices(state, directory)
        return
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.load(state, storage_reader=reader(str(directory)))


@torch.no_grad()
def load_slices(state: dict[str, torch.Tensor], directory: str | os.PathLike) -> None:
    """What DCP's reader does, without DCP: each of `state`'s tensors (a DTensor: this rank's shard) is
    filled from the parts of the saved chunks that overlap it, read as safetensors slices, so a rank
    reads only what it holds. Needs no process group (each rank plans from the headers alone)."""
    from safetensors import safe_open

    index = tensor_index(directory)
    missing = sorted(set(state) - set(index))
    if missing:
        raise KeyError(f"{directory} holds no tensor {missing[0]!r} ({len(missing)} missing)")
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}
        for name, t in state.items():
            local, offset = _local_view(t)
            if local.numel() == 0:
                continue
            entry = index[name]
            if tuple(t.shape) != entry.shape:
                raise ValueError(f"tensor {name}: checkpoint shape {entry.shape}, expected {tuple(t.shape)}")
            filled = 0
            for path, c_off, c_size in entry.chunks:
                # the overlap of [offset, offset + local.shape) and [c_off, c_off + c_size), per dimension
                lo = [max(o, co) for o, co in zip(offset, c_off)]
                hi = [min(o + n, co + cn) for o, n, co, cn in zip(offset, local.shape, c_off, c_size)]
                if any(a >= b for a, b in zip(lo, hi)):
                    continue
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                f = handles[path]
                where = tuple(slice(a - co, b - co) for a, b, co in zip(lo, hi, c_off))
                part = f.get_slice(name)[where] if where else f.get_tensor(name)  # () : a 0-dim tensor
                local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))].copy_(part)
                filled += part.numel()
            if filled != local.numel():  # saved chunks never overlap (a replicated one is written once)
                raise ValueError(
                    f"tensor {name}: the shards cover {filled} of this rank's {local.numel()} elements"
                )


def _local_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the tensor this rank fills, its offset in the global tensor): a DTensor's local shard."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if t.device_mesh.get_coordinate() is None:  # not on this DTensor's mesh: nothing to fill
        return t.to_local(), (0,) * t.dim()
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(offset)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when no group exists; that is the intent then."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass
class TensorEntry:
    """One tensor of a sharded directory: its global shape and dtype and where its chunks lie."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[Path, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list
    )  # file, off, size

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def shard_files(directory: str | os.PathLike) -> list[Path]:
    """The shard files of a directory, in rank order: what a manifest or a checksum pass walks."""
    return sorted(Path(directory).glob(f"*{SUFFIX}"))


def read_header(path: Path) -> dict:
    """A safetensors file's JSON header (8-byte little-endian length, then JSON): no tensor data read."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        return json.loads(f.read(n))


def tensor_index(directory: str | os.PathLike) -> dict[str, TensorEntry]:
    """{name: TensorEntry} of every tensor in a sharded directory (headers only)."""
    entries: dict[str, TensorEntry] = {}
    for path in shard_files(directory):
        header = read_header(path)
        meta = header.pop("__metadata__", None) or {}
        sharding = json.loads(meta[_SHARDING_KEY]) if _SHARDING_KEY in meta else {}
        for name, info in header.items():
            size = tuple(info["shape"])
            offset = tuple(sharding.get(name, {}).get("saved_offsets", [0] * len(size)))
            entry = entries.setdefault(name, TensorEntry(size, ST_DTYPES[info["dtype"]]))
            entry.shape = tuple(max(a, o + s) for a, o, s in zip(entry.shape, offset, size))
            entry.chunks.append((path, offset, size))
    return entries


def read_full(name: str, entry: TensorEntry) -> torch.Tensor:
    """The whole tensor `name`, assembled from its chunks (peak memory: this tensor + one chunk)."""
    from safetensors import safe_open

    full = torch.empty(entry.shape, dtype=entry.dtype)
    covered = 0
    for path, offset, size in entry.chunks:
        with safe_open(str(path), framework="pt") as f:
            chunk = f.get_tensor(name)
        full[tuple(slice(o, o + s) for o, s in zip(offset, size))] = chunk
        covered += chunk.numel()
    if covered < full.numel():
        raise ValueError(f"tensor {name}: its shards cover {covered} of {full.numel()} elements")
    return full
