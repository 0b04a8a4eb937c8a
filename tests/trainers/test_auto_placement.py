"""The trainer carries out auto-mapping plans: `resources.placement: auto` or a plan file.

Without Ray: config -> planner inputs, plan -> pools / roles / per-role parallel sizes, role-name
mapping, skipped models, `auto` planning only layouts the engines run, and every refusal with its
message. With a local Ray cluster: a plan file
for 4 CPU devices and `auto` on 2 each build the planned pools and dp sizes and run a GRPO step on
the tiny model.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridflow.config import ConfigError, validate_config
from hybridflow.planner import ClusterSpec, ModelSpec, Plan, WorkloadSpec, build_dataflow, plan
from hybridflow.planner.plan import build_plan
from hybridflow.planner.profile import DeviceProfile
from hybridflow.planner.search import search, strategy_name
from hybridflow.planner.specs import get_device
from hybridflow.trainers import Placement, build_trainer
from hybridflow.trainers.auto_placement import (
    ENGINE_LIMITS,
    PromptLengths,
    build_planner_cluster,
    build_planner_dataflow,
    build_planner_workload,
    check_plan,
    config_limits,
    device_entry,
    plan_for_config,
)
from hybridflow.trainers.placement import placement_from_plan, role_config

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
KL_LOSS = "algorithm.use_kl_loss=true"


def _tiny_plan(
    model_dir,
    algorithm: str,
    devices: int,
    reward_model: bool = False,
    old_log_probs: str = "actor",
    strategy: str | None = None,
) -> Plan:
    """What `hybridflow plan --model-config DIR --gpu cpu --gpus N` computes,
    for the tiny test run (old_log_probs="actor": with an actor forward for old log-probs, as the
    trainer runs when it takes several optimizer steps; the CLI derives "free" for this one-step batch).
    `strategy` (e.g. "standalone"): that placement's best plan instead of the fastest one (for 8 rows the
    fastest colocates every model at d = 4; the tests of pools of their own ask for standalone)."""
    model = ModelSpec.from_hf_config(model_dir)
    df = build_dataflow(algorithm, model, reward_model=reward_model, old_log_probs=old_log_probs)
    wl = WorkloadSpec(  # tests/trainers/configs.py's batch and the config's default micro-batch sizes
        prompts=4, samples_per_prompt=2, prompt_len=16, response_len=4, mini_batches=1,
        micro_batch_size=4, inference_micro_batch_size=8,
    )  # fmt: skip
    cluster = ClusterSpec.build("cpu", devices, devices)
    if strategy is None:
        return plan(df, cluster, wl, limits=ENGINE_LIMITS)
    roles = list(df.roles)
    named = [
        r
        for r in search(df, cluster, wl, ENGINE_LIMITS)
        if strategy_name([list(s) for s in r.placement], roles) == strategy
    ]
    return build_plan(df, cluster, wl, named[:1], ENGINE_LIMITS)


def _with_model(plan_: Plan, role: str, **changes) -> Plan:
    out = copy.deepcopy(plan_)
    out.models = [replace(m, **changes) if m.role == role else m for m in out.models]
    return out


# ---- no Ray --------------------------------------------------------------------------------------------
def test_planner_inputs_from_the_config(make_config, tiny_model_dir):
    cfg = make_config("ppo", "data.train_batch_size=8", "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=3")
    df = build_planner_dataflow(cfg)
    assert df.algorithm == "ppo" and df.roles == ("actor", "critic")  # no KL term: no reference
    assert df.model("actor").spec == ModelSpec.from_hf_config(tiny_model_dir)
    wl = build_planner_workload(cfg)
    assert (wl.prompts, wl.samples_per_prompt, wl.prompt_len, wl.response_len) == (8, 2, 16, 4)
    assert (wl.ppo_epochs, wl.mini_batches, wl.micro_batch_size) == (3, 4, 4)
    # each worker's passes at its own section's micro-batch (the critic's values at critic's)
    cfg = make_config("ppo", "critic.micro_batch_size_per_device=64", "ref.max_tokens_per_micro_batch=100")
    wl = build_planner_workload(cfg)
    assert wl.for_role("critic").inference_micro_batch_size == 64 == wl.for_role("critic").micro_batch_size
    assert wl.for_role("reference").inference_micro_batch_size == 100 // (16 + 4)  # tokens over full rows
    assert wl.for_role("actor").inference_micro_batch_size == cfg.actor.micro_batch_size_per_device
    assert wl.shared_prompts  # a llama model: padding removed, prompts shared, as the engines resolve it
    assert not build_planner_workload(make_config("ppo", "model.share_prompt=false")).shared_prompts
    # the loaded prompts' mean prices passes that pack real tokens; padded ones compute the longest prompt,
    # the width batches are left-padded to; memory the bound
    loaded = build_planner_workload(cfg, PromptLengths(7.5, 9))
    assert (loaded.mean_prompt_len, loaded.padded_seq_len, loaded.seq_len) == (7.5, 9 + 4, 16 + 4)
    assert (wl.mean_prompt_len, wl.padded_seq_len) == (0.0, 16 + 4)  # nothing loaded: the bound
    padded = build_planner_workload(make_config("ppo", "model.remove_padding=false"), PromptLengths(7.5, 9))
    assert padded.mean_prompt_len == 0.0 and padded.packed_seq_len == 9 + 4
    assert build_planner_dataflow(make_config("rloo", KL_LOSS)).roles == ("actor", "reference")


def test_plan_becomes_pools_roles_and_layouts(make_config, tiny_model_dir):
    """A PPO plan with a reward model, run by a PPO config with a rule reward and a KL penalty: the
    reward model is skipped (its pool too, if it had one alone), names map to the trainer's roles, and
    each role's worker config carries the plan's sizes."""
    p = _tiny_plan(tiny_model_dir, "ppo", 4, reward_model=True)
    p = _with_model(p, "actor", t=2, d=p.model("actor").n_devices // 2, tg=2, checkpoint=True, offload=True)
    cfg = make_config("ppo", "algorithm.kl.in_reward=true", devices=4)
    placement = placement_from_plan(p, cfg)
    assert placement.plan is p
    assert set(placement.roles) == {"actor_rollout", "ref", "critic"}
    for role, planner_role in (("actor_rollout", "actor"), ("ref", "reference"), ("critic", "critic")):
        m = p.model(planner_role)
        assert placement.roles[role] == m.pool
        assert placement.pools[m.pool] == m.n_devices
        assert (placement.parallel[role].tp, placement.parallel[role].dp) == (m.t, m.d)
    reward_alone = [pool.name for pool in p.pools if pool.roles == ["reward"]]
    assert not set(reward_alone) & set(placement.pools)
    assert placement.num_devices == sum(pool.n_devices for pool in p.pools if pool.name not in reward_alone)
    worker_cfg = role_config(cfg, placement, "actor_rollout")
    assert (worker_cfg.actor.parallel.tp, worker_cfg.actor.parallel.dp, worker_cfg.rollout.tg) == (
        2, p.model("actor").d, 2,
    )  # fmt: skip
    assert worker_cfg.critic.parallel.dp == p.model("critic").d
    # the plan's memory choices are applied, not just planned
    assert worker_cfg.actor.gradient_checkpointing and worker_cfg.actor.offload
    assert not cfg.actor.gradient_checkpointing and not cfg.actor.offload
    assert cfg.actor.parallel.tp == 1  # the trainer's own config is untouched


def test_auto_plans_what_the_plan_api_plans(make_config, tiny_model_dir, capsys):
    """`auto` on 4 CPU devices = the plan `hybridflow plan` computes for the same model and workload:
    one optimizer step, so neither prices an actor forward for old log-probs (trainers/rl.py)."""
    cfg = make_config("grpo", KL_LOSS, "resources.placement=auto", devices=4)
    placement = Placement.from_config(cfg)
    expected = placement_from_plan(_tiny_plan(tiny_model_dir, "grpo", 4, old_log_probs="free"), cfg)
    assert (placement.pools, placement.roles, placement.parallel) == (
        expected.pools, expected.roles, expected.parallel,
    )  # fmt: skip
    # preparation is then the reference's forward alone: nothing to run beside it on a pool of its own
    assert placement.pools == {"actor+reference": 4}
    out = capsys.readouterr().out
    assert "placement planned (resources.placement=auto)" in out and "colocate" in out
    assert Plan.load(Path(cfg.run_dir) / "plan.yaml") == placement.plan  # the run records its plan


def test_auto_plans_only_layouts_the_engines_run(make_config, tmp_path):
    """A GQA model (12 heads, 2 KV heads) for GRPO on 8 CPU devices: the actor at t = 4 (KV heads
    replicated, which the paper's search allows) is refused by the engine; `auto` plans within the engines'
    limits (8 rows: t = 2 over d = 4, a replica's 2 rows one micro-batch)."""
    model_dir = tmp_path / "gqa"
    model_dir.mkdir()
    shape = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=2)
    config = dict(model_type="llama", intermediate_size=2048, vocab_size=32000, **shape)
    (model_dir / "config.json").write_text(json.dumps(config))
    cfg = make_config("grpo", KL_LOSS, f"model.path={model_dir}", "resources.placement=auto", devices=8)
    inputs = build_planner_dataflow(cfg), build_planner_cluster(cfg), build_planner_workload(cfg)
    free = _with_model(plan(*inputs), "actor", t=4, d=2)
    assert any("t=4 does not divide {'kv_heads': 2}" in e for e in check_plan(free, cfg, "auto"))
    auto = plan_for_config(cfg)
    assert auto.limits == ENGINE_LIMITS and check_plan(auto, cfg, "auto") == []
    # the synchronous placement (the run's rollout_ahead=0); the one-step-ahead search is kept beside it
    sync = plan(*inputs, limits=ENGINE_LIMITS)
    assert not auto.rollout_ahead and auto.models == sync.models and auto.ahead is not None
    for m in auto.models:
        assert m.pg == 1 and 2 % m.t == 0 and m.p * m.t * m.d == m.n_devices, m.role
    # the actor trains in p x t x d as planned
    actor = placement_from_plan(auto, cfg, "auto").parallel["actor_rollout"]
    assert (actor.pp, actor.tp, actor.pg) == (auto.model("actor").p, auto.model("actor").t, 1) == (1, 2, 1)


def test_models_the_config_does_not_use_are_skipped(make_config, tiny_model_dir):
    """GRPO with a rule reward and no KL term runs neither the plan's reward model nor its reference:
    their pools are not started."""
    p = _tiny_plan(tiny_model_dir, "grpo", 4, reward_model=True, strategy="standalone")
    assert [pool.roles for pool in p.pools] == [["actor"], ["reference"], ["reward"]]
    placement = placement_from_plan(p, make_config("grpo", devices=4))
    assert placement.pools == {"actor": p.model("actor").n_devices} and placement.num_devices == 2
    assert placement.roles == {"actor_rollout": "actor"}


def test_plan_file_errors(make_config, tiny_model_dir, tmp_path):
    missing = make_config("grpo")
    missing.resources.placement = str(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="not colocate|split|auto or an existing plan file"):
        validate_config(missing)
    with pytest.raises(FileNotFoundError, match="hybridflow plan"):
        Placement.from_config(missing)

    garbage = tmp_path / "notes.yaml"
    garbage.write_text("pools: 4\n")
    with pytest.raises(ConfigError, match="is not a plan written by `hybridflow plan`"):
        Placement.from_config(make_config("grpo", f"resources.placement={garbage}"))

    grpo4 = _tiny_plan(tiny_model_dir, "grpo", 4, strategy="standalone")
    with pytest.raises(ConfigError, match=r"no model \['critic'\].*--algorithm ppo"):
        placement_from_plan(grpo4, make_config("ppo", devices=4))
    with pytest.raises(ConfigError, match=r"needs 4 devices .* = 2; .*--gpus 2"):
        placement_from_plan(grpo4, make_config("grpo", KL_LOSS, devices=2))
    n = grpo4.model("actor").n_devices
    staged = _with_model(grpo4, "actor", p=2, t=1, d=n // 2)
    placement_from_plan(staged, make_config("grpo", devices=4))  # pipeline stages with t = 1 run
    packed = make_config("grpo", "model.remove_padding=true", devices=4)  # stages run padded rows
    with pytest.raises(
        ConfigError, match=r"the engines run no pipeline for actor .*p: 1 .*--engines builtin"
    ):
        placement_from_plan(staged, packed)
    # the tiny model has 2 KV heads: the engine cannot shard them 4 ways (the planner would replicate)
    with pytest.raises(ConfigError, match="its pool 'actor' has 2 devices, not its 4"):
        placement_from_plan(_with_model(grpo4, "actor", d=4, n_devices=4), make_config("grpo", devices=8))
    four = _with_model(grpo4, "actor", t=4, d=1, n_devices=4)
    four.pools = [replace(pool, n_devices=4) if pool.name == "actor" else pool for pool in four.pools]
    with pytest.raises(ConfigError, match=r"t=4 does not divide \{'kv_heads': 2\}"):
        placement_from_plan(four, make_config("grpo", devices=8))
    with pytest.raises(ConfigError, match="no dataflow for 'dpo'"):
        make_config("dpo", "resources.placement=auto")  # validated on load


def test_device_names_map_to_the_catalogue():
    assert device_entry("NVIDIA H200", 139.8) == "h200"
    assert device_entry("NVIDIA H100 80GB HBM3", 79.6) == "h100"
    assert device_entry("NVIDIA A100-SXM4-80GB", 79.2) == "a100-80"
    assert device_entry("NVIDIA A100-SXM4-40GB", 39.4) == "a100-40"
    with pytest.raises(ConfigError, match="--gpu ENTRY --output plan.yaml"):
        device_entry("NVIDIA GeForce RTX 4090", 24.0)


def test_gpu_is_named_without_a_cuda_call_in_the_driver(make_config, monkeypatch):
    """placement=auto on a GPU host (device cuda, or auto where torch finds a GPU): the catalogue entry
    comes from the GPU a child process names (resource_pool.gpu_info, the boundary stubbed here); the
    driver makes no torch.cuda call that opens a context (which would hold memory on GPU 0 all run)."""
    from hybridflow.controller import resource_pool
    from tests.trainers.test_strict_device import forbid_cuda_in_driver

    forbid_cuda_in_driver(monkeypatch)
    for name in ("get_device_name", "get_device_properties", "get_device_capability", "mem_get_info"):

        def forbidden(*args, _name=name, **kwargs):
            raise AssertionError(f"torch.cuda.{_name} called in the driver process")

        monkeypatch.setattr(torch.cuda, name, forbidden)
    monkeypatch.setattr(resource_pool, "gpu_info", lambda: ("NVIDIA H100 80GB HBM3", 79.6))
    for device in ("cuda", "auto"):
        cfg = make_config("grpo", KL_LOSS, f"resources.device={device}")
        assert build_planner_cluster(cfg).device.name == "h100"
    assert plan_for_config(cfg).device == "h100"
    monkeypatch.setattr(resource_pool, "gpu_info", lambda: None)
    with pytest.raises(ConfigError, match="resources.device=cuda, but this machine shows no GPU to name"):
        build_planner_cluster(make_config("grpo", KL_LOSS, "resources.device=cuda"))


def test_gpu_info_names_the_gpu_torch_sees():
    """The child process's answer, unstubbed: this machine's first GPU as torch names it, None without one."""
    from hybridflow.controller.resource_pool import gpu_info

    if not torch.cuda.is_available():
        assert gpu_info() is None
        return
    props = torch.cuda.get_device_properties(0)
    assert gpu_info() == (props.name, props.total_memory / 2**30)


def test_cpu_entry_follows_the_compute_dtype(make_config):
    """model.dtype=bfloat16 on CPU plans on the catalogue's bf16 CPU entry (faster GEMMs, 2-byte weights),
    whose predicted iteration is shorter than fp32's for the same config."""
    fp32, bf16 = make_config("grpo", KL_LOSS), make_config("grpo", KL_LOSS, "model.dtype=bfloat16")
    cpu, cpu_bf16 = build_planner_cluster(fp32).device, build_planner_cluster(bf16).device
    assert (cpu.name, cpu_bf16.name) == ("cpu", "cpu-bf16") and cpu_bf16.bytes_per_param == 2
    assert plan_for_config(bf16).iteration_seconds < plan_for_config(fp32).iteration_seconds


# ---- on a local Ray cluster ----------------------------------------------------------------------------
def _one_step(trainer) -> dict:
    trainer.global_step = 1
    batch = trainer.train_loader.next_batch()
    batch.meta.global_step = 1
    batch, metrics = trainer.train_step(batch)
    assert len(batch) == 4 * 2
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
        assert math.isfinite(metrics[key]), key
    return metrics


def _dp_sizes(group, layout: str) -> list[int]:
    return [lay.dp_size for lay in group.layouts(layout)]


def test_plan_file_runs_on_four_cpu_devices(ray_cluster, make_config, tiny_model_dir, tmp_path):
    """The plan for GRPO on 4 CPU devices (actor and reference standalone, 2 devices each)."""
    p = _tiny_plan(tiny_model_dir, "grpo", 4)
    path = p.save(tmp_path / "plan.yaml")
    cfg = make_config("grpo", DIGITS, KL_LOSS, f"resources.placement={path}", devices=4)
    with build_trainer(cfg) as trainer:
        pools = {pool.name: pool.n_devices for pool in trainer.pools}
        assert pools == {pool.name: pool.n_devices for pool in p.pools}
        actor, ref = p.model("actor"), p.model("reference")
        assert trainer.groups["actor_rollout"].world_size == actor.n_devices
        assert _dp_sizes(trainer.groups["actor_rollout"], "train") == [actor.d] * actor.n_devices
        assert _dp_sizes(trainer.groups["ref"], "ref") == [ref.d] * ref.n_devices
        assert (trainer.groups["ref"] is trainer.groups["actor_rollout"]) == (actor.pool == ref.pool)
        _one_step(trainer)
    assert Plan.load(Path(cfg.run_dir) / "plan.yaml") == p  # the run records the plan it ran


def test_plan_file_with_the_actor_in_pipeline_stages_runs(ray_cluster, make_config, tiny_model_dir, tmp_path):
    """The 4-device plan with the actor at p = 2 on its 2 devices (a layout ENGINE_LIMITS plans: any p for
    the actor, pg = 1): the trainer runs its stages, and the switch's bytes equal the formula."""
    p = _with_model(_tiny_plan(tiny_model_dir, "grpo", 4, strategy="standalone"), "actor", p=2, t=1, d=1)
    assert ENGINE_LIMITS.allows("actor", 2, 1) and p.model("actor").n_devices == 2
    cfg = make_config(
        "grpo", DIGITS, KL_LOSS, f"resources.placement={p.save(tmp_path / 'plan.yaml')}", devices=4
    )
    with build_trainer(cfg) as trainer:
        train = trainer.groups["actor_rollout"].layouts("train")
        assert [(lay.pp_rank, lay.pp_size, lay.dp_size) for lay in train] == [(0, 2, 1), (1, 2, 1)]
        metrics = _one_step(trainer)
    assert metrics["reshard/bytes_per_rank"] == metrics["reshard/formula_bytes_per_rank"] > 0


def test_auto_placement_plans_and_runs(ray_cluster, make_config, tmp_path):
    """One CPU device keeps the run cheap; what `auto` chooses on more is checked without Ray above. The
    plan is priced with a device profile (resources.planner_profile), and each step logs its predicted
    stage seconds beside the measured ones."""
    cpu = replace(
        get_device("cpu"), name="cpu-measured", measured=True, layer_overhead_s=2e-3, call_overhead_s=5e-3
    )
    profile = DeviceProfile("cpu-measured", {"float32": cpu}).save(tmp_path / "cpu.yaml")
    overrides = (
        "resources.placement=auto",
        f"resources.planner_profile={profile}",
        "trainer.val_before_train=false",
    )
    cfg = make_config("grpo", DIGITS, KL_LOSS, *overrides, devices=1)
    with build_trainer(cfg) as trainer:
        planned = trainer.placement.plan
        assert planned is not None and (planned.device, planned.num_devices) == ("cpu-measured", 1)
        # priced at the loaded prompts' mean length, below data.max_prompt_length (16)
        mean, longest = trainer.prompt_lengths()
        assert (
            0
            < planned.workload["mean_prompt_len"]
            == mean
            <= planned.workload["longest_prompt_len"]
            == longest
            < 16
        )
        assert planned.device_measured
        assert [pool.n_devices for pool in trainer.pools] == [1]
        assert trainer.groups["ref"] is trainer.groups["actor_rollout"]  # colocated: one process
        (step,) = trainer.fit(stop_after=1)
    assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["actor/kl_loss"])
    for stage in ("generation", "preparation", "training"):
        assert step[f"plan/predicted_s/{stage}"] == planned.stage_seconds[stage] > 0
        assert step[f"timing_s/stage/{stage}"] > 0
    assert step["plan/predicted_s/iteration"] == planned.iteration_seconds
    assert (
        step["plan/predicted_s/rest"] == planned.rest_seconds > 0
    )  # the profile prices the advantages' call
    # the rule reward ran in the driver (controller/timers.py): it may end the preparation, not start it
    tl = {
        k.removeprefix("timing_s/timeline/"): v for k, v in step.items() if k.startswith("timing_s/timeline/")
    }
    end = max(tl["ref/end"], tl["reward/end"])
    assert step["timing_s/stage/preparation"] == pytest.approx(end - tl["ref/start"])
    # the stages run one after another inside the step (one pool): their sum fits in it
    assert (
        sum(step[f"timing_s/stage/{s}"] for s in ("generation", "preparation", "training"))
        <= step["timing_s/step"]
    )


def test_auto_plans_no_pipeline_for_a_model_whose_stages_the_config_cannot_run(make_config):
    """config_limits: ENGINE_LIMITS (p > 1 with any t for every role) where the config runs stages; no
    pipeline for every role under padding removal (stages run padded rows), for the actor alone with a
    one-step-ahead rollout pool (its weight sync gathers an unpipelined actor) and not for the critic."""
    assert config_limits(make_config("ppo", devices=4)) == ENGINE_LIMITS
    packed = config_limits(make_config("ppo", "model.remove_padding=true", devices=4))
    assert set(dict(packed.pipeline_max_tp).values()) == {0} and not packed.allows("critic", 2, 1)
    ahead = config_limits(make_config("ppo", "trainer.rollout_ahead=1", devices=4))
    assert not ahead.allows("actor", 2, 1) and ahead.allows("critic", 2, 1)
