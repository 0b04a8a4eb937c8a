"""A generation tensor-parallel group as the decoder sees it (rollout/llama_decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.compat.dist import all_gather_single


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

    def rank(self) -> int:
        """This rank's index in the group (its generation shard's index)."""
        return dist.get_rank(self.group)

    @property
    def is_src(self) -> bool:
        """Whether this rank is the member that samples and decides (`src`)."""
        return dist.get_rank() == self.src

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
        """Vocab-parallel lookup: `weight` holds rows [start, start + len(weight)) of the embedding; a
        member contributes zeros for the ids it does not hold and the all-reduce sums the owners' rows."""
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(x.masked_fill_(outside[..., None], 0.0))

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """cat over the members (in group order) of their `x` along its last dim: vocab-parallel logits
        -> full-vocabulary logits."""
        out = x.new_empty((self.size, *x.shape))
        all_gather_single(out.view(-1), x.contiguous().view(-1), group=self.group)
        return torch.cat(out.unbind(0), dim=-1)

    def agree(self, tokens: torch.Tensor, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src's (tokens, log-probs) on every member: one float64 broadcast (token ids are exact)."""
        both = torch.stack([tokens.double(), logps.double()])
        dist.broadcast(both, src=self.src, group=self.group)
        return both[0].long(), both[1].to(logps.dtype)

    def share(self, values: list[float], device: torch.device) -> list[float]:
        """src's `values` on every member (the others' are ignored): its count, then (when there are
        any) the values, each one float64 broadcast on `device` (the group's: NCCL takes no host
        tensor). Exact for integers below 2**53 (token ids, row numbers, flags)."""
        count = torch.tensor([float(len(values))], dtype=torch.float64, device=device)
        dist.broadcast(count, src=self.src, group=self.group)
        k = int(count.item())
        if k == 0:
            return []
        if self.is_src:
            out = torch.tensor(values, dtype=torch.float64, device=device)
        else:
            out = torch.empty(k, dtype=torch.float64, device=device)
        dist.broadcast(out, src=self.src, group=self.group)
        return out.tolist()
