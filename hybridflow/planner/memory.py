"""Bytes per device of one model under one parallel configuration.

Conventions (Megatron-style 3D parallelism with a distributed optimizer, as in the paper):
weights and gradients are split over the p*t model-parallel ranks and replicated over d; the fp32
master weights and Adam moments (12 bytes/param with bf16 weights; 8 with fp32 weights) are further
split over d. Gradients are fp32 (Megatron's default for bf16), so d = 1 costs 18 bytes/param, a
little above docs/design.md §2's ~16. Activations assume sequence
parallelism (split over t) and flash attention (no s^2 term), following Korthikanti et al. 2022:
~34 bytes * s * b * h per layer at 2-byte precision, or only the layer input when checkpointing.

Memory is split into *persistent* bytes (kept on the device between stages) and *transient* bytes
(alive only while the model runs). Models colocated on one pool need the sum of their persistent
bytes plus the largest transient peak, since they run one after another.
"""

from __future__ import annotations

from hybridflow.planner.specs import ModelSpec

ACTIVATION_UNITS_PER_LAYER = 17  # 34 bytes/(s*b*h) at 2 bytes per value, in units of values


def weight_bytes(spec: ModelSpec, bytes_per_param: int, p: int, t: int) -> float:
    return spec.num_params * bytes_per_param / (p * t)


def optimizer_bytes(spec: ModelSpec, bytes_per_param: int, p: int, t: int, d: int) -> float:
    """fp32 Adam moments (8 B/param) plus fp32 master weights when training in 16-bit, split over p*t*d."""
    per_param = 8 + (4 if bytes_per_param < 4 else 0)
    return spec.num_params * per_param / (p * t * d)


GRAD_BYTES_PER_PARAM = 4  # Megatron accumulates and all-reduces bf16 models' gradients in fp32


def train_state_bytes(spec: ModelSpec, bytes_per_param: int, p: int, t: int, d: int) -> float:
    """Weights + fp32 gradients + optimizer state on one device."""
    w = weight_bytes(spec, bytes_per_param, p, t)
    g = spec.num_params * GRAD_BYTES_PER_PARAM / (p * t)
    return w + g + optimizer_bytes(spec, bytes_per_param, p, t, d)


def train_activation_bytes(
    spec: ModelSpec,
    bytes_per_param: int,
    seq_len: int,
    micro_batch: int,
    p: int,
    t: int,
    micro_batches: int,
    checkpoint: bool,
    lm_head: bool,
) -> float:
    """Peak activation bytes on the first pipeline stage under 1F1B (it holds min(p, m) micro-batches)."""
    sbh = seq_len * micro_batch * spec.hidden * bytes_per_param
    full_layer = ACTIVATION_UNITS_PER_LAYER * sbh / t
    layers_per_stage = spec.num_layers / p
    in_flight = min(p, micro_batches)
    if checkpoint:  # keep each layer's input, recompute one layer at a time in backward
        stored = layers_per_stage * in_flight * sbh / t + full_layer
    else:
        stored = layers_per_stage * in_flight * full_layer
    logits = 2 * seq_len * micro_batch * spec.vocab_size * 4 / t if lm_head else 0.0  # fp32 + grad
    return stored + logits


def inference_activation_bytes(
    spec: ModelSpec, bytes_per_param: int, seq_len: int, micro_batch: int, t: int, lm_head: bool
) -> float:
    """One layer's working set (a few s*b*h buffers and the MLP's s*b*ffn) plus fp32 logits."""
    sb = seq_len * micro_batch
    working = sb * (4 * spec.hidden + 2 * spec.ffn_hidden) * bytes_per_param / t
    logits = sb * spec.vocab_size * 4 / t if lm_head else 0.0
    return working + logits


def kv_cache_bytes(
    spec: ModelSpec, bytes_per_param: int, sequences_per_replica: int, seq_len: int, pg: int, tg: int
) -> float:
    """KV cache of a generation replica's sequences at full length, on one of its pg*tg devices.

    TP splits KV heads; beyond num_kv_heads ranks (GQA) the heads are replicated, not split further.
    """
    per_token = spec.kv_bytes_per_token(bytes_per_param) / (pg * min(tg, spec.num_kv_heads))
    return sequences_per_replica * seq_len * per_token


def generation_extra_weight_bytes(spec: ModelSpec, bytes_per_param: int, p: int, t: int, pg: int, tg: int):
    """3D-HybridEngine: a generation shard (1/(pg*tg)) contains the training shard (1/(p*t)),
    so only the difference is gathered: zero redundancy (docs/design.md §4, Table 2, last-but-one row)."""
    return spec.num_params * bytes_per_param * (1 / (pg * tg) - 1 / (p * t))
