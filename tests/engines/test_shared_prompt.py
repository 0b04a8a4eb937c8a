"""Shared prompts (engines/shared_prompt.py, model.share_prompt): rows of a packed micro-batch with the same
prompt compute it once, and log-probs, entropy, values, scores and every parameter's gradient stay those
of the unshared packed forward and of the padded one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rl_data import pg_loss

from hybridflow.batch import Batch, position_ids_from_mask
from hybridflow.config import ConfigError, load_config
from hybridflow.engines import EngineConfig, TrainEngine, shared_prompt
from hybridflow.models import load_causal_lm, load_critic, load_reward_model
from hybridflow.models.tiny import random_rl_batch, save_tiny_model

PROMPT_LENS = (7, 4, 2)  # three groups of N rows, then one singleton with a prompt of its own
N, LP, LR, SINGLE = 4, 7, 9, 5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_prompt_models")
    return {a: save_tiny_model(root / a, "tiny", a, seed=2) for a in ("llama", "qwen2", "gpt2")}


def grouped_batch(vocab: int, seed: int = 0) -> Batch:
    """3 groups x N rows sharing a left-padded prompt (lengths PROMPT_LENS) + 1 singleton; responses of
    random lengths in 1..LR (right-padded; row 1 at the cap), random advantages: random_rl_batch's layout
    with its prompts overwritten by the groups'."""
    plens = [p for p in PROMPT_LENS for _ in range(N)] + [SINGLE]
    rows = len(plens)
    batch = random_rl_batch(vocab, batch_size=rows, lp=LP, lr=LR, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros_like(batch["prompts"])
    for i, p in enumerate(plens):
        if i % N == 0 or i == rows - 1:  # a new prompt; the rest of a group copies it
            prompt = torch.randint(3, vocab, (p,), generator=g)
        prompts[i, LP - p :] = prompt
    rm, responses, advantages = batch["response_mask"], batch["responses"], batch["advantages"]
    rm[1] = 1  # one row at the response cap
    responses[1] = torch.randint(3, vocab, (LR,), generator=g)
    advantages[1] = torch.randn(LR, generator=g)
    attn = torch.cat([(prompts != 0).long(), rm], 1)
    batch["prompts"] = prompts
    batch["input_ids"] = torch.cat([prompts, responses], 1)
    batch["attention_mask"] = attn
    batch["position_ids"] = position_ids_from_mask(attn)
    return batch


def _engines(path, loader=load_causal_lm, trainable=False):
    """The same weights behind a padded, a packed and a packed-with-shared-prompts engine."""
    engines = []
    for remove, share in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        cfg = EngineConfig(remove_padding=remove, share_prompt=share, logits_chunk_size=5)
        engines.append(TrainEngine(loader(path), cfg, trainable=trainable))
    return engines


def test_groups_found_by_content_in_any_order():
    batch = grouped_batch(50)
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(1))
    shuffled = batch.index(perm)
    groups = shared_prompt.prompt_groups(
        shuffled["attention_mask"][:, :LP].bool(),
        shuffled["input_ids"][:, :LP],
        shuffled["position_ids"][:, :LP],
    )
    want = sorted(sorted(perm.argsort()[i * N : (i + 1) * N].tolist()) for i in range(3))
    assert sorted(sorted(g) for g in groups if len(g) > 1) == want
    assert sum(len(g) == 1 for g in groups) == 1
    p = shared_prompt.plan(shuffled["attention_mask"], shuffled["input_ids"], shuffled["position_ids"], LR)
    assert p.saved == sum(PROMPT_LENS) * (N - 1)
    assert p.cols == int(batch["attention_mask"].sum()) - p.saved  # every real token once, nothing else


def test_groups_match_prompts_wherever_their_run_sits():
    """Rows equal by their attended tokens and positions, not by column: the same prompt padded to another
    offset joins its group; an empty prompt, or one whose positions differ, does not. Groups in order of
    first appearance, rows ascending."""
    mask = torch.tensor([[0, 1, 1], [1, 1, 0], [0, 1, 1], [0, 0, 0], [0, 1, 1], [0, 0, 0], [0, 0, 1]]).bool()
    ids = torch.tensor([[9, 5, 6], [5, 6, 9], [0, 5, 6], [0, 0, 0], [0, 5, 6], [0, 0, 0], [0, 0, 5]])
    pos = torch.tensor([[0, 0, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0], [0, 1, 2], [0, 0, 0], [0, 0, 0]])
    assert shared_prompt.prompt_groups(mask, ids, pos) == [[0, 1, 2], [3], [4], [5], [6]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_log_probs_entropy_and_grads_equal_unshared_and_padded(model_dirs, arch):
    padded, packed, shared = _engines(model_dirs[arch], trainable=True)
    assert (packed.share_prompt, shared.share_prompt) == (False, True)
    batch = grouped_batch(padded.hf_model.config.vocab_size, seed=3)
    mask = batch["attention_mask"][:, -LR:].bool()
    rows = len(batch)
    want_lp, want_ent = padded.compute_log_probs(batch, with_entropy=True, micro_batch_size=rows)
    for engine in (packed, shared):
        lp, ent = engine.compute_log_probs(batch, with_entropy=True, micro_batch_size=rows)
        torch.testing.assert_close(lp[mask], want_lp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[mask], want_ent[mask], atol=1e-5, rtol=0)
        assert not lp[~mask].any() and not ent[~mask].any()  # padding comes back as 0
    assert shared.take_shared_prompt_tokens() == sum(PROMPT_LENS) * (N - 1)
    assert packed.take_shared_prompt_tokens() == 0
    grads = {}
    for name, engine in (("padded", padded), ("packed", packed), ("shared", shared)):
        metrics = engine.forward_backward(batch, pg_loss, with_entropy=True, micro_batch_size=rows)
        grads[name] = (metrics, dict(engine.iter_full_grads()))
    assert shared.take_shared_prompt_tokens() == sum(PROMPT_LENS) * (N - 1)
    (m_pack, g_pack), (m_share, g_share) = grads["packed"], grads["shared"]
    assert m_share["loss"] == pytest.approx(m_pack["loss"], abs=1e-5)
    assert m_share["loss"] == pytest.approx(grads["padded"][0]["loss"], abs=1e-5)
    for name, g in g_pack.items():
        torch.testing.assert_close(g_share[name], g, atol=1e-4, rtol=1e-4, msg=name)
        torch.testing.assert_close(g_share[name], grads["padded"][1][name], atol=1e-4, rtol=1e-4, msg=name)
    assert max(float(g.abs().max()) for g in g_pack.values()) > 0


def test_shared_grads_under_activation_checkpointing(model_dirs):
    """Recomputing each decoder layer in backward takes the shared attention again (same kwargs)."""
    engines = []
    for share in (False, True):
        torch.manual_seed(0)
        cfg = EngineConfig(remove_padding=True, share_prompt=share, gradient_checkpointing=True)
        engines.append(TrainEngine(load_causal_lm(model_dirs["llama"]), cfg))
    batch = grouped_batch(engines[0].hf_model.config.vocab_size, seed=6)
    grads = [
        dict(e.iter_full_grads()) for e in engines if e.forward_backward(batch, pg_loss, micro_batch_size=13)
    ]
    assert engines[1].take_shared_prompt_tokens() == sum(PROMPT_LENS) * (N - 1)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-4, rtol=1e-4, msg=name)


def test_shuffled_rows_split_groups_and_unique_prompts(model_dirs):
    """Rows in any order give the same per-row outputs; a group split over micro-batches shares within each;
    a micro-batch with no repeated prompt takes the unshared path."""
    _, packed, shared = _engines(model_dirs["llama"])
    batch = grouped_batch(packed.hf_model.config.vocab_size, seed=4)
    want, _ = packed.compute_log_probs(batch, micro_batch_size=len(batch))
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(2))
    mask = batch["attention_mask"][:, -LR:].bool()
    shared.take_shared_prompt_tokens()
    lp, _ = shared.compute_log_probs(batch.index(perm), micro_batch_size=len(batch))
    torch.testing.assert_close(lp[mask[perm]], want[perm][mask[perm]], atol=1e-5, rtol=0)
    assert shared.take_shared_prompt_tokens() == sum(PROMPT_LENS) * (N - 1)
    lp, _ = shared.compute_log_probs(batch, micro_batch_size=3)  # groups of 4 over micro-batches of 3
    torch.testing.assert_close(lp[mask], want[mask], atol=1e-5, rtol=0)
    assert 0 < shared.take_shared_prompt_tokens() < sum(PROMPT_LENS) * (N - 1)
    unique = batch.index(torch.tensor([0, 4, 8, 12]))  # one row of each prompt
    assert (
        shared_prompt.plan(unique["attention_mask"], unique["input_ids"], unique["position_ids"], LR) is None
    )
    lp, _ = shared.compute_log_probs(unique, micro_batch_size=4)
    u_mask = unique["attention_mask"][:, -LR:].bool()
    torch.testing.assert_close(lp[u_mask], want[[0, 4, 8, 12]][u_mask], atol=1e-5, rtol=0)
    assert shared.take_shared_prompt_tokens() == 0


def test_group_without_padding_is_packed_for_its_shared_prompt(model_dirs):
    """A micro-batch of one group with no padding at all runs padded unshared (packing.MIN_PADDING_TO_PACK),
    but packed with its prompt computed once: the tokens saved count as padding would."""
    padded, packed, shared = _engines(model_dirs["llama"], trainable=True)
    batch = grouped_batch(padded.hf_model.config.vocab_size, seed=7).index(torch.arange(N))  # prompt len LP
    batch["attention_mask"][:, LP:] = 1
    batch["response_mask"][:] = 1
    batch["position_ids"] = position_ids_from_mask(batch["attention_mask"])
    batch["advantages"] = torch.randn(N, LR, generator=torch.Generator().manual_seed(0))
    assert bool(batch["attention_mask"].all())
    want, _ = padded.compute_log_probs(batch, micro_batch_size=N)
    for engine, saved in ((packed, 0), (shared, LP * (N - 1))):
        lp, _ = engine.compute_log_probs(batch, micro_batch_size=N)
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)
        assert engine.take_shared_prompt_tokens() == saved
    g_pad, g_share = (dict(e.iter_full_grads()) for e in (padded, shared)
                      if e.forward_backward(batch, pg_loss, micro_batch_size=N))  # fmt: skip
    for name, g in g_pad.items():
        torch.testing.assert_close(g_share[name], g, atol=1e-4, rtol=1e-4, msg=name)


def test_shared_values_and_scores_equal_unshared(model_dirs):
    batch = grouped_batch(60, seed=5)
    mask = batch["attention_mask"][:, -LR:].bool()
    _, pack_c, share_c = _engines(model_dirs["llama"], load_critic)
    torch.testing.assert_close(
        share_c.compute_values(batch)[mask], pack_c.compute_values(batch)[mask], atol=1e-5, rtol=0
    )
    assert share_c.take_shared_prompt_tokens() > 0
    _, pack_r, share_r = _engines(model_dirs["llama"], load_reward_model)
    torch.testing.assert_close(share_r.compute_scores(batch), pack_r.compute_scores(batch), atol=1e-5, rtol=0)
    assert share_r.take_shared_prompt_tokens() > 0


def test_share_prompt_without_padding_removal_is_refused(model_dirs):
    with pytest.raises(ValueError, match="share_prompt=true needs padding removal"):
        TrainEngine(
            load_causal_lm(model_dirs["llama"]), EngineConfig(remove_padding=False, share_prompt=True)
        )
    base = [f"model.path={model_dirs['llama']}", "data.dataset=synthetic:arithmetic", "algorithm.name=grpo",
            "rollout.n=2", "resources.device=cpu"]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "model.remove_padding=false", "model.share_prompt=true"])
    assert len(e.value.errors) == 1 and e.value.errors[0].startswith("model.share_prompt: true needs padding")
    assert load_config(None, [*base, "model.remove_padding=false"]).model.share_prompt is None
    gpt2 = [
        f"model.path={model_dirs['gpt2']}",
        *base[1:],
    ]  # padding removal null: off for a model that cannot pack
    with pytest.raises(ConfigError) as e:
        load_config(None, [*gpt2, "model.share_prompt=true"])
    assert e.value.errors == [
        "model.share_prompt: true, but model.path is a 'gpt2' model, which cannot run packed sequences "
        "(supported: llama, qwen2, qwen3, mistral); set it to false or null"
    ]


def test_grpo_run_shared_equals_unshared(ray_cluster, tmp_path):
    """A 2-step GRPO run (n=4, KL loss, entropy logged) at natural EOS through the trainer: sharing the prompts
    changes no metric, and the update reports the prompt tokens it did not compute."""
    from test_packing import _eos_prone

    from hybridflow.trainers import build_trainer
    from tests.trainers.configs import tiny_config

    torch.manual_seed(0)
    model_dir = _eos_prone(save_tiny_model(tmp_path / "qwen2", "tiny", "qwen2", seed=2))
    digits = f"reward.fn={Path(__file__).parents[1] / 'trainers' / 'rewards.py'}:digit_reward"
    runs = {}
    for flag in ("false", "true"):
        cfg = tiny_config(model_dir, tmp_path / flag, "grpo", f"model.share_prompt={flag}", digits,
                          "rollout.n=4", "rollout.response_length=12", "actor.micro_batch_size_per_device=8", "algorithm.use_kl_loss=true",
                          "trainer.val_before_train=false")  # fmt: skip
        with build_trainer(cfg) as trainer:
            runs[flag] = trainer.fit()
    keys = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "reward/mean",
            "response_length/mean")  # fmt: skip
    for plain, shared in zip(runs["false"], runs["true"], strict=True):
        for key in keys:
            assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
        assert plain["perf/actor_shared_prompt_tokens"] == 0
    # the updates' packed micro-batches (those > 5% padding) computed each prompt once
    assert sum(m["perf/actor_shared_prompt_tokens"] for m in runs["true"]) > 0
    assert (
        runs["true"][-1]["actor/kl_loss"] > 0
    )  # the second step's policy moved: the numbers are not trivial
