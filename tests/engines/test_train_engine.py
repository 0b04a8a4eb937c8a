"""Single-process TrainEngine: RL forward passes against plain HF, gradient accumulation invariants,
micro-batch planning, optimizer schedule, checkpoint resume."""

from __future__ import annotations

import math

import pytest
import torch
from rl_data import make_rl_batch, pg_loss, reference_log_probs

from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine, build_mesh
from hybridflow.engines.forward import chunked_log_probs
from hybridflow.engines.micro_batch import (
    plan_micro_batches,
    restore_order,
    split_micro_batches,
    trim_padding,
)
from hybridflow.engines.optim import lr_factor
from hybridflow.models import load_causal_lm
from hybridflow.models.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    return {arch: save_tiny_model(root / arch, "tiny", arch, seed=1) for arch in ("llama", "gpt2")}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_log_probs_match_plain_hf_forward(model_dirs, arch):
    ref = load_causal_lm(model_dirs[arch])
    batch = make_rl_batch(ref.config.vocab_size, batch_size=7, seed=3)
    want_lp, want_ent = reference_log_probs(ref, batch)
    engine = TrainEngine(load_causal_lm(model_dirs[arch]), EngineConfig(logits_chunk_size=3), trainable=False)
    mask = batch["response_mask"].bool()
    for kwargs in ({"micro_batch_size": 2}, {"micro_batch_size": 7}, {"max_tokens": 30}):
        lp, ent = engine.compute_log_probs(batch, with_entropy=True, **kwargs)
        assert lp.shape == ent.shape == batch["responses"].shape
        torch.testing.assert_close(lp[mask], want_lp[mask], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent[mask], want_ent[mask], atol=2e-5, rtol=1e-5)
    # Temperature divides the logits before the softmax, as the sampler does.
    lp_t, _ = engine.compute_log_probs(batch, temperature=0.7)
    assert not torch.allclose(lp_t[mask], want_lp[mask], atol=1e-3)


def test_chunked_log_probs_equal_unchunked_values_and_grads():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 11))
    outs = []
    for chunk in (11, 4, 1):
        head.zero_grad()
        hidden.grad = None
        lp, ent = chunked_log_probs(hidden, head, labels, chunk_size=chunk, with_entropy=True)
        (lp.sum() + 0.3 * ent.sum()).backward()
        outs.append((lp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    full_lp = torch.log_softmax(head(hidden), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(outs[0][0], full_lp.detach())
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _grads(engine, batch, **kwargs):
    metrics = engine.forward_backward(batch, pg_loss, **kwargs)
    return metrics, dict(engine.iter_full_grads())


def test_gradient_accumulation_1x8_equals_8x1_and_token_budget(model_dirs):
    engine = TrainEngine(load_causal_lm(model_dirs["llama"]))
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=8, seed=5)
    m_full, g_full = _grads(engine, batch, micro_batch_size=8)
    for kwargs in ({"micro_batch_size": 1}, {"micro_batch_size": 3}, {"max_tokens": 24}):
        m, g = _grads(engine, batch, **kwargs)
        assert m["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-6)
        for name, grad in g_full.items():
            torch.testing.assert_close(g[name], grad, atol=1e-6, rtol=1e-4, msg=f"{name} with {kwargs}")
    assert max(float(v.abs().max()) for v in g_full.values()) > 0


def test_sequence_weighting_is_split_invariant(model_dirs):
    engine = TrainEngine(load_causal_lm(model_dirs["gpt2"]))
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=6, seed=6)

    def seq_loss(out, mb):
        m = mb["response_mask"].float()
        return (-(out["log_probs"] * m).sum(-1) / m.sum(-1)).mean(), {}

    _, g1 = _grads_with(engine, batch, seq_loss, micro_batch_size=6)
    _, g2 = _grads_with(engine, batch, seq_loss, micro_batch_size=4)  # uneven split: 4 + 2
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-4)


def _grads_with(engine, batch, loss_fn, **kwargs):
    m = engine.forward_backward(batch, loss_fn, loss_weighting="sequences", **kwargs)
    return m, dict(engine.iter_full_grads())


def test_token_budget_plan_respects_budget_and_restores_order(model_dirs):
    batch = make_rl_batch(60, batch_size=16, lp=10, lr=12, seed=7)
    groups = plan_micro_batches(batch, max_tokens=60)
    assert sorted(i for g in groups for i in g) == list(range(16))
    for mb in split_micro_batches(batch, groups):
        assert mb["input_ids"].numel() <= 60 or len(mb) == 1
    # Bucketing by length computes fewer (padded) tokens than one padded batch would.
    assert (
        sum(mb["input_ids"].numel() for mb in split_micro_batches(batch, groups)) < batch["input_ids"].numel()
    )
    forced = plan_micro_batches(batch, max_tokens=60, num_micro_batches=len(groups) + 3)
    assert len(forced) == len(groups) + 3
    rows = restore_order([batch["input_ids"][g] for g in groups], groups)
    assert torch.equal(rows, batch["input_ids"])


def test_trim_padding_drops_only_all_pad_columns():
    batch = make_rl_batch(60, batch_size=4, lp=6, lr=8, seed=8)
    mb = trim_padding(batch)
    prompt_lens, resp_lens = batch["attention_mask"][:, :6].sum(-1), batch["response_mask"].sum(-1)
    assert mb["prompts"].shape[1] == int(prompt_lens.max())
    assert mb["responses"].shape[1] == mb["advantages"].shape[1] == int(resp_lens.max())
    assert mb["input_ids"].shape[1] == int(prompt_lens.max() + resp_lens.max())
    assert int(mb["attention_mask"].sum()) == int(batch["attention_mask"].sum())


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, total_steps=14, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4 + 5, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(14, cfg) == pytest.approx(0.1)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    assert lr_factor(50, OptimConfig(warmup_steps=2)) == 1.0


def test_lr_schedule_warmup_then_linear():
    """Linear decay from lr to min_lr_ratio * lr between the end of warmup and total_steps."""
    cfg = OptimConfig(lr=1.0, warmup_steps=2, total_steps=10, schedule="linear", min_lr_ratio=0.2)
    assert [lr_factor(s, cfg) for s in range(2)] == [0.5, 1.0]
    # step 2 starts the decay at 1; 8 decay steps of 0.8 / 8 = 0.1 each
    assert [lr_factor(s, cfg) for s in (2, 3, 6, 10, 50)] == pytest.approx([1.0, 0.9, 0.6, 0.2, 0.2])


def test_engine_steps_follow_the_linear_schedule(model_dirs):
    """optim.schedule=linear end to end in the engine: the lr each train_step reports."""
    optim = OptimConfig(lr=1e-3, schedule="linear", total_steps=4)
    engine = TrainEngine(load_causal_lm(model_dirs["llama"]), EngineConfig(optim=optim))
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=2, seed=12)

    def nll(out, mb):
        m = mb["response_mask"].float()
        return -(out["log_probs"] * m).sum() / m.sum(), {}

    lrs = [engine.train_step(batch, nll)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


def test_train_step_clips_and_improves_and_resumes(model_dirs, tmp_path):
    cfg = EngineConfig(
        micro_batch_size_per_device=4, optim=OptimConfig(lr=1e-2, grad_clip=0.5, warmup_steps=2)
    )
    engine = TrainEngine(load_causal_lm(model_dirs["llama"]), cfg)
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=8, seed=9)

    def nll(out, mb):
        m = mb["response_mask"].float()
        return -(out["log_probs"] * m).sum() / m.sum(), {}

    first = engine.train_step(batch, nll)
    assert first["grad_norm"] > 0.5 and first["lr"] == pytest.approx(5e-3)
    g = engine.forward_backward(batch, nll)  # clipping scales grads to norm 0.5
    engine.optimizer.zero_grad()
    assert g["loss"] < first["loss"]
    engine.save_checkpoint(tmp_path / "ckpt")
    after = [engine.train_step(batch, nll)["loss"] for _ in range(2)]
    state_after = engine.full_state_dict()

    resumed = TrainEngine(load_causal_lm(model_dirs["llama"]), cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.global_step == 1
    again = [resumed.train_step(batch, nll)["loss"] for _ in range(2)]
    assert again == pytest.approx(after, rel=1e-6)
    for k, v in resumed.full_state_dict().items():
        torch.testing.assert_close(v, state_after[k])
    assert math.isfinite(after[-1]) and after[-1] < first["loss"]


def test_clipping_bounds_the_update(model_dirs):
    cfg = EngineConfig(optim=OptimConfig(lr=1.0, grad_clip=1e-3))
    engine = TrainEngine(load_causal_lm(model_dirs["gpt2"]), cfg)
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=4, seed=10)
    engine.forward_backward(batch, pg_loss)
    from hybridflow.engines.optim import clip_grad_norm_, global_grad_norm

    before = clip_grad_norm_(engine.module.parameters(), 1e-3)
    assert float(before) > 1e-3
    assert float(global_grad_norm(engine.module.parameters())) == pytest.approx(1e-3, rel=1e-3)


def test_config_errors_are_clear():
    with pytest.raises(RuntimeError, match="needs 2 ranks"):
        build_mesh(ParallelConfig(pp=2, dp=1))  # two pipeline stages, one process
    with pytest.raises(ValueError, match="dp must be >= 1"):
        build_mesh(ParallelConfig())  # dp=0 ("derive") must be resolved before an engine is built
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_mesh(ParallelConfig(dp=2))
    for schedule in ("cosine", "linear"):
        with pytest.raises(ValueError, match=schedule):
            OptimConfig(schedule=schedule).check()


def test_activation_checkpointing_gives_the_same_gradients(model_dirs):
    plain = TrainEngine(load_causal_lm(model_dirs["llama"]))
    ckpt = TrainEngine(load_causal_lm(model_dirs["llama"]), EngineConfig(gradient_checkpointing=True))
    on = [
        any(getattr(m, "gradient_checkpointing", False) for m in e.hf_model.modules()) for e in (ckpt, plain)
    ]
    assert on == [True, False]  # the layers' flag, which transformers 5.17 and 5.24 both set
    batch = make_rl_batch(plain.hf_model.config.vocab_size, batch_size=4, seed=11)
    _, g_plain = _grads(plain, batch, micro_batch_size=2)
    _, g_ckpt = _grads(ckpt, batch, micro_batch_size=2)
    for name, grad in g_plain.items():
        torch.testing.assert_close(g_ckpt[name], grad, atol=1e-6, rtol=1e-5)


def test_metric_sums_are_read_once_per_step(model_dirs):
    """forward_backward keeps its loss/metric sums on the device and reads them in one transfer: the
    host syncs of a step (tensor -> Python number) do not grow with the number of metrics (before:
    one per metric per micro-batch, each a device stall on a GPU), and the values are unchanged."""
    from torch.profiler import ProfilerActivity, profile

    engine = TrainEngine(load_causal_lm(model_dirs["llama"]), EngineConfig())
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=8, seed=5)

    def step(n_metrics):
        def loss_fn(out, mb):
            loss, _ = pg_loss(out, mb)
            lp = out["log_probs"].detach()
            return loss, {f"m{i}": lp.mean() * i for i in range(n_metrics)}

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            metrics = engine.forward_backward(batch, loss_fn, micro_batch_size=2)  # 4 micro-batches
        return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense"), metrics

    reads_1, m1 = step(1)
    reads_12, m12 = step(12)
    assert reads_12 == reads_1, (reads_1, reads_12)  # before: + 11 metrics x 4 micro-batches
    assert set(m12) == {"loss", *(f"m{i}" for i in range(12))}
    assert all(isinstance(v, float) for v in m12.values())
    assert m12["m0"] == 0.0 and m12["loss"] == m1["loss"]
    for i in range(2, 12):  # m_i = i x m_1 in every micro-batch, so in the token-weighted mean too
        assert math.isclose(m12[f"m{i}"], i * m12["m1"], rel_tol=1e-6)


def test_cpu_gemm_routes_the_engines_linear_layers_with_the_same_gradients(model_dirs):
    """model.cpu_gemm (models/cpu_gemm.py): under onednn every fp32 linear layer and the chunked lm_head go
    through oneDNN, with packed rows and micro-batches; the loss and gradients are MKL's."""
    from hybridflow.models import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("this torch build has no oneDNN linear op")
    engines = {
        choice: TrainEngine(load_causal_lm(model_dirs["llama"]), EngineConfig(cpu_gemm=choice))
        for choice in ("mkl", "onednn")
    }
    linears = {
        c: [cpu_gemm.routed(m) for m in e.hf_model.modules() if type(m) is torch.nn.Linear]
        for c, e in engines.items()
    }
    assert linears["onednn"] and all(linears["onednn"]) and not any(linears["mkl"])
    batch = make_rl_batch(engines["mkl"].hf_model.config.vocab_size, batch_size=8, seed=5)
    (m_mkl, g_mkl), (m_dnn, g_dnn) = (_grads(e, batch, micro_batch_size=3) for e in engines.values())
    assert m_dnn["loss"] == pytest.approx(m_mkl["loss"], rel=1e-5, abs=1e-6)
    for name, grad in g_mkl.items():
        torch.testing.assert_close(g_dnn[name], grad, atol=1e-6, rtol=1e-4, msg=name)
