"""Serve a model whose head_dim vLLM's CPU attention has no kernel for, by exact zero-padding of heads.

vLLM's CPU attention supports head_dim 32, 64, 80, ... only (VLLM_CPU_HEAD_DIMS); the demo's tiny model
has head_dim 16. vLLM is then given the same model with every head widened to the next supported size
`P`, which computes exactly the same function (docs/rollout.md, "head_dim"):

- config: head_dim = P, and RoPE on the first `d` dims only (rope_parameters.partial_rotary_factor =
  d / P). vLLM's neox-style rotary on rotary_dim = d pairs dims (i, i + d/2) with frequency
  base^(-2i/d): HF's rotate_half on the d-dim head. A Qwen2 model is served as vLLM's Llama with
  qkv_bias, since vLLM's Qwen2 derives head_dim from hidden_size / heads and ignores config.head_dim.
- weights, on every load: per head, q_proj / k_proj / v_proj rows (and biases) padded d -> P with
  zeros, o_proj columns padded the same. q (weights and bias) is scaled by sqrt(P / d): vLLM scales
  scores by P^-0.5, the model by d^-0.5, and RoPE is linear, so scaling q before it is exact. The
  padded q and k dims are zero, so scores are unchanged; the padded v dims are zero and their o_proj
  columns too.

Padding is per head, so it commutes with vLLM's tensor parallel split of whole heads (rollout.tg > 1):
a full-shaped tensor holding one rank's block (vllm_engine.shard_as_full) pads to the padded block.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger(__name__)

# vLLM 0.32 CPU attention (CPUAttentionBackend.get_supported_head_sizes)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Architectures whose attention this module knows how to widen (HF names, Llama-style layers).
PADDABLE = ("llama", "qwen2")


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def padded_head_dim(head_dim: int) -> int | None:
    """The supported size to pad `head_dim` to, or None when it is supported as is (or too big)."""
    if head_dim in VLLM_CPU_HEAD_DIMS:
        return None
    bigger = [p for p in VLLM_CPU_HEAD_DIMS if p > head_dim]
    return bigger[0] if bigger else None


def unsupported_reason(hf_config) -> str | None:
    """One line when vLLM's CPU attention can serve this model neither as is nor padded, else None."""
    d = head_dim_of(hf_config)
    if d in VLLM_CPU_HEAD_DIMS:
        return None
    if padded_head_dim(d) is None:
        return f"vLLM's CPU attention supports head_dim {list(VLLM_CPU_HEAD_DIMS)}; this model has {d}"
    if hf_config.model_type not in PADDABLE:
        return (
            f"vLLM's CPU attention supports head_dim {list(VLLM_CPU_HEAD_DIMS)}; this {hf_config.model_type} "
            f"model has {d}, and zero-padding heads is implemented for {list(PADDABLE)} only"
        )
    if dict(getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default") != "default":
        return f"head_dim {d} would need padding, which supports plain RoPE only (rope_type=default)"
    return None


def write_padded_config(hf_config, path: str, head_dim: int) -> None:
    """config.json for vLLM in `path`: `hf_config` with heads widened to `head_dim` (see module doc)."""
    d = head_dim_of(hf_config)
    cfg = hf_config.to_dict()
    rope = dict(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["partial_rotary_factor"] = d / head_dim
    cfg.update(head_dim=head_dim, rope_parameters=rope)
    if cfg.get("model_type") == "qwen2":  # vLLM's Qwen2 ignores config.head_dim; its Llama reads it
        cfg.update(
            model_type="llama", architectures=["LlamaForCausalLM"], qkv_bias=True, attention_bias=False
        )
        for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
            cfg.pop(key, None)
    cfg.pop("partial_rotary_factor", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    log.warning(
        "rollout.engine=vllm: head_dim %d has no vLLM CPU kernel; serving heads zero-padded to %d "
        "(exactly the same function, see docs/rollout.md)",
        d,
        head_dim,
    )


def _pad_rows(t: torch.Tensor, heads: int, d: int, p: int) -> torch.Tensor:
    """[heads * d, ...] -> [heads * p, ...], each head's d rows followed by p - d zero rows."""
    x = t.reshape(heads, d, *t.shape[1:])
    out = x.new_zeros(heads, p, *t.shape[1:])
    out[:, :d] = x
    return out.reshape(heads * p, *t.shape[1:])


def pad_weights(
    weights: Iterable[tuple[str, torch.Tensor]], hf_config, head_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs with the attention projections widened to `head_dim` (module doc)."""
    d, p = head_dim_of(hf_config), head_dim
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    q_scale = math.sqrt(p / d)
    for name, t in weights:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module == "q_proj":
            t = _pad_rows(t * q_scale, heads, d, p)
        elif module in ("k_proj", "v_proj"):
            t = _pad_rows(t, kv_heads, d, p)
        elif module == "o_proj" and parts[-1] == "weight":
            t = _pad_rows(t.t(), heads, d, p).t().contiguous()
        yield name, t
