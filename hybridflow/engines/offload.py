"""Offload once per phase: where a TrainEngine's parameters and optimizer state live between calls.

With `offload: true` (GPU only; colocated models take turns on the device) each piece of state comes
back only for the phase that needs it and goes out once when that phase ends:
  parameters       generation, log-prob / value / score passes, the whole PPO update
  optimizer state  only the optimizer steps (AdamW moments are 2x the parameters in fp32)
Phases nest: a worker wraps its whole update loop in `engine.phase(optimizer=True)`, so the
mini-batches inside it move nothing; only the outermost phase offloads on exit. Every move is timed
and its bytes counted (`take_stats`), logged by the workers as perf/offload_s and perf/offload_bytes.
On CPU the state already lives in host memory and nothing moves.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.distributed.tensor import DTensor


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
        return self.engine.device.type != "cpu"

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
        cpu = torch.device("cpu")
        if self.params_home:
            self._move_params(cpu)
            self.params_home = False
        if self.optim_home and self.engine.optimizer is not None:
            self._move_optimizer(cpu)
            self.optim_home = False
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
        self._timed(lambda: module.to(device), list(module.parameters()))  # FSDP2 moves its shards

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


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
