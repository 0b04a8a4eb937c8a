"""Capture and restore every random number generator a rank uses (python, numpy, torch, CUDA).

CUDA's generator is captured only for the CUDA device a caller names (a worker its own device): the
driver names none and so makes no CUDA call at all (torch.cuda.get_rng_state_all would open a context
on every visible GPU in the driver, ~0.5 GiB each, and fail outright in exclusive-process mode).

Exact resume needs the same random draws after a restart as without one: sampling seeds, dropout,
shuffles that are not derived from (seed, epoch). The state is returned as plain JSON types
(lists, ints, base64 strings) so it can live in a JSON file or inside the trainer state, and loading
it never unpickles anything.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state(device: str | torch.device | None = None) -> dict:
    """The state of python `random`, numpy's global RNG, torch's CPU generator and, when `device` is a
    CUDA device, that device's generator, as JSON-serialisable values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if _cuda(device):
        state["cuda"] = [_b64(torch.cuda.get_rng_state(device))]  # a list: the format of one device per rank
    return state


def _cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def restore_rng_state(state: dict, device: str | torch.device | None = None) -> None:
    """Inverse of `capture_rng_state`. A CUDA state is restored only onto a CUDA `device` (a checkpoint
    from a GPU run resumes on CPU with the CPU generators restored)."""
    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        raise ValueError(f"RNG state lacks {missing}; it was not written by capture_rng_state")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and _cuda(device):
        torch.cuda.set_rng_state(_unb64(state["cuda"][0]), device)
