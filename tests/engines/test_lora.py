"""LoRA (models/lora.py) in the training engine: only the adapters train, the reference is the base, the
merged weights are the adapted model, checkpoints hold the adapters only and resume exactly, the exported
adapter is PEFT's, and dp=2 / tp=2 runs equal the one-process run.

Tolerances (docs/testing.md): fp32 throughout. Adapters off compute exactly the base's ops (B @ A is
skipped, not added as zero), so the reference matches a separately loaded base to 1e-5 (the same kernels;
1e-5 covers a reordered reduction of 64-wide dot products, ~1e-7 each). Merged weights W + s * B @ A
against the unmerged forward x W^T + s * (x A^T) B^T: the same sums in another order, one rounding per
rank-8 product, so logits agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from dist_workers import run_group
from rl_data import make_rl_batch, pg_loss
from test_parallel import BATCH, assert_matches_reference, reference

from hybridflow.checkpoint import CheckpointManager, export_hf, load_engine_state, save_engine_state
from hybridflow.cli import main as cli_main
from hybridflow.engines import EngineConfig, OptimConfig, TrainEngine
from hybridflow.engines.config import LoraConfig
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.models.tiny import save_tiny_model

pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("lora_model"), "tiny", "llama", seed=3))


def _engine(model_dir, **kwargs) -> TrainEngine:
    optim = OptimConfig(lr=2e-2, warmup_steps=2, schedule="linear", total_steps=10, grad_clip=1.0)
    return TrainEngine(load_causal_lm(model_dir), EngineConfig(optim=optim, lora=LORA, **kwargs))


def _logits(model, batch):
    with torch.no_grad():
        ids, attn, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        return model(input_ids=ids, attention_mask=attn, position_ids=pos).logits


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """A LoRA engine after two steps, checkpointed at step 2, then stepped once more (the uninterrupted run)."""
    tmp = tmp_path_factory.mktemp("lora_run")
    engine = _engine(model_dir)
    base_before = {
        n: p.detach().clone() for n, p in engine.hf_model.named_parameters() if not p.requires_grad
    }
    batch = make_rl_batch(engine.hf_model.config.vocab_size, seed=5)
    steps = [engine.train_step(batch, pg_loss) for _ in range(2)]
    manager = CheckpointManager(tmp / "run", keep_last=1)
    with manager.writing(2, meta={"tokenizer_dir": model_dir}) as step_dir:
        save_engine_state(engine, step_dir / "actor", tokenizer=load_tokenizer(model_dir))
    at_save = _logits(engine.hf_model, batch)
    merged = engine.full_state_dict()
    third = engine.train_step(batch, pg_loss)
    return dict(engine=engine, batch=batch, steps=steps, third=third, at_save=at_save, merged=merged,
                base_before=base_before, manager=manager, tmp=tmp)  # fmt: skip


def test_only_adapters_train_and_the_reference_is_the_base(model_dir, trained):
    engine, batch = trained["engine"], trained["batch"]
    trainable = {n for n, p in engine.hf_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in engine.hf_model.parameters() if p.requires_grad
    }
    for name, p in engine.hf_model.named_parameters():
        if name in trained["base_before"]:
            assert torch.equal(p, trained["base_before"][name]), name
    base = TrainEngine(load_causal_lm(model_dir), EngineConfig(), trainable=False)
    want, _ = base.compute_log_probs(batch)
    with engine.adapters_disabled():
        ref, _ = engine.compute_log_probs(batch)
    adapted, _ = engine.compute_log_probs(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(ref[mask], want[mask], atol=1e-5, rtol=0)
    assert (adapted[mask] - want[mask]).abs().max() > 1e-3  # the adapters did learn something


def test_merged_weights_are_the_adapted_model(model_dir, trained):
    merged = trained["merged"]
    assert not any("lora_" in n or "base_layer" in n for n in merged)
    plain = load_causal_lm(model_dir)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(_logits(plain, trained["batch"]), trained["at_save"], atol=1e-5, rtol=1e-5)


def test_checkpoint_is_adapter_sized_and_resumes_exactly(model_dir, trained):
    engine, batch = trained["engine"], trained["batch"]
    actor_dir = trained["manager"].resolve("auto") / "actor"
    shard_bytes = sum(f.stat().st_size for f in (actor_dir / "model").rglob("*.safetensors"))
    adapter_bytes = sum(p.numel() * 4 for n, p in engine.hf_model.named_parameters() if p.requires_grad)
    model_bytes = sum(p.numel() * p.element_size() for p in engine.hf_model.parameters())
    assert adapter_bytes <= shard_bytes < adapter_bytes + 64 * 1024  # the adapters + safetensors headers
    assert shard_bytes < model_bytes / 4
    resumed = _engine(model_dir)
    info = load_engine_state(resumed, actor_dir)
    assert info["lora"]["rank"] == LORA.rank and resumed.global_step == 2
    third = resumed.train_step(batch, pg_loss)
    assert third["loss"] == trained["third"]["loss"] and third["lr"] == trained["third"]["lr"]
    for name, t in resumed.full_state_dict().items():
        assert torch.equal(t, engine.full_state_dict()[name]), name


def test_exported_adapter_loads_in_peft_with_the_trained_logits(model_dir, trained):
    from peft import PeftModel

    adapter = export_hf(trained["tmp"] / "run", trained["tmp"] / "adapter")
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    peft_model = PeftModel.from_pretrained(load_causal_lm(model_dir), adapter)
    torch.testing.assert_close(
        _logits(peft_model, trained["batch"]), trained["at_save"], atol=1e-5, rtol=1e-5
    )
    run, merged = trained["tmp"] / "run", trained["tmp"] / "merged"
    assert cli_main(["export", str(run), "-o", str(merged), "--merge"]) == 0  # `hybridflow export --merge`
    torch.testing.assert_close(_logits(load_causal_lm(merged), trained["batch"]), trained["at_save"],
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_lora_under_fsdp_and_tensor_parallel_matches_one_process(tmp_path, model_dir):
    """dp=2 (FSDP2) and tp=2 (adapters split with their base: parallelize.with_adapters), both initialised
    from slices on the meta device: log-probs, losses, adapter gradients and merged weights after two steps
    equal the one-process run (tolerances as test_parallel.py's)."""
    qwen = str(save_tiny_model(tmp_path / "qwen2", "tiny", "qwen2", seed=2))
    engine = {"lora": LORA, "micro_batch_size_per_device": 3}
    cases = [dict(name="lora_dp2", meta=True, model_dir=model_dir, tp=1, dp=2, batch=BATCH, engine=engine),
             dict(name="lora_tp2", meta=True, model_dir=qwen, tp=2, dp=1, batch=BATCH, engine=engine)]  # fmt: skip
    got = run_group(2, cases, tmp_path)
    assert_matches_reference(got["lora_dp2"], reference(model_dir, lora=LORA))
    assert_matches_reference(got["lora_tp2"], reference(qwen, lora=LORA))
    assert any(".lora_B." in n for n in got["lora_tp2"]["grads"])


def test_generation_weights_are_the_merged_model_and_training_weights_stay(trained):
    """The 3D-HybridEngine's switch (dp = tp = 1: the live parameters, merged into new tensors) hands the
    generation engine the merged weights by HF name and leaves the adapters and the base as they were."""
    from hybridflow.hybrid_engine.resharder import build_resharder

    engine = trained["engine"]
    before = {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}
    merged = engine.full_state_dict()
    resharder = build_resharder(engine)
    assert not resharder.in_place
    with resharder.generation() as (weights, tp):
        assert tp is None and set(weights) <= set(merged)
        assert set(merged) - set(weights) <= {"lm_head.weight"}  # a tied head is the embeddings' tensor
        for name, t in weights.items():
            torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=0, msg=name)
    for name, p in engine.hf_model.named_parameters():
        assert torch.equal(p, before[name]), name
