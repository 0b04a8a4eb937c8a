"""What `parallel.pp > 1` runs with, for every model section (engines/pipeline_engine.py), one line each.

Pipeline stages run padded micro-batches of one shape, cut from a Llama-family model's decoder layers
(engines/pipeline.py). The actor's generation side (tp, tg, the switch, its model) is checked with the
generation layout (hybrid_engine/layout.py); the reference, critic and reward model train (critic) or
score under pp as the actor does, with any tp (each stage's (dp, tp) plane: engines/pipeline.py).
`pipeline_blockers` says why a section could not run stages at all under a config: the planner
(trainers/auto_placement.py) then plans it at p = 1.
"""

from __future__ import annotations

import copy
import json
import os

from hybridflow.config.rollout_pool import frozen_on_rollout
from hybridflow.hybrid_engine.layout import LLAMA_FAMILY

SECTIONS = ("actor", "critic", "ref", "reward")


def pipelined_sections(cfg) -> dict[str, int]:
    """{section: pp} of the model sections with parallel.pp > 1, in SECTIONS' order."""
    return {s: getattr(cfg, s).parallel.pp for s in SECTIONS if getattr(cfg, s).parallel.pp > 1}


def pipeline_role_errors(cfg) -> list[str]:
    """Every section's pipeline problems (module docstring)."""
    sections = pipelined_sections(cfg)
    if not sections:
        return []
    errors = []
    first, pp = next(iter(sections.items()))
    for key in ("remove_padding", "share_prompt"):
        if getattr(cfg.model, key):
            errors.append(f"model.{key}: true with {first}.parallel.pp = {pp}; pipeline stages run padded "
                          "micro-batches of equal shape; set it to null or false")  # fmt: skip
    for section, pp in sections.items():
        errors += _actor_errors(cfg, pp) if section == "actor" else _section_errors(cfg, section, pp)
    return errors


def _stages(cfg, section: str) -> tuple[int, str]:
    """(pipeline stages the section's model is cut into, what sets that number) for its messages."""
    p = getattr(cfg, section).parallel
    if p.stages_per_rank == 1:
        return p.pp, f"{section}.parallel.pp = {p.pp}"
    return p.pp * p.stages_per_rank, (
        f"{section}.parallel.pp = {p.pp} x pp_virtual_stages = {p.stages_per_rank} (interleaved_1f1b)"
    )


def pipeline_blockers(cfg, section: str) -> list[str]:
    """Why `section` could not run pipeline stages (pp = 2) under `cfg`; [] where it could."""
    trial = copy.deepcopy(cfg)
    getattr(trial, section).parallel.pp = 2
    errors = pipeline_role_errors(trial)
    # what the generation layout (hybrid_engine/layout.py) checks for a pipelined actor
    if section == "actor":
        if cfg.rollout.reshard != "hybridflow":
            errors.append(f"rollout.reshard: {cfg.rollout.reshard} (pipelined actors switch by hybridflow)")
        errors += _model_errors("actor", 2, cfg.model.path)
    return errors


def _actor_errors(cfg, pp: int) -> list[str]:
    """The settings actor.parallel.pp > 1 does not run with yet (engines/pipeline_engine.py)."""
    errors = []
    if cfg.rollout.engine != "builtin":
        errors.append(f"rollout.engine: {cfg.rollout.engine!r} with actor.parallel.pp = {pp}; pipeline "
                      "stages generate with the built-in engine")  # fmt: skip
    if cfg.model.lora.rank:
        errors.append(f"model.lora.rank: {cfg.model.lora.rank} with actor.parallel.pp = {pp}; adapters are not "
                      "applied to pipeline stages yet, use pp=1 or full fine-tuning (rank 0)")  # fmt: skip
    if cfg.trainer.rollout_ahead:
        errors.append(f"trainer.rollout_ahead: {cfg.trainer.rollout_ahead} with actor.parallel.pp = {pp}; "
                      "the rollout pool's weight sync gathers an unpipelined actor, use rollout_ahead=0")  # fmt: skip
    # the model's family and tied embeddings are the generation layout's checks (hybrid_engine/layout.py)
    return errors + _layer_errors(cfg, "actor", cfg.model.path)


def _layer_errors(cfg, section: str, path: str) -> list[str]:
    """No more pipeline stages than the model at `path` has decoder layers."""
    hf = _read_json(os.path.join(path, "config.json"))
    layers = hf.get("num_hidden_layers") if isinstance(hf, dict) else None
    stages, what = _stages(cfg, section)
    if isinstance(layers, int) and stages > layers:
        return [f"{what}: {stages} pipeline stages exceed the model's {layers} decoder layers ({path})"]
    return []


def _section_errors(cfg, section: str, pp: int) -> list[str]:
    errors, lora = [], cfg.model.lora
    if section == "critic" and lora.enabled and lora.critic:
        errors.append(f"model.lora.critic: true with critic.parallel.pp = {pp}; adapters are not applied "
                      "to pipeline stages yet, use pp = 1 or a fully trained critic")  # fmt: skip
    if section == "ref" and lora.enabled:
        errors.append(f"ref.parallel.pp: {pp} with model.lora.rank = {lora.rank}; the reference is then the "
                      "actor with its adapters off, laid out by actor.parallel; remove ref.parallel.pp")  # fmt: skip
    if section in ("ref", "reward") and frozen_on_rollout(cfg):
        errors.append(f"{section}.parallel.pp: {pp} with the frozen models on the rollout pool "
                      "(trainer.rollout_ahead=1); set resources.frozen_pool=training or pp = 1")  # fmt: skip
    for path in _model_paths(cfg, section):
        errors += _model_errors(section, pp, path, _stages(cfg, section))
    return errors


def _model_paths(cfg, section: str) -> list[str]:
    """The HF directories `section`'s engines are cut from (the reward section's: reward and cost model)."""
    m = cfg.model
    paths = {
        "critic": [m.critic_path or m.path],
        "ref": [m.path],
        "reward": [m.reward_model_path, m.cost_model_path],
    }[section]
    return [p for p in paths if p]


def _model_errors(section: str, pp: int, path: str, stages: tuple[int, str] | None = None) -> list[str]:
    """The model at `path` can be cut into pp stages (`stages`: (pp * stages a rank, what says so)):
    Llama-family, no more stages than its layers, untied embeddings where it has an lm_head (actor,
    reference); nothing to say where config.json is unreadable (the model checks report that)."""
    stages, what = stages or (pp, f"{section}.parallel.pp = {pp}")
    hf = _read_json(os.path.join(path, "config.json"))
    if not isinstance(hf, dict):
        return []
    kind, layers = hf.get("model_type"), hf.get("num_hidden_layers")
    if kind not in LLAMA_FAMILY:
        return [f"{section}.parallel.pp = {pp}: pipeline stages are cut from {LLAMA_FAMILY} models, not "
                f"{kind!r} ({path}); use pp = 1"]  # fmt: skip
    if isinstance(layers, int) and stages > layers:
        return [f"{what}: {stages} pipeline stages exceed the model's {layers} decoder layers ({path})"]
    if section in ("actor", "ref") and hf.get("tie_word_embeddings"):
        return [f"{section}.parallel.pp = {pp}: the model ties its input and output embeddings "
                "(tie_word_embeddings), which the first and last stages would hold as two copies; use pp = 1"]  # fmt: skip
    return []


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
