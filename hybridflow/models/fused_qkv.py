"""GPT-2's fused qkv projection (c_attn, (.., 3E)) under tensor parallelism: the column order that makes a
Shard over tp give each rank [q_r, k_r, v_r]. engines/parallelize.py applies it, checkpoints store the
permuted layout, checkpoint/export.py undoes it; here, below both, so neither imports the other."""

from __future__ import annotations

import torch


def fused_qkv_permutation(embed_dim: int, tp: int) -> torch.Tensor:
    """Column order that makes a Shard over tp give each rank [q_r, k_r, v_r] of a fused (.., 3E) qkv."""
    return torch.arange(3 * embed_dim).view(3, tp, embed_dim // tp).transpose(0, 1).reshape(-1)
