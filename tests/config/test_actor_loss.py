"""actor.policy_loss, loss_agg_mode and actor.rollout_correction: the names match the algorithm functions',
and a setting a mode would not use, or an impossible range, is one line naming the key."""

from __future__ import annotations

import pytest

from hybridflow.algorithms import AGG_MODES, POLICY_LOSSES
from hybridflow.algorithms.rollout_correction import CORRECTION_LEVELS, CORRECTION_MODES
from hybridflow.config import ConfigError, load_config, schema

BASE = ["model.path=m", "data.dataset=synthetic:arithmetic"]


def _errors(*overrides) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *overrides], check_model=False)
    return e.value.errors


def test_config_names_are_the_functions_names():
    assert schema.LOSS_AGG_MODES == AGG_MODES
    assert schema.POLICY_LOSS_NAMES == tuple(POLICY_LOSSES)
    assert (schema.CORRECTION_MODES, schema.CORRECTION_LEVELS) == (CORRECTION_MODES, CORRECTION_LEVELS)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "geo_mean"])
@pytest.mark.parametrize("agg", ["token-sum", "seq-mean-token-sum-norm"])
def test_every_loss_and_new_aggregation_loads(name, agg):
    cfg = load_config(None, [*BASE, f"actor.policy_loss={name}", f"actor.loss_agg_mode={agg}",
                             f"critic.loss_agg_mode={agg}"], check_model=False)  # fmt: skip
    assert (cfg.actor.policy_loss, cfg.actor.loss_agg_mode, cfg.critic.loss_agg_mode) == (name, agg, agg)


def test_default_correction_is_token_tis_at_two():
    rc = load_config(None, BASE, check_model=False).actor.rollout_correction
    assert (rc.mode, rc.level, rc.lower, rc.upper) == ("tis", "token", 0.0, 2.0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("actor.policy_loss=gpso",), "actor.policy_loss: 'gpso' is not one of"),
        (("actor.rollout_correction.mode=seq_tis",), "actor.rollout_correction.mode: 'seq_tis' is not one of"),
        (("actor.rollout_correction.lower=0.5",), "actor.rollout_correction.lower: tis truncates from above only"),
        (("actor.rollout_correction.mode=icepop",), "actor.rollout_correction.lower: icepop masks both sides"),
        (("actor.rollout_correction.mode=icepop", "actor.rollout_correction.lower=0.5",
          "actor.rollout_correction.level=sequence"), "actor.rollout_correction.level: icepop is per token"),
        (("actor.rollout_correction.mode=mis", "actor.rollout_correction.lower=3"),
         "actor.rollout_correction: needs 0 <= lower < upper"),
        (("actor.clip_ratio_c=1",), "actor.clip_ratio_c: must be a finite number > 1, got 1.0"),
        (("actor.policy_loss=gspo", "actor.clip_ratio_c=10"), "actor.clip_ratio_c: the dual clip is policy_loss vanilla's"),
        (("actor.rollout_correction.mode=none", "actor.rollout_correction.upper=5"),
         "actor.rollout_correction.upper: mode none corrects nothing"),
        (("actor.tis_imp_ratio_cap=3",), "unknown key 'actor.tis_imp_ratio_cap' (did you mean "
                                         "'actor.rollout_correction.upper'?"),
    ],
)  # fmt: skip
def test_bad_loss_settings_are_one_line(overrides, message):
    errors = _errors(*overrides)
    assert any(line.startswith(message) for line in errors), errors


def test_masks_with_bounds_load():
    for mode, level, lower in [
        ("mis", "sequence", 0.0),
        ("icepop", "token", 0.5),
        ("geo_mask", "token", 0.999),
    ]:
        rc = load_config(None, [*BASE, f"actor.rollout_correction.mode={mode}", f"actor.rollout_correction.level={level}",
                                f"actor.rollout_correction.lower={lower}"], check_model=False).actor.rollout_correction  # fmt: skip
        assert (rc.mode, rc.lower) == (mode, lower)
