"""Offload once per phase: where a TrainEngine's parameters and optimizer state live between calls.

With `offload: true` (GPU only; colocated models take turns on the device) each piece of state comes
back only for the phase that needs it and goes out once when that phase ends:
  parameters       generation, log-prob / value / score passes, the whole PPO update
  optimizer state  only the optimizer steps (AdamW moments are 2x the parameters in fp32)
Phases nest: a worker wraps its whole update loop in `engine.phase(optimizer=True)`, so the
mini-batches inside it move nothing; only the outermost phase offloads on exit. Every move is timed
and its bytes counted (`take_stats`), logged by the workers as perf/offload_s and perf/offload_bytes.

Moves are `non_blocking`: from a CUDA device that makes torch allocate the host copies in pinned memory
(page-locked, so they copy by DMA and the copy back is asynchronous too), and each move ends with one
synchronize before the host copies are read. On CPU the state already lives in host memory and nothing
moves; device-strict mode's stand-in accelerator (`cpu:0`, controller/strict_device.py) is no CPU there:
its state moves to the host tier and back, and an offloaded tensor that meets a device tensor raises.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.distributed.tensor import DTensor

from hybridflow.controller import strict_device

HOST = torch.device("cpu")


class Offloader:
    def __init__(self, engine):
        self.engine = engine
        self.params_home = self.optim_home = True  # on the compute device
        self.depth = 0
        self.seconds = 0.0
        self.bytes = 0
        self.moves = 0

    @property
    def active(self) -> bool:
        # a GPU, or strict mode's stand-in accelerator: cpu:0 is not the plain "cpu" of host memory
        return self.engine.device != HOST

    @contextlib.contextmanager
    def phase(self, optimizer: bool = False):
        outer = self.depth == 0
        self.depth += 1
        try:
            self.bring(optimizer)
            yield
        finally:
            self.depth -= 1
            if outer and self.engine.config.offload:
                self.send_out()

    def bring(self, optimizer: bool = False) -> None:
        if not self.params_home:
            self._move_params(self.engine.device)
            self.params_home = True
        if optimizer and not self.optim_home:
            self._move_optimizer(self.engine.device)
            self.optim_home = True

    def send_out(self) -> None:
        if not self.active:
            return
        if self.params_home:
            self._move_params(HOST)
            self.params_home = False
        if self.optim_home and self.engine.optimizer is not None:
            self._move_optimizer(HOST)
            self.optim_home = False
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()

    def take_stats(self) -> dict[str, float]:
        """Seconds and bytes moved since the last call (then reset)."""
        out = {
            "offload_s": self.seconds,
            "offload_bytes": float(self.bytes),
            "offload_moves": float(self.moves),
        }
        self.seconds, self.bytes, self.moves = 0.0, 0, 0
        return out

    def _timed(self, fn, tensors) -> None:
        if not self.active:
            return
        t0 = time.perf_counter()
        fn()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        self.seconds += time.perf_counter() - t0
        self.bytes += sum(_local_bytes(t) for t in tensors)
        self.moves += 1

    def _move_params(self, device: torch.device) -> None:
        module = self.engine.module
        # FSDP2 moves its shards (and re-registers them); gradients and buffers move with the parameters
        self._timed(lambda: module.to(device, non_blocking=True), list(module.parameters()))
        strict_device.mark_moved(_state_tensors(module), device)

    def _move_optimizer(self, device: torch.device) -> None:
        opt = self.engine.optimizer
        moved = []

        def move():
            for state in opt.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0):
                        state[k] = v.to(device, non_blocking=True)
                        moved.append(state[k])

        self._timed(move, moved)  # counted after the move, when `moved` is filled


def _state_tensors(module: torch.nn.Module):
    for p in module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from module.buffers()


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
