"""Every numeric setting has a declared domain (hybridflow/fields.py), and every bad value of every one of
them is refused in one line before Ray starts -- or is listed here with why it is a value that runs.

The property test walks every numeric leaf of the config tree and loads examples/configs/grpo_tiny.yaml
(with a real tiny model directory) with the leaf set to NaN, +inf, -inf, -1, 0, 10**30 and a string, through
the loader's dotted overrides: what `hybridflow train` does before it starts Ray. Each outcome is a
ConfigError whose lines each name the key, or an entry of ALLOWED with its reason; an entry that is refused
fails too, so the list stays exactly the values that run.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import shutil
import typing

import pytest
import yaml

from hybridflow.config.loader import key_type, leaf_paths, load_config
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.errors import ConfigError

BASE = "examples/configs/grpo_tiny.yaml"
# label -> the override's value (YAML); list leaves (optim.betas) get it as their first item
VALUES = {
    "nan": ".nan",
    "+inf": ".inf",
    "-inf": "-.inf",
    "-1": "-1",
    "0": "0",
    "huge": str(10**30),
    "str": "abc",
}

_OFF = "0 turns it off, or derives it, as its help says"
_COEF = "a finite weight, bound or rate: any size is a setting (a diverging update is stopped by max_skipped_steps)"
_RUNS_LONGER = (
    "a count of steps, passes or attempts, or an interval: a larger one runs longer, or never comes"
)
_CAP = "a cap that something smaller bounds anyway (the batch, the data, rollout.response_length)"
_UNUSED = "read only with its feature on (overlong_buffer.enable, a Safe-RLHF run)"
# label -> {key pattern (fnmatch) -> why the value runs}
ALLOWED: dict[str, dict[str, str]] = {
    "0": {
        "algorithm.gamma": "no discount beyond the step", "algorithm.lam": "GAE(0): one-step TD",
        "algorithm.kl.coef": _OFF, "algorithm.kl_loss_coef": _OFF, "algorithm.entropy_coeff": _OFF,
        "algorithm.filter_groups.max_num_gen_batches": "0 = unlimited (verl's convention)",
        "algorithm.safe_rlhf.*": "a Lagrangian with no cost budget, multiplier or step: a (Safe-RLHF) setting",
        "algorithm.dpo.label_smoothing": "plain DPO", "algorithm.sft.max_length": _OFF,
        "model.lora.rank": _OFF, "model.lora.alpha": "adapters scaled to nothing: trains nothing, as lr=0",
        "model.lora.dropout": "no dropout", "data.val_batch_size": _OFF, "*seed": "a seed",
        "*.optim.lr": "0 freezes the model", "*.optim.weight_decay": _OFF, "*.optim.warmup_steps": _OFF,
        "*.optim.min_lr_ratio": "decay to 0", "*.optim.total_steps": _OFF, "*.optim.grad_clip": _OFF,
        "*.optim.betas": "beta1 = 0: Adam without momentum (RMSProp-like)",
        "*.max_tokens_per_micro_batch": _OFF, "*.num_mini_batches": _OFF, "*.parallel.dp": _OFF,
        "critic.ppo_mini_batch_size": _OFF, "critic.ppo_epochs": _OFF,
        "actor.clip_ratio_[lh]*": "a closed trust region: the ratio clipped at 1",
        "actor.rollout_correction.lower": _OFF, "rollout.*temperature": "greedy", "rollout.*top_k": _OFF,
        "rollout.micro_batch_size_per_device": _OFF, "rollout.cpu_threads": _OFF,
        "rollout.gpu_memory_utilization": _OFF, "reward.num_workers": "scored in-process",
        "reward.chunk_size": _OFF, "reward.error_score": "any finite score", "reward.max_logged_errors": _OFF,
        "reward.max_error_fraction": "any failed reward stops the run", "reward.overlong_buffer.*": _UNUSED,
        "resources.rollout_devices": _OFF, "resources.ray_num_cpus": _OFF, "trainer.rollout_ahead": _OFF,
        "trainer.total_steps": _OFF, "trainer.total_epochs": "trainer.total_steps is set",
        "trainer.val_every": _OFF, "trainer.val_generations_to_log": _OFF, "trainer.save_every": _OFF,
        "trainer.save_every_minutes": _OFF, "trainer.max_restarts": _OFF, "trainer.restart_wait_s": _OFF,
        "trainer.min_devices": _OFF, "trainer.stop_grace_s": "no grace", "trainer.hang_timeout_s": _OFF,
        "trainer.keep_last": "keeps every checkpoint (verl's null)",
    },
    "-1": {
        "rollout.*top_k": "-1 = off", "reward.error_score": "any finite score",
        "algorithm.safe_rlhf.cost_limit": "any finite cost",
    },
    "+inf": {"algorithm.safe_rlhf.lambda_max": "no cap on the multiplier (the field allows inf)"},
    "huge": {
        "algorithm.kl.*": _COEF, "algorithm.kl_loss_coef": _COEF, "algorithm.entropy_coeff": _COEF,
        "algorithm.safe_rlhf.*": _COEF, "algorithm.dpo.beta": _COEF, "model.lora.alpha": _COEF,
        "*.optim.lr": _COEF, "*.optim.weight_decay": _COEF, "*.optim.eps": _COEF, "*.optim.grad_clip": _COEF,
        "actor.clip_ratio_*": _COEF, "actor.rollout_correction.upper": _COEF, "critic.cliprange_value": _COEF,
        "rollout.*temperature": "uniform sampling", "rollout.*top_k": "k past the vocabulary = off",
        "reward.max_abs_score": _COEF,
        "reward.overlong_buffer.*": _UNUSED, "algorithm.sft.max_length": _CAP,
        "algorithm.filter_groups.max_num_gen_batches": _RUNS_LONGER,
        "data.train_batch_size": "the data bounds it: a batch larger than the dataset is one line at load",
        "data.val_batch_size": _CAP, "*.micro_batch_size_per_device": _CAP,
        "*.max_tokens_per_micro_batch": _CAP, "rollout.multi_turn.max_*": _CAP, "reward.chunk_size": _CAP,
        "reward.max_logged_errors": _CAP, "trainer.val_generations_to_log": _CAP,
        "rollout.n": "a size that only memory bounds", "rollout.val.n": "a size that only memory bounds",
        "*.optim.warmup_steps": _RUNS_LONGER, "*.optim.total_steps": _RUNS_LONGER, "*ppo_epochs": _RUNS_LONGER,
        "trainer.total_steps": _RUNS_LONGER, "trainer.total_epochs": _RUNS_LONGER, "trainer.val_every": _RUNS_LONGER,
        "trainer.save_every": _RUNS_LONGER, "trainer.max_restarts": _RUNS_LONGER, "trainer.keep_last": _RUNS_LONGER,
        "trainer.max_skipped_steps": _RUNS_LONGER,
        "critic.ppo_mini_batch_size": "GRPO trains no critic (with one, a mini-batch over the batch is refused)",
    },
}  # fmt: skip


def _numeric(tp) -> bool:
    args = typing.get_args(tp) or (tp,)
    return any(a in (int, float) for a in args)


def numeric_leaves() -> list[str]:
    return [key for key in leaf_paths() if _numeric(key_type(key))]


def _allowed(key: str, label: str) -> str | None:
    return next(
        (why for pattern, why in ALLOWED.get(label, {}).items() if fnmatch.fnmatch(key, pattern)), None
    )


def _field(key: str) -> dataclasses.Field:
    *parents, leaf = key.split(".")
    cls = HybridFlowConfig
    for part in parents:
        cls = typing.get_type_hints(cls)[part]
    return next(f for f in dataclasses.fields(cls) if f.name == leaf)


def test_every_numeric_leaf_declares_its_domain():
    leaves = numeric_leaves()
    assert len(leaves) > 100 and "actor.optim.eps" in leaves and "trainer.rollout_ahead" in leaves
    undeclared = [k for k in leaves if not {"domain", "choices"} & set(_field(k).metadata)]
    assert undeclared == []
    # an int's domain has a bound: "any integer" is never what a count, size or seed means
    unbounded = [
        k for k in leaves if "domain" in _field(k).metadata and key_type(k) is int
        and all(getattr(_field(k).metadata["domain"], b) is None for b in ("ge", "gt", "le", "lt"))
    ]  # fmt: skip
    assert unbounded == []


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    data = yaml.safe_load(open(BASE))
    data["model"]["path"] = str(tiny_model_dir)
    return data


def _outcome(base: dict, key: str, value: str) -> list[str] | None:
    """The error lines of loading `base` with key=value, or None when it loads."""
    if "list" in str(key_type(key)):
        value = f"[{value}, 0.999]"
    try:
        load_config(data=base, overrides=[f"{key}={value}"])
    except ConfigError as e:
        return e.errors
    return None


def _names(line: str, key: str) -> bool:
    """A line names the key, or its section and its own name ('actor.parallel: tp*pp = ...')."""
    section, _, leaf = key.rpartition(".")
    return key in line or (line.startswith(section) and leaf in line)


def test_every_bad_value_of_every_leaf_is_one_line_or_runs(base):
    unnamed, refused_allowed, accepted = [], [], []
    for key in numeric_leaves():
        for label, value in VALUES.items():
            errors = _outcome(base, key, value)  # anything but a ConfigError fails the test: a traceback
            why = _allowed(key, label)
            if errors is None and why is None:
                accepted.append(f"{key}={label}")
            elif errors is not None and why is not None:
                refused_allowed.append(f"{key}={label}: {errors}")
            elif errors is not None and not all("\n" not in e and _names(e, key) for e in errors):
                unnamed.append(f"{key}={label}: {errors}")
    assert accepted == [], "accepted without a reason in ALLOWED"
    assert refused_allowed == [], "in ALLOWED, but refused"
    assert unnamed == [], "refused, but a line does not name the key"


def test_the_issues_values_are_refused_in_one_line(base):
    for override, line in [
        ("actor.optim.weight_decay=nan", "actor.optim.weight_decay: must be a finite number >= 0, got nan"),
        ("actor.optim.eps=-1", "actor.optim.eps: must be a finite number > 0, got -1.0"),
        ("rollout.top_k=-7", "rollout.top_k: must be >= -1, got -7"),
        ("actor.clip_ratio_c=.nan", "actor.clip_ratio_c: must be a finite number > 1, got nan"),
        ("actor.optim.grad_clip=-1", "actor.optim.grad_clip: must be a finite number >= 0, got -1.0"),
        ("actor.optim.min_lr_ratio=-1", "actor.optim.min_lr_ratio: must be in [0, 1], got -1.0"),
        ("algorithm.entropy_coeff=.inf", "algorithm.entropy_coeff: must be a finite number >= 0, got inf"),
        ("algorithm.kl.coef=.inf", "algorithm.kl.coef: must be a finite number >= 0, got inf"),
        ("critic.cliprange_value=-1", "critic.cliprange_value: must be a finite number > 0, got -1.0"),
        ("reward.error_score=.nan", "reward.error_score: must be a finite number, got nan"),
        ("reward.error_score=2e6", "reward.error_score: 2000000.0 is beyond reward.max_abs_score 1000000.0, "
                                   "a score the run itself counts as failed; choose one within it"),
        ("actor.ppo_mini_batch_size=-1", "actor.ppo_mini_batch_size: must be >= 1, got -1"),  # not the critic's
        ("trainer.seed=-1", "trainer.seed: must be in [0, 2147483647], got -1"),
        (f"actor.optim.lr={10**400}", f"actor.optim.lr: {10**400} is too large for a float"),  # no OverflowError
        (f"trainer.keep_last={10**400}", None),  # an int: any size, where its domain has no upper bound
    ]:  # fmt: skip
        if line is None:
            assert load_config(data=base, overrides=[override]).trainer.keep_last == 10**400
            continue
        with pytest.raises(ConfigError) as e:
            load_config(data=base, overrides=[override])
        assert e.value.errors == [line]


# ---- values checked against the model: its config.json against its safetensors headers -----------------
@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_a_config_that_does_not_match_the_weights_is_one_line(base, model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["hidden_size"] = 96  # the weights are 64 wide
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        load_config(data=base, overrides=[f"model.path={model_copy}"])
    assert e.value.errors == [
        f"model.path: {model_copy}/config.json has hidden_size 96, but model.safetensors holds "
        f"model.embed_tokens.weight of shape {config['vocab_size']} x 64 (hidden_size 64): the config and "
        "the weights are of different models"
    ]
    config.update(hidden_size=64, vocab_size=config["vocab_size"] + 1)
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"has vocab_size \d+, but model.safetensors holds"):
        load_config(data=base, overrides=[f"model.path={model_copy}"])
    with pytest.raises(ConfigError, match=r"model.lora.rank=65: exceeds the model's hidden_size 64"):
        load_config(data=base, overrides=["model.lora.rank=65"])


def test_a_model_directory_without_weights_is_one_line_before_ray(base, model_copy):
    """`hybridflow train` refuses it before Ray starts; `config show` and `plan` need config.json alone."""
    from hybridflow.trainers.cli import check_this_machine

    (model_copy / "model.safetensors").unlink()
    cfg = load_config(data=base, overrides=[f"model.path={model_copy}", "resources.n_gpus_per_node=1"])
    with pytest.raises(ConfigError) as e:
        check_this_machine(cfg)
    assert e.value.errors == [
        f"model.path: {model_copy} has no weight files (none of model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json); save the model there with model.save_pretrained(dir)"
    ]
