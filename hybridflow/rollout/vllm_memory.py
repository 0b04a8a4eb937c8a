"""The memory vLLM is asked for (rollout/vllm_engine.py; docs/rollout.md, "GPU memory"): one rank's KV
cache for the sequences of one call, and, with `rollout.gpu_memory_utilization` 0 on a CUDA device, the
utilisation vLLM's start-up check needs beside it. Pure functions of the model's config, the engine's
settings and the device's (free, total) bytes, which the engine reads in the worker.
"""

from __future__ import annotations

import torch

from hybridflow.rollout import vllm_pad


def kv_cache_bytes(hf_config, dtype: torch.dtype, max_num_seqs: int, max_model_len: int, tg: int = 1) -> int:
    """K and V for max_num_seqs full-length sequences, in vLLM's 16-token blocks, plus one spare block
    per sequence (vLLM's scheduler needs a little slack), on one rank of a tg-way vLLM tensor-parallel
    group: it holds num_key_value_heads / tg heads, or one replicated head when tg exceeds them (as
    vLLM's attention splits them). vLLM's kv_cache_memory_bytes is per rank."""
    layers = hf_config.num_hidden_layers
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    heads = max(1, heads // tg)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    blocks = -(-max_model_len // 16) + 1
    per_token = 2 * layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    return max_num_seqs * blocks * 16 * per_token


def memory_settings(
    hf_config,
    dtype: torch.dtype,
    config,  # rollout/vllm_engine.VLLMEngineConfig
    pad_head_dim: int | None = None,
    device_memory: tuple[int, int] | None = None,
    weight_bytes: int = 0,
) -> dict:
    """vLLM's memory arguments for one rank. gpu_memory_utilization > 0: passed through. 0 (auto): a
    KV cache of exactly this rank's share of max_num_seqs full-length sequences (kv_cache_memory_bytes;
    scaled up for heads zero-padded on CPU), and on a CUDA device, whose (free, total) bytes are
    `device_memory`, the utilisation that vLLM's start-up check needs (`auto_memory_utilization`)."""
    if config.gpu_memory_utilization > 0:
        return {"gpu_memory_utilization": config.gpu_memory_utilization}
    kv = kv_cache_bytes(
        hf_config, dtype, config.max_num_seqs, config.max_model_len, config.tensor_parallel_size
    )
    if pad_head_dim:
        kv = kv * pad_head_dim // vllm_pad.head_dim_of(hf_config)
    out = {"kv_cache_memory_bytes": kv}
    if device_memory is not None:
        out["gpu_memory_utilization"] = auto_memory_utilization(*device_memory, kv, weight_bytes)
    return out


def auto_memory_utilization(free: int, total: int, kv_bytes: int, weight_bytes: int) -> float:
    """vLLM's gpu_memory_utilization beside an explicit kv_cache_memory_bytes: the KV cache is then sized
    by the bytes, but vLLM still refuses to start when the device's free memory is below utilisation x
    total (its default utilisation is 0.92 in the pinned vLLM), which a device shared with the actor
    never has. Asked for: this rank's weights and KV cache, as a fraction of the device. Refused in one
    line when they are not free now (vLLM's activations and CUDA graphs come on top, not counted here)."""
    needed = kv_bytes + weight_bytes
    if needed >= free:  # vLLM asks for ceil(total x utilisation): equal could round a byte over
        from hybridflow.errors import ConfigError

        gib = 2**30
        raise ConfigError(
            [
                f"rollout.gpu_memory_utilization: 0 (auto) needs {needed / gib:.2f} GiB free for vLLM "
                f"(weights {weight_bytes / gib:.2f} + KV cache {kv_bytes / gib:.2f}), the device has "
                f"{free / gib:.2f} of {total / gib:.2f} GiB free: fewer sequences per call "
                "(rollout.micro_batch_size_per_device, rollout.n), shorter ones, or a larger rollout.tg"
            ]
        )
    return needed / total
