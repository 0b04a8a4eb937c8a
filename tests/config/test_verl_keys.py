"""Each verl key is mapped exactly, noted (no effect on results) or refused in one line, as docs/verl.md's
tables say (config/verl_keys.py, config/verl_rules.py); the real CLI refuses before Ray starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.verl import RENAMES
from hybridflow.config.verl_keys import NOTED, NOTED_TREES, REFUSED
from hybridflow.config.verl_rules import OUR_KEYS

BASE = ("actor_rollout_ref.model.path=m", "data.dataset=synthetic:arithmetic")
DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."


def load(*overrides: str, notes: list | None = None):
    sink = notes.append if notes is not None else lambda n: None
    return load_config(None, [*BASE, *overrides], verl=True, check_model=False, notes=sink)


def refused(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    return e.value.errors


def needs(key: str):
    """Skip while `key` (a setting another feature adds) is not in this build; the mapping refuses then."""
    return pytest.mark.skipif(key not in OUR_KEYS, reason=f"{key} lands with its feature's branch")


# the keys that used to be noted and ignored while they changed the job, and the one line each gets now
REFUSALS = [
    ("actor_rollout_ref.model.lora_adapter_path=adapter", "starting from a saved LoRA adapter is not supported yet (model.lora trains new ones); remove it or set None"),
    ("critic.model.lora_alpha=32", "the critic's adapters take model.lora's settings (verl's default here); remove it or set 16"),
    (R + "multi_turn.tool_config_path=tools.yaml", "verl's tool classes do not run here; list typed functions in rollout.multi_turn.tools; remove it or set None"),
    (R + "agent.default_agent_loop=tool_agent", "verl's agent loops do not run here; multi-turn rollouts are rollout.multi_turn (docs/rollout.md); remove it or set 'single_turn_agent'"),
    (A + "strategy=megatron", "Megatron-LM is not supported; models here train with FSDP2 sharding (strategy fsdp); remove it or set 'fsdp'"),
    ("critic.strategy=megatron", "Megatron-LM is not supported; models here train with FSDP2 sharding (strategy fsdp); remove it or set 'fsdp'"),
    (A + "fsdp_config.model_dtype=bf16", "verl keeps this model's parameters in that dtype; here trained models keep float32 ones; remove it or set 'fp32'"),
    ("reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code", "sandboxed code execution is not supported yet; remove it or set None"),
    ("data.custom_cls.path=my_dataset.py", "custom dataset classes are not supported yet (data.dataset registers one); remove it or set None"),
    (R + "do_sample=False", "for greedy training rollouts set actor_rollout_ref.rollout.temperature=0; remove it or set True"),
    (R + "use_fire_sampling=True", "no FIRE sampling: every token at the temperature; remove it or set False"),
    ("actor_rollout_ref.ref.model=other_model", "the reference is the policy's initial weights (model.path); remove it or set None"),
    (A + "clip_ratio_hgih=0.3", f"is not known here (did you mean {A}clip_ratio_high?); remove it (docs/verl.md lists them)"),
]  # fmt: skip


@pytest.mark.parametrize("override,why", REFUSALS, ids=[o.partition("=")[0] for o, _ in REFUSALS])
def test_a_key_that_changes_the_job_is_refused_in_one_line(override, why):
    key, _, value = override.partition("=")
    errors = refused(override)
    assert len(errors) == 1 and errors[0].startswith(f"verl key {key}=") and errors[0].endswith(why), errors
    assert "\n" not in errors[0]


def test_verl_values_that_keep_its_behaviour_are_accepted_with_a_note():
    notes = []
    load("actor_rollout_ref.model.lora_adapter_path=null", A + "strategy=fsdp", A + "fsdp_config.model_dtype=fp32",
         "actor_rollout_ref.ref.fsdp_config.model_dtype=bf16", R + "mode=async", R + "multi_turn.tool_config_path=null",
         "reward_model.sandbox_fusion.url=null", "critic.model.lora_alpha=16",
         "global_profiler.tool=nsys", A + "profiler.enable=True", notes=notes)  # fmt: skip
    text = "\n".join(notes)
    for key in ("lora_adapter_path=None", "actor.strategy='fsdp'", "actor.fsdp_config.model_dtype='fp32'",
                "ref.fsdp_config.model_dtype='bf16'", "rollout.mode='async'", "multi_turn.tool_config_path=None",
                "sandbox_fusion.url=None", "lora_alpha=16"):  # fmt: skip
        assert f"{key}" in text, key
    assert "verl keys global_profiler.* (1) have no effect on results here" in text
    assert "verl keys *.profiler.* (1) have no effect on results here" in text
    assert "not known here" not in text


def test_verl_multi_turn_keys_map_to_rollout_multi_turn():
    cfg = load(R + "multi_turn.enable=False", R + "multi_turn.max_assistant_turns=3", R + "multi_turn.format=hermes",
               R + "multi_turn.max_parallel_calls=2", R + "multi_turn.max_user_turns=null")  # fmt: skip
    m = cfg.rollout.multi_turn
    assert (m.enable, m.max_turns, m.parser, m.max_parallel_calls) == (False, 3, "hermes", 2)
    # enabled, it needs our tools (verl's tool classes do not run here): one line
    assert refused(R + "multi_turn.enable=True")[0].endswith(
        "needs rollout.multi_turn.tools or rollout.multi_turn.environment"
    )
    assert refused(R + "multi_turn.format=gpt-oss")[0].endswith(
        "only hermes is built in; give another as rollout.multi_turn.parser=path/file.py:function"
    )


@pytest.mark.parametrize("cli_args", [
    ["actor_rollout_ref.model.lora_adapter_path=adapter"],
    [A + "strategy=megatron", R + "multi_turn.tool_config_path=tools.yaml"],
])  # fmt: skip
def test_the_cli_refuses_in_one_line_before_ray_starts(cli_args, tmp_path):
    """The real `hybridflow train --verl ...`, as a user runs it: exit 2, one line on stderr, no Ray."""
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", "--verl", *BASE, f"trainer.default_local_dir={tmp_path}",
           *cli_args]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    # besides the versions log line, which comes first, one line: the refusal
    lines = [x for x in done.stderr.strip().splitlines() if " hybridflow.compat.versions INFO " not in x]
    assert len(lines) == 1 and lines[0].startswith("hybridflow train: invalid config: verl key "), lines
    for arg in cli_args:
        assert f"verl key {arg.partition('=')[0]}=" in lines[0]
    assert "Ray" not in done.stderr + done.stdout and not list(tmp_path.iterdir())


def test_clip_ratio_low_and_high_win_over_clip_ratio_in_any_order():
    cfg = load(A + "clip_ratio_high=0.28", A + "clip_ratio=0.1")  # verl: clip_ratio only fills unset sides
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.1, 0.28)
    cfg = load(A + "clip_ratio=0.3", A + "clip_ratio_low=0.2")
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.3)
    cfg = load(A + "clip_ratio=0.25")
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == 0.25


def _val(cfg):
    v = cfg.rollout.val
    return v.temperature, v.top_k, v.top_p


def test_validation_sampling_follows_do_sample_and_the_rollout_mode():
    temp = R + "val_kwargs.temperature=0.6"
    # verl's sync rollout: greedy unless do_sample, whatever the temperature
    assert _val(load(R + "mode=sync", temp, R + "val_kwargs.top_p=0.9")) == (0.0, -1, 1.0)
    assert _val(load(R + "mode=sync", temp, R + "val_kwargs.do_sample=True")) == (0.6, -1, 1.0)
    assert _val(load(temp, R + "val_kwargs.do_sample=True", R + "val_kwargs.top_k=20")) == (0.6, 20, 1.0)
    # verl 0.7's async agent loop samples at the val temperature and never reads do_sample
    assert _val(load(R + "mode=async", temp, R + "val_kwargs.do_sample=False")) == (0.6, -1, 1.0)
    # without the mode the two verl versions disagree: said in one line
    (error,) = refused(temp)
    assert error.startswith(f"verl key {R}val_kwargs.temperature=0.6 without val_kwargs.do_sample=True: ")
    assert (
        _val(load(R + "val_kwargs.n=4")) == (0.0, -1, 1.0) and load(R + "val_kwargs.n=4").rollout.val.n == 4
    )


def test_val_only_and_the_generation_dumps_map(tmp_path):
    cfg = load("trainer.val_only=True", f"trainer.rollout_data_dir={tmp_path}/r",
               f"trainer.validation_data_dir={tmp_path}/v")  # fmt: skip
    assert cfg.trainer.val_only and cfg.trainer.val_before_train
    assert (cfg.trainer.rollout_data_dir, cfg.trainer.validation_data_dir) == (
        f"{tmp_path}/r",
        f"{tmp_path}/v",
    )
    (error,) = refused("trainer.val_only=True", "trainer.val_before_train=False")
    assert "verl then ignores val_only and trains" in error


def test_interpolations_resolve_after_the_overrides_as_in_verl(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(
        "data: {max_prompt_length: 64, max_response_length: 32, train_batch_size: 8, dataset: synthetic:arithmetic}\n"
        "actor_rollout_ref:\n"
        "  model: {path: m, use_remove_padding: true}\n"
        "  actor:\n"
        "    ppo_mini_batch_size: 4\n"
        "    ppo_epochs: 2\n"
        "    use_remove_padding: ${oc.select:actor_rollout_ref.model.use_remove_padding,false}\n"
        "    checkpoint: {save_contents: [model], load_contents: '${.save_contents}'}\n"
        "    _target_: verl.workers.config.FSDPActorConfig\n"
        "  rollout: {name: hf, response_length: '${oc.select:data.max_response_length,512}'}\n"
        "critic: {ppo_epochs: '${oc.select:actor_rollout_ref.actor.ppo_epochs,1}', optim: {lr: 2.0e-5}}\n"
        "trainer: {project_name: p, experiment_name: e, default_local_dir: 'ckpt/${trainer.project_name}/${trainer.experiment_name}'}\n"
    )  # fmt: skip
    notes = []
    cfg = load_config(path, ["data.max_response_length=16", "actor_rollout_ref.actor.ppo_epochs=3"],
                      check_model=False, notes=notes.append)  # fmt: skip
    assert cfg.rollout.response_length == 16  # the interpolation follows the override, as in verl
    assert (cfg.actor.ppo_epochs, cfg.critic.ppo_epochs) == (3, 3)
    assert cfg.trainer.output_dir == "ckpt/p/e" and cfg.model.remove_padding is True
    assert not any("not known" in n or "_target_" in n for n in notes), notes
    path.write_text(path.read_text().replace("name: hf", "name: '???'"))
    with pytest.raises(
        ConfigError, match=f"verl key {R}name is \\?\\?\\? \\(a value verl requires\\): set it"
    ):
        load_config(path, check_model=False, notes=lambda n: None)
    path.write_text("defaults: [ppo_trainer]\nactor_rollout_ref: {model: {path: m}}\n")
    with pytest.raises(ConfigError, match="a Hydra `defaults` list is not composed here"):
        load_config(path, check_model=False)
    path.write_text("actor_rollout_ref: {model: {path: '${nowhere.at_all}'}}\n")
    with pytest.raises(ConfigError, match="verl config: actor_rollout_ref.model.path: "):
        load_config(path, check_model=False)


def test_policy_loss_modes_outside_ours_are_refused():
    (error,) = refused(A + "policy_loss.loss_mode=clip_cov")
    assert error == (f"verl key {A}policy_loss.loss_mode='clip_cov': not available here; choose one of "
                     "['vanilla', 'gspo', 'cispo', 'geo_mean']")  # fmt: skip
    load(A + "policy_loss.loss_mode=vanilla")


@needs("actor.policy_loss")
def test_policy_loss_modes_map():
    for mode in ("vanilla", "gspo", "cispo", "geo_mean"):
        assert load(A + f"policy_loss.loss_mode={mode}").actor.policy_loss == mode


def test_loss_agg_modes_map_by_prefix():
    from hybridflow.config.schema import LOSS_AGG_MODES

    for mode in ("token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        if mode not in LOSS_AGG_MODES:
            with pytest.raises(ConfigError, match="actor.loss_agg_mode"):
                load(A + f"loss_agg_mode={mode}")
            continue
        assert load(A + f"loss_agg_mode={mode}").actor.loss_agg_mode == mode


DAPO = ("algorithm.adv_estimator=grpo", R + "n=4", "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.max_num_gen_batches=5", "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=64",
        "reward_model.overlong_buffer.penalty_factor=1.0", "data.max_response_length=256")  # fmt: skip


@needs("algorithm.filter_groups.enable")
def test_dapo_keys_select_the_dapo_driver():
    cfg = load(*DAPO, "algorithm.filter_groups.metric=acc")
    assert cfg.algorithm.name == "dapo" and cfg.algorithm.filter_groups.enable
    assert (cfg.algorithm.filter_groups.metric, cfg.algorithm.filter_groups.max_num_gen_batches) == ("acc", 5)
    ob = cfg.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 64, 1.0)
    assert load(*DAPO, "algorithm.filter_groups.metric=seq_reward").algorithm.filter_groups.metric == "score"
    (error,) = refused(*DAPO, "algorithm.filter_groups.metric=score")  # verl's: before the overlong penalty
    assert error.startswith("verl key algorithm.filter_groups.metric='score': not available here")


def test_dapo_keys_verl_would_not_read_or_cannot_run_are_refused():
    (error,) = refused("algorithm.adv_estimator=grpo", "reward_model.overlong_buffer.enable=True")
    assert "reward manager 'naive' never reads it" in error
    (error,) = refused("algorithm.filter_groups.enable=True")  # gae
    assert "need algorithm.adv_estimator=grpo" in error
    if "algorithm.filter_groups.enable" not in OUR_KEYS:
        (error,) = refused("algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=True")
        assert "not available in this build" in error


RC = "algorithm.rollout_correction."


@needs("actor.rollout_correction.mode")
def test_rollout_correction_keys_map():
    def rc(*overrides):
        c = load(*overrides).actor.rollout_correction
        return c.mode, c.level, round(c.lower, 6), c.upper

    assert rc()[0] == "none"  # verl corrects nothing unless told
    assert rc(RC + "rollout_is=sequence", RC + "rollout_is_threshold=3.0") == ("tis", "sequence", 0.0, 3.0)
    assert rc(RC + "rollout_rs=seq_mean_k1", RC + "rollout_rs_threshold=0.5_2.0") == (
        "geo_mask",
        "sequence",
        0.5,
        2.0,
    )
    assert rc("algorithm.rollout_is=True", "algorithm.rollout_is_threshold=4.0", "algorithm.rollout_is_mode=mask",
              "algorithm.rollout_is_veto_threshold=null") == ("mis", "token", 0.25, 4.0)  # fmt: skip
    assert rc(A + "tis_imp_ratio_cap=2.5") == ("tis", "token", 0.0, 2.5)


def test_rollout_correction_keys_without_an_equivalent_are_refused():
    (error,) = refused(RC + "rollout_is=token", RC + "bypass_mode=True")
    assert error == f"verl key {RC}bypass_mode=True: not available here; remove it"
    (error,) = refused(RC + "rollout_rs=token_k2", RC + "rollout_rs_threshold=2.0")
    assert error.startswith(f"verl key {RC}rollout_rs='token_k2': here only seq_mean_k1")
    (error,) = refused("algorithm.rollout_is=True", "algorithm.rollout_is_threshold=2.0")
    assert error == "verl key algorithm.rollout_is_veto_threshold=0.0001: no veto here; set it to null"


# ---- docs/verl.md lists the tables' keys, and only them ----------------------------------------------
def _section_keys(title: str) -> list[str]:
    text = DOC.read_text()
    body = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)`", body, re.M)]


@pytest.mark.parametrize("title,table", [
    ("Refused unless verl would do what runs here", REFUSED),
    ("Noted: no effect on results", {**NOTED, **NOTED_TREES}),
])  # fmt: skip
def test_the_doc_lists_every_key_of_the_code_tables_and_no_other(title, table):
    listed = _section_keys(title)
    assert sorted(listed) == sorted(table), set(listed) ^ set(table)


def test_the_doc_lists_every_rename():
    listed = set(_section_keys("Renamed or converted"))
    assert not set(RENAMES) - listed, set(RENAMES) - listed


# each key of the issue ("noted and ignored while it changes the job") -> the doc section saying what it does
ISSUE_KEYS = {
    "actor_rollout_ref.model.lora_rank": "Renamed or converted",
    "actor_rollout_ref.rollout.multi_turn.enable": "Renamed or converted",
    "actor_rollout_ref.rollout.mode": "Refused unless verl would do what runs here",
    "actor_rollout_ref.actor.strategy": "Refused unless verl would do what runs here",
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "Refused unless verl would do what runs here",
    "reward_model.sandbox_fusion.url": "Refused unless verl would do what runs here",
    "data.custom_cls.path": "Refused unless verl would do what runs here",
    "trainer.val_only": "Read together",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "Read together",
    "algorithm.filter_groups.enable": "Read together",
    "actor_rollout_ref.actor.clip_ratio": "Read together",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "Read together",
}


@pytest.mark.parametrize("key,title", ISSUE_KEYS.items())
def test_each_key_of_the_issue_is_in_the_doc_section_that_says_what_happens(key, title):
    text = DOC.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    assert f"`{key}`" in text, key
    for other in ("Noted: no effect on results",):
        assert f"| `{key}` |" not in DOC.read_text().split(f"## {other}\n", 1)[1].split("\n## ", 1)[0]


def test_rollout_and_validation_dirs_are_our_keys():
    # verl's trainer.rollout_data_dir / validation_data_dir / val_only move by prefix: same meaning, our keys
    assert {"trainer.rollout_data_dir", "trainer.validation_data_dir", "trainer.val_only"} <= OUR_KEYS


def test_a_mapping_that_is_one_setting_is_read_whole():
    cfg = load("data.dataset_kwargs={num_samples: 8, val_size: 3}", "reward_model.reward_manager=naive")
    assert cfg.data.dataset_kwargs == {"num_samples": 8, "val_size": 3}
    (error,) = refused("actor_rollout_ref.model.override_config={attn_implementation: eager}")
    assert error.startswith(
        "verl key actor_rollout_ref.model.override_config={'attn_implementation': 'eager'}: "
    )
