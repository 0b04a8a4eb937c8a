"""Multi-process training on real gloo groups equals the single-process reference.

FSDP2 over 1 and 2 ranks, tensor parallel (Llama-like and GPT-2's fused qkv), and a 2 x 2 dp x tp
mesh: same response log-probs, same global loss, same full gradients, same weights after two AdamW
steps, and the HF checkpoint written from TP shards is the reference model's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_workers import run_case, run_group
from rl_data import make_rl_batch, pg_loss

from hybridflow.engines import EngineConfig, OptimConfig, TrainEngine
from hybridflow.models import load_causal_lm
from hybridflow.models.tiny import save_tiny_model

BATCH = dict(batch_size=8, lp=6, lr=8, seed=4)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_models")
    return {
        arch: str(save_tiny_model(root / arch, "tiny", arch, seed=2)) for arch in ("llama", "qwen2", "gpt2")
    }


def reference(model_dir: str, batch_kwargs: dict = BATCH, **engine_kwargs) -> dict:
    """The same two steps in one process on the whole batch, one micro-batch, no process group.

    Adam's eps is 1e-6 (not 1e-8) on both sides: some gradients are zero in exact arithmetic (GPT-2's
    key bias: softmax ignores a constant added to every key) and Adam would turn their ~1e-12
    round-off, which differs between layouts, into full +-lr steps."""
    optim = OptimConfig(lr=1e-2, grad_clip=1.0, eps=1e-6)
    engine = TrainEngine(
        load_causal_lm(model_dir), EngineConfig(optim=optim, logits_chunk_size=4, **engine_kwargs)
    )
    batch = make_rl_batch(engine.hf_model.config.vocab_size, **batch_kwargs)
    log_probs, entropy = engine.compute_log_probs(batch, with_entropy=True, micro_batch_size=8)
    metrics = engine.forward_backward(batch, pg_loss, micro_batch_size=8)
    grads = dict(engine.iter_full_grads())
    step = engine.optimizer_step()
    second = engine.train_step(batch, pg_loss, micro_batch_size=8)
    mask = batch["response_mask"].bool()
    return dict(
        log_probs=log_probs,
        entropy=entropy,
        mask=mask,
        loss=metrics["loss"],
        loss2=second["loss"],
        grads=grads,
        step=step,
        state=engine.full_state_dict(),
    )


def assert_matches_reference(got: dict, ref: dict, state_atol: float = 1e-5) -> None:
    mask = ref["mask"]
    torch.testing.assert_close(got["log_probs"][mask], ref["log_probs"][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["entropy"][mask], ref["entropy"][mask], atol=1e-5, rtol=1e-5)
    # Each dp rank reports its local token-mean; weighting by tokens gives the global token-mean.
    total = sum(n for *_, n in got["losses"])
    assert sum(loss * n for loss, _, n in got["losses"]) / total == pytest.approx(ref["loss"], abs=1e-5)
    assert sum(loss2 * n for _, loss2, n in got["losses"]) / total == pytest.approx(ref["loss2"], abs=1e-5)
    assert set(got["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert got["step"]["grad_norm"] == pytest.approx(ref["step"]["grad_norm"], rel=1e-5)
    for name, value in ref["state"].items():
        torch.testing.assert_close(got["state"][name], value, atol=state_atol, rtol=1e-4, msg=name)


def test_fsdp_on_one_rank_matches_reference(model_dirs, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        case = dict(name="one", model_dir=model_dirs["llama"], tp=1, dp=1, batch=BATCH)
        got = run_case({**case, "engine": {"micro_batch_size_per_device": 3}}, tmp_path)
        assert isinstance(got["state"]["model.embed_tokens.weight"], torch.Tensor)
    finally:
        dist.destroy_process_group()
    assert_matches_reference(got, reference(model_dirs["llama"]))


def test_two_ranks_fsdp_and_tensor_parallel_match_reference(model_dirs, tmp_path):
    cases = [
        # dp=2 with token-budget micro-batches: ranks plan different counts and must agree on one.
        dict(
            name="fsdp2",
            model_dir=model_dirs["llama"],
            tp=1,
            dp=2,
            batch=BATCH,
            engine={"max_tokens_per_micro_batch": 30},
        ),
        # tp=2 on GPT-2 (fused qkv permuted per rank), initialised from slices of the HF file (meta),
        # saved back to HF from the shards.
        dict(
            name="gpt2_tp2",
            meta=True,
            model_dir=model_dirs["gpt2"],
            tp=2,
            dp=1,
            batch=BATCH,
            engine={"micro_batch_size_per_device": 3},
            save_dir=str(tmp_path / "gpt2_tp2_hf"),
        ),
    ]
    got = run_group(2, cases, tmp_path)
    assert_matches_reference(got["fsdp2"], reference(model_dirs["llama"]))
    ref_gpt2 = reference(model_dirs["gpt2"])
    assert_matches_reference(got["gpt2_tp2"], ref_gpt2)
    saved = load_causal_lm(tmp_path / "gpt2_tp2_hf").state_dict()
    for name, value in ref_gpt2["state"].items():
        torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_dp2_x_tp2_mesh_matches_reference(model_dirs, tmp_path):
    case = dict(
        name="mesh",
        meta=True,  # sharded init on the 2-D mesh: each rank reads its (dp, tp) chunk of every weight
        model_dir=model_dirs["qwen2"],
        tp=2,
        dp=2,
        batch=BATCH,
        engine={"micro_batch_size_per_device": 2},
    )
    got = run_group(4, [case], tmp_path)["mesh"]
    assert_matches_reference(got, reference(model_dirs["qwen2"]))


def test_shared_prompts_under_fsdp_and_tensor_parallel_match_unshared_reference(model_dirs, tmp_path):
    """model.share_prompt on 2 ranks (FSDP2 dp=2, and tp=2 on Qwen2): rows with the same prompt compute it
    once on each rank; log-probs, losses, gradients and the stepped weights are the unshared run's."""
    grouped = {**BATCH, "group": 4}
    cases = [
        dict(name="dp2", model_dir=model_dirs["llama"], tp=1, dp=2, batch=grouped,
             engine={"share_prompt": True, "micro_batch_size_per_device": 4}),
        dict(name="tp2", model_dir=model_dirs["qwen2"], tp=2, dp=1, batch=grouped,
             engine={"share_prompt": True, "micro_batch_size_per_device": 8}),
    ]  # fmt: skip
    got = run_group(2, cases, tmp_path)
    for name, arch in (("dp2", "llama"), ("tp2", "qwen2")):
        assert got[name]["shared_prompt_tokens"] > 0
        assert_matches_reference(got[name], reference(model_dirs[arch], grouped, share_prompt=False))
