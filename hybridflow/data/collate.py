"""Padding and collation into `Batch` objects (field names per the project conventions).

Prompts are left-padded so every prompt ends at the same column and generation appends on the
right; responses are right-padded. position_ids count real tokens only, so a left-padded row gets
the same positions as the unpadded one.
"""

from __future__ import annotations

import torch

from hybridflow.batch import position_ids_from_mask


def _pad(
    seqs: list[list[int]], pad_id: int, length: int | None, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    length = max((len(s) for s in seqs), default=0) if length is None else length
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            cols = slice(length - len(s), length) if left else slice(0, len(s))
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = 1
    return ids, mask


def left_pad(
    seqs: list[list[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids, mask), both (B, L) long, L = `length` or the longest sequence; tokens flush right."""
    return _pad(seqs, pad_id, length, left=True)


def right_pad(
    seqs: list[list[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids, mask), both (B, L) long; tokens flush left."""
    return _pad(seqs, pad_id, length, left=False)


def collate_prompt_response(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    loss_masks: list[list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Token lists -> the rollout layout: prompts (B, Lp) left-padded, responses (B, Lr) right-padded,
    input_ids = cat(prompts, responses) (B, Lp+Lr), attention_mask, position_ids, response_mask (B, Lr):
    1 on every response token, or `loss_masks` (each as long as its response; 0 on a tool-use trace's
    inserted tokens, which attention still covers).

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
        "response_mask": r_mask
        if loss_masks is None
        else r_mask * right_pad(loss_masks, 0, r_ids.shape[1])[0],
    }
