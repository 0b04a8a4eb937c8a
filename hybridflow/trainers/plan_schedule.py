"""Which schedule a plan runs (docs/planner.md): synchronous, or the rollout one step ahead on its own pool.

`trainer.rollout_ahead` in the config decides: `resources.placement: auto` plans that schedule, and a
plan file's `rollout_ahead` must match it (switching to off-policy training is the user's call, not a
placement's). Builds without the setting accept only synchronous plans. auto_placement.py calls these.

The schedule also decides where the trainer takes old log-probs (trainers/sources/base.py old_log_prob_source),
so `planner_old_log_probs` asks that rule per schedule, and a plan file that priced it otherwise gets a note.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from hybridflow.planner import Plan
from hybridflow.planner.specs import ENGINE_LIMITS
from hybridflow.trainers.sources.base import old_log_prob_source

# `hybridflow plan`'s default: the layouts the engines run (planner/specs.py ENGINE_LIMITS)
REPLAN_FLAGS = "--engines builtin"


def config_rollout_ahead(cfg) -> int | None:
    """The config's trainer.rollout_ahead, or None where this build has no such setting."""
    return getattr(cfg.trainer, "rollout_ahead", None)


def planner_old_log_probs(cfg, rollout_ahead: int | None = None) -> str:
    """Whether the trainer runs a separate actor forward for old log-probs ("actor") or not ("free",
    planner/dataflow.py) under `cfg` with trainer.rollout_ahead = `rollout_ahead` (None: the config's),
    asked of the trainer's own rule (trainers/sources/base.py old_log_prob_source) so the plan prices what runs."""
    if rollout_ahead is not None and rollout_ahead != config_rollout_ahead(cfg):
        cfg = copy.copy(cfg)
        cfg.trainer = replace(cfg.trainer, rollout_ahead=rollout_ahead)
    r = cfg.rollout  # vLLM's log-probs miss top-k / top-p truncation (rollout/vllm_engine.py sets the meta)
    exact = r.engine != "vllm" or r.temperature == 0 or not (r.top_k > 0 or r.top_p < 1.0)
    return "actor" if old_log_prob_source(cfg, exact) == "actor" else "free"


def report_old_log_probs(p: Plan, cfg, console) -> None:
    """The plan's old-log-prob pricing per schedule, and a note when the run takes them otherwise than
    the plan priced for the schedule it runs (a plan file made for other epochs / mini-batches / KL)."""
    from hybridflow.planner.cli import old_log_probs_line

    console.print(old_log_probs_line(p))
    planned = p.ahead.old_log_probs if p.rollout_ahead and p.ahead else p.old_log_probs
    runs = planner_old_log_probs(cfg, p.rollout_ahead if config_rollout_ahead(cfg) is not None else None)
    if planned != runs:
        priced = "prices an actor forward" if planned == "actor" else "prices no actor forward"
        console.print(
            f"note: the plan {priced} for old log-probs, but this run {'runs one' if runs == 'actor' else 'does not'}"
            " (trainers/sources/base.py old_log_prob_source); its predicted times are off by that forward: re-plan with "
            "`hybridflow plan` given this config's --ppo-epochs, --mini-batches and --kl-in-reward"
        )


def check_schedule(p: Plan, cfg, source: str) -> list[str]:
    """The plan's schedule against the config's trainer.rollout_ahead, and the rollout pool's layout."""
    want = config_rollout_ahead(cfg)
    if p.rollout_ahead and want is None:
        return [
            f"plan {source!r} runs the rollout one step ahead (rollout_ahead: 1), which this build's trainer "
            "does not have (no trainer.rollout_ahead); re-plan with `hybridflow plan ... --schedule sync`"
        ]
    if want is not None and p.rollout_ahead != want:
        fix = "--schedule ahead" if want else "--schedule sync"
        return [
            f"plan {source!r} has rollout_ahead: {p.rollout_ahead} but trainer.rollout_ahead={want}; set "
            f"trainer.rollout_ahead={p.rollout_ahead} or re-plan with `hybridflow plan ... {fix}`"
        ]
    errors = []
    r = p.ahead if p.rollout_ahead else None
    if r is not None:
        where = f"plan {source!r}: the rollout pool (pg={r.pg}, tg={r.tg}, {r.n_devices} devices)"
        max_pg = ENGINE_LIMITS.max_pg
        if max_pg is not None and r.pg > max_pg:
            errors.append(
                f"{where}: the rollout engines run pipelines of pg <= {max_pg}; edit the plan to pg: {max_pg} or "
                f"re-plan with `hybridflow plan ... {REPLAN_FLAGS}`"
            )
        if r.tg < 1 or r.n_devices % r.tg:
            errors.append(f"{where}: tg must divide its {r.n_devices} devices; fix the plan")
        elif r.tg > 1:
            errors += _rollout_tp_errors(where, r.tg, cfg)
        errors += _frozen_pool_errors(where, r, cfg)
        fixed = getattr(cfg.resources, "rollout_devices", 0)
        if fixed and fixed != r.n_devices:
            errors.append(
                f"{where}: resources.rollout_devices={fixed} differs; remove the setting (the plan sizes "
                "the pool) or edit the plan"
            )
    return errors


def _frozen_pool_errors(where: str, r, cfg) -> list[str]:
    """The plan's place of the frozen models (reference, reward, cost) against resources.frozen_pool,
    when this run has any (a plan file without the field priced them in the training pool)."""
    from hybridflow.config.algorithms import algorithm_spec
    from hybridflow.config.rollout_pool import FROZEN_ROLES

    want = getattr(cfg.resources, "frozen_pool", "training")
    spec = algorithm_spec(cfg)
    if want in ("auto", r.frozen_pool) or not any(role in FROZEN_ROLES for role in spec.roles(cfg)):
        return []
    place = (
        "both pools (the reference's rows split)" if r.frozen_pool == "both" else f"the {r.frozen_pool} pool"
    )
    return [
        f"{where}: runs the frozen models (reference, reward, cost) in {place} but "
        f"resources.frozen_pool={want}; set resources.frozen_pool={r.frozen_pool} or re-plan with "
        f"`hybridflow plan ... --frozen-pool {want}`"
    ]


def _rollout_tp_errors(where: str, tg: int, cfg) -> list[str]:
    """Why the rollout pool cannot generate tg-way tensor parallel (rollout/pool_tp.py): the built-in
    engine's TP decoder runs the Llama family and splits whole heads and KV heads."""
    from hybridflow.hybrid_engine.layout import LLAMA_FAMILY, _read_config

    if cfg.rollout.engine != "builtin":
        return [f"{where}: tg > 1 on the rollout pool runs on rollout.engine=builtin; edit the plan to tg: 1"]
    hf = _read_config(cfg.model.path)
    if hf is None:
        return []  # no model directory: model.path's own check reports it
    if hf.get("model_type") not in LLAMA_FAMILY:
        return [f"{where}: tensor-parallel generation runs {LLAMA_FAMILY} models, not "
                f"{hf.get('model_type')!r}; edit the plan to tg: 1"]  # fmt: skip
    heads = hf.get("num_attention_heads")
    sizes = {
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads", heads),
        "ffn": hf.get("intermediate_size"),
    }
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % tg}
    if bad:
        return [f"{where}: tg must divide the model's {bad}; fix the plan or re-plan with "
                f"`hybridflow plan ... {REPLAN_FLAGS}`"]  # fmt: skip
    return []


def report_schedule(p: Plan, cfg, console) -> None:
    """Say when the schedule the config did not pick is predicted faster."""
    if config_rollout_ahead(cfg) is None or p.ahead is None or not p.synchronous_seconds:
        return
    if (
        p.rollout_ahead
        and p.ahead.tg > 1
        and p.limits.rollout_full_weights
        and cfg.rollout.engine == "builtin"
    ):
        console.print(
            "note: the plan prices each rollout device holding and receiving the whole weights; the trainer's "
            f"rollout ranks hold and receive 1/{p.ahead.tg} of them (re-plan without --rollout-full-weights)"
        )
    sync, ahead = p.synchronous_seconds, p.ahead.iteration_seconds
    if not p.rollout_ahead and ahead < sync:
        console.print(
            f"note: one step ahead (trainer.rollout_ahead=1, rollout pool of {p.ahead.n_devices} devices) is "
            f"predicted at {ahead:.3g} s per iteration against {sync:.3g} s synchronous (responses one step "
            "off-policy); `hybridflow plan --explain` shows why"
        )
    elif p.rollout_ahead and sync < ahead:
        console.print(
            f"note: the synchronous schedule (trainer.rollout_ahead=0) is predicted at {sync:.3g} s per "
            f"iteration against {ahead:.3g} s one step ahead"
        )
