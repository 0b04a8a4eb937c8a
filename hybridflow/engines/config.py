"""Typed configs of the training engine: parallel layout, optimizer, engine behaviour.

ParallelConfig and OptimConfig are defined here once, with their help text: the config tree
(config/schema.py) composes them as `actor.parallel`, `actor.optim`, ... and the engine reads the
same objects (docs/design.md §7). Fields hold what the user wrote, so they are not
checked at construction: `validate_config` reports bad values with the key path before any worker
starts (each field's declared domain, then `parallel_errors`, `optim_errors` below), and the engine
re-checks what it needs (`ParallelConfig.check`, `OptimConfig.check`).

Sizes are global unless suffixed `_per_device`. The layout is 3-D (pp, tp, dp) as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.fields import setting

SCHEDULES = ("constant", "linear", "cosine")
# torch.distributed.pipelining's schedules by their names there (engines/pipeline.py builds them)
PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")


@dataclass
class ParallelConfig:
    """How one model is laid out over its worker group (world size = pp * tp * dp)."""

    tp: int = setting(1, "tensor-parallel size (DTensor column/row shards inside each layer)", ge=1)
    pp: int = setting(
        1,
        "pipeline-parallel size (stages of decoder layers cut from a Llama-family model; docs/design.md §8)",
        ge=1,
    )
    dp: int = setting(
        0, "data-parallel size, FSDP2-sharded (0 = derive: the group's devices / (tp * pp))", ge=0
    )
    pp_schedule: str = setting(
        "1f1b",
        "pipeline schedule when pp > 1: 1f1b, interleaved_1f1b (pp_virtual_stages stages a rank) or gpipe "
        "(docs/design.md §8)",
        choices=PP_SCHEDULES,
    )
    pp_virtual_stages: int = setting(
        2,
        "pipeline stages per rank under interleaved_1f1b (Megatron's virtual pipeline size); the model "
        "needs pp * pp_virtual_stages decoder layers. 1f1b and gpipe run one",
        ge=1,
    )

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def check(self) -> None:
        """Raise unless this is a concrete layout the engine can build (dp resolved)."""
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(
                f"ParallelConfig.pp_schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}"
            )
        errors = parallel_errors(self, "ParallelConfig")
        if errors:
            raise ValueError(errors[0])

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds: pp_virtual_stages under interleaved_1f1b, else one."""
        return self.pp_virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1


@dataclass
class OptimConfig:
    """AdamW with linear warmup, a decay schedule and global gradient-norm clipping.

    Defaults are verl's actor defaults (lr 1e-6, weight decay 0.01, as torch's AdamW); the critic
    section overrides lr to 1e-5 (config/schema.py)."""

    lr: float = setting(1e-6, "peak learning rate (0 freezes the model)", ge=0)
    weight_decay: float = setting(0.01, "AdamW weight decay", ge=0)
    betas: list[float] = setting([0.9, 0.999], "AdamW (beta1, beta2)", ge=0, lt=1)
    eps: float = setting(1e-8, "AdamW epsilon (divides by sqrt(v) + eps: 0 would divide 0 by 0)", gt=0)
    warmup_steps: int = setting(0, "linear warmup from 0 to lr over this many optimizer steps", ge=0)
    schedule: str = setting(
        "constant",
        "lr after warmup: constant, linear or cosine decay to min_lr_ratio * lr at total_steps",
        choices=SCHEDULES,
    )
    min_lr_ratio: float = setting(0.0, "final lr as a fraction of lr for linear/cosine schedules", unit=True)
    total_steps: int = setting(
        0, "optimizer steps the linear/cosine decay spans (0 = the whole run's optimizer steps)", ge=0
    )
    grad_clip: float = setting(1.0, "clip the global gradient norm to this value (0 = no clipping)", ge=0)

    def check(self) -> None:
        """Raise ValueError for a schedule the engine cannot build."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule != "constant" and self.total_steps <= 0:
            raise ValueError(
                f"OptimConfig.schedule={self.schedule!r} needs total_steps > 0 (the decay length)"
            )


@dataclass
class LoraConfig:
    """Low-rank adapters (peft's LoRA) on the actor and the critic: the base weights frozen, only the
    adapters (and a critic's value head) trained. models/lora.py applies them; docs/lora.md."""

    rank: int = setting(0, "adapter rank r (0 = no LoRA: full fine-tuning)", ge=0)
    alpha: float = setting(16.0, "adapter scale numerator: the update is (alpha / rank) * B @ A", ge=0)
    target_modules: list[str] = setting(
        ["all-linear"],
        "module names the adapters wrap (peft's target_modules, e.g. [q_proj, v_proj]); [all-linear] = "
        "every linear layer of the decoder (not lm_head nor a value head)",
    )
    dropout: float = setting(0.0, "dropout on the adapters' input while training", ge=0, lt=1)
    critic: bool = setting(True, "the critic gets adapters too (its value head stays fully trained)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def lora_errors(c: LoraConfig, key: str) -> list[str]:
    """The section at `key` (model.lora), one line per bad value."""
    errors = []  # rank, alpha and dropout: the fields' domains (fields.domain_errors)
    if not c.target_modules or not all(isinstance(m, str) and m for m in c.target_modules):
        errors.append(
            f"{key}.target_modules: expected a non-empty list of module names, got {c.target_modules}"
        )
    return errors


def parallel_errors(p: ParallelConfig, key: str) -> list[str]:
    """The section at `key` (e.g. "actor.parallel") as the user wrote it: dp may still be 0 (derive)."""
    if p.tp < 1 or p.pp < 1 or p.dp < 0:
        return [f"{key}: tp and pp must be >= 1 and dp >= 0, got tp={p.tp} pp={p.pp} dp={p.dp}"]
    if p.pp_schedule not in PP_SCHEDULES:
        return []  # the field's choices report it (config/validate.py), ParallelConfig.check in code
    interleaved = p.pp_schedule == "interleaved_1f1b"
    if interleaved and p.pp_virtual_stages < 2:
        return [f"{key}.pp_virtual_stages: interleaved_1f1b runs >= 2 stages a rank, got "
                f"{p.pp_virtual_stages} (one stage a rank is pp_schedule=1f1b)"]  # fmt: skip
    if not interleaved and p.pp_virtual_stages != 2:
        return [f"{key}.pp_virtual_stages: {p.pp_virtual_stages} applies to pp_schedule=interleaved_1f1b "
                f"only; {p.pp_schedule} runs one stage a rank"]  # fmt: skip
    return []


def optim_errors(o: OptimConfig, key: str) -> list[str]:
    """The section at `key` (e.g. "actor.optim"), one line per bad value."""
    if len(o.betas) != 2:  # each one's range: the field's domain (fields.domain_errors)
        return [f"{key}.betas: expected two numbers in [0, 1), got {o.betas}"]
    return []


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

    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(dp=1))
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Fixed micro-batch size per device (rows); used when max_tokens_per_micro_batch is 0.
    micro_batch_size_per_device: int = 8
    # Token budget per micro-batch (padded rows * padded length after trimming). > 0 switches on
    # dynamic micro-batches: samples are sorted by length and packed up to the budget.
    max_tokens_per_micro_batch: int = 0
    # Padding removal (engines/packing.py): each micro-batch's real tokens packed into rows, no padding
    # computed. None = on for the model types that pack (packing.PACKABLE_MODEL_TYPES), off otherwise;
    # True on another type raises. With it the token budget counts real tokens, not padded ones.
    remove_padding: bool | None = None
    # Shared prompts (engines/shared_prompt.py): in a packed micro-batch, rows with an identical prompt
    # compute it once. None = wherever padding is removed; True with padding removal off raises.
    share_prompt: bool | None = None
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
    # fp32 linear layers on CPU through "mkl" (PyTorch's path), "onednn" or "auto" (oneDNN where MKL runs
    # below the CPU's vector width: models/cpu_gemm.py). Nothing on GPUs, in 16-bit or under tensor parallelism.
    cpu_gemm: str = "auto"
    # Low-rank adapters (models/lora.py); rank 0 trains every weight.
    lora: LoraConfig = field(default_factory=LoraConfig)
