"""Typed configs of the training engine: parallel layout, optimizer, engine behaviour.

Sizes are global unless suffixed `_per_device` (docs/design.md §7). The layout stays 3-D (pp, tp, dp) as in
the paper even though pipeline parallelism is not implemented yet, so plans and protocols that
reason about (p, t, d) need no change when it is added.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is laid out over its worker group (world size = pp * tp * dp)."""

    tp: int = 1  # tensor-parallel size (DTensor colwise/rowwise shards inside each layer)
    pp: int = 1  # pipeline-parallel size; must be 1 for now (kept so configs stay 3-D)
    dp: int = 1  # data-parallel size; parameters, grads and optimizer state are FSDP2-sharded over it

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.pp != 1:
            raise NotImplementedError(
                f"pipeline parallelism is not implemented (pp={self.pp}); use pp=1 and raise tp or dp instead"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp


@dataclass
class OptimConfig:
    """AdamW + learning-rate schedule + gradient clipping."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warmup from 0 to lr over this many optimizer steps
    total_steps: int = 0  # schedule length for cosine decay; 0 with "cosine" is an error
    schedule: str = "constant"  # "constant" (after warmup) or "cosine" (decay to min_lr_ratio * lr)
    min_lr_ratio: float = 0.0  # floor of the cosine schedule as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping (the norm is still reported)

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"OptimConfig.schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.schedule == "cosine" and self.total_steps <= 0:
            raise ValueError("OptimConfig.schedule='cosine' needs total_steps > 0 (the decay length)")


MIXED_PRECISION = ("auto", "bf16", "fp16", "none")


def compute_dtype(mixed_precision: str, on_gpu: bool):
    """The dtype a model computes in (None = fp32) for an EngineConfig.mixed_precision value."""
    import torch

    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}")
    if mixed_precision == "auto":
        return torch.bfloat16 if on_gpu else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[mixed_precision]


@dataclass
class EngineConfig:
    """Behaviour of a TrainEngine for one model (actor, critic, reference or reward)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Fixed micro-batch size per device (rows); used when max_tokens_per_micro_batch is 0.
    micro_batch_size_per_device: int = 8
    # Token budget per micro-batch (padded rows * padded length after trimming). > 0 switches on
    # dynamic micro-batches: samples are sorted by length and packed up to the budget.
    max_tokens_per_micro_batch: int = 0
    # Sequence positions per chunk of lm_head + log_softmax: bounds the logits held at once to
    # (micro_batch, logits_chunk_size, vocab).
    logits_chunk_size: int = 256
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward
    # Compute dtype: "auto" (bf16 on GPU, fp32 on CPU), "bf16", "fp16" or "none" (fp32). Trainable
    # models keep fp32 master weights and compute in it (FSDP2 MixedPrecisionPolicy, or autocast
    # without FSDP); frozen models (reference, reward, cost) store their parameters in it.
    mixed_precision: str = "auto"
    # Move params + optimizer state to CPU after each phase (GPU only; colocated models take turns).
    offload: bool = False
    seed: int = 0
