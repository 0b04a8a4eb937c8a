"""Padding and collation into `Batch` objects (field names per the project conventions).

Prompts are left-padded so every prompt ends at the same column and generation appends on the
right; responses are right-padded. position_ids count real tokens only, so a left-padded row gets
the same positions as the unpadded one.
"""

from __future__ import annotations

import torch


def left_pad(
    seqs: list[list[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids, mask), both (B, L) long, L = `length` or the longest sequence; tokens flush right."""
    length = max((len(s) for s in seqs), default=0) if length is None else length
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s) :] = 1
    return ids, mask


def right_pad(
    seqs: list[list[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids, mask), both (B, L) long; tokens flush left."""
    length = max((len(s) for s in seqs), default=0) if length is None else length
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
    return ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) mask -> (B, L) positions 0, 1, ... over the real tokens (0 on padding)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def collate_prompt_response(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Token lists -> the rollout layout: prompts (B, Lp) left-padded, responses (B, Lr) right-padded,
    input_ids = cat(prompts, responses) (B, Lp+Lr), attention_mask, position_ids, response_mask (B, Lr).

    SFT and DPO batches use it so the actor computes their log-probs exactly as for rollouts.
    """
    p_ids, p_mask = left_pad(prompts, pad_id)
    r_ids, r_mask = right_pad(responses, pad_id)
    mask = torch.cat([p_mask, r_mask], dim=1)
    return {
        "prompts": p_ids,
        "responses": r_ids,
        "input_ids": torch.cat([p_ids, r_ids], dim=1),
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask),
        "response_mask": r_mask,
    }
