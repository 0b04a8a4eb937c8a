"""A role's part of a checkpoint, written by every rank of its worker group (a collective call).

    <step>/<role>/model/           parameters, each rank its own shards (sharded safetensors; shards.py);
                                   with LoRA only the adapters (engine.json "lora" names the base)
    <step>/<role>/optim/           AdamW moments and step counts, sharded the same way (trainable models)
    <step>/<role>/train_state.json global_step, LR scheduler, optimizer param_groups
    <step>/<role>/hf_config/       the model's config.json (+ generation config, + tokenizer when given)
    <step>/<role>/rng/rank_R.json  each rank's RNG states (python, numpy, torch, CUDA)
    <step>/<role>/engine.json      layout it was saved with (kind, world size, tp, dp, step)

Nothing here is pickled, and no rank gathers the full model: each rank writes only the shards it holds,
so saving costs no more host memory than training. Resume reads each rank's slices from the shard
files whatever the saved dp size (engines/checkpoint_io.py); `hybridflow export` streams the shards
into a plain HF directory one tensor at a time (export.py). All ranks must see the same directory (a
shared filesystem across nodes). Every file of the layout is listed by `checkpoint_files`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from hybridflow.checkpoint.manager import CheckpointError, atomic_write_text
from hybridflow.checkpoint.rng import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)

ENGINE_JSON = "engine.json"
HF_CONFIG = "hf_config"
FORMAT = "sharded-safetensors-1"  # engine.json "format"; checkpoints without it used pickled DCP metadata


def _rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_engine_state(
    engine, directory: str | os.PathLike, rank: int | None = None, *, tokenizer=None
) -> Path:
    """Save a TrainEngine's model, optimizer, scheduler and this rank's RNG states under `directory`
    (typically `<checkpoint temp dir>/actor`). Collective: every rank of the engine's group calls it.
    rank: this process's rank in the group (default: torch.distributed rank, or 0)."""
    directory = Path(directory)
    rank = _rank(rank)
    (directory / "rng").mkdir(parents=True, exist_ok=True)
    rng = capture_rng_state(engine.device)  # this rank's own device only
    atomic_write_text(directory / "rng" / f"rank_{rank}.json", json.dumps(rng))
    engine.save_checkpoint(directory)
    # saving must not move any generator: a resumed run continues from here
    restore_rng_state(rng, engine.device)
    if rank == 0:
        engine.hf_model.config.save_pretrained(directory / HF_CONFIG)
        gen = getattr(engine.hf_model, "generation_config", None)
        if gen is not None and engine.kind == "causal_lm":
            gen.save_pretrained(directory / HF_CONFIG)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory / HF_CONFIG)
        par = engine.config.parallel
        info = {
            "kind": engine.kind,
            "model_class": type(engine.hf_model).__name__,
            "world_size": par.world_size,
            "tp": par.tp,
            "dp": par.dp,
            "global_step": engine.global_step,
            "trainable": engine.optimizer is not None,
            "format": FORMAT,
        }
        if engine.lora_layers:  # the shards hold only the adapters: export needs the rest (export.py)
            info["lora"] = lora_info(engine)
        atomic_write_text(directory / ENGINE_JSON, json.dumps(info, indent=1))
    _barrier()
    return directory


def lora_info(engine) -> dict:
    """What `hybridflow export` needs of a LoRA engine: the adapters' settings and the base weights' dir."""
    from hybridflow.models.meta import WEIGHTS_ATTR

    cfg, model = engine.config.lora, engine.hf_model
    base = getattr(model, WEIGHTS_ATTR, None) or getattr(model.config, "_name_or_path", "")
    return {
        "rank": cfg.rank,
        "alpha": cfg.alpha,
        "dropout": cfg.dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in engine.lora_layers}),
        "fan_in_fan_out": any(fan for _, fan in engine.lora_layers.values()),
        "base_model": str(Path(base).resolve()) if base else "",
    }


def read_engine_info(directory: str | os.PathLike) -> dict:
    path = Path(directory) / ENGINE_JSON
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not an engine checkpoint (no {ENGINE_JSON}); pass <step_dir>/<role>, "
            "e.g. checkpoints/step_10/actor"
        )
    return json.loads(path.read_text())


def load_engine_state(
    engine, directory: str | os.PathLike, rank: int | None = None, *, restore_rng: bool = True
) -> dict:
    """Restore what `save_engine_state` wrote into an engine built the same way (same model class;
    the dp size may differ: DCP reshards, but then RNG states cannot be matched per rank and are
    left alone, with a warning). Collective. Returns the saved engine.json info."""
    directory = Path(directory)
    rank = _rank(rank)
    info = read_engine_info(directory)
    if info["kind"] != engine.kind:
        raise CheckpointError(f"{directory} holds a {info['kind']} model, this engine a {engine.kind} model")
    if info["tp"] != engine.config.parallel.tp and info["model_class"].startswith("GPT2"):
        # GPT-2's fused qkv is stored column-permuted per tp (parallelize.py); DCP cannot undo that.
        raise CheckpointError(
            f"{directory} was saved with tp={info['tp']}; a GPT-2 model must resume with the same tp "
            f"(now {engine.config.parallel.tp})"
        )
    if info.get("format") != FORMAT:
        raise CheckpointError(
            f"{directory} was written by an older hybridflow (pickled torch.distributed.checkpoint metadata), "
            "which is not loaded for safety; resume from a checkpoint written by this version"
        )
    engine.load_checkpoint(directory)
    if restore_rng:
        rng_file = directory / "rng" / f"rank_{rank}.json"
        if info["world_size"] == engine.config.parallel.world_size and rng_file.is_file():
            restore_rng_state(json.loads(rng_file.read_text()), engine.device)
        else:
            log.warning(
                "%s: saved with %d ranks, loading on %d: RNG states not restored (random draws will "
                "differ from the uninterrupted run)",
                directory,
                info["world_size"],
                engine.config.parallel.world_size,
            )
    _barrier()
    return info


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """Every file of a role's part, sorted (shards, JSON, config): what a manifest checksums."""
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())
