"""The driver's part of a checkpoint: everything besides model state needed for an exact resume.

What the driver puts in (its choice; the dict is free-form): `step`, the dataloader's
`state_dict()`, the KL controller value, the Safe-RLHF Lagrange multiplier, metric history the
algorithm reads (e.g. running reward statistics), the driver's `capture_rng_state()`. Stored as JSON
so a person can read it and no code is unpickled on load; floats round-trip exactly (json writes
repr). numpy / torch scalars and arrays are converted to Python numbers and lists.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from hybridflow.checkpoint.manager import CheckpointError, atomic_write_text

TRAINER_STATE = "trainer_state.json"


def _to_json(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(
        f"trainer state value of type {type(value).__name__} is not JSON-serialisable; "
        "store plain numbers, strings, lists, dicts (or tensors / numpy arrays)"
    )


def save_trainer_state(directory: str | os.PathLike, state: dict) -> Path:
    """Write `state` to directory/trainer_state.json (the checkpoint's temp directory); returns the path."""
    if not isinstance(state, dict):
        raise TypeError(f"trainer state must be a dict, got {type(state).__name__}")
    path = Path(directory) / TRAINER_STATE
    atomic_write_text(path, json.dumps(state, default=_to_json, indent=1))
    return path


def load_trainer_state(directory: str | os.PathLike) -> dict:
    """Read directory/trainer_state.json from a checkpoint step directory."""
    path = Path(directory) / TRAINER_STATE
    if not path.is_file():
        raise CheckpointError(
            f"{directory} has no {TRAINER_STATE}; the driver saves it with save_trainer_state at each checkpoint"
        )
    return json.loads(path.read_text())
