"""Config tree: YAML + overrides, errors that name the key (and the nearest valid key), derived values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from hybridflow.config import (
    ConfigError,
    HybridFlowConfig,
    config_from_dict,
    config_to_dict,
    leaf_paths,
    load_config,
)
from hybridflow.config.cli import field_reference, to_yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
BASE = ["model.path=m", "data.dataset=synthetic:arithmetic"]


def _errors(overrides, path=None, **kw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, [*BASE, *overrides], check_model=False, **kw)
    return e.value.errors


def test_every_field_has_help():
    def walk(cls, prefix=""):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{prefix}{f.name} has no help string"
            sub = getattr(cls(), f.name)
            if dataclasses.is_dataclass(sub):
                walk(type(sub), prefix + f.name + ".")

    walk(HybridFlowConfig)
    ref = field_reference()
    assert "actor.optim.lr (float, default 1.0e-06)" in ref
    assert "rollout.n (int, default 1)" in ref


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algorithm: {name: grpo}\nactor:\n  optim: {lr: 1e-5}\nrollout: {n: 4}\n")
    cfg = load_config(
        p,
        [*BASE, "actor.optim.betas=[0.8, 0.9]", "rollout.n=8", "trainer.loggers=[console]"],
        check_model=False,
    )
    assert cfg.actor.optim.lr == 1e-5  # YAML 1.1 reads '1e-5' as a string: coerced to float
    assert cfg.actor.optim.betas == [0.8, 0.9]
    assert cfg.rollout.n == 8  # override beats the file
    assert cfg.trainer.loggers == ["console"]
    assert cfg.critic.optim.lr == 1e-5  # critic's own default, not the actor's
    assert cfg.algorithm.adv_estimator == "grpo"  # derived from the name
    assert cfg.critic.ppo_mini_batch_size == cfg.actor.ppo_mini_batch_size == 8
    # a one-element list from a bare string, and a nested mapping override merged into defaults
    cfg = load_config(
        None, [*BASE, "data.train_files=a.parquet", "actor.optim={lr: 2e-6}"], check_model=False
    )
    assert cfg.data.train_files == ["a.parquet"]
    assert cfg.actor.optim.lr == 2e-6 and cfg.actor.optim.grad_clip == 1.0


def test_unknown_keys_suggest_the_nearest():
    errs = _errors(["actor.optim.lrr=1", "actor.lr=1", "algoritm.name=ppo", "rollout.temprature=0.5"])
    assert "unknown key 'actor.optim.lrr' (did you mean 'actor.optim.lr'?)" in errs
    assert "unknown key 'actor.lr' (did you mean 'actor.optim.lr'?)" in errs
    assert "unknown key 'algoritm' (did you mean 'algorithm'?)" in errs
    assert "unknown key 'rollout.temprature' (did you mean 'rollout.temperature'?)" in errs
    assert len(errs) == 4  # all reported at once


def test_wrong_types_name_key_type_and_value(tmp_path):
    errs = _errors(["rollout.n=abc", "actor.gradient_checkpointing=3", "actor.optim.betas=0.9"])
    assert "rollout.n: expected int, got 'abc' (str)" in errs
    assert "actor.gradient_checkpointing: expected bool, got 3 (int)" in errs
    assert "actor.optim.betas: expected list[float], got 0.9" in errs
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  train_batch_size: 2.5\n")
    assert _errors([], path=p) == ["data.train_batch_size: expected int, got 2.5 (float)"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["data.train_batch_size=4", "actor.ppo_mini_batch_size=8"],
            "actor.ppo_mini_batch_size: 8 is larger",
        ),
        (
            ["data.train_batch_size=12", "actor.ppo_mini_batch_size=8"],
            "not divisible by 8; choose a divisor (e.g. 6)",
        ),
        (["algorithm.name=grpo", "rollout.n=1"], "rollout.n: grpo normalises rewards within a group"),
        (["algorithm.name=grop"], "algorithm.name: 'grop' is not one of"),
        (
            ["data.truncation=cut"],
            "data.truncation: 'cut' is not one of ['error', 'left', 'right', 'filter']",
        ),
        (
            ["algorithm.name=grpo", "rollout.n=2", "algorithm.adv_estimator=gae"],
            "algorithm.adv_estimator: 'gae' is not grpo's estimator ('grpo'); each algorithm has its own, "
            "so set algorithm.name=ppo or safe_rlhf instead",
        ),
        (
            ["actor.parallel.tp=2", "rollout.tg=4", "resources.n_gpus_per_node=4"],
            "rollout.tg = 4 must divide actor.parallel.tp = 2",
        ),
        (["actor.parallel.tp=3", "resources.n_gpus_per_node=4"], "actor.parallel: tp*pp = 3 does not divide"),
        (["trainer.loggers=[console, wandbb]"], "trainer.loggers: unknown logger 'wandbb'"),
        (["resources.placement=plan.json"], "resources.placement: 'plan.json' is not colocate|split|auto"),
        (["algorithm.name=sft", "trainer.overlap_phases=false"], "trainer.overlap_phases: sft has one phase"),
    ],
)
def test_inconsistent_values(overrides, expected):
    errs = _errors(overrides)
    assert any(expected in e for e in errs), errs


def test_response_length_over_model_context(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    base = [f"model.path={tmp_path}", "data.dataset=synthetic:arithmetic", "data.max_prompt_length=64"]
    load_config(None, [*base, "rollout.response_length=64"])  # exactly fits
    with pytest.raises(ConfigError, match=r"rollout.response_length: .* = 129 exceeds the model's context"):
        load_config(None, [*base, "rollout.response_length=65"])
    with pytest.raises(ConfigError, match="model.path: 'nowhere' does not exist"):
        load_config(None, ["model.path=nowhere", "data.dataset=x"])


def test_show_round_trips_and_examples_load():
    cfg = load_config(None, [*BASE, "rollout.n=3", "algorithm.name=rloo"], check_model=False)
    text = to_yaml(cfg, comments=True)
    assert "  n: 3  # responses sampled per prompt" in text
    again = config_from_dict(yaml.safe_load(text))
    assert config_to_dict(again) == config_to_dict(cfg)
    assert "actor.optim.lr" in leaf_paths() and "resources.ray_address" in leaf_paths()
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert {"grpo_tiny.yaml", "ppo_tiny.yaml"} <= set(names) and len(names) >= 6
    for p in EXAMPLES.glob("*.yaml"):
        load_config(p, check_model=False)


def test_ppo_recipe_is_the_grpo_recipe_with_a_critic():
    """docs/learning.md compares ppo_tiny.yaml with grpo_tiny.yaml on the demo task: they must differ only in the
    algorithm (the critic and its settings, GAE's gamma and lambda) and the logging/checkpoint schedule."""
    ppo, grpo = (
        config_to_dict(load_config(EXAMPLES / n, check_model=False))
        for n in ("ppo_tiny.yaml", "grpo_tiny.yaml")
    )
    assert ppo["algorithm"]["name"] == "ppo" and grpo["algorithm"]["name"] == "grpo"
    assert ppo["algorithm"]["adv_estimator"] == "gae" and ppo["actor"]["num_mini_batches"] == 1
    for section in ("model", "data", "actor", "rollout", "reward", "resources", "ref"):
        assert ppo[section] == grpo[section], section
    assert not ppo["algorithm"]["kl"]["in_reward"] and not ppo["algorithm"]["use_kl_loss"]
    assert ppo["critic"]["optim"]["lr"] == ppo["actor"]["optim"]["lr"] == 1e-3


def test_cli_show(capsys):
    from hybridflow.cli import main

    assert main(["config", "show", str(EXAMPLES / "grpo_tiny.yaml"), "rollout.n=6", "--no-validate"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["rollout"]["n"] == 6 and shown["algorithm"]["adv_estimator"] == "grpo"
    assert main(["config", "show", str(EXAMPLES / "grpo_tiny.yaml"), "rollout.m=6"]) == 2
    assert "did you mean 'rollout.n'" in capsys.readouterr().err


def test_choices_match_the_algorithms():
    """The config checks names without importing torch; they must agree with what the code accepts."""
    from hybridflow.algorithms.kl import KL_KINDS
    from hybridflow.algorithms.losses import AGG_MODES
    from hybridflow.config import algorithm_config, schema

    assert set(algorithm_config.KL_KINDS) == set(KL_KINDS)
    assert set(schema.LOSS_AGG_MODES) == set(AGG_MODES)


def test_reward_section_is_what_the_reward_executor_reads():
    """One RewardConfig: the executor takes the config tree's `reward` section as is."""
    from hybridflow.rewards import RewardConfig as ExecutorRewardConfig
    from hybridflow.rewards import RewardExecutor, RewardSpecError

    cfg = load_config(None, [*BASE, "reward.on_error=raise", "reward.timeout_s=2"], check_model=False)
    assert ExecutorRewardConfig is type(cfg.reward)
    with RewardExecutor(cfg.reward, fn="gsm8k") as ex:
        assert (ex.batched, ex.fallback, ex.cfg.timeout_s, ex.cfg.fn) == (False, None, 2.0, "gsm8k")
    assert cfg.reward.fn == ""  # the executor's overrides do not write into the config
    # reward.batched is read too: true for a per-sample function is refused at the start, not on every sample
    batched = load_config(None, [*BASE, "reward.batched=true"], check_model=False)
    with pytest.raises(RewardSpecError, match="declared batched"):
        RewardExecutor(batched.reward, fn="gsm8k")
    assert load_config(None, [*BASE, "reward.batched=null"], check_model=False).reward.batched is None


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "actor:\n  optim: {lr: 1e-5\n",
            "{path}:3:1: not valid YAML: expected ',' or '}}', but got '<stream end>' "
            "(while parsing a flow mapping at line 2, column 10)",
        ),
        ("a: b: c\n", "{path}:1:5: not valid YAML: mapping values are not allowed here"),
        (  # PyYAML alone keeps the last one silently
            "actor:\n  optim: {lr: 1e-3}\n  ppo_mini_batch_size: 4\n  optim: {lr: 2e-3}\n",
            "{path}:4:3: not valid YAML: found duplicate key 'optim' (first at line 2); keep one "
            "(in the mapping at line 2)",
        ),
        (
            "trainer:\n\tx: 1\n",
            "{path}:2:1: not valid YAML: found character '\\t' that cannot start any token "
            "(while scanning for the next token)",
        ),
    ],
)
def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.errors == [expected.format(path=path)]


def test_a_config_file_that_is_not_yaml_text_is_one_line(tmp_path):
    """Not UTF-8, a control character, a directory, nesting past the reader's recursion: one line each."""
    cases = {
        "latin1.yaml": (b"trainer:\n  experiment_name: caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 31)"),
        "bell.yaml": (b"a: \x07\n", "not valid YAML: a control character (0x07 at character 3)"),
        "deep.yaml": (
            b"a: " + b"[" * 200_000,
            "not valid YAML: nested deeper than the reader's recursion limit",
        ),
    }
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError) as info:
            load_config(str(tmp_path / name))
        assert info.value.errors == [f"{tmp_path / name}: {why}"]
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path))
    assert info.value.errors == [f"config file {str(tmp_path)!r} is a directory; name a YAML file in it"]
