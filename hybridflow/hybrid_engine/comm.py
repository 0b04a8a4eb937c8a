"""Counted collectives and an allocation ledger: the measured side of the switch's cost accounting.

Bytes are counted at the call, from the tensors actually passed, under the usual bandwidth model of each
collective (the one Table 2 of the paper uses):
- all-gather over n ranks of a c-byte slot: every rank receives (n-1)*c and sends (n-1)*c (ring);
- broadcast of b bytes: every non-root rank receives b; the root sends b per receiver;
- gather of c-byte slots to a root: the root receives (n-1)*c, every other member sends c.

Peak memory: CPU tensors have no allocator statistics, so the switch tells the ledger what it holds for
generation (`hold`) and what it holds only while one unit is switched (`transient`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.compat.dist import all_gather_single
from hybridflow.controller.device import device_clock


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    seconds: float = 0.0  # wall time of the collectives, each until its device had finished it


class CountedComm:
    """Thin wrapper over torch.distributed collectives that adds up the bytes each call moves."""

    def __init__(self):
        self.stats = CommStats()

    def reset(self) -> None:
        self.stats = CommStats()

    def all_gather_into(self, output: torch.Tensor, slot: torch.Tensor, group) -> None:
        """output = cat of every member's `slot` (slot may be this member's own part of output)."""
        n = dist.get_world_size(group)
        if output.numel() != n * slot.numel():
            raise ValueError(
                f"all-gather output has {output.numel()} elements, expected {n} x {slot.numel()}"
            )
        start = device_clock(slot.device)
        if n > 1:
            all_gather_single(output, slot, group=group)
        self.stats.seconds += device_clock(slot.device) - start
        moved = (n - 1) * tensor_bytes(slot)
        self._count(moved, moved)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None) -> None:
        """Broadcast from global rank `src` to every member of `group`."""
        n, start = dist.get_world_size(group), device_clock(tensor.device)
        if n > 1:
            dist.broadcast(tensor, src=src, group=group)
        self.stats.seconds += device_clock(tensor.device) - start
        if dist.get_rank() == src:
            self._count(sent=(n - 1) * tensor_bytes(tensor), received=0)
        else:
            self._count(sent=0, received=tensor_bytes(tensor))

    def gather(self, slot: torch.Tensor, output: torch.Tensor | None, dst: int, group) -> None:
        """Gather every member's `slot` into `output` (cat order = group order) on global rank `dst`."""
        n, start = dist.get_world_size(group), device_clock(slot.device)
        if dist.get_rank() == dst:
            parts = list(output.chunk(n))
            if n > 1:
                dist.gather(slot, parts, dst=dst, group=group)
            elif parts[0].data_ptr() != slot.data_ptr():
                parts[0].copy_(slot)
            self._count(sent=0, received=(n - 1) * tensor_bytes(slot))
        else:
            dist.gather(slot, None, dst=dst, group=group)
            self._count(sent=tensor_bytes(slot), received=0)
        self.stats.seconds += device_clock(slot.device) - start

    def _count(self, sent: int, received: int) -> None:
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.calls += 1


class MemoryLedger:
    """Running and peak bytes of the generation weights a switch holds (CPU has no memory_allocated())."""

    def __init__(self, resident: int = 0):
        self.current = self.peak = resident

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count `tensor` as held from now on (until the ledger is replaced); returns it."""
        self.current += tensor_bytes(tensor)
        self.peak = max(self.peak, self.current)
        return tensor

    def transient(self, nbytes: int) -> None:
        """Count `nbytes` held on top of the current bytes for a moment (a unit being switched)."""
        self.peak = max(self.peak, self.current + nbytes)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
