"""Generation in the actor's compute dtype (BuiltinEngineConfig.dtype; model.dtype=bfloat16 on CPU).

The engine given dtype=bf16 on an fp32 model must generate exactly what it generates from the same
weights stored in bf16 (the rollout pool's case), stay close to a bf16 HF forward, and differ from fp32
(the setting is used, not ignored)."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.engines.train_engine import cast_parameters
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, BuiltinEngineConfig, SamplingParams
from hybridflow.workers.common import model_compute_dtype
from tests.rollout.gen_helpers import prompt_batch

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _bf16_copy(model):
    other = copy.deepcopy(model)
    cast_parameters(other, BF16)
    return other


def _hf_log_probs(model, out, autocast: bool) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    lp = out["prompts"].shape[1]
    return logits[:, lp - 1 : -1].float().log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)


@pytest.mark.parametrize("pack_weights", [True, False])
def test_cast_at_call_equals_weights_stored_in_bf16(tokenizer, pack_weights):
    model = build_tiny_model("small", "llama", seed=0).eval()
    batch = prompt_batch(tokenizer)
    params = SamplingParams(max_new_tokens=24, n=2, seed=3, eos_token_ids=())
    cast = BuiltinEngine(model, BuiltinEngineConfig(dtype=BF16, pack_weights=pack_weights)).generate(
        batch, params
    )
    stored = BuiltinEngine(_bf16_copy(model), BuiltinEngineConfig(pack_weights=pack_weights)).generate(
        batch, params
    )
    assert torch.equal(cast["responses"], stored["responses"])
    assert torch.equal(cast["rollout_log_probs"], stored["rollout_log_probs"])
    assert next(model.parameters()).dtype == torch.float32, "the actor's own weights are not touched"
    # the dtype is used: fp32 log-probs of the same tokens differ by bf16 rounding, not by more
    fp32 = _hf_log_probs(model, cast, autocast=False)
    mask = cast["response_mask"].bool()
    diff = (cast["rollout_log_probs"] - fp32)[mask].abs()
    assert diff.max() > 1e-4
    assert diff.mean() < 0.05


def test_bf16_log_probs_close_to_a_bf16_hf_forward(tokenizer):
    model = build_tiny_model("small", "llama", seed=0).eval()
    out = BuiltinEngine(model, BuiltinEngineConfig(dtype=BF16)).generate(
        prompt_batch(tokenizer), SamplingParams(max_new_tokens=20, temperature=1.0, seed=5)
    )
    mask = out["response_mask"].bool()
    ref = _hf_log_probs(_bf16_copy(model), out, autocast=False)[mask]
    err = (out["rollout_log_probs"][mask] - ref).abs()
    assert err.mean() < 0.02 and err.max() < 0.2, (err.mean(), err.max())


def test_hf_fallback_runs_under_autocast(tokenizer):
    """gpt2 (no functional forward): the HF forward runs under autocast to the compute dtype."""
    model = build_tiny_model("tiny", "gpt2", seed=0).eval()
    params = SamplingParams(max_new_tokens=12, seed=2)
    out = BuiltinEngine(model, BuiltinEngineConfig(dtype=BF16)).generate(prompt_batch(tokenizer), params)
    mask = out["response_mask"].bool()
    under = _hf_log_probs(model, out, autocast=True)[mask]
    torch.testing.assert_close(out["rollout_log_probs"][mask], under, atol=2e-2, rtol=0)
    plain = BuiltinEngine(model).generate(prompt_batch(tokenizer), params)
    assert not torch.equal(plain["rollout_log_probs"], out["rollout_log_probs"])


def test_model_compute_dtype():
    assert model_compute_dtype("bfloat16", "cpu") == BF16
    assert model_compute_dtype("auto", "cpu") is None and model_compute_dtype("float32", "cuda") is None
    assert model_compute_dtype("auto", "cuda") == BF16
    assert model_compute_dtype("float16", "cpu") == torch.float16


def test_bf16_full_row_attention_equals_the_sliced_one(tokenizer, monkeypatch):
    """16-bit CPU decode reads whole cache rows once that is cheaper (llama_decoder._attend_full): the
    slots not written yet are masked, so rows that stop early (compaction moves the survivors) and n > 1
    samples give what attention over the written slots only gives."""
    from hybridflow.rollout import llama_decoder

    model = build_tiny_model("small", "llama", seed=0, initializer_range=0.2).eval()
    params = SamplingParams(max_new_tokens=24, n=2, seed=4, temperature=0.8, stop_token_ids=(7, 9, 11))
    engine = BuiltinEngine(model, BuiltinEngineConfig(dtype=BF16))
    full = engine.generate(prompt_batch(tokenizer), params)
    assert int(full["response_mask"].sum()) < full["response_mask"].numel(), "some rows must stop early"
    monkeypatch.setattr(llama_decoder, "_attend_full", lambda length, max_len: False)
    sliced = engine.generate(prompt_batch(tokenizer), params)
    assert torch.equal(full["responses"], sliced["responses"])
    torch.testing.assert_close(full["rollout_log_probs"], sliced["rollout_log_probs"], atol=1e-2, rtol=0)
