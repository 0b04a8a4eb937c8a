"""The whole GPU path under device-strict mode (hybridflow/controller/strict_device.py): every worker rank
computes on the stand-in accelerator and raises on a host tensor meeting a device tensor or entering a
collective; the driver runs with torch.cuda reporting a GPU whose every stateful call raises (no CUDA call in
the driver). Tiny runs of 2 steps, each layout once (docs/operations.md, "GPU correctness on CPU"): PPO with
a critic and a reward model on 2 ranks, generating with tools at tg = 2, offloaded, with a checkpoint and a
resume; PPO with the actor and the critic on dp = 2 FSDP2 with LoRA and offload; GRPO at pp = 2 with
offload; GRPO with a rollout pool one step ahead (weight sync); SFT and DPO.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hybridflow.controller import strict_device
from hybridflow.models import load_reward_model, save_hf_model
from hybridflow.trainers import build_trainer
from tests.trainers.test_drivers import DIGITS

AGENT_FILES = Path(__file__).parents[1] / "agent" / "agent_files.py"
# multi-turn rollouts: a tool call at each turn's first digit, its output inserted as tokens
AGENT = ("rollout.response_length=16", "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=3",
         f"rollout.multi_turn.tools=[{AGENT_FILES}:echo]", f"rollout.multi_turn.parser={AGENT_FILES}:digit_parser",
         "rollout.multi_turn.tool_response_template=<r>{output}</r>")  # fmt: skip

# torch.cuda calls that initialise CUDA or touch a device's state: each opens a context on a GPU host
# (torch.manual_seed's torch.cuda.manual_seed_all is queued until CUDA initialises, so it is not one)
CUDA_STATE_CALLS = ("_lazy_init", "init", "current_device", "set_device", "synchronize", "get_rng_state",
                    "get_rng_state_all", "set_rng_state", "set_rng_state_all", "empty_cache", "memory_allocated",
                    "max_memory_allocated")  # fmt: skip


def forbid_cuda_in_driver(monkeypatch) -> None:
    """This process (the driver) sees a GPU host: is_available() is true, and each stateful call raises."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in CUDA_STATE_CALLS:

        def forbidden(*args, _name=name, **kwargs):
            raise AssertionError(f"torch.cuda.{_name} called in the driver process")

        monkeypatch.setattr(torch.cuda, name, forbidden)


@pytest.fixture
def strict(monkeypatch):
    """Strict worker groups, and a driver that must not touch CUDA."""
    monkeypatch.setenv(strict_device.ENV, "1")
    forbid_cuda_in_driver(monkeypatch)


@pytest.fixture
def reward_model_dir(tiny_model_dir, tmp_path):
    torch.manual_seed(3)
    return save_hf_model(load_reward_model(tiny_model_dir), tmp_path / "rm")


def _fit(cfg, **kw) -> list[dict]:
    with build_trainer(cfg) as trainer:
        return trainer.fit(**kw)


def _finite(history: list[dict], *keys: str) -> None:
    for key in keys:
        values = [h[key] for h in history if key in h]
        assert values and all(math.isfinite(v) for v in values), (key, values)


def test_ppo_with_critic_and_reward_model_on_two_ranks_then_resume(
    strict, ray_cluster, make_config, reward_model_dir
):
    """Generate (colocated, 2 ranks: the reshard metrics' all-reduce) through the agent loop's continuous
    batch with tool calls in a tg = 2 group, old / ref log-probs, values, scores, critic and actor updates,
    a checkpoint at step 1 and a resume that runs step 2; the actor and the reference offloaded (the
    actor's moments saved from and loaded into the host tier)."""
    args = ("reward.kind=model", f"model.reward_model_path={reward_model_dir}", "algorithm.use_kl_loss=true",
            "actor.ppo_mini_batch_size=2", "trainer.val_before_train=false", "actor.parallel.tp=2", "rollout.tg=2",
            "actor.offload=true", "ref.offload=true", *AGENT)  # fmt: skip
    first = _fit(make_config("ppo", *args, devices=2), stop_after=1)
    assert [h["step"] for h in first] == [1]
    _finite(first, "actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "reward/mean")
    assert first[0]["agent/tool_calls/mean"] > 0 and first[0]["agent/tool_tokens/mean"] > 0
    second = _fit(make_config("ppo", *args, "trainer.resume=auto", devices=2))
    assert [h["step"] for h in second] == [2]  # step 1 read back from its checkpoint, step 2 run
    _finite(second, "actor/pg_loss", "critic/vf_loss", "actor/grad_norm")
    assert second[0]["perf/actor_offload_bytes"] > 0


def test_grpo_with_a_rollout_pool_one_step_ahead(strict, ray_cluster, make_config):
    """Weights synced actor -> rollout pool, the batch one step ahead, truncated importance weights."""
    cfg = make_config("grpo", DIGITS, "trainer.rollout_ahead=1", "trainer.val_before_train=false",
                      "trainer.total_steps=3", devices=2)  # fmt: skip
    history = _fit(cfg)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[1]["sync/bytes"] > 0  # the weights went actor -> rollout pool before step 3
    _finite(history, "actor/pg_loss", "actor/grad_norm", "reward/mean")


@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_offline_trainers(strict, ray_cluster, make_config, algorithm):
    cfg = make_config(
        algorithm, f"data.dataset=synthetic:arithmetic_{algorithm}", "trainer.val_before_train=false",
        "actor.micro_batch_size_per_device=2",
    )  # fmt: skip
    history = _fit(cfg)
    assert [h["step"] for h in history] == [1, 2]
    _finite(history, f"{algorithm}/loss", f"{algorithm}/grad_norm")


def test_driver_rng_capture_and_restore_make_no_cuda_call(monkeypatch):
    """G4: the driver's RNG state (trainer_state.json, restarts) on a GPU host without a CUDA call."""
    from hybridflow.checkpoint import capture_rng_state, restore_rng_state

    forbid_cuda_in_driver(monkeypatch)
    state = capture_rng_state()
    want = torch.rand(3)
    restore_rng_state(state)
    assert torch.equal(torch.rand(3), want) and "cuda" not in state


def test_ppo_fsdp_actor_and_critic_with_lora_and_offload(strict, ray_cluster, make_config):
    """dp = 2 FSDP2 for the actor and the critic (no tensor parallelism), both with LoRA adapters (the
    reference is the actor with its adapters off) and offload: each phase brings the sharded parameters and
    the moments in from the host tier and sends them out again."""
    args = ("algorithm.use_kl_loss=true", "actor.ppo_mini_batch_size=2", "trainer.val_before_train=false",
            "model.lora.rank=4", "actor.offload=true", "critic.offload=true")  # fmt: skip
    history = _fit(make_config("ppo", *args, devices=2))
    assert [h["step"] for h in history] == [1, 2]
    _finite(
        history, "actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"
    )
    assert all(h["perf/actor_offload_bytes"] > 0 and h["perf/critic_offload_bytes"] > 0 for h in history)


def test_grpo_with_the_actor_in_two_pipeline_stages_offloaded(strict, ray_cluster, make_config):
    """pp = 2 on 2 ranks: activations and gradients sent between the stages, generation switched to whole
    replicas and back, and each stage's parameters and moments offloaded between phases."""
    cfg = make_config("grpo", "trainer.val_before_train=false", "actor.parallel.pp=2", "actor.offload=true",
                      devices=2)  # fmt: skip
    history = _fit(cfg)
    assert [h["step"] for h in history] == [1, 2]
    _finite(history, "actor/pg_loss", "actor/grad_norm")
    assert all(h["perf/actor_offload_bytes"] > 0 for h in history)
