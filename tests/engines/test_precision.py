"""One dp rank in bf16 computes as FSDP2 does over several (engines/precision.py): the forward and
backward are those of a bf16 copy of the model, the gradients arrive as fp32 sums, and the fp32 weights
are what the optimizer, clipping and checkpoints see."""

from __future__ import annotations

import torch
from rl_data import make_rl_batch as make_batch

from hybridflow.engines import EngineConfig, TrainEngine
from hybridflow.engines.precision import cast_parameters
from hybridflow.models import load_causal_lm


def _loss(out, mb):  # a token-mean of the log-probs: a gradient on every weight the responses reach
    mask = mb["response_mask"][:, : out["log_probs"].shape[1]].float()
    return -(out["log_probs"] * mask).sum() / mask.sum(), {}


def _grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in engine.hf_model.named_parameters()}


def _engine(model_dir, precision: str, micro: int, bf16_weights: bool = False) -> TrainEngine:
    model = load_causal_lm(model_dir)
    if bf16_weights:
        cast_parameters(model, torch.bfloat16)
    return TrainEngine(model, EngineConfig(mixed_precision=precision, micro_batch_size_per_device=micro))


def test_forward_and_gradient_are_a_bf16_copys_summed_in_fp32(tiny_model_dir):
    batch = make_batch(load_causal_lm(tiny_model_dir).config.vocab_size, batch_size=8, seed=7, group=4)
    mixed = _engine(tiny_model_dir, "bf16", micro=8)
    copy = _engine(tiny_model_dir, "none", micro=8, bf16_weights=True)  # its parameters stored in bf16
    assert mixed._autocast is None and mixed._copies is not None
    before = {n: p.detach().clone() for n, p in mixed.hf_model.named_parameters()}

    assert torch.equal(mixed.compute_log_probs(batch)[0], copy.compute_log_probs(batch)[0])
    mixed.forward_backward(batch, _loss)
    copy.forward_backward(batch, _loss)
    for name, p in mixed.hf_model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name  # the fp32 weights, untouched
        assert p.grad.dtype == torch.float32, name
        # one micro-batch: the fp32 sum is the bf16 copy's gradient itself
        assert torch.equal(p.grad, _grads(copy)[name].float()), name


def _fp32_sums_of_micro_batch_grads(engine) -> dict[str, torch.Tensor]:
    """Run by a bf16-stored engine's backward: each micro-batch's bf16 gradient, summed in fp32 here."""
    sums: dict[str, torch.Tensor] = {}

    def take(name):
        def hook(p):
            sums[name] = p.grad.float() if name not in sums else sums[name].add_(p.grad)
            p.grad = None

        return hook

    for name, p in engine.hf_model.named_parameters():
        p.register_post_accumulate_grad_hook(take(name))
    return sums


def test_micro_batches_accumulate_in_fp32_and_the_step_moves_fp32_weights(tiny_model_dir):
    """4 x 2: the fp32 sum of the bf16 copy's four micro-batch gradients, exactly (a bf16 running sum
    would round at every add); near fp32's gradient; the optimizer then steps the fp32 weights."""
    batch = make_batch(load_causal_lm(tiny_model_dir).config.vocab_size, batch_size=8, seed=8, group=4)
    runs = {key: _engine(tiny_model_dir, precision, micro) for key, precision, micro in
            (("one", "bf16", 8), ("four", "bf16", 2), ("fp32", "none", 8))}  # fmt: skip
    copy = _engine(tiny_model_dir, "none", micro=2, bf16_weights=True)
    summed = _fp32_sums_of_micro_batch_grads(copy)
    for engine in (*runs.values(), copy):
        engine.forward_backward(batch, _loss)
    one, four, fp32 = (_grads(runs[k]) for k in ("one", "four", "fp32"))
    assert set(summed) == set(four)
    scale = max(g.abs().max() for g in fp32.values())
    for name in fp32:
        assert torch.equal(four[name], summed[name]), name
        assert (one[name] - fp32[name]).abs().max() < 3e-2 * scale, name
    # across all weights, bf16 is close: its error is rounding, not a wrong or missing term
    flat = {k: torch.cat([g[n].flatten() for n in fp32]) for k, g in (("one", one), ("fp32", fp32))}
    assert torch.nn.functional.cosine_similarity(flat["one"], flat["fp32"], dim=0) > 0.999

    engine = runs["four"]
    before = [p.detach().clone() for p in engine.hf_model.parameters()]
    metrics = engine.optimizer_step()
    assert metrics["step_skipped"] == 0.0 and metrics["grad_norm"] > 0
    params = list(engine.hf_model.parameters())
    assert all(p.dtype == torch.float32 and p.grad is None for p in params)
    assert sum(int(not torch.equal(p, old)) for p, old in zip(params, before)) > 0


def test_a_raising_loss_leaves_fp32_weights_and_no_gradient(tiny_model_dir):
    batch = make_batch(load_causal_lm(tiny_model_dir).config.vocab_size, batch_size=4, seed=9)
    engine = _engine(tiny_model_dir, "bf16", micro=2)

    def failing(out, mb):
        raise RuntimeError("loss failed")

    try:
        engine.forward_backward(batch, failing)
    except RuntimeError as e:
        assert str(e) == "loss failed"
    assert {p.dtype for p in engine.hf_model.parameters()} == {torch.float32}
    assert all(p.grad is None for p in engine.hf_model.parameters())
    engine.forward_backward(batch, _loss)  # and the next call trains normally
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in engine.hf_model.parameters())


def test_activation_checkpointing_recomputes_on_the_copies(tiny_model_dir):
    """The backward's recompute sees the same bf16 copies as the forward: the gradients are identical."""
    batch = make_batch(load_causal_lm(tiny_model_dir).config.vocab_size, batch_size=8, seed=3, group=4)
    grads = []
    for checkpointing in (False, True):
        cfg = EngineConfig(mixed_precision="bf16", micro_batch_size_per_device=4,
                           gradient_checkpointing=checkpointing)  # fmt: skip
        engine = TrainEngine(load_causal_lm(tiny_model_dir), cfg)
        assert engine._copies is not None
        engine.forward_backward(batch, _loss)
        grads.append(_grads(engine))
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
