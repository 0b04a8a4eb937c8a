"""Setup shared by the generation-engine tests: the built-in engine's (tests/rollout/test_engine.py) and
vLLM's (tests/rollout_vllm/test_vllm_engine.py, run in .venv-vllm), so both are checked against HF
`generate` the same way. Imports only the main package, torch and transformers: it runs in either venv."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.batch import Batch
from hybridflow.models.tiny import build_char_tokenizer
from hybridflow.rollout import SamplingParams

TEXTS = ["hello world", "1+2=", "abc", "The quick brown fox jumps", "x", "What is 12*3?"]


def prompt_batch(tokenizer=None, texts=TEXTS) -> Batch:
    """Left-padded prompts with `uid` and `prompt_text`, as the trainer's dataloader gives them."""
    enc = (tokenizer or build_char_tokenizer())(texts, return_tensors="pt", padding=True)
    return Batch.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
        {"uid": np.arange(len(texts)), "prompt_text": np.array(texts, dtype=object)},
    )


def hf_generate(model, batch: Batch, max_new_tokens: int, eos) -> torch.Tensor:
    """HF greedy `generate` responses (B, max_new_tokens), padded with 0 after the end."""
    out = model.generate(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
    )
    resp = out[:, batch["input_ids"].shape[1] :]
    return torch.nn.functional.pad(resp, (0, max_new_tokens - resp.shape[1]), value=0)


def check_greedy_matches_hf(generate, model, batch: Batch, max_new_tokens: int = 24):
    """`generate(batch, params)` greedy equals HF `generate` token for token, first with no EOS, then with
    an EOS that row 0 produces at step 6 (some rows stop early, others run to the cap). Returns the
    second call's (output, params)."""
    free = generate(batch, SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, eos_token_ids=()))
    assert torch.equal(free["responses"], hf_generate(model, batch, max_new_tokens, None))
    eos = int(free["responses"][0, 6])
    params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, eos_token_ids=(eos,))
    out = generate(batch, params)
    assert torch.equal(out["responses"], hf_generate(model, batch, max_new_tokens, eos))
    lengths = out["response_mask"].sum(1)
    assert lengths.min() < max_new_tokens and int(lengths[0]) <= 7
    return out, params
