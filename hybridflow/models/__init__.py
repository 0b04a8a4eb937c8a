"""Models: HF loading/saving (policy, critic, reward/cost) and tiny test models (tiny.py)."""

from hybridflow.models.hf import (
    disable_dropout,
    init_critic_from_causal_lm,
    load_causal_lm,
    load_critic,
    load_reward_model,
    load_tokenizer,
    model_kind,
    save_hf_model,
    scalar_head,
)

__all__ = [
    "disable_dropout",
    "init_critic_from_causal_lm",
    "load_causal_lm",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "model_kind",
    "save_hf_model",
    "scalar_head",
]
