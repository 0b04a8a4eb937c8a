"""Tiny models and a locally built tokenizer, for tests, demos and benchmarks (nothing is downloaded).

The tokenizer is character level (digits, operators, letters, punctuation) built with `tokenizers`
and saved as an ordinary HF tokenizer directory with a chat template, so every code path that loads
a real model (`AutoTokenizer.from_pretrained(dir)`, `apply_chat_template`) is the one exercised.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from hybridflow.batch import Batch, position_ids_from_mask

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>"]
CHARS = string.digits + string.ascii_letters + " +-*/=?.,:;!()[]<>#'\"\n_%$"

# A minimal chat template in the HF (jinja) format: `<|user|>text<|assistant|>`.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# name -> (hidden, layers, heads, kv_heads, intermediate). "tiny" is ~0.1M params, "small" ~1M,
# "medium" ~25M: the sizes the benchmarks name. "qwen2.5-0.5b" is Qwen2.5-0.5B's shape (494M parameters
# with its vocabulary and tied embeddings, SIZE_CONFIG), random weights: speed measured where users'
# models live.
SIZES = {
    "tiny": (64, 2, 4, 2, 128),
    "small": (128, 4, 4, 2, 384),
    "medium": (512, 8, 8, 4, 1536),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
}
# config fields a size fixes beyond SIZES (the caller's overrides still win)
SIZE_CONFIG = {"qwen2.5-0.5b": {"vocab_size": 151_936, "tie_word_embeddings": True}}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<pad>",
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_config(size: str = "tiny", arch: str = "llama", vocab_size: int | None = None, **overrides):
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SIZES)}")
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    vocab_size = (
        vocab_size or SIZE_CONFIG.get(size, {}).get("vocab_size") or len(SPECIAL_TOKENS) + len(set(CHARS))
    )
    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gpt2":
        kw = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024, n_inner=inter)
    else:  # llama / qwen2 / qwen3 / mistral share these names
        kw = dict(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=inter,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
        if arch == "qwen3":  # its config defaults head_dim to 128 whatever the width
            kw["head_dim"] = hidden // heads
    kw.update(SIZE_CONFIG.get(size, {}))
    kw.update(common)
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def build_tiny_model(size: str = "tiny", arch: str = "llama", seed: int = 0, **overrides):
    config = build_tiny_config(size, arch, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(
    path: str | os.PathLike, size: str = "tiny", arch: str = "llama", seed: int = 0, **overrides
) -> Path:
    """Build a tiny model + tokenizer and save both as a normal HF directory; returns the path.
    overrides: HF config fields (e.g. num_key_value_heads=4 for 4-way tensor parallelism, num_attention_heads=2
    for vLLM's CPU attention, which needs head_dim >= 32)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(size, arch, seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    build_char_tokenizer().save_pretrained(path)
    return path


def random_rl_batch(
    vocab_size: int,
    batch_size: int = 8,
    lp: int = 6,
    lr: int = 8,
    seed: int = 0,
    min_prompt_len: int = 1,
    min_response_len: int = 1,
    min_token_id: int = 3,
) -> Batch:
    """A synthetic RL batch for tests and benchmarks: random tokens in [min_token_id, vocab_size) (so no
    pad/bos/eos), prompts (B, lp) left-padded to random lengths in [min_prompt_len, lp], responses (B, lr)
    right-padded to random lengths in [min_response_len, lr], and random advantages (B, lr) (0 on padding).

    Fields: prompts, responses, input_ids, attention_mask, position_ids, response_mask, advantages.
    Deterministic in `seed` (its own generator; the global RNG is untouched).
    """
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(min_prompt_len, lp + 1, (batch_size,), generator=g)
    resp_lens = torch.randint(min_response_len, lr + 1, (batch_size,), generator=g)
    pm = (torch.arange(lp)[None] >= lp - prompt_lens[:, None]).long()
    rm = (torch.arange(lr)[None] < resp_lens[:, None]).long()
    prompts = torch.randint(min_token_id, vocab_size, (batch_size, lp), generator=g) * pm
    responses = torch.randint(min_token_id, vocab_size, (batch_size, lr), generator=g) * rm
    attn = torch.cat([pm, rm], 1)
    return Batch.from_dict(
        dict(
            prompts=prompts,
            responses=responses,
            input_ids=torch.cat([prompts, responses], 1),
            attention_mask=attn,
            position_ids=position_ids_from_mask(attn),
            response_mask=rm,
            advantages=torch.randn(batch_size, lr, generator=g) * rm,
        )
    )
