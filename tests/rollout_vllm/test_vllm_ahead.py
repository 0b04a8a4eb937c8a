"""trainer.rollout_ahead=1 with rollout.engine=vllm: the rollout pool's workers generate with vLLM, whose
weights change only by the weight sync (workers/weight_sync.py streams the received buckets into vLLM's
in-place reload); the behaviour log-probs of the importance weights are vLLM's. Real Ray groups, gloo,
vLLM's CPU build (runs in .venv-vllm; skipped elsewhere). The tiny Llama has head_dim 32 (vLLM's CPU
attention has no kernel for 16). The builtin engine's run of the same schedule: tests/trainers/
test_rollout_ahead.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hybridflow.models import load_causal_lm
from hybridflow.rollout.vllm_engine import available
from hybridflow.trainers import build_trainer
from tests.trainers.configs import tiny_config

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"{REASON}")

DIGITS = f"reward.fn={Path(__file__).parents[1] / 'trainers' / 'rewards.py'}:digit_reward"
AHEAD = (DIGITS, "trainer.rollout_ahead=1", "trainer.val_before_train=false", "rollout.engine=vllm")
LAG = "rollout/policy_lag"
GREEDY = {"n": 1, "temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    out = tmp_path_factory.mktemp("vllm_ahead")
    return save_tiny_model(
        out / "tiny", "tiny", "llama", seed=0, num_attention_heads=2, num_key_value_heads=2
    )


def _param_bytes(model_dir) -> int:
    model = load_causal_lm(model_dir)
    return sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())


def _greedy(trainer, prompts):
    return [
        g.generate_sequences(prompts, sampling=GREEDY) for g in (trainer.actor, trainer.groups["rollout"])
    ]


TG2 = ("resources.rollout_devices=2", "actor.parallel.tp=2", "rollout.tg=2")
LONG = pytest.mark.skipif(
    not os.environ.get("HYBRIDFLOW_VLLM_LONG"), reason="4 vLLM ranks: HYBRIDFLOW_VLLM_LONG=1"
)


@pytest.mark.parametrize(
    "tp,devices,pools",
    [
        ((), 2, {"global": 1, "rollout": 1}),
        # rollout.tg=2: vLLM's own TP over the pool's two ranks, each loading the whole synced model
        pytest.param(TG2, 4, {"global": 2, "rollout": 2}, marks=LONG),
    ],
)
def test_vllm_rollout_pool_lags_one_step_and_loads_each_sync(
    ray_cluster, model_dir, tmp_path, tp, devices, pools
):
    cfg = tiny_config(model_dir, tmp_path, "grpo", *AHEAD, "trainer.total_steps=3", *tp, devices=devices)
    with build_trainer(cfg) as trainer:
        assert trainer.placement.pools == pools
        steps = trainer.fit()
        prompts = trainer.val_dataset.collate([trainer.val_dataset[i] for i in range(4)])
        # the last step issues nothing, so the rollout pool still holds the weights it drew step 3's
        # batch with (two updates old): vLLM's log-probs of its greedy samples differ from the actor's
        actor, stale = _greedy(trainer, prompts)
        assert (actor["rollout_log_probs"] - stale["rollout_log_probs"]).abs().max() > 1e-4
        # one more sync, and the rollout pool's vLLM samples exactly as the actor (whose colocated vLLM
        # streams the actor's weights in at every call): it would not if the sync were not loaded
        trainer.source.sync(trainer.global_step)
        actor, synced = _greedy(trainer, prompts)
        # what an importance weight compares: the actor's training forward on the pool's samples
        recomputed = trainer.actor.compute_log_prob(synced)["old_log_probs"] * synced["response_mask"]
    assert torch.equal(actor["responses"], synced["responses"])
    torch.testing.assert_close(synced["rollout_log_probs"], actor["rollout_log_probs"], atol=1e-5, rtol=0)
    # exp(actor - vLLM log-prob) is 1 within 1e-5 on the same (synced) weights: what lr=0 would log
    torch.testing.assert_close(synced["rollout_log_probs"], recomputed, atol=1e-5, rtol=0)

    assert [h[LAG] for h in steps] == [0.0, 1.0, 1.0]
    # step 2 syncs the whole model (tied embeddings once); step 1's pool holds model.path, step 3 issues nothing
    assert "sync/bytes" not in steps[0] and "sync/bytes" not in steps[-1]
    assert steps[1]["sync/bytes"] == _param_bytes(model_dir) and steps[1]["timing_s/weight_sync"] > 0
    # lag 0: the pool's vLLM (model.path, loaded when it was built) sampled with the actor's own weights
    assert abs(steps[0]["actor/is_weight_mean"] - 1) < 1e-5 and steps[0]["actor/is_weight_clipfrac"] == 0
    for h in steps:
        assert 0 < h["actor/is_weight_mean"] <= 2.0 and 0 <= h["actor/is_weight_clipfrac"] <= 1
    assert any(abs(h["actor/is_weight_mean"] - 1) > 1e-4 for h in steps[1:])  # lag 1: the policy moved


def _comparable(row: dict) -> dict:
    return {
        k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/")) and not k.endswith("_time_s")
    }


@LONG
def test_resume_with_the_vllm_pool_repeats_the_uninterrupted_run(ray_cluster, model_dir, tmp_path):
    """The batch in flight is in the checkpoint; the resumed run's fresh vLLM pool gets the restored actor's
    weights at its first sync (three trainers, so with the long runs)."""
    settings = (*AHEAD, "trainer.total_steps=4", "trainer.save_every=2")
    with build_trainer(tiny_config(model_dir, tmp_path, "grpo", *settings, devices=2)) as trainer:
        whole = trainer.fit()
    cfg = tiny_config(model_dir, tmp_path, "grpo", *settings, "trainer.experiment_name=parts", "trainer.resume=auto",
                      devices=2)  # fmt: skip
    with build_trainer(cfg) as trainer:
        first = trainer.fit(stop_after=2)
    with build_trainer(cfg) as trainer:
        rest = trainer.fit()
    assert [h["step"] for h in first + rest] == [1, 2, 3, 4]
    assert [h[LAG] for h in first + rest] == [0.0, 1.0, 1.0, 1.0]
    for a, b in zip(whole, first + rest, strict=True):
        assert _comparable(a) == _comparable(b), a["step"]
