"""What `parallel.pp > 1` runs with, for every model section (engines/pipeline_engine.py), one line each.

Pipeline stages run padded micro-batches of one shape, cut from a Llama-family model's decoder layers
(engines/pipeline.py). The actor's generation side (tp, tg, the switch) is checked with the generation
layout (hybrid_engine/layout.py) and its other limits in config/validate.py; the checks here hold for the
reference, critic and reward model, which train (critic) or score under pp as the actor does, with t = 1.
"""

from __future__ import annotations

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
        errors += [] if section == "actor" else _section_errors(cfg, section, pp)
    return errors


def _section_errors(cfg, section: str, pp: int) -> list[str]:
    tp, errors = getattr(cfg, section).parallel.tp, []
    if tp != 1:
        errors.append(f"{section}.parallel.pp = {pp} runs with {section}.parallel.tp = 1, got tp = {tp}; "
                      "raise pp or dp instead")  # fmt: skip
    lora = cfg.model.lora
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
        errors += _model_errors(section, pp, path)
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


def _model_errors(section: str, pp: int, path: str) -> list[str]:
    """The model at `path` can be cut into pp stages: Llama-family, pp <= its layers, untied embeddings
    where it has an lm_head (the reference); nothing to say where config.json is unreadable (the
    model checks report that)."""
    hf = _read_json(os.path.join(path, "config.json"))
    if not isinstance(hf, dict):
        return []
    kind, layers = hf.get("model_type"), hf.get("num_hidden_layers")
    if kind not in LLAMA_FAMILY:
        return [f"{section}.parallel.pp = {pp}: pipeline stages are cut from {LLAMA_FAMILY} models, not "
                f"{kind!r} ({path}); use pp = 1"]  # fmt: skip
    if isinstance(layers, int) and pp > layers:
        return [f"{section}.parallel.pp = {pp} exceeds the model's {layers} decoder layers ({path})"]
    if section == "ref" and hf.get("tie_word_embeddings"):
        return [f"ref.parallel.pp = {pp}: the model ties its input and output embeddings "
                "(tie_word_embeddings), which the first and last stages would hold as two copies; use pp = 1"]  # fmt: skip
    return []


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
