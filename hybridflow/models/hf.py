"""Load and save Hugging Face models as plain HF directories: the policy (causal LM), the critic
(per-token value) and the reward / cost model (last-token score).

Why HF's own classes for the scalar heads: a critic is `AutoModelForTokenClassification(num_labels=1)`
(as verl does) and a reward model `AutoModelForSequenceClassification(num_labels=1)`, so every
checkpoint we write opens in `transformers` (and vLLM for the policy) without custom code. The
engines never call the HF heads' own pooling: they take the backbone's hidden states and apply the
head themselves (see `scalar_head`), so the reward is read at the last *attended* token even when
pad == eos.

Dropout is switched off on load by default: RL computes the same log-probs twice (rollout vs.
training) and their ratio must be 1 when nothing changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
)

from hybridflow.models.meta import build_on_meta

# Config keys that hold dropout probabilities in the supported families (llama/qwen2/mistral/gpt2).
_DROPOUT_KEYS = ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout")


def _check_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model directory (no config.json); "
            "pass a local directory written by save_pretrained / save_hf_model"
        )
    return path


def _no_dropout_config(path: Path, **overrides):
    config = AutoConfig.from_pretrained(path, **overrides)
    for key in _DROPOUT_KEYS:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    # Token-classification heads read classifier_dropout (falling back to hidden_dropout, then 0.1).
    config.classifier_dropout = 0.0
    return config


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set p=0 on every nn.Dropout (covers families whose config keys we do not know)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """The tokenizer (with its chat template) saved next to the model. Left padding, as prompts need.
    trust_remote_code: run custom code shipped in the directory (model.trust_remote_code)."""
    from hybridflow.errors import ModelFileError
    from hybridflow.models.files import tokenizer_files_error

    missing = tokenizer_files_error(path)
    if missing:
        raise ModelFileError(missing)
    try:
        tok = AutoTokenizer.from_pretrained(_check_dir(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # the files parse (models/files.py checked them) but do not make a tokenizer
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ModelFileError(f"{path}: its tokenizer files do not load ({why})") from e
    tok.padding_side = "left"
    if tok.pad_token is None:  # common for Llama-style tokenizers: reuse eos
        tok.pad_token = tok.eos_token
    return tok


def _load(
    auto_cls,
    path,
    dtype,
    dropout,
    attn_implementation,
    device=None,
    trust_remote_code=False,
    **config_overrides,
):
    path = _check_dir(path)
    config_overrides["trust_remote_code"] = trust_remote_code
    config = (
        AutoConfig.from_pretrained(path, **config_overrides)
        if dropout
        else _no_dropout_config(path, **config_overrides)
    )
    model = None
    if str(device) == "meta":  # weights stay on disk; the engine reads each rank's shards (models/meta.py)
        new_head = auto_cls is AutoModelForTokenClassification  # a critic may start from a causal LM
        model = build_on_meta(auto_cls, path, config, dtype, attn_implementation, new_head, trust_remote_code)
    if model is None:
        kwargs = {"config": config, "dtype": dtype, "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = auto_cls.from_pretrained(path, **kwargs)
    if not dropout:
        disable_dropout(model)
    model.config.use_cache = False  # training / scoring never reuse a KV cache
    return model


def load_causal_lm(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    dropout: bool = False,
    attn_implementation: str | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A policy / reference model: any `AutoModelForCausalLM` (Llama, Qwen2, Mistral, GPT-2, ...).
    device="meta": parameters stay on disk for TrainEngine's sharded init (models/meta.py)."""
    return _load(AutoModelForCausalLM, path, dtype, dropout, attn_implementation, device, trust_remote_code)


def load_critic(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    dropout: bool = False,
    attn_implementation: str | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A critic: `AutoModelForTokenClassification(num_labels=1)`. From a causal-LM directory the
    backbone is loaded and the value head is freshly initialised (see `init_critic_from_causal_lm`)."""
    return _load(
        AutoModelForTokenClassification,
        path,
        dtype,
        dropout,
        attn_implementation,
        device,
        trust_remote_code,
        num_labels=1,
    )


def load_reward_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    dropout: bool = False,
    attn_implementation: str | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A reward or cost model: `AutoModelForSequenceClassification(num_labels=1)`; HF
    sequence-classification checkpoints (e.g. trained reward models) load as they are."""
    return _load(
        AutoModelForSequenceClassification,
        path,
        dtype,
        dropout,
        attn_implementation,
        device,
        trust_remote_code,
        num_labels=1,
    )


def init_critic_from_causal_lm(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A critic whose backbone is the causal LM at `src` and whose value head is zero-initialised
    (values start at 0, so the first GAE is the plain discounted return). Saved to `dst` if given,
    with the tokenizer, as an ordinary HF token-classification directory."""
    torch.manual_seed(seed)
    critic = load_critic(src, trust_remote_code=trust_remote_code)
    head = scalar_head(critic)
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    if dst is not None:
        save_hf_model(critic, dst, tokenizer=load_tokenizer(src, trust_remote_code))
    return critic


def scalar_head(model: PreTrainedModel) -> nn.Linear:
    """The (hidden -> 1) head of a critic / reward model (`score` in most families, `classifier` in
    GPT-2 token classification)."""
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise TypeError(
        f"{type(model).__name__} has no scalar head (score / classifier); load it with "
        "load_critic or load_reward_model"
    )


def model_kind(model: PreTrainedModel) -> str:
    """'causal_lm', 'critic' (per-token values) or 'reward' (one score per sequence)."""
    name = type(model).__name__
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        return "causal_lm"
    if name.endswith("ForTokenClassification"):
        return "critic"
    if name.endswith("ForSequenceClassification"):
        return "reward"
    raise TypeError(
        f"unsupported model class {name}: use a *ForCausalLM, *ForTokenClassification "
        "or *ForSequenceClassification model"
    )


def save_hf_model(
    model: PreTrainedModel,
    path: str | os.PathLike,
    tokenizer=None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` (or `state_dict` with `model`'s config/class, e.g. a gathered full state dict
    from a sharded engine) as safetensors + config (+ tokenizer) loadable by `from_pretrained`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
