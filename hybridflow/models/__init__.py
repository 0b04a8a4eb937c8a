"""Models: HF loading/saving (policy, critic, reward/cost) and tiny test models (tiny.py)."""

from hybridflow._lazy import lazy_exports

# loaded on first use (PEP 562): resolving model names (resolve.py) must not import torch
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
__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "hf"))
