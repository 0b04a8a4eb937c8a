"""The one place that maps `rollout.engine` to a GenerationEngine, and says which rollout settings each
engine uses (validation rejects the others; docs/rollout.md has the table).

Engines: "builtin" (rollout/engine.py, any device) and "vllm" (rollout/vllm_engine.py, vLLM's offline
engine; `make vllm` installs its CPU build in .venv-vllm). SGLang is not offered: it is CUDA-only, has
no build for this project's CPU test machines, and an adapter nobody has run would be a setting
accepted and not honoured.
"""

from __future__ import annotations

import json
import os

import torch

from hybridflow.rollout.base import GenerationEngine
from hybridflow.rollout.vllm_pad import VLLM_CPU_HEAD_DIMS, unsupported_reason  # noqa: F401  (re-exported)

ENGINES = ("builtin", "vllm")
_VLLM = None  # this process's vLLM engine, once built


def build_generation_engine(
    config, model: torch.nn.Module, world_size: int = 1, own_weights: bool = False, dtype=None, device=None
) -> GenerationEngine:
    """config: the actor worker's config (config/roles.ActorWorkerConfig); model: the HF causal LM to
    generate with (the actor's own, whose parameters are full tensors while generating); world_size: ranks
    of the rollout group;
    own_weights: a rollout pool's engine, whose weights change only by load_weights (vLLM then keeps
    its own copy: rollout/vllm_engine.py; the built-in engine reads `model` either way); dtype: the
    compute dtype to generate in (the actor's: workers/common.model_compute_dtype; None = the model's);
    device: where vLLM runs (None: where the model's parameters are; a rollout pool's model is on the
    meta device)."""
    r = config.rollout
    if r.engine == "builtin":
        from hybridflow.rollout.engine import BuiltinEngine, BuiltinEngineConfig

        cfg = BuiltinEngineConfig(cpu_threads=r.cpu_threads, dtype=dtype, cpu_gemm=config.model.cpu_gemm)
        return BuiltinEngine(model, cfg)
    if r.engine == "vllm":
        from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        global _VLLM
        if _VLLM is not None:
            # One vLLM per process (its parallel groups are process-global): a later call (the worker's
            # full-weights copy of a tensor-parallel actor) only changes where the weights come from.
            _VLLM.model = model
            return _VLLM
        _VLLM = VLLMEngine(
            model,
            VLLMEngineConfig(
                max_model_len=config.max_prompt_length + r.response_length,
                max_num_seqs=max_sequences_per_call(config, max(1, world_size // r.tg)),  # per replica
                gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tg,
                seed=config.seed,
                cpu_threads=r.cpu_threads,
                own_weights=own_weights,
                dtype=dtype,
            ),
            device=device,
        )
        return _VLLM
    raise ValueError(f"rollout.engine: unknown engine {r.engine!r}; choose one of {ENGINES}")


def max_sequences_per_call(config, world_size: int) -> int:
    """Most sequences one rank's generate call holds: its prompts per call times the larger n
    (training or validation sampling). config: as for build_generation_engine."""
    r = config.rollout
    prompts = r.micro_batch_size_per_device or -(-config.prompts_per_step // world_size)
    return max(1, prompts) * max(r.n, r.val.n)


def require_rollout_engine(cfg) -> None:
    """Raise ConfigError (one line) when the chosen engine cannot be imported here. Checked when a
    run starts, not in validate_config: `hybridflow config show` must work on any machine."""
    import importlib.util

    from hybridflow.errors import ConfigError

    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            ["rollout.engine: vllm is not installed in this Python; `make vllm` builds .venv-vllm with it"]
        )


def rollout_engine_errors(cfg) -> list[str]:
    """One line per rollout setting the chosen engine would not use (see docs/rollout.md)."""
    r, errors = cfg.rollout, []
    if r.engine == "builtin" and r.gpu_memory_utilization:
        errors.append(
            f"rollout.gpu_memory_utilization: {r.gpu_memory_utilization} is a vLLM setting; the builtin engine "
            "allocates its KV cache per call (remove it, or set rollout.engine=vllm)"
        )
    if r.engine == "vllm":
        if not 0.0 <= r.gpu_memory_utilization < 1.0:
            errors.append(
                f"rollout.gpu_memory_utilization: must be in [0, 1) (0 = KV cache sized for the batch), "
                f"got {r.gpu_memory_utilization}"
            )
        tp = cfg.actor.parallel.tp
        if r.tg > 1 and r.reshard != "vanilla" and r.tg != tp:
            errors.append(
                f"rollout.tg: vLLM's TP groups are consecutive ranks; reshard={r.reshard} with tg={r.tg} < "
                f"actor.parallel.tp={tp} groups ranks {tp // r.tg} apart (use tg={tp}, reshard=vanilla or engine=builtin)"
            )
        reason = _pad_reason(cfg.model.path)  # an unsupported head_dim is zero-padded (rollout/vllm_pad.py)
        if reason is not None:
            # imported here: the config checks import this module, and Ray only for this case
            from hybridflow.controller.resource_pool import uses_cuda

            if not uses_cuda(cfg.resources.device):
                errors.append(f"rollout.engine: {cfg.model.path}: {reason} (use rollout.engine=builtin)")
    return errors


def _pad_reason(model_path: str) -> str | None:
    """Why vLLM's CPU attention cannot serve this model even with padded heads (None: it can)."""
    from types import SimpleNamespace

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            c = json.load(f)
        c.setdefault("head_dim", None)
        c.setdefault("model_type", "")
        return unsupported_reason(SimpleNamespace(**c))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None  # unreadable configs are reported by the model checks
