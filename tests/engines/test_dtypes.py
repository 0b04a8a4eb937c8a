"""model.dtype honoured on CPU too: a bf16 frozen model (reference / reward) stores half the bytes and
gives log-probs within bf16 rounding of fp32; a bf16 actor keeps fp32 master weights, computes in
bf16, and its recomputed old log-probs equal the training forward's (ratio exactly 1)."""

from __future__ import annotations

import torch
from rl_data import make_rl_batch as make_batch

from hybridflow.engines import EngineConfig, TrainEngine
from hybridflow.engines.micro_batch import pad_response_aligned
from hybridflow.models import load_causal_lm
from hybridflow.workers.common import computes_in_fp32


def _param_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.hf_model.parameters())


def _masked(lp, batch):
    return lp[batch["response_mask"].bool()]


def test_bf16_reference_model_halves_memory_within_bf16_tolerance(tiny_model_dir):
    batch = make_batch(load_causal_lm(tiny_model_dir).config.vocab_size, batch_size=8, seed=3)
    fp32 = TrainEngine(load_causal_lm(tiny_model_dir), EngineConfig(mixed_precision="none"), trainable=False)
    bf16 = TrainEngine(
        load_causal_lm(tiny_model_dir, device="meta"), EngineConfig(mixed_precision="bf16"), trainable=False
    )
    assert {p.dtype for p in bf16.hf_model.parameters()} == {torch.bfloat16}
    assert _param_bytes(bf16) * 2 == _param_bytes(fp32)
    assert bf16.init_stats.bytes_allocated * 2 == _param_bytes(fp32)  # never held in fp32 either
    assert bf16.hf_model.model.rotary_emb.inv_freq.dtype == torch.float32  # rotary table stays exact
    ref, low = (_masked(e.compute_log_probs(batch)[0], batch) for e in (fp32, bf16))
    diff = (ref - low).abs()
    assert 0 < diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())


def test_bf16_actor_fp32_master_weights_and_first_ratio_exactly_one(tiny_model_dir):
    batch = make_batch(load_causal_lm(tiny_model_dir).config.vocab_size, batch_size=8, seed=5)
    actor = TrainEngine(
        load_causal_lm(tiny_model_dir), EngineConfig(mixed_precision="bf16", micro_batch_size_per_device=4)
    )
    assert {p.dtype for p in actor.hf_model.parameters()} == {torch.float32}  # master weights
    old = actor.compute_log_probs(batch)[0]
    fp32_old = TrainEngine(load_causal_lm(tiny_model_dir), EngineConfig()).compute_log_probs(batch)[0]
    assert not torch.equal(_masked(old, batch), _masked(fp32_old, batch))  # computed in bf16
    seen = []

    def capture(out, mb):  # the training forward's log-probs, micro-batch by micro-batch (in row order)
        seen.append(pad_response_aligned(out["log_probs"].detach(), old.shape[1]))
        return out["log_probs"].sum() * 0, {}

    actor.forward_backward(batch, capture)
    new = torch.cat(seen)
    mask = batch["response_mask"].bool()
    assert len(seen) == 2 and torch.equal(torch.exp(new[mask] - old[mask]), torch.ones(int(mask.sum())))


def test_rollout_log_probs_stand_in_only_in_fp32():
    assert computes_in_fp32("float32", "cuda") and computes_in_fp32("auto", "cpu")
    assert not computes_in_fp32("bfloat16", "cpu") and not computes_in_fp32("auto", "cuda")
