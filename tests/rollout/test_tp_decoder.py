"""The built-in engine tensor-parallel over 2 gloo ranks (torch.multiprocessing, no Ray): each rank gets its
generation shard sliced by hand from the full weights (q/k/v, gate/up and the q/k/v biases by output
rows, o/down by input columns, norms whole, embeddings and lm_head whole or vocab-parallel (V/2 rows per
rank): the Megatron split docs/hybrid_engine.md describes), and must produce the tg = 1 engine's
rollouts: greedy tokens, sampled tokens with n > 1 and stop tokens (finished rows dropped), and
log-probs. Qwen2 (q/k/v biases; whole embeddings), Mistral (vocab-parallel) and Qwen2 with tied
embeddings (vocab-parallel, lm_head = embed_tokens); one spawn for all."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.batch import Batch
from hybridflow.models.tiny import build_tiny_model
from hybridflow.rollout import BuiltinEngine, BuiltinEngineConfig, SamplingParams
from hybridflow.rollout.tp_group import TPGroup

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
CASES = {
    "greedy": dict(max_new_tokens=6, do_sample=False),
    "sampled": dict(
        max_new_tokens=6, n=3, temperature=0.8, top_k=20, top_p=0.9, seed=2, stop_token_ids=(7, 9, 11)
    ),
}


VOCAB_PARALLEL = {"qwen2": False, "mistral": True, "qwen2_tied": True}


def _models() -> dict:
    # initializer_range 0.2: peaked logits, so sampled tokens do not sit on a rounding boundary
    models = {
        arch: build_tiny_model("tiny", arch, seed=1, initializer_range=0.2).eval()
        for arch in ("qwen2", "mistral")
    }
    models["qwen2_tied"] = build_tiny_model(
        "tiny", "qwen2", seed=2, initializer_range=0.2, tie_word_embeddings=True
    ).eval()
    return models


def _prompts() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 60, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return Batch({"input_ids": ids * mask, "attention_mask": mask})


def shard(model, rank: int, size: int, vocab: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():  # tied: lm_head.weight is embed_tokens.weight, listed once
        kind = name.split(".")[-2]
        if kind in COLUMN or (vocab and kind in ("embed_tokens", "lm_head")):
            out[name] = p.detach().chunk(size, 0)[rank]
        elif kind in ROW and name.endswith("weight"):
            out[name] = p.detach().chunk(size, 1)[rank]
        else:
            out[name] = p.detach()
    return out


def _worker(rank: int, rdzv: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + rdzv, rank=rank, world_size=2)
    tp = TPGroup(dist.group.WORLD, 2, 0)
    for arch, model in _models().items():
        engine = BuiltinEngine(model)
        engine.set_shard(shard(model, rank, 2, VOCAB_PARALLEL[arch]), tp)
        for case, kw in CASES.items():
            out = engine.generate(_prompts(), SamplingParams(**kw))
            results[(arch, case, rank)] = {
                k: out[k] for k in ("responses", "response_mask", "rollout_log_probs")
            }
    # the compute dtype applies to a shard too: bf16 copies of this rank's slices, bf16 partial sums
    model = _models()["mistral"]
    engine = BuiltinEngine(model, BuiltinEngineConfig(dtype=torch.bfloat16))
    engine.set_shard(shard(model, rank, 2, True), tp)
    out = engine.generate(_prompts(), SamplingParams(**CASES["greedy"]))
    results[("mistral", "bf16", rank)] = {k: out[k] for k in ("responses", "rollout_log_probs")}
    dist.destroy_process_group()


def test_tp2_generation_equals_tg1():
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "rdzv"), results), nprocs=2)
    for arch, model in _models().items():
        for case, kw in CASES.items():
            ref = BuiltinEngine(model).generate(_prompts(), SamplingParams(**kw))
            for rank in (0, 1):  # both ranks of the group hold the same rows
                got = results[(arch, case, rank)]
                assert torch.equal(got["responses"], ref["responses"]), (arch, case, rank)
                assert torch.equal(got["response_mask"], ref["response_mask"]), (arch, case, rank)
                torch.testing.assert_close(
                    got["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-5, rtol=0
                )
            if case == "sampled":  # the stop tokens ended some rows early: finished rows were dropped
                assert int(ref["response_mask"].sum()) < ref["response_mask"].numel()
    model = _models()["mistral"]
    ref = BuiltinEngine(model, BuiltinEngineConfig(dtype=torch.bfloat16)).generate(
        _prompts(), SamplingParams(**CASES["greedy"])
    )
    fp32 = BuiltinEngine(model).generate(_prompts(), SamplingParams(**CASES["greedy"]))
    for rank in (0, 1):  # bf16 partial sums round differently from tg = 1 bf16, not more than bf16 does
        got = results[("mistral", "bf16", rank)]
        assert torch.equal(got["responses"], ref["responses"])
        torch.testing.assert_close(got["rollout_log_probs"], ref["rollout_log_probs"], atol=0.05, rtol=0)
        assert not torch.equal(got["rollout_log_probs"], fp32["rollout_log_probs"])
