"""What every role worker shares: config-tree -> EngineConfig, layouts, the PPO mini-batch loop, metrics.

Why the mini-batch/epoch loop lives in the worker (docs/design.md §2; verl's dp_actor): the
controller sends a whole rollout batch once; each rank splits its own shard into `num_mini_batches`
pieces and runs `ppo_epochs` passes, one optimizer step per piece. Every rank holds an equal-sized
shard (the controller pads a batch that does not divide dp), so every rank runs the same number of
steps and the FSDP collectives line up; `mask_padding` keeps those padding rows out of every loss and
metric, so a padded batch trains exactly as the unpadded one would.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.batch import Batch
from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig
from hybridflow.engines.config import LoraConfig, compute_dtype

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import ActorConfig, CriticConfig, RefConfig, RewardConfig


def engine_parallel(section_parallel: ParallelConfig, world_size: int, what: str) -> ParallelConfig:
    """The engine's ParallelConfig for one model on a worker group of `world_size` ranks: the
    section's own, whose dp resolve_config (or the placement's plan) has already derived. Checked
    against the group actually started, since a Placement passed in code may differ from the config.
    """
    tp, pp, dp = section_parallel.tp, section_parallel.pp, section_parallel.dp
    if world_size % (tp * pp):
        raise ValueError(
            f"{what}.parallel: tp*pp = {tp * pp} does not divide the {world_size} devices of its pool; "
            "change tp/pp or the pool size"
        )
    if tp * pp * dp != world_size:
        raise ValueError(
            f"{what}.parallel.dp = {dp}, but its pool has {world_size} devices and tp*pp = {tp * pp}, "
            f"so dp must be {world_size // (tp * pp)} (resolve_config derives it from the placement)"
        )
    return dataclasses.replace(section_parallel, dp=dp)


def engine_optim(optim: OptimConfig, total_steps: int) -> OptimConfig:
    """The section's OptimConfig with the decay length filled in (optim.total_steps, 0 = the whole
    run: `total_steps` optimizer steps)."""
    return dataclasses.replace(
        optim, betas=list(optim.betas), total_steps=optim.total_steps or max(total_steps, 1)
    )


def engine_config(
    section: ActorConfig | CriticConfig | RefConfig | RewardConfig,
    world_size: int,
    what: str,
    seed: int,
    model_dtype: str = "auto",
    total_steps: int = 0,
    micro_batch_size_per_device: int | None = None,
    remove_padding: bool | None = None,
    share_prompt: bool | None = None,
    lora: LoraConfig | None = None,
    cpu_gemm: str = "auto",
) -> EngineConfig:
    """An EngineConfig from an actor / critic / ref / reward config section (remove_padding, share_prompt:
    model.remove_padding, model.share_prompt; lora: model.lora for a model that trains adapters; cpu_gemm:
    model.cpu_gemm)."""
    optim = getattr(section, "optim", None)
    return EngineConfig(
        parallel=engine_parallel(section.parallel, world_size, what),
        optim=engine_optim(optim, total_steps) if optim is not None else OptimConfig(),
        micro_batch_size_per_device=micro_batch_size_per_device or section.micro_batch_size_per_device,
        max_tokens_per_micro_batch=getattr(section, "max_tokens_per_micro_batch", 0),
        remove_padding=remove_padding,
        share_prompt=share_prompt,
        gradient_checkpointing=getattr(section, "gradient_checkpointing", False),
        mixed_precision=_MIXED_PRECISION[model_dtype],
        offload=getattr(section, "offload", False),
        seed=seed,
        cpu_gemm=cpu_gemm,
        lora=lora or LoraConfig(),
    )


# model.dtype -> EngineConfig.mixed_precision ("auto": bf16 on GPU, fp32 on CPU)
_MIXED_PRECISION = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "float32": "none"}


def computes_in_fp32(model_dtype: str, device: str) -> bool:
    """Whether the actor computes in fp32 under model.dtype on `device` ("cpu"/"cuda"/"auto")."""
    return model_compute_dtype(model_dtype, device) is None


def model_compute_dtype(model_dtype: str, device: str) -> torch.dtype | None:
    """The dtype the actor computes in under model.dtype on `device` (None = fp32). Generation runs in it
    too (verl's rollout does: bf16 weights in vLLM), from a copy cast at each call or a rollout pool's
    weights stored in it (workers/actor.py)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return compute_dtype(_MIXED_PRECISION[model_dtype], device == "cuda")


def set_train_layout(worker, name: str, parallel: ParallelConfig) -> None:
    """Declare layout `name` from an engine mesh (pp, dp, tp), tp fastest-varying (engines/mesh.py): the
    ranks of one pp group get the same rows, collected from the last stage."""
    r, tp, dp = worker.rank, parallel.tp, parallel.dp
    worker.set_layout(
        name, dp_rank=(r // tp) % dp, dp_size=dp, tp_rank=r % tp, tp_size=tp,
        pp_rank=r // (tp * dp), pp_size=parallel.pp,
    )  # fmt: skip


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def mask_padding(batch: Batch) -> Batch:
    """Zero `response_mask` on the trailing padding rows (`batch.meta.pad_rows`, set by the transfer
    protocol when it repeated rows to give every dp rank an equal shard) and drop the count.

    Every loss, the engine's token / sequence counts and every training metric are masked by
    response_mask, so the copies still run forward and backward (FSDP needs the same passes on every
    rank) but weigh nothing: without this, a repeated row would count twice.
    """
    pad, batch.meta.pad_rows = batch.meta.pad_rows, 0
    if pad:
        mask = batch["response_mask"].clone()
        mask[len(batch) - pad :] = 0
        batch["response_mask"] = mask
    return batch


def iter_mini_batches(batch: Batch, num_mini_batches: int, epochs: int, seed: int) -> Iterator[Batch]:
    """`epochs` passes over `batch`, each cut into `num_mini_batches` consecutive pieces.

    The first epoch keeps the row order (so one mini-batch and one epoch is exactly on-policy);
    later epochs use a seeded permutation, the same on every rank.
    """
    n = max(1, min(num_mini_batches, len(batch)))
    for epoch in range(epochs):
        rows = batch if epoch == 0 else batch.index(torch.randperm(len(batch), generator=_gen(seed, epoch)))
        size = -(-len(rows) // n)
        yield from rows.split(size)


def _gen(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1009 + epoch)


def offload_metrics(engine) -> dict[str, float]:
    """offload_s and offload_bytes moved by `engine` since the last call: empty unless offloading."""
    stats = engine.offload_stats()
    return {k: v for k, v in stats.items() if k != "offload_moves"} if engine.config.offload else {}


class MetricLists:
    """Per-step metric values collected as lists (DP_METRICS pools the lists over ranks and averages)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, metrics: dict, prefix: str = "", rename: dict[str, str] | None = None) -> None:
        rename = rename or {}
        for k, v in metrics.items():
            self.values[prefix + rename.get(k, k)].append(float(v))

    def as_dict(self) -> dict[str, list[float]]:
        return dict(self.values)
