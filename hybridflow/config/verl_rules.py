"""verl settings whose meaning depends on other keys, mapped as verl reads them (config/verl.py;
docs/verl.md, "Read together").

Each rule runs before the one-key mappings: it pops the verl keys it alone reads from `flat` (verl's
dotted keys -> values; keys that other mappings read too stay there) and writes ours into `out`, which
is applied after the one-key mappings and so wins over them; or it appends one line to `errors` naming
the key and why it cannot run here. Some targets are settings that land with other features (the
policy losses, DAPO, rollout correction): while a target key is absent from our schema, a value that
needs it is refused and verl's default is accepted.
"""

from __future__ import annotations

import typing
from typing import Any

from hybridflow.config.loader import key_type, leaf_paths

OUR_KEYS = frozenset(leaf_paths())
# our keys whose value is a mapping (data.dataset_kwargs, reward.fn_kwargs): set whole, never flattened
OUR_MAPPINGS = frozenset(k for k in OUR_KEYS if typing.get_origin(key_type(k)) is dict)
ACTOR, ROLLOUT, ALG = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "algorithm."
POLICY_LOSSES = ("vanilla", "gspo", "cispo", "geo_mean")  # verl's names, ours too (actor.policy_loss)


def _missing(ours: str, key: str, value: Any, errors: list[str]) -> bool:
    """True (and an error) when our key `ours`, which `key=value` needs, is not in this build."""
    if ours in OUR_KEYS:
        return False
    errors.append(f"verl key {key}={value!r}: not available in this build (needs {ours}); remove it")
    return True


def clip_ratios(flat: dict, out: dict, errors: list[str]) -> None:
    """verl reads clip_ratio_low / _high when set, else clip_ratio (core_algos.py), whatever the order."""
    both = flat.pop(ACTOR + "clip_ratio", None)
    for side in ("low", "high"):
        value = flat.pop(f"{ACTOR}clip_ratio_{side}", None)
        value = both if value is None else value
        if value is not None:
            out[f"actor.clip_ratio_{side}"] = float(value)


def validation_sampling(flat: dict, out: dict, errors: list[str]) -> None:
    """val_kwargs as verl samples them. verl's sync rollout (the default up to verl 0.6) decodes greedily
    unless val_kwargs.do_sample is true, whatever the temperature; its async agent loop (verl 0.7's only
    mode) samples at val_kwargs.temperature and never reads do_sample."""
    do_sample = flat.pop(ROLLOUT + "val_kwargs.do_sample", None)
    mode = flat.get(ROLLOUT + "mode")
    temperature = flat.get(ROLLOUT + "val_kwargs.temperature") or 0
    if do_sample or mode == "async":
        return  # val_kwargs map as given (rollout.val.*)
    if temperature > 0 and mode is None:
        errors.append(
            f"verl key {ROLLOUT}val_kwargs.temperature={temperature!r} without val_kwargs.do_sample=True: "
            "verl's sync rollout decodes greedily, its async one (verl 0.7) samples at that temperature; "
            f"set {ROLLOUT}mode=sync or async, or val_kwargs.do_sample=True"
        )
        return
    for key in ("temperature", "top_k", "top_p"):
        flat.pop(f"{ROLLOUT}val_kwargs.{key}", None)
    out.update({"rollout.val.temperature": 0.0, "rollout.val.top_k": -1, "rollout.val.top_p": 1.0})


def val_only(flat: dict, out: dict, errors: list[str]) -> None:
    """verl's val_only returns after the validation before training, so it needs val_before_train."""
    value = flat.pop("trainer.val_only", None)
    if not value:
        return
    if flat.get("trainer.val_before_train") is False:
        errors.append(
            "verl key trainer.val_only=True with trainer.val_before_train=False: verl then ignores "
            "val_only and trains; set val_before_train=True to validate only, or val_only=False"
        )
    elif not _missing("trainer.val_only", "trainer.val_only", value, errors):
        out["trainer.val_only"] = True


def policy_loss(flat: dict, out: dict, errors: list[str]) -> None:
    key = ACTOR + "policy_loss.loss_mode"
    mode = flat.pop(key, None)
    if mode is None or (mode == "vanilla" and "actor.policy_loss" not in OUR_KEYS):
        return
    if mode not in POLICY_LOSSES:
        errors.append(f"verl key {key}={mode!r}: not available here; choose one of {list(POLICY_LOSSES)}")
    elif not _missing("actor.policy_loss", key, mode, errors):
        out["actor.policy_loss"] = mode


# verl's filter_groups.metric -> ours: what must vary within a kept group
_FILTER_METRICS = {"acc": "acc", "seq_reward": "score", "seq_final_reward": "score", "score": "score"}


def dapo(flat: dict, out: dict, errors: list[str]) -> None:
    """DAPO's dynamic sampling (algorithm.filter_groups) and overlong reward shaping (verl: the dapo
    reward manager's overlong_buffer; the naive manager never reads it). Here both run in the dapo
    driver: GRPO advantages plus these, so verl's grpo estimator with either becomes algorithm.name=dapo."""
    fg = {k: flat.pop(f"{ALG}filter_groups.{k}", None) for k in ("enable", "metric", "max_num_gen_batches")}
    ob = {k: flat.pop(f"reward_model.overlong_buffer.{k}", None) for k in ("enable", "len", "penalty_factor")}
    for k in ("enable", "len", "penalty_factor"):  # verl 0.7's copy, read by the dapo reward manager
        ob[k] = flat.pop(f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}", ob[k])
    manager = flat.get("reward_model.reward_manager") or flat.get("reward_manager.name") or "naive"
    if ob["enable"] and manager != "dapo":
        errors.append(
            "verl key reward_model.overlong_buffer.enable=True: verl's reward manager "
            f"{manager!r} never reads it; set reward_model.reward_manager=dapo, or enable=False"
        )
        return
    if not (fg["enable"] or ob["enable"]):
        return
    estimator = flat.get(ALG + "adv_estimator", "gae")
    if estimator != "grpo":
        errors.append(f"verl's DAPO keys (filter_groups, overlong_buffer) need algorithm.adv_estimator=grpo "
                      f"here (the dapo driver uses GRPO advantages), got {estimator!r}")  # fmt: skip
        return
    if _missing("algorithm.filter_groups.enable", ALG + "filter_groups.enable", True, errors):
        return
    out["algorithm.name"] = "dapo"
    _filter_groups(fg, ob, flat, out, errors)
    for k, v in ob.items():
        if v is not None:
            out[f"reward.overlong_buffer.{k}"] = v


def _filter_groups(fg: dict, ob: dict, flat: dict, out: dict, errors: list[str]) -> None:
    metric = fg["metric"]
    if metric is not None:
        key = f"{ALG}filter_groups.metric"
        # ours is the shaped score; verl's 'score' is the reward fn's own (before the overlong penalty),
        # its seq_final_reward includes a KL-in-reward penalty
        shaped = (metric == "score" and ob["enable"]) or (
            metric == "seq_final_reward" and flat.get(ALG + "use_kl_in_reward")
        )
        if metric not in _FILTER_METRICS or shaped:
            errors.append(f"verl key {key}={metric!r}: not available here; use acc or seq_reward "
                          "(the sequence's score after the overlong penalty)")  # fmt: skip
            return
        out["algorithm.filter_groups.metric"] = _FILTER_METRICS[metric]
    for k in ("enable", "max_num_gen_batches"):
        if fg[k] is not None:
            out[f"algorithm.filter_groups.{k}"] = fg[k]


RC = "algorithm.rollout_correction."
_OLD_RC = ("rollout_is", "rollout_is_threshold", "rollout_is_threshold_lower", "rollout_is_level",
           "rollout_is_mode", "rollout_is_veto_threshold")  # fmt: skip


def rollout_correction(flat: dict, out: dict, errors: list[str]) -> None:
    """verl's rollout importance sampling -> actor.rollout_correction: verl 0.7's
    algorithm.rollout_correction.*, verl 0.6's algorithm.rollout_is*, verl 0.5's actor.tis_imp_ratio_cap.
    verl corrects nothing unless told, so a verl config without them runs with mode none."""
    new = {k[len(RC) :]: flat.pop(k) for k in [k for k in flat if k.startswith(RC)]}
    old = {k: flat.pop(ALG + k) for k in _OLD_RC if ALG + k in flat}
    cap = flat.pop(ACTOR + "tis_imp_ratio_cap", None)
    setting = _rc_new(new, errors) or _rc_old(old, errors) or _rc_cap(cap)
    if setting is None:
        ours_given = any(k.startswith("actor.rollout_correction.") for k in flat)  # our keys, mixed in
        if "actor.rollout_correction.mode" in OUR_KEYS and not ours_given:
            out["actor.rollout_correction.mode"] = "none"
        return
    if not _missing("actor.rollout_correction.mode", "algorithm.rollout_correction", setting, errors):
        out.update({f"actor.rollout_correction.{k}": v for k, v in setting.items()})


def _rc_new(rc: dict, errors: list[str]) -> dict | None:
    unsupported = [k for k in ("bypass_mode", "rollout_is_batch_normalize") if rc.get(k)]
    errors += [f"verl key {RC}{k}={rc[k]!r}: not available here; remove it" for k in unsupported]
    if unsupported:
        return None
    level, rs = rc.get("rollout_is"), rc.get("rollout_rs")
    upper = float(rc.get("rollout_is_threshold") or 2.0)
    if rs is not None:  # a mask; here only the geometric-mean one, without IS weights on top
        if rs != "seq_mean_k1" or level is not None:
            errors.append(f"verl key {RC}rollout_rs={rs!r}: here only seq_mean_k1 without rollout_is "
                          "(mode geo_mask); remove it")  # fmt: skip
            return None
        lower, upper = _bounds(rc.get("rollout_rs_threshold"))
        return {"mode": "geo_mask", "level": "sequence", "lower": lower, "upper": upper}
    if level is None:
        return None
    if level not in ("token", "sequence"):
        errors.append(f"verl key {RC}rollout_is={level!r}: choose token or sequence")
        return None
    return {"mode": "tis", "level": level, "lower": 0.0, "upper": upper}


def _bounds(threshold) -> tuple[float, float]:
    """verl's ratio bounds: 'lower_upper', or one upper bound whose reciprocal is the lower."""
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = (float(x) for x in threshold.split("_"))
        return lower, upper
    upper = float(threshold or 2.0)
    return 1.0 / upper, upper


def _rc_old(rc: dict, errors: list[str]) -> dict | None:
    if not rc.get("rollout_is") or rc.get("rollout_is_threshold") is None:
        return None  # verl 0.6 computes metrics only
    veto = rc.get("rollout_is_veto_threshold", 1e-4)
    if veto:
        errors.append(f"verl key {ALG}rollout_is_veto_threshold={veto!r}: no veto here; set it to null")
        return None
    upper, mode = float(rc["rollout_is_threshold"]), rc.get("rollout_is_mode", "truncate")
    lower = rc.get("rollout_is_threshold_lower")
    lower = 1.0 / upper if lower is None else float(lower)
    level = rc.get("rollout_is_level", "token")
    if level == "geometric" and mode == "mask":
        return {"mode": "geo_mask", "level": "sequence", "lower": lower, "upper": upper}
    if level not in ("token", "sequence") or mode not in ("truncate", "mask"):
        errors.append(
            f"verl keys {ALG}rollout_is_level={level!r}, rollout_is_mode={mode!r}: not available here"
        )
        return None
    if mode == "truncate":
        return {"mode": "tis", "level": level, "lower": 0.0, "upper": upper}
    return {"mode": "mis", "level": level, "lower": lower, "upper": upper}


def _rc_cap(cap) -> dict | None:
    if cap is None or float(cap) <= 0:
        return None
    return {"mode": "tis", "level": "token", "lower": 0.0, "upper": float(cap)}


RULES = (clip_ratios, validation_sampling, val_only, policy_loss, dapo, rollout_correction)
