"""Padding removal (engines/packing.py, model.remove_padding): the packed forward and update give the
padded ones' numbers on the architectures that pack; other types are refused; token budgets count real
tokens and keep gradient accumulation exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rl_data import make_rl_batch, pg_loss

from hybridflow.batch import position_ids_from_mask
from hybridflow.config import ConfigError, load_config
from hybridflow.engines import EngineConfig, TrainEngine, packing, varlen
from hybridflow.engines.micro_batch import plan_micro_batches, split_micro_batches
from hybridflow.engines.packing import first_fit, pack, plan, resolve_remove_padding, worth_packing
from hybridflow.models import load_causal_lm, load_critic, load_reward_model
from hybridflow.models.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing_models")
    return {a: save_tiny_model(root / a, "tiny", a, seed=2) for a in ("llama", "qwen2", "mistral", "gpt2")}


def _engines(path, loader=load_causal_lm, trainable=False, **cfg):
    """The same weights behind a padded and a packed engine (a new head drawn from the same seed)."""
    engines = []
    for flag in (False, True):
        torch.manual_seed(0)
        engines.append(
            TrainEngine(loader(path), EngineConfig(remove_padding=flag, **cfg), trainable=trainable)
        )
    return engines


def _grads(engine, batch, loss_fn=pg_loss, **kwargs):
    metrics = engine.forward_backward(batch, loss_fn, with_entropy=True, **kwargs)
    return metrics, dict(engine.iter_full_grads())


def test_first_fit_rows_and_pack_round_trip():
    row, start, rows = first_fit([5, 2, 4, 1, 3], capacity=5)
    assert rows == 3  # 5 | 4+1 | 3+2
    for r in range(rows):  # each row: disjoint runs within the capacity
        runs = sorted((s, s + n) for s, n, rr in zip(start, [5, 2, 4, 1, 3], row) if rr == r)
        assert runs[0][0] == 0 and runs[-1][1] <= 5
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    batch = make_rl_batch(50, batch_size=6, lp=5, lr=7, seed=1)
    attn = batch["attention_mask"]
    p = plan(attn)
    ids, pos = pack(p, batch["input_ids"], batch["position_ids"])
    assert p.cols == int(attn.sum(-1).max()) and int((ids != 0).sum()) == int((batch["input_ids"] != 0).sum())
    assert torch.equal(ids[p.dst], batch["input_ids"][p.src])  # every real token, nothing else
    assert p.rows * p.cols < attn.numel()
    with pytest.raises(ValueError, match="position_ids counting"):
        pack(p, batch["input_ids"], batch["position_ids"] * 2)  # steps of 2: transformers would split them


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_log_probs_entropy_loss_and_grads_equal_padded(model_dirs, arch):
    padded, packed = _engines(model_dirs[arch], trainable=True, logits_chunk_size=5)
    assert (padded.remove_padding, packed.remove_padding) == (False, True)
    batch = make_rl_batch(padded.hf_model.config.vocab_size, batch_size=7, lp=6, lr=9, seed=3)
    mask = batch["attention_mask"][:, -9:].bool()
    want_lp, want_ent = padded.compute_log_probs(batch, with_entropy=True, micro_batch_size=7)
    for kwargs in ({"micro_batch_size": 7}, {"micro_batch_size": 3}, {"max_tokens": 30}):
        lp, ent = packed.compute_log_probs(batch, with_entropy=True, **kwargs)
        torch.testing.assert_close(lp[mask], want_lp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[mask], want_ent[mask], atol=1e-5, rtol=0)
        assert not lp[~mask].any()  # padding comes back as 0
    m_pad, g_pad = _grads(padded, batch, micro_batch_size=7)
    m_pack, g_pack = _grads(packed, batch, micro_batch_size=7)
    assert m_pack["loss"] == pytest.approx(m_pad["loss"], abs=1e-5)
    for name, g in g_pad.items():
        torch.testing.assert_close(g_pack[name], g, atol=1e-5, rtol=1e-4, msg=name)
    assert max(float(g.abs().max()) for g in g_pad.values()) > 0


def test_packed_values_and_scores_equal_padded(model_dirs):
    batch = make_rl_batch(60, batch_size=5, lp=6, lr=8, seed=4)
    pad_c, pack_c = _engines(model_dirs["llama"], load_critic)
    mask = batch["attention_mask"][:, -8:].bool()
    torch.testing.assert_close(
        pack_c.compute_values(batch)[mask], pad_c.compute_values(batch)[mask], atol=1e-5, rtol=0
    )
    pad_r, pack_r = _engines(model_dirs["llama"], load_reward_model)
    torch.testing.assert_close(pack_r.compute_scores(batch), pad_r.compute_scores(batch), atol=1e-5, rtol=0)


def test_real_token_budget_keeps_accumulation_exact(model_dirs):
    """With padding removed the budget counts real tokens; any split accumulates to the one-batch gradient."""
    engine = TrainEngine(load_causal_lm(model_dirs["qwen2"]), EngineConfig(remove_padding=True))
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=8, lp=6, lr=10, seed=5)
    groups = plan_micro_batches(batch, max_tokens=40, real_tokens=True)
    assert len(groups) > 2
    for mb in split_micro_batches(batch, groups):
        assert int(mb["attention_mask"].sum()) <= 40 or len(mb) == 1
    padded_groups = plan_micro_batches(batch, max_tokens=40)
    assert len(groups) <= len(padded_groups)  # never more passes for the same budget
    m_full, g_full = _grads(engine, batch, micro_batch_size=8)
    m, g = _grads(engine, batch, max_tokens=40)
    assert m["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-6)
    for name, grad in g_full.items():
        torch.testing.assert_close(g[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_types_that_cannot_pack_are_refused(model_dirs, tmp_path):
    assert resolve_remove_padding(None, "gpt2") is False and resolve_remove_padding(None, "qwen2") is True
    with pytest.raises(ValueError, match="'gpt2' cannot run packed sequences"):
        resolve_remove_padding(True, "gpt2")
    base = [f"model.path={model_dirs['gpt2']}", "data.dataset=synthetic:arithmetic", "algorithm.name=grpo",
            "rollout.n=2", "resources.device=cpu"]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "model.remove_padding=true"])
    assert e.value.errors == [
        "model.remove_padding: true, but model.path is a 'gpt2' model, which cannot run packed sequences "
        "(supported: llama, qwen2, qwen3, mistral); set it to false or null"
    ]
    assert load_config(None, base).model.remove_padding is None  # null: off for gpt2, no error


def _eos_prone(model_dir):
    """The model with lm_head's EOS row along its mean hidden state: EOS comes ~15% of tokens, so responses
    stop at random lengths (natural EOS) within a few tokens, as an untrained model's would not."""
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        hidden = model.model(torch.randint(3, model.config.vocab_size, (8, 24))).last_hidden_state.mean(
            (0, 1)
        )
        model.lm_head.weight[model.config.eos_token_id] = hidden / hidden.norm()
    model.save_pretrained(model_dir)
    return model_dir


def test_grpo_run_packed_equals_padded(ray_cluster, tmp_path):
    """A 2-step GRPO run (KL loss, entropy logged) at natural EOS through the trainer: removing padding
    changes no metric."""
    from hybridflow.trainers import build_trainer
    from tests.trainers.configs import tiny_config

    torch.manual_seed(0)
    model_dir = _eos_prone(save_tiny_model(tmp_path / "qwen2", "tiny", "qwen2", seed=2))
    digits = f"reward.fn={Path(__file__).parents[1] / 'trainers' / 'rewards.py'}:digit_reward"
    runs = {}
    for flag in ("false", "true"):
        cfg = tiny_config(model_dir, tmp_path / flag, "grpo", f"model.remove_padding={flag}", digits,
                          "rollout.response_length=12", "algorithm.use_kl_loss=true", "trainer.val_before_train=false")  # fmt: skip
        with build_trainer(cfg) as trainer:
            runs[flag] = trainer.fit()
    keys = (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/kl_loss",
        "actor/entropy",
        "reward/mean",
        "response_length/mean",
    )
    for padded, packed in zip(runs["false"][1:], runs["true"][1:], strict=True):
        for key in keys:
            assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert (
        runs["true"][-1]["actor/kl_loss"] > 0
    )  # the second step's policy moved: the numbers are not trivial


def test_packs_only_micro_batches_with_enough_padding(model_dirs, monkeypatch):
    """packing.MIN_PADDING_TO_PACK: a micro-batch with no padding runs padded, one at natural EOS runs as one
    packed row with attention per sequence (engines/varlen.py); both give the padded engine's loss and grads."""
    padded, packed = _engines(model_dirs["llama"], trainable=True)
    assert packed.hf_model.config._attn_implementation == varlen.NAME
    vocab = padded.hf_model.config.vocab_size
    full = make_rl_batch(vocab, batch_size=6, lp=5, lr=7, seed=6)
    full["attention_mask"][:] = 1
    full["response_mask"][:] = 1
    full["position_ids"] = position_ids_from_mask(full["attention_mask"])
    natural = make_rl_batch(vocab, batch_size=6, lp=5, lr=7, seed=6)
    assert not worth_packing(full["attention_mask"]) and worth_packing(natural["attention_mask"])
    rows = []  # rows of each packed plan (a spy on the real function)
    real_plan = packing.plan
    monkeypatch.setattr(packing, "plan", lambda *a: rows.append(real_plan(*a).rows) or real_plan(*a))
    for batch, want_rows in ((full, []), (natural, [1])):
        rows.clear()
        m_pad, g_pad = _grads(padded, batch, micro_batch_size=6)
        m_pack, g_pack = _grads(packed, batch, micro_batch_size=6)
        assert rows == want_rows  # the padded forward, or every sequence in one packed row
        assert m_pack["loss"] == pytest.approx(m_pad["loss"], rel=1e-6)
        for name, g in g_pad.items():
            torch.testing.assert_close(g_pack[name], g, atol=1e-6, rtol=1e-5, msg=name)
