"""Generation in the actor's compute dtype (BuiltinEngineConfig.dtype; model.dtype=bfloat16 on CPU).

The engine given dtype=bf16 on an fp32 model must generate exactly what it generates from the same
weights stored in bf16 (the rollout pool's case), stay close to a bf16 HF forward, and differ from fp32
(the setting is used, not ignored)."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.engines.precision import cast_parameters
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


def _full_vs_sliced(tokenizer, monkeypatch, dtype, force_full: bool):
    """(full-row, sliced) generations of the same seeded batch; rows stop early and n = 2 samples."""
    from hybridflow.rollout import llama_decoder

    if force_full:
        monkeypatch.setattr(llama_decoder, "_full_rows", lambda dtype, device: True)
    model = build_tiny_model("small", "llama", seed=0, initializer_range=0.2).eval()
    params = SamplingParams(max_new_tokens=24, n=2, seed=4, temperature=0.8, stop_token_ids=(7, 9, 11))
    engine = BuiltinEngine(model, BuiltinEngineConfig(dtype=dtype))
    full = engine.generate(prompt_batch(tokenizer), params)
    assert int(full["response_mask"].sum()) < full["response_mask"].numel(), "some rows must stop early"
    monkeypatch.setattr(llama_decoder, "_attend_full", lambda length, max_len: False)
    sliced = engine.generate(prompt_batch(tokenizer), params)
    return model, full, sliced


def test_full_row_attention_masks_what_is_not_written(tokenizer, monkeypatch):
    """Decode attention over whole cache rows (llama_decoder._attend_full), forced in fp32: the slots not
    written yet are masked, so rows that stop early (compaction moves the survivors) and n > 1 samples give
    what attention over the written slots gives. fp32 tells masking errors apart from rounding: the two
    paths only sum the same products over a different number of exact zeros, so they agree to fp32
    rounding (1e-5 + 1e-5 relative on log-probs of magnitude < 10: oneDNN's GEMMs, model.cpu_gemm, block
    their sums by row count), where a wrongly unmasked slot moves them by O(0.1)."""
    _, full, sliced = _full_vs_sliced(tokenizer, monkeypatch, None, force_full=True)
    assert torch.equal(full["responses"], sliced["responses"])
    torch.testing.assert_close(full["rollout_log_probs"], sliced["rollout_log_probs"], atol=1e-5, rtol=1e-5)


def test_bf16_full_row_attention_samples_what_the_sliced_one_samples(tokenizer, monkeypatch):
    """The same in bf16, the dtype it runs in. The tokens must agree; the log-probs only to bf16 rounding:
    the two paths accumulate attention in a different order (and AMX, AVX512-BF16 and AVX2 kernels each
    in their own), which can move an activation by one bf16 ulp (2^-8 relative, 8 bits of mantissa). What
    reaches a logit z is then about 2^-8 |z|, and a log-prob z_y - logsumexp(z) carries two such errors:
    tolerance 2 * 2^-8 * max|z| (max|z| ~ 8 here: ~0.065; seen on an AMX CPU: 0.016 at 1 of 288 tokens)."""
    model, full, sliced = _full_vs_sliced(tokenizer, monkeypatch, BF16, force_full=False)
    assert torch.equal(full["responses"], sliced["responses"])
    with torch.no_grad():
        max_logit = (
            model(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits.abs().max()
        )
    atol = 2 * 2**-8 * float(max_logit)
    torch.testing.assert_close(full["rollout_log_probs"], sliced["rollout_log_probs"], atol=atol, rtol=0)
