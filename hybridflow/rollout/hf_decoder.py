"""Fallback decoder for architectures the functional forward does not cover (GPT-2, Qwen3, ...):
the model's own HF forward with a `DynamicCache`, behind the same start/prefill/decode/select calls
as `LlamaFamilyDecoder`, so the engine's loop (sampling, stop tokens, compaction) is shared.

The forward runs on a `PlainReplica`, never on the actor's module itself: under FSDP2 the decoder layers
are FSDP units whose forward hooks all-gather their weights at every call, so decoding through them
would gather each layer once per token and deadlock as soon as one rank's rows finish before
another's (the finished rank stops calling the collectives). Calling a layer before the FSDP root would
also lazily initialise it as a root of its own, which breaks the next training forward. The replica is
a hook-free copy of the module tree (built once, on the meta device) whose parameters and buffers are
bound, for one generate call, to the tensors the model holds then: under the 3D-HybridEngine those are
the generation weights the Resharder gathered once for the call (docs/hybrid_engine.md), so the replica
costs no memory of its own and decoding runs no collective. docs/rollout.md, "The HF fallback under FSDP".
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch.distributed.tensor import DTensor
from transformers import DynamicCache


class PlainReplica:
    """A plain module tree of `model`'s class and config whose tensors `bind(source)` points at
    `source`'s current parameters and buffers (same names, no copy) and `release()` points back at
    meta placeholders, so the replica never keeps the weights alive past a call."""

    def __init__(self, model: torch.nn.Module):
        config = copy.deepcopy(model.config)  # the attention implementation included (engines/varlen.py)
        with torch.device("meta"):
            self.model = type(model)(config)
        self.model.eval()  # no dropout while generating, and no need to toggle the actor's own mode
        self.model.requires_grad_(False)
        # (module, "_parameters" | "_buffers", leaf name, full name, meta placeholder); tied weights
        # appear under each of their names and are bound to the same source tensor
        self._slots = [
            (mod, kind, leaf, f"{prefix}.{leaf}" if prefix else leaf, t)
            for prefix, mod in self.model.named_modules(remove_duplicate=False)
            for kind in ("_parameters", "_buffers")
            for leaf, t in getattr(mod, kind).items()
            if t is not None
        ]  # fmt: skip

    def bind(self, source: torch.nn.Module) -> torch.nn.Module:
        """The replica, computing with `source`'s tensors as they are now (whole, unsharded ones)."""
        tensors = dict(source.named_parameters(remove_duplicate=False))
        tensors.update(source.named_buffers(remove_duplicate=False))
        for mod, kind, leaf, name, meta in self._slots:
            t = tensors.get(name)
            if t is None or t.shape != meta.shape:
                got = "missing" if t is None else f"shape {tuple(t.shape)}"
                raise RuntimeError(
                    f"HF fallback decoder: {name} is {got} in the model (expected {tuple(meta.shape)})"
                )
            if isinstance(t, DTensor):
                raise RuntimeError(
                    f"HF fallback decoder: {name} is still sharded ({t.placements}); it generates on whole "
                    "weights (tp = 1, the FSDP units unsharded by the Resharder)"
                )
            getattr(mod, kind)[leaf] = t.detach()
        return self.model

    def release(self) -> None:
        for mod, kind, leaf, _, meta in self._slots:
            getattr(mod, kind)[leaf] = meta


def _logits_kwargs(forward) -> dict:
    """{logits_to_keep: 1} where the forward takes it (transformers >= 4.50; `num_logits_to_keep`
    before), so prefill projects only the last position onto the vocabulary, not (B, prompt, V)."""
    params = inspect.signature(forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


class HFDecoder:
    """model: the module to run (a bound PlainReplica's, or any plain HF causal LM); release: called by
    `release()` at the end of the generate call (the replica's unbinding)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None, release=None):
        self.model = model
        # a compute dtype other than the weights' own: the forward runs under autocast to it
        own = next(model.parameters()).dtype
        self.dtype = dtype if dtype is not None and dtype != own else None
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache (the old name still works, with a warning).
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.logits_kw = _logits_kwargs(model.forward)
        self.cache = None
        self._release = release

    def start(self, capacity: int, max_len: int, max_position: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.rows = 0

    def release(self) -> None:
        self.cache = self.mask = None
        if self._release is not None:
            self._release()

    def _forward(self, ids, mask, pos) -> torch.Tensor:
        if self.dtype is not None:
            with torch.autocast(ids.device.type, dtype=self.dtype):  # sampling casts the logits to fp32
                return self._run(ids, mask, pos)
        return self._run(ids, mask, pos)

    def _run(self, ids, mask, pos) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{self.cache_kw: self.cache},
            **self.logits_kw,
        )
        return out.logits[:, -1]

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, repeat: int = 1
    ) -> torch.Tensor:
        logits = self._forward(ids, mask, pos)
        if repeat > 1:
            self.cache.batch_repeat_interleave(repeat)
        self.mask = mask.repeat_interleave(repeat, 0)
        self.rows = self.mask.shape[0]
        return logits

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)
        return self._forward(tokens[:, None], self.mask, pos[:, None])

    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        self.rows = idx.shape[0]
