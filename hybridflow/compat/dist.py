"""torch.distributed collectives under the name each torch release has.

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` (the old name stays as a deprecated
alias that warns on every call); torch 2.11 and 2.12 have only the old name. Both take (output, input,
group, async_op) and fill `output` with the members' inputs concatenated in group order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """output = cat over the members of `group` (in group order) of their `input`; output has
    world_size * input.numel() elements. Looked up at each call, so a test can hide the new name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)
