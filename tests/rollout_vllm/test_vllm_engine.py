"""rollout.engine=vllm against the built-in engine, HF `generate` and the training forward, on CPU.

Runs in .venv-vllm (`make vllm`, `make test-vllm`); elsewhere every test skips with the reason. The
tiny models here use 2 attention heads (head_dim 32), and the `padded` cases the default tiny shape
(head_dim 16), which vLLM's CPU attention serves only with heads zero-padded (rollout/vllm_pad.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.engines.forward import RLForward
from hybridflow.models.tiny import build_tiny_model
from hybridflow.rollout import BuiltinEngine, SamplingParams, load_named_weights
from hybridflow.rollout.sampling import apply_top_k, apply_top_p
from hybridflow.rollout.vllm_engine import available
from tests.rollout.gen_helpers import check_greedy_matches_hf, prompt_batch

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"{REASON}")

HEADS = dict(num_attention_heads=2, num_key_value_heads=1)
MODELS: dict = {}
_ENGINES: dict = {}


def model(arch: str, padded: bool = False):
    """padded: the default tiny shape (head_dim 16), which vLLM serves with heads zero-padded to 32
    (rollout/vllm_pad.py); its q/k/v biases (Qwen2) are made nonzero so their padding is checked too."""
    if (arch, padded) not in MODELS:
        m = build_tiny_model("tiny", arch, seed=0, **({} if padded else HEADS)).eval()
        if padded:
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if name.endswith("_proj.bias"):
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        MODELS[arch, padded] = m
    return MODELS[arch, padded]


def engine(arch: str, padded: bool = False):
    """One vLLM engine per process at a time (vLLM's parallel groups are process-global)."""
    from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    if (arch, padded) not in _ENGINES:
        for e in _ENGINES.values():
            e.close()
        _ENGINES.clear()
        cfg = VLLMEngineConfig(max_model_len=64, max_num_seqs=512)
        _ENGINES[arch, padded] = VLLMEngine(model(arch, padded), cfg)
    return _ENGINES[arch, padded]


@pytest.fixture(scope="module")
def batch():
    return prompt_batch()


def training_log_probs(m, out: Batch, temperature: float) -> torch.Tensor:
    """The training engine's forward (engines/forward.py) on the rollout, zero past each response."""
    with torch.no_grad():
        lp = RLForward(m)(
            out["input_ids"],
            out["attention_mask"],
            out["position_ids"],
            out["responses"].shape[1],
            temperature,
        )["log_probs"]
    return lp * out["response_mask"]


@pytest.mark.parametrize(
    "arch,padded", [("qwen2", True), ("qwen2", False), ("llama", False), ("llama", True)]
)
def test_greedy_matches_builtin_hf_and_training_log_probs(arch, padded, batch):
    m, eng = model(arch, padded), engine(arch, padded)
    assert eng.pad_head_dim == (32 if padded else None)
    # vLLM equals HF `generate` token for token; with the mid-way EOS every field equals the built-in engine's
    out, params = check_greedy_matches_hf(eng.generate, m, batch)
    ref = BuiltinEngine(m).generate(batch, params)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(out[key], ref[key]), key
    assert out["rollout_log_probs"].dtype == torch.float32
    torch.testing.assert_close(out["rollout_log_probs"], training_log_probs(m, out, 1.0), atol=1e-4, rtol=0)
    assert (out["rollout_log_probs"] * (1 - out["response_mask"])).abs().sum() == 0
    assert out.meta.rollout_log_probs_exact and out.meta.temperature == 1.0


@pytest.mark.parametrize("padded", [True, False])
def test_weight_update_shows_in_next_generation(padded, batch):
    """padded: every reload goes through the head padding (rollout/vllm_pad.py) too."""
    m, eng = model("llama", padded), engine("llama", padded)
    params = SamplingParams(max_new_tokens=16, do_sample=False, eos_token_ids=())
    before = eng.generate(batch, params)["responses"]
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        # In place, as an optimizer step changes the actor's parameters.
        new = build_tiny_model("tiny", "llama", seed=1, **({} if padded else HEADS))
        load_named_weights(m, new.named_parameters())
        after = eng.generate(batch, params)["responses"]
        assert not torch.equal(after, before), "vLLM still generates with the old weights"
        assert torch.equal(after, BuiltinEngine(m).generate(batch, params)["responses"])
        assert eng.last_stats["rollout/weight_sync_seconds"] > 0
    finally:
        m.load_state_dict(saved)
    assert torch.equal(eng.generate(batch, params)["responses"], before)


def test_sampled_batch_fields_like_builtin(batch):
    m, eng = model("qwen2"), engine("qwen2")
    params = SamplingParams(max_new_tokens=12, n=3, temperature=0.9, seed=5, stop_token_ids=(7, 8, 9, 10))
    out, ref = eng.generate(batch, params), BuiltinEngine(m).generate(batch, params)
    assert out.keys() == ref.keys()
    for key in ref.tensors:
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
    for key in ("prompts", "uid", "prompt_text"):
        assert list(map(str, out[key])) == list(map(str, ref[key])), key
    # Samples differ across the n copies of a prompt and repeat exactly with the same seed.
    assert not torch.equal(out["responses"][0], out["responses"][1])
    assert torch.equal(eng.generate(batch, params)["responses"], out["responses"])
    # Stop tokens end a row and stay in it, as in the built-in engine.
    stop, lengths = torch.tensor([2, 7, 8, 9, 10]), out["response_mask"].sum(1)
    for row, n in zip(out["responses"], lengths):
        assert not torch.isin(row[: n - 1], stop).any()
        assert n == 12 or bool(torch.isin(row[n - 1], stop))
    torch.testing.assert_close(out["rollout_log_probs"], training_log_probs(m, out, 0.9), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(0.7, 8, 1.0), (1.5, 0, 0.7), (1.3, 0, 1.0)],
    ids=["top-k", "top-p", "temperature"],
)
def test_sampling_statistics_match_the_exact_distribution(temperature, top_k, top_p):
    """First-token frequencies of 3000 samples, vLLM and built-in, against the exact top-k/top-p/T
    distribution: every token within 5 standard errors, and no token outside the kept set."""
    m, eng, n = model("llama"), engine("llama"), 3000
    one = prompt_batch(texts=["1+2="])
    with torch.no_grad():
        logits = m(input_ids=one["input_ids"], attention_mask=one["attention_mask"]).logits[:, -1].float()
    exact = apply_top_p(apply_top_k(logits / temperature, top_k), top_p).softmax(-1)[0]
    params = SamplingParams(max_new_tokens=1, n=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=9)
    for name, out in (
        ("vllm", eng.generate(one, params)),
        ("builtin", BuiltinEngine(m).generate(one, params)),
    ):
        freq = torch.bincount(out["responses"][:, 0], minlength=exact.numel()).double() / n
        bound = 5 * (exact * (1 - exact) / n).sqrt() + 2.0 / n
        assert ((freq - exact).abs() <= bound).all(), (
            f"{name}: max excess {((freq - exact).abs() - bound).max()}"
        )
        assert freq[exact == 0].sum() == 0, f"{name} sampled a token top-k/top-p excludes"
    truncated = top_k > 0 or top_p < 1.0
    vout = eng.generate(one, params)
    assert vout.meta.rollout_log_probs_exact is (not truncated)
    if not truncated:  # then vLLM's log-probs are log_softmax(logits / T), as the training side computes
        expect = (logits[0] / temperature).log_softmax(-1)[vout["responses"][:, 0]]
        torch.testing.assert_close(vout["rollout_log_probs"][:, 0], expect, atol=1e-4, rtol=0)


def test_compute_dtype_bf16_runs_vllm_in_bf16(batch):
    """VLLMEngineConfig.dtype (the actor's compute dtype under model.dtype=bfloat16): vLLM is built in bf16
    and the fp32 actor's weights are cast on each load; its log-probs then match a bf16 forward of the same
    weights to bf16 rounding, and differ from the fp32 forward's (the setting is used)."""
    from hybridflow.engines.precision import cast_parameters
    from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    for e in _ENGINES.values():
        e.close()
    _ENGINES.clear()
    m = model("llama")
    eng = VLLMEngine(m, VLLMEngineConfig(max_model_len=64, max_num_seqs=512, dtype=torch.bfloat16))
    try:
        out = eng.generate(batch, SamplingParams(max_new_tokens=16, do_sample=False, eos_token_ids=()))
    finally:
        eng.close()
    bf16 = copy.deepcopy(m)
    cast_parameters(bf16, torch.bfloat16)
    mask = out["response_mask"].bool()
    err = (out["rollout_log_probs"] - training_log_probs(bf16, out, 1.0))[mask].abs()
    assert err.mean() < 0.02, err.mean()
    assert (out["rollout_log_probs"] - training_log_probs(m, out, 1.0))[mask].abs().max() > 1e-4


def test_lora_actor_streams_merged_weights(batch):
    """A LoRA actor (peft layers in the model) after an update (B nonzero): vLLM is sent the merged weights
    W + scale * B @ A under their HF names, as the 3D-HybridEngine's switch makes them, and generates what
    the built-in engine does from the same shard, and what the adapted model itself computes; it was sent
    every weight, whole (the bytes the actor logs as rollout/weight_update_bytes)."""
    pytest.importorskip("peft", reason="model.lora needs peft (the vllm-cpu extra; `make vllm`)")
    from hybridflow.models.lora import apply_lora, is_adapter, lora_layers, merge_named
    from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    for e in _ENGINES.values():
        e.close()
    _ENGINES.clear()
    m = copy.deepcopy(model("llama"))
    apply_lora(m, rank=4, alpha=8, target_modules=["all-linear"])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if is_adapter(name):  # an update's worth: B @ A moves every adapted weight
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    shard = dict(merge_named(((n, p.detach().clone()) for n, p in m.named_parameters()), lora_layers(m)))
    assert not any(is_adapter(n) or "base_layer" in n for n in shard)
    params = SamplingParams(max_new_tokens=16, do_sample=False, eos_token_ids=())
    eng = VLLMEngine(m, VLLMEngineConfig(max_model_len=64, max_num_seqs=512))
    try:
        eng.set_shard(shard)
        out = eng.generate(batch, params)
        assert eng.sent_bytes == sum(t.numel() * 4 for t in shard.values())  # fp32, every weight once
    finally:
        eng.close()
    builtin = BuiltinEngine(m)
    builtin.set_shard(shard)
    ref = builtin.generate(batch, params)
    assert torch.equal(out["responses"], ref["responses"])
    base = BuiltinEngine(model("llama")).generate(batch, params)["responses"]
    assert not torch.equal(out["responses"], base), "the adapters should change the greedy answers"
    # the adapted model's own forward (peft's layers, unmerged) scores vLLM's tokens as vLLM did
    torch.testing.assert_close(out["rollout_log_probs"], training_log_probs(m, out, 1.0), atol=1e-4, rtol=0)
