"""torch.distributed.checkpoint's reader of safetensors shards, where this torch has it.

`HuggingFaceStorageReader` (torch.distributed.checkpoint.hf_storage, public from torch 2.8; 2.7 had only a
private `_hf_storage` of another interface) plans a load from the shards' safetensors headers,
`DCP_SHARDING_INFO` giving each chunk's global offset. Where it is missing,
checkpoint/shards.py reads the same files itself (`load_slices`): each rank reads just the slices of the
saved chunks that overlap its own shards, so a checkpoint still resumes onto any dp/tp layout.
"""

from __future__ import annotations


def hf_storage_reader() -> type | None:
    """The HuggingFaceStorageReader class, or None when this torch has no DCP safetensors storage."""
    try:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    except ImportError:
        return None
    return HuggingFaceStorageReader
