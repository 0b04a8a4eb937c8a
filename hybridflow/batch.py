"""The data object passed between stages (docs/design.md §3): named tensors sharing a first dimension,
per-sample non-tensor fields, and typed metadata about all the rows (batch_meta.py: its fields and
what each operation does to them).

Why not pickle tensors as-is: Ray serialises numpy arrays out-of-band (zero-copy from the object
store), so a Batch reduces its tensors to numpy views when pickled and rebuilds tensors around them
on load. A 512 MB batch therefore costs one memcpy into the object store, not a pickle round trip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridflow.batch_meta import BatchMeta


def _tensor_to_numpy(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """Return (torch dtype name, numpy view). bf16 has no numpy dtype, so it travels as int16 bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return "bfloat16", t.view(torch.int16).numpy()
    return str(t.dtype).removeprefix("torch."), t.numpy()


def _numpy_to_tensor(dtype: str, a: np.ndarray) -> torch.Tensor:
    if not a.flags.writeable:
        # Arrays read from Ray's object store are read-only views of shared memory. Copying keeps
        # every consumer free to write in place (torch would otherwise warn on each from_numpy).
        a = a.copy()
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


@dataclass
class Batch:
    """A batch of samples.

    tensors:     name -> tensor of shape (batch, ...), all with the same batch size.
    non_tensors: name -> numpy object/array of shape (batch,), e.g. ground truths, data sources.
    meta:        BatchMeta, facts about every row (the step, the log-prob temperature, padding, ...).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: BatchMeta = field(default_factory=BatchMeta)

    def __post_init__(self) -> None:
        if not isinstance(self.meta, BatchMeta):
            raise TypeError(
                f"Batch.meta must be a BatchMeta (hybridflow/batch_meta.py), got {type(self.meta).__name__}"
            )
        self.non_tensors = {k: _as_object_array(v) for k, v in self.non_tensors.items()}
        self._check()

    # ---- construction / inspection ---------------------------------------------------------
    @classmethod
    def from_dict(
        cls, tensors: dict | None = None, non_tensors: dict | None = None, meta: BatchMeta | None = None
    ) -> Batch:
        return cls(
            dict(tensors or {}), dict(non_tensors or {}), meta.copy() if meta is not None else BatchMeta()
        )

    def _check(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"{key!r} not in batch; fields are {self.keys()}")

    def __setitem__(self, key: str, value) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = _as_object_array(value)
        self._check()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items()]
        fields += [f"{k}: ({len(v)},) object" for k, v in self.non_tensors.items()]
        return f"Batch(len={len(self)}, " + ", ".join(fields) + f", meta={self.meta})"

    # ---- selection ---------------------------------------------------------------------------
    def select(self, keys: Iterable[str], meta: bool = True) -> Batch:
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"select: {missing} not in batch; fields are {self.keys()}")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
            self.meta.copy() if meta else BatchMeta(),
        )

    def pop(self, keys: Iterable[str]) -> Batch:
        out = self.select(keys)
        for k in out.keys():
            self.tensors.pop(k, None)
            self.non_tensors.pop(k, None)
        return out

    def index(self, idx) -> Batch:
        """Rows by slice, index list or bool mask."""
        if isinstance(idx, slice):
            np_idx = idx
        else:
            idx = torch.as_tensor(idx)
            if idx.dtype == torch.bool:
                idx = idx.nonzero().flatten()
            np_idx = idx.numpy()
        return Batch(
            {k: v[idx] for k, v in self.tensors.items()},
            {k: v[np_idx] for k, v in self.non_tensors.items()},
            self.meta.index(len(self), np_idx),
        )

    # ---- split / merge -----------------------------------------------------------------------
    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of `size` rows (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """Exactly n chunks of equal size; the batch size must divide (see pad_to_divisor)."""
        if len(self) % n:
            raise ValueError(
                f"cannot chunk a batch of {len(self)} into {n} equal parts; call pad_to_divisor({n}) first"
            )
        return self.split(len(self) // n) if len(self) else [self.index(slice(0, 0)) for _ in range(n)]

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        if not batches:
            return Batch()
        first = batches[0]
        for b in batches[1:]:
            if set(b.keys()) != set(first.keys()):
                raise ValueError(f"concat: fields differ: {sorted(first.keys())} vs {sorted(b.keys())}")
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            BatchMeta.concat([b.meta for b in batches], [len(b) for b in batches]),
        )

    def union(self, other: Batch) -> Batch:
        """Merge fields of two batches of the same samples. Shared keys must hold equal values."""
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not (tensors[k].shape == v.shape and torch.equal(tensors[k], v)):
                raise ValueError(f"union: conflicting values for tensor field {k!r}")
            tensors[k] = v
        non_tensors = dict(self.non_tensors)
        for k, v in other.non_tensors.items():
            if k in non_tensors and not np.array_equal(non_tensors[k], v):
                raise ValueError(f"union: conflicting values for field {k!r}")
            non_tensors[k] = v
        return Batch(tensors, non_tensors, self.meta.union(other.meta))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Repeat every sample n times: interleave gives a,a,b,b; otherwise a,b,a,b."""
        if interleave:
            t = {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()}
            nt = {k: np.repeat(v, n, axis=0) for k, v in self.non_tensors.items()}
        else:
            t = {k: v.repeat(n, *[1] * (v.dim() - 1)) for k, v in self.tensors.items()}
            nt = {k: np.concatenate([v] * n) for k, v in self.non_tensors.items()}
        return Batch(t, nt, self.meta.repeat(n, interleave))

    def pad_to_divisor(self, divisor: int) -> Batch:
        """Pad by repeating leading rows (row len + i is row i % len) so len % divisor == 0;
        meta.pad_rows counts the padding rows."""
        pad = (-len(self)) % divisor
        if pad == 0:
            return self
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch")
        # copies of rows that may themselves be padding: all of the filler is padding either way
        filler = Batch(self.tensors, self.non_tensors, dataclasses.replace(self.meta, pad_rows=0))
        filler = filler.index(torch.arange(pad) % len(self))
        filler.meta.pad_rows = pad
        return Batch.concat([self, filler])

    def to(self, device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors, self.meta.copy())

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    # ---- serialisation -----------------------------------------------------------------------
    def __reduce__(self):
        packed = {k: _tensor_to_numpy(v) for k, v in self.tensors.items()}
        return (_rebuild_batch, (packed, self.non_tensors, self.meta))


def _rebuild_batch(packed, non_tensors, meta) -> Batch:
    tensors = {k: _numpy_to_tensor(dtype, a) for k, (dtype, a) in packed.items()}
    return Batch(tensors, non_tensors, meta)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 mask -> (B, L) position ids counting only attended tokens, 0 on padding (HF and verl
    convention for left-padded prompts)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _as_object_array(v) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v
    arr = np.empty(len(v), dtype=object)
    arr[:] = list(v)
    return arr
