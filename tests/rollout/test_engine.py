"""Built-in generation engine against HF `generate` and HF forward, on real tiny models."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, BuiltinEngineConfig, SamplingParams
from tests.rollout.gen_helpers import TEXTS, check_greedy_matches_hf, hf_generate, prompt_batch


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def models():
    return {
        arch: build_tiny_model("tiny", arch, seed=0).eval()
        for arch in ("llama", "qwen2", "mistral", "gpt2", "qwen3")
    }


def hf_log_probs(model, out: Batch, temperature: float) -> torch.Tensor:
    """Per-token log-probs of out's responses from one plain HF forward over (prompt, response)."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    lp = out["prompts"].shape[1]
    logits = logits[:, lp - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "qwen3"])
def test_greedy_matches_hf_generate(models, tokenizer, arch):
    """Token for token, with an EOS that fires mid-way for some rows and never for others."""
    check_greedy_matches_hf(BuiltinEngine(models[arch]).generate, models[arch], prompt_batch(tokenizer))


@pytest.mark.parametrize("cpu_gemm", ["mkl", "onednn"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_hf_generate_under_either_cpu_gemm(models, tokenizer, arch, cpu_gemm):
    """The decoder's fp32 GEMMs through MKL or oneDNN (models/cpu_gemm.py): HF generate's tokens either way
    (qwen2: q/k/v biases), prefill and decode, rows finishing at EOS."""
    from hybridflow.models.cpu_gemm import available

    if cpu_gemm == "onednn" and not available():
        pytest.skip("this torch build has no oneDNN linear op")
    engine = BuiltinEngine(models[arch], BuiltinEngineConfig(cpu_gemm=cpu_gemm))
    check_greedy_matches_hf(engine.generate, models[arch], prompt_batch(tokenizer))


def test_hf_fallback_routes_its_replica_under_onednn(models, tokenizer):
    """The HF fallback (Qwen3 here) runs a replica of the model: under cpu_gemm=onednn its linear layers go
    through oneDNN too, with HF generate's tokens."""
    from hybridflow.models.cpu_gemm import available, routed

    if not available():
        pytest.skip("this torch build has no oneDNN linear op")
    engine = BuiltinEngine(models["qwen3"], BuiltinEngineConfig(cpu_gemm="onednn"))
    check_greedy_matches_hf(engine.generate, models["qwen3"], prompt_batch(tokenizer))
    assert routed(engine._replica.model.lm_head)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_hf_generate_without_packed_weights(models, tokenizer, arch):
    """pack_weights=False runs on transposed views of the model's tensors (qwen2: q/k/v biases)."""
    model, batch = models[arch], prompt_batch(tokenizer)
    engine = BuiltinEngine(model, BuiltinEngineConfig(pack_weights=False))
    out = engine.generate(batch, SamplingParams(max_new_tokens=16, do_sample=False, eos_token_ids=()))
    assert torch.equal(out["responses"], hf_generate(model, batch, 16, None))


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_hf_fallback_never_runs_the_models_own_modules(models, tokenizer, arch):
    """A strict stand-in for FSDP2's units: every module of the model raises when called, as an FSDP
    unit's forward hook would all-gather. The fallback decodes on its replica bound to the model's
    tensors at each call: same tokens as HF generate, the replica holds nothing after the call, and it
    sees a change to the model's weights at the next call."""
    model = build_tiny_model("tiny", arch, seed=1).eval()
    batch, params = (
        prompt_batch(tokenizer),
        SamplingParams(max_new_tokens=12, do_sample=False, eos_token_ids=()),
    )
    engine = BuiltinEngine(model)
    expected = [hf_generate(model, batch, 12, None)]
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(-1.0)  # greedy picks other tokens now
    expected.append(hf_generate(model, batch, 12, None))
    model.get_output_embeddings().weight.data.mul_(-1.0)
    assert not torch.equal(*expected)

    def forbidden(module, args, kwargs):
        raise AssertionError(f"the model's own {type(module).__name__} ran during generation")

    hooks = [m.register_forward_pre_hook(forbidden, with_kwargs=True) for m in model.modules()]
    try:
        assert torch.equal(engine.generate(batch, params)["responses"], expected[0])
        assert all(t.is_meta for t in engine._replica.model.state_dict().values())
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(-1.0)
        assert torch.equal(engine.generate(batch, params)["responses"], expected[1])
    finally:
        for h in hooks:
            h.remove()


def test_hf_fallback_prefill_projects_only_the_last_position(models, tokenizer):
    """logits_to_keep=1: the LM head sees one position per row in prefill as in decode, not (B, prompt)."""
    from hybridflow.rollout.hf_decoder import _logits_kwargs

    engine, batch = BuiltinEngine(models["gpt2"]), prompt_batch(tokenizer)
    params = SamplingParams(max_new_tokens=4, do_sample=False)
    engine.generate(batch, params)  # builds the replica
    widths = []
    head = engine._replica.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    try:
        out = engine.generate(batch, params)
    finally:
        hook.remove()
    assert len(widths) == out["response_mask"].sum(1).max() and set(widths) == {1}
    assert batch["input_ids"].shape[1] > 1
    # a forward without the argument runs as it is; the pre-4.50 name is used where that is the one
    assert _logits_kwargs(lambda input_ids, attention_mask=None, **kw: None) == {}
    assert _logits_kwargs(lambda input_ids, num_logits_to_keep=0: None) == {"num_logits_to_keep": 1}


def test_hole_filling_order():
    from hybridflow.rollout.engine import hole_filling_order

    alive = torch.tensor([True, False, True, False, True, True, False, True])
    # 5 alive: holes at 1 and 3 are filled by the live rows 5 and 7 from beyond position 5.
    assert hole_filling_order(alive, 5).tolist() == [0, 5, 2, 7, 4]
    assert hole_filling_order(torch.ones(4, dtype=torch.bool), 4).tolist() == [0, 1, 2, 3]
    assert hole_filling_order(torch.tensor([False, False, True]), 1).tolist() == [2]


def test_functional_backend_used_for_llama_family(models):
    from hybridflow.rollout.llama_decoder import LlamaFamilyDecoder

    for arch in ("llama", "qwen2", "mistral"):
        assert isinstance(BuiltinEngine(models[arch])._decoder(64), LlamaFamilyDecoder)
    with pytest.raises(ValueError, match="functional backend cannot run"):
        BuiltinEngine(models["gpt2"], BuiltinEngineConfig(backend="functional"))._decoder(64)


def test_output_fields_and_eos(models, tokenizer):
    batch = prompt_batch(tokenizer)
    lr = 32
    out = BuiltinEngine(models["llama"]).generate(
        batch, SamplingParams(max_new_tokens=lr, temperature=1.0, stop_token_ids=(7, 8, 9, 10, 11), seed=3)
    )
    b, lp = batch["input_ids"].shape
    assert out["responses"].shape == (b, lr) and out["input_ids"].shape == (b, lp + lr)
    assert torch.equal(out["prompts"], batch["input_ids"])
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"], torch.cat([batch["attention_mask"], out["response_mask"]], 1))
    pos = out["position_ids"]
    assert torch.equal(pos[:, lp:], pos[:, lp - 1 : lp] + torch.arange(1, lr + 1))
    stop = torch.tensor([2, 7, 8, 9, 10, 11])
    lengths = out["response_mask"].sum(1)
    assert lengths.min() < lr, "with 6 stop tokens of ~90, some row must stop early"
    for i in range(b):
        n = int(lengths[i])
        assert torch.equal(out["response_mask"][i, :n], torch.ones(n, dtype=out["response_mask"].dtype))
        assert not out["response_mask"][i, n:].any()
        row = out["responses"][i]
        assert not torch.isin(row[: n - 1], stop).any(), "a stop token inside the response"
        if n < lr:
            assert bool(torch.isin(row[n - 1], stop)), "stopped early without a stop token"
        assert (row[n:] == 0).all() and (out["rollout_log_probs"][i, n:] == 0).all()
    assert list(out["uid"]) == list(range(b)) and out.meta.temperature == 1.0


def test_n_samples_interleaved_and_seeded(models, tokenizer):
    batch = prompt_batch(tokenizer)
    engine = BuiltinEngine(models["qwen2"])
    params = SamplingParams(max_new_tokens=16, n=3, temperature=1.0, seed=11, eos_token_ids=())
    out = engine.generate(batch, params)
    b = len(batch)
    assert len(out) == 3 * b
    assert torch.equal(out["prompts"], batch["input_ids"].repeat_interleave(3, 0))
    assert list(out["uid"]) == [i for i in range(b) for _ in range(3)]
    assert list(out["prompt_text"][:3]) == [TEXTS[0]] * 3
    resp = out["responses"].view(b, 3, -1)
    assert all(not torch.equal(resp[i, 0], resp[i, 1]) for i in range(b)), "samples of a prompt must differ"
    again = engine.generate(batch, params)
    assert torch.equal(again["responses"], out["responses"])
    assert torch.equal(again["rollout_log_probs"], out["rollout_log_probs"])
    other = engine.generate(batch, SamplingParams(max_new_tokens=16, n=3, seed=12, eos_token_ids=()))
    assert not torch.equal(other["responses"], out["responses"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_seeded_sample_does_not_depend_on_the_rows_beside_it(models, tokenizer, arch):
    """Draws are keyed by (seed, prompt uid, sample index, position): a subset of the prompts, in another
    order, or cut into chunks (max_num_seqs), samples what the whole batch sampled for them, as a prompt
    does on whichever data-parallel rank it lands."""
    batch = prompt_batch(tokenizer)
    params = SamplingParams(max_new_tokens=12, n=2, temperature=1.0, seed=5, eos_token_ids=())
    whole = BuiltinEngine(models[arch]).generate(batch, params)["responses"].view(len(batch), 2, -1)
    pick = torch.tensor([4, 1, 3])
    part = BuiltinEngine(models[arch]).generate(batch.index(pick), params)["responses"].view(3, 2, -1)
    assert torch.equal(part, whole[pick])
    chunked = BuiltinEngine(models[arch], BuiltinEngineConfig(max_num_seqs=4)).generate(batch, params)
    assert torch.equal(chunked["responses"].view(len(batch), 2, -1), whole)


@pytest.mark.parametrize("arch,temperature", [("llama", 0.7), ("qwen2", 1.3), ("gpt2", 1.0)])
def test_rollout_log_probs_match_hf_forward(models, tokenizer, arch, temperature):
    model = models[arch]
    out = BuiltinEngine(model).generate(
        prompt_batch(tokenizer), SamplingParams(max_new_tokens=20, temperature=temperature, top_k=20, seed=5)
    )
    ref = hf_log_probs(model, out, temperature)
    mask = out["response_mask"].bool()
    assert out.meta.temperature == temperature
    torch.testing.assert_close(out["rollout_log_probs"][mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_greedy_log_probs_at_temperature_one(models, tokenizer):
    out = BuiltinEngine(models["llama"]).generate(
        prompt_batch(tokenizer), SamplingParams(max_new_tokens=12, do_sample=False, temperature=0.5)
    )
    assert out.meta.temperature == 1.0
    mask = out["response_mask"].bool()
    torch.testing.assert_close(
        out["rollout_log_probs"][mask], hf_log_probs(models["llama"], out, 1.0)[mask], atol=1e-4, rtol=1e-4
    )


def test_compaction_does_not_change_greedy_output(models, tokenizer):
    batch = prompt_batch(tokenizer, TEXTS * 3)
    params = SamplingParams(max_new_tokens=30, do_sample=False, stop_token_ids=(7, 8, 9, 10, 11, 12))
    outs = [
        BuiltinEngine(models["llama"], BuiltinEngineConfig(compact_fraction=f)).generate(batch, params)
        for f in (0.0, 0.5, 1.0)
    ]
    lengths = outs[0]["response_mask"].sum(1)
    assert lengths.min() < lengths.max(), "rows must finish at different steps for this test to mean anything"
    for o in outs[1:]:
        assert torch.equal(o["responses"], outs[0]["responses"])
        torch.testing.assert_close(o["rollout_log_probs"], outs[0]["rollout_log_probs"])


def test_top_k_one_equals_greedy(models, tokenizer):
    batch, engine = prompt_batch(tokenizer), BuiltinEngine(models["mistral"])
    greedy = engine.generate(batch, SamplingParams(max_new_tokens=12, do_sample=False))
    top1 = engine.generate(batch, SamplingParams(max_new_tokens=12, temperature=0.8, top_k=1, seed=0))
    assert torch.equal(greedy["responses"], top1["responses"])


def test_load_weights_runs_new_weights_in_place(tokenizer):
    a, b = build_tiny_model("tiny", "llama", seed=1).eval(), build_tiny_model("tiny", "llama", seed=2).eval()
    batch, params = (
        prompt_batch(tokenizer),
        SamplingParams(max_new_tokens=10, do_sample=False, eos_token_ids=()),
    )
    engine = BuiltinEngine(a)
    before = engine.generate(batch, params)["responses"]
    expected = BuiltinEngine(b).generate(batch, params)["responses"]
    assert not torch.equal(before, expected)
    engine.load_weights(b.state_dict().items())
    assert torch.equal(engine.generate(batch, params)["responses"], expected)
    with pytest.raises(KeyError, match="no parameter"):
        engine.load_weights([("model.layers.0.nope.weight", torch.zeros(1))])


def test_rejects_right_padded_prompts(models):
    ids = torch.tensor([[5, 6, 7], [5, 0, 0]])
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": (ids != 0).long()})
    with pytest.raises(ValueError, match="left-padded"):
        BuiltinEngine(models["llama"]).generate(batch, SamplingParams(max_new_tokens=2))


def test_outputs_train_and_model_mode_is_restored(tokenizer):
    """The rollout feeds a training step: its tensors must support backward (no inference tensors)."""
    model = build_tiny_model("tiny", "llama", seed=3)
    model.train()
    out = BuiltinEngine(model).generate(prompt_batch(tokenizer), SamplingParams(max_new_tokens=6, seed=0))
    assert model.training
    logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits
    logits.float().logsumexp(-1).mean().backward()
    assert model.lm_head.weight.grad is not None


def test_max_num_seqs_chunks_give_the_same_greedy_rollout(models, tokenizer):
    batch = prompt_batch(tokenizer)
    params = SamplingParams(max_new_tokens=10, n=2, do_sample=False, stop_token_ids=(7, 8))
    full = BuiltinEngine(models["llama"]).generate(batch, params)
    chunked = BuiltinEngine(models["llama"], BuiltinEngineConfig(max_num_seqs=5)).generate(batch, params)
    for key in ("responses", "input_ids", "attention_mask", "position_ids", "rollout_log_probs"):
        torch.testing.assert_close(chunked[key], full[key])
    assert list(chunked["uid"]) == list(full["uid"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_n_samples_equal_single_sample_repeated(models, tokenizer, arch):
    """Prefill runs once per prompt and its cache is repeated n times: that must not change anything."""
    batch, engine = prompt_batch(tokenizer), BuiltinEngine(models[arch])
    one = engine.generate(batch, SamplingParams(max_new_tokens=10, do_sample=False, stop_token_ids=(7, 8)))
    three = engine.generate(
        batch, SamplingParams(max_new_tokens=10, n=3, do_sample=False, stop_token_ids=(7, 8))
    )
    assert torch.equal(three["responses"], one["responses"].repeat_interleave(3, 0))
    torch.testing.assert_close(three["rollout_log_probs"], one["rollout_log_probs"].repeat_interleave(3, 0))


def test_mkl_packed_linear_equals_matmul_for_any_row_count():
    """Decode packs each weight once per generate call (MKL packed GEMM) and multiplies it with 1..B
    rows as rows finish; the pack must give x @ w.T at every row count, with and without bias."""
    from hybridflow.rollout.cpu.mkl_packed import MklPacked, mkl_pack_works
    from hybridflow.rollout.llama_decoder import _mm, _mm_residual

    if not mkl_pack_works():
        pytest.skip("this torch build has no MKL packed GEMM (the decoder uses transposed copies)")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    packed = MklPacked(w)
    assert packed.shape.untyped_storage().nbytes() <= 4, "the shape carrier must not copy the weight"
    for m in (1, 2, 5, 16, 63, 64, 65, 300):
        x, res = torch.randn(m, 64, generator=g), torch.randn(m, 96, generator=g)
        torch.testing.assert_close(_mm(x, packed, None), x @ w.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_mm(x, packed, b), x @ w.t() + b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_mm_residual(res, x, packed, None), res + x @ w.t(), rtol=1e-5, atol=1e-5)


def test_decoder_packs_for_the_chosen_cpu_gemm(models):
    """model.cpu_gemm: MKL's packed format under mkl, oneDNN weights under onednn (fp32 on CPU)."""
    from hybridflow.models.cpu_gemm import OneDnnWeight, available
    from hybridflow.rollout.cpu.mkl_packed import MklPacked, mkl_pack_works
    from hybridflow.rollout.llama_decoder import LlamaFamilyDecoder

    decoder = LlamaFamilyDecoder(models["llama"], pack_weights=True, cpu_gemm="mkl")
    decoder.load()
    qkv = decoder.layers[0].qkv[0][0]
    assert isinstance(qkv, MklPacked) == mkl_pack_works()
    assert isinstance(decoder.lm_head[0], MklPacked) == mkl_pack_works()
    if available():
        decoder = LlamaFamilyDecoder(models["llama"], pack_weights=True, cpu_gemm="onednn")
        decoder.load()
        assert isinstance(decoder.layers[0].qkv[0][0], OneDnnWeight)
        assert isinstance(decoder.lm_head[0], OneDnnWeight)
        assert decoder._weights_for(300) is decoder.layers  # prefill too; a 1-row gemv on the raw views
        assert decoder._weights_for(1) is decoder.raw_layers
    decoder = LlamaFamilyDecoder(models["llama"], pack_weights=False)
    decoder.load()
    assert (
        decoder.layers[0].qkv[0][0].data_ptr()
        == models["llama"].model.layers[0].self_attn.q_proj.weight.data_ptr()
    )


def test_cpu_threads_for_generation_and_restored(models, tokenizer, monkeypatch):
    from hybridflow.rollout import engine as engine_mod

    tiny = models["llama"]
    assert BuiltinEngine(tiny)._threads(2) == 1, "a sub-5M model decodes on one thread"
    assert BuiltinEngine(tiny, BuiltinEngineConfig(cpu_threads=3))._threads(2) == 3
    monkeypatch.setattr(engine_mod, "SMALL_MODEL_PARAMS", 0)
    assert BuiltinEngine(tiny)._threads(2) == 2, "larger models keep the process's threads"
    monkeypatch.undo()
    seen = []
    real = engine_mod.BuiltinEngine._generate
    monkeypatch.setattr(
        engine_mod.BuiltinEngine,
        "_generate",
        lambda self, *a: seen.append(torch.get_num_threads()) or real(self, *a),
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        BuiltinEngine(tiny).generate(
            prompt_batch(tokenizer), SamplingParams(max_new_tokens=4, temperature=0.0)
        )
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_decoder_norm_and_rope_equal_their_reference_bit_for_bit():
    """The decoder's lean RMSNorm (6 ops) equals HF's LlamaRMSNorm exactly, and its rope (roll with a
    signed sin) equals the rotate_half form it replaced exactly (HF's separate mul/add within rounding),
    so greedy and seeded outputs did not move when they replaced F.rms_norm and rotate_half."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, rotate_half

    from hybridflow.rollout.decoder_ops import _rms_norm, _rope, signed_sin

    g = torch.Generator().manual_seed(0)
    for rows, hidden in ((1, 64), (7, 128), (33, 512)):
        norm = LlamaRMSNorm(hidden, eps=1e-6)
        norm.weight.data = torch.randn(hidden, generator=g)
        for scale in (1e-3, 1.0, 40.0):
            x = torch.randn(rows, hidden, generator=g) * scale
            assert torch.equal(_rms_norm(x, norm.weight.data, 1e-6), norm(x))
    hd = 32
    q, k = torch.randn(5, 4, hd, generator=g), torch.randn(5, 2, hd, generator=g)
    angles = torch.randn(5, 1, hd // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (5, 1, hd), as HF
    for x in (q, k):
        ours = _rope(x, cos, signed_sin(sin))
        assert torch.equal(ours, torch.addcmul(x * cos, rotate_half(x), sin))
        hf, _ = apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=0)
        torch.testing.assert_close(ours, hf[0], rtol=1e-6, atol=1e-6)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that make the host wait for a tensor's value (each one a stall on a GPU)."""

    READS = {torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.item,
             torch.Tensor.tolist, torch.Tensor.nonzero}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compact_fraction", [0.0, 0.5])
def test_device_stop_checks_give_the_host_paths_greedy_rollout_with_few_host_reads(
    models, tokenizer, monkeypatch, compact_fraction
):
    """On an accelerator the decode loop reads the live-row count every DEVICE_STOP_CHECK_EVERY steps,
    not every step; rows that stopped in between decode on, masked. Same rollout, ~1/k of the reads."""
    from hybridflow.rollout import engine as engine_mod

    batch = prompt_batch(tokenizer, TEXTS * 3)
    params = SamplingParams(max_new_tokens=30, do_sample=False, stop_token_ids=(7, 8, 9, 10, 11, 12))
    engine = BuiltinEngine(models["llama"], BuiltinEngineConfig(compact_fraction=compact_fraction))
    runs = {}
    for every in (1, 4):
        monkeypatch.setattr(engine_mod, "stop_check_every", lambda device, every=every: every)
        with _HostReads() as reads:
            runs[every] = (engine.generate(batch, params), reads.count)
    (host, host_reads), (device, device_reads) = runs[1], runs[4]
    lengths = host["response_mask"].sum(1)
    assert lengths.min() < lengths.max(), "rows must stop at different steps"
    assert torch.equal(device["response_mask"], host["response_mask"])
    assert torch.equal(device["responses"], host["responses"])
    torch.testing.assert_close(device["rollout_log_probs"], host["rollout_log_probs"])
    assert host_reads >= 30  # one a step: the counter sees the reads it is meant to bound
    assert device_reads <= 30 // 4 * 3 + 4, device_reads  # per check: the count, compaction's two nonzeros


def test_stop_checks_and_weight_packing_by_device():
    """The host CPU reads every step and packs its weights; an accelerator (or strict mode's stand-in, an
    indexed cpu) reads every k steps and decodes on views of the weights, with no second copy."""
    from hybridflow.rollout.engine import DEVICE_STOP_CHECK_EVERY, stop_check_every
    from hybridflow.rollout.llama_decoder import packs_on

    assert stop_check_every(torch.device("cpu")) == 1 and packs_on(torch.device("cpu"))
    for device in (torch.device("cuda", 0), torch.device("cpu", 0)):
        assert stop_check_every(device) == DEVICE_STOP_CHECK_EVERY > 1
        assert not packs_on(device)
