"""transformers model methods under the name each transformers release has.

transformers 5.23 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable` (the old
name stays as a deprecated alias, to be removed in v6); 5.17 to 5.22 have only the old name (checked in
each release's modeling_utils.py), with the same checkpointing: each decoder layer recomputed in backward
through torch.utils.checkpoint, the kwargs passed on to it.
"""

from __future__ import annotations

from torch import nn


def enable_activation_checkpointing(model: nn.Module, checkpoint_kwargs: dict | None = None) -> None:
    """Recompute each decoder layer of the HF `model` in backward; `checkpoint_kwargs` go to
    torch.utils.checkpoint.checkpoint (e.g. {"use_reentrant": False})."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
