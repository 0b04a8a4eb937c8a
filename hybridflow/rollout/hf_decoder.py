"""Fallback decoder for architectures the functional forward does not cover (GPT-2, Qwen3, ...):
the model's own HF forward with a `DynamicCache`, behind the same start/prefill/decode/select calls
as `LlamaFamilyDecoder`, so the engine's loop (sampling, stop tokens, compaction) is shared.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


class HFDecoder:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None):
        self.model = model
        # a compute dtype other than the weights' own: the forward runs under autocast to it
        own = next(model.parameters()).dtype
        self.dtype = dtype if dtype is not None and dtype != own else None
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache (the old name still works, with a warning).
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = None

    def start(self, capacity: int, max_len: int, max_position: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.rows = 0

    def release(self) -> None:
        self.cache = self.mask = None

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
