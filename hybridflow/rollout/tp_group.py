"""A generation tensor-parallel group as the decoder sees it (rollout/llama_decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's generation tensor-parallel group (docs/hybrid_engine.md). Its ranks run the same
    rows; the sampled tokens (and their log-probs) are broadcast from `src`, the group's first rank, so
    the ranks agree on every token whatever the rounding of their logits."""

    group: Any  # a torch.distributed process group
    size: int
    src: int  # global rank of the member that samples and broadcasts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def agree(self, tokens: torch.Tensor, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src's (tokens, log-probs) on every member: one float64 broadcast (token ids are exact)."""
        both = torch.stack([tokens.double(), logps.double()])
        dist.broadcast(both, src=self.src, group=self.group)
        return both[0].long(), both[1].to(logps.dtype)
