"""model.lora: verl's LoRA keys map to it, a LoRA run starts no reference model, and what LoRA cannot run
yet is refused in one line before Ray starts (config/validate.py, config/model_checks.py)."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.models.tiny import save_tiny_model

BASE = [
    "data.dataset=synthetic:arithmetic",
    "algorithm.name=grpo",
    "rollout.n=2",
    "algorithm.use_kl_loss=true",
]


def _load(model_dir, *overrides):
    return load_config(None, [f"model.path={model_dir}", *BASE, *overrides])


def test_verl_lora_keys_map_to_model_lora():
    verl = ["actor_rollout_ref.model.path=m", "data.dataset=synthetic:arithmetic"]
    keys = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "critic.model.lora_rank=0"]  # fmt: skip
    cfg = load_config(None, [*verl, *keys], verl=True, check_model=False)
    lora = cfg.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.critic) == (16, 32, ["q_proj", "v_proj"], False)
    all_linear = load_config(None, [*verl, "actor_rollout_ref.model.target_modules=all-linear"], verl=True,
                             check_model=False)  # fmt: skip
    assert all_linear.model.lora.target_modules == ["all-linear"]
    with pytest.raises(
        ConfigError, match="critic.model.lora_rank=8: the critic's adapters take the actor's rank"
    ):
        load_config(None, [*verl, keys[0], "critic.model.lora_rank=8"], verl=True, check_model=False)


def test_a_lora_run_has_no_reference_model(tiny_model_dir):
    spec = ALGORITHM_SPECS["grpo"]
    assert "ref" in spec.roles(_load(tiny_model_dir))
    cfg = _load(tiny_model_dir, "model.lora.rank=4")
    assert spec.uses_reference(cfg) and "ref" not in spec.roles(cfg)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.lora.rank=-1"], "model.lora.rank: must be >= 0, got -1"),
        (["model.lora.rank=4", "model.lora.dropout=1.0"], "model.lora.dropout: must be in [0, 1), got 1.0"),
    ],
)  # fmt: skip
def test_what_lora_cannot_run_is_refused_in_one_line(tiny_model_dir, overrides, message):
    with pytest.raises(ConfigError) as e:
        _load(tiny_model_dir, *overrides)
    assert any(message in line and "\n" not in line for line in e.value.errors), e.value.errors


def test_lora_on_a_model_type_the_functional_decoder_lacks_is_refused(tmp_path):
    gpt2 = save_tiny_model(tmp_path / "gpt2", "tiny", "gpt2", seed=0)
    with pytest.raises(ConfigError) as e:
        _load(gpt2, "model.lora.rank=4", "model.remove_padding=false")
    assert any("LoRA generation supports model types" in line and "'gpt2'" in line for line in e.value.errors)
