"""`hybridflow plan`: run the auto-mapping planner from the command line and print the plan.

    hybridflow plan --model-size 13B --gpus 128 --gpu a100-80 [--algorithm ppo] [--explain] [--output plan.yaml]
    hybridflow plan --profile cpu.yaml --gpus 4 ...   # priced with this machine's measured coefficients

By default (`--engines builtin`) it searches only the layouts hybridflow's own engines run (specs.py
`ENGINE_LIMITS`, the limits `resources.placement: auto` plans under), so every plan it prints runs under
`hybridflow train`. `--engines any` searches the paper's full space (pipeline parallelism, replicated KV
heads), for comparison; `--max-pp`, `--max-pg`, `--max-rollout-tg` and `--tp-whole-heads` then narrow it.

`--explain` sets the winner beside the paper's three fixed strategies (colocate all; split
actor+reference | critic+reward; standalone), each with its own best device allocation, and says in
which stages the winner gains and loses time; then the synchronous schedule beside the one-step-ahead
one (`--schedule`, docs/planner.md): each one's predicted iteration and what decides between them,
where the frozen models run one step ahead (`--frozen-pool`, with both sides' seconds), and whether each schedule priced the actor's old-log-prob forward (the trainer's rule, dataflow.py
`old_log_prob_work`, from --ppo-epochs, --mini-batches, --kl-in-reward and the device's precision).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from hybridflow.planner.ahead import FROZEN_POOLS, search_ahead
from hybridflow.planner.ahead_both import explain_frozen_pools
from hybridflow.planner.dataflow import (
    ALGORITHMS,
    STAGES,
    build_dataflow,
    old_log_prob_work,
    with_old_log_probs,
)
from hybridflow.planner.plan import SCHEDULES, Plan, build_plan
from hybridflow.planner.profile import DTYPES, DeviceProfile
from hybridflow.planner.search import bell_number, search
from hybridflow.planner.specs import (
    DEVICES,
    ENGINE_LIMITS,
    ClusterSpec,
    EngineLimits,
    ModelSpec,
    WorkloadSpec,
)

# --engines: whose layouts the search considers
ENGINES = {"builtin": ENGINE_LIMITS, "any": EngineLimits()}
# GRPO scores with rules (a verifier, exact match) as its recipes do; PPO, ReMax and Safe-RLHF, the
# paper's settings, with learned reward (and cost) models
RULE_REWARD = ("grpo",)


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=8, help="number of devices")
    c.add_argument("--gpu", default="a100-80", choices=sorted(DEVICES), help="device type from the catalogue")
    c.add_argument(
        "--profile",
        default=None,
        help="a device profile measured by `hybridflow calibrate --out FILE`: plan with it instead of --gpu",
    )
    c.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="with --profile: the compute dtype whose measured entry prices the work",
    )
    c.add_argument("--devices-per-node", type=int, default=None, help="default: the catalogue's (8 for GPUs)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("models")
    m.add_argument(
        "--model-size", default="7B", help="actor size as a parameter count: 7B, 13B, 34B, 70B, 350M"
    )
    m.add_argument(
        "--model-config", default=None, help="HF config.json (or model dir) instead of --model-size"
    )
    m.add_argument("--critic-size", default=None, help="critic size (default: the actor's)")
    m.add_argument("--reward-size", default=None, help="reward (and cost) model size (default: the actor's)")
    m.add_argument("--algorithm", default="ppo", choices=ALGORITHMS, help="built-in dataflow")
    m.add_argument(
        "--reward-model",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a reward model to place (--no-reward-model: a rule-based reward); default: with one for "
        f"{', '.join(a for a in ALGORITHMS if a not in RULE_REWARD)}, without for {', '.join(RULE_REWARD)}",
    )
    _add_cluster_arguments(parser)
    _add_engine_arguments(parser)
    w = parser.add_argument_group("workload (defaults: the paper's setting)")
    defaults = WorkloadSpec()
    w.add_argument("--prompts", type=int, default=defaults.prompts, help="global batch of prompts")
    w.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt)
    w.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    w.add_argument("--response-len", type=int, default=defaults.response_len)
    w.add_argument("--ppo-epochs", type=int, default=defaults.ppo_epochs)
    w.add_argument(
        "--mini-batches", type=int, default=defaults.mini_batches, help="optimizer steps per epoch"
    )
    w.add_argument(
        "--kl-in-reward",
        action="store_true",
        help="KL penalty in the reward (algorithm.kl.in_reward): with one optimizer step the actor still "
        "recomputes old log-probs unless the synchronous rollout's own serve (fp32 devices)",
    )
    w.add_argument(
        "--schedule",
        default="auto",
        choices=SCHEDULES,
        help="sync: generation, preparation, training in turn; ahead: trainer.rollout_ahead=1, generation "
        "on its own pool one step ahead; auto: whichever predicts the shorter iteration",
    )
    w.add_argument(
        "--frozen-pool",
        default="auto",
        choices=("auto", *FROZEN_POOLS),
        help="one step ahead: where the frozen models (reference, reward, cost) run: rollout = on the rollout "
        "pool after generation, training = with the training side, both = the reference on both, its rows "
        "split, reward / cost on the rollout pool; auto = the fastest (resources.frozen_pool)",
    )
    o = parser.add_argument_group("output")
    o.add_argument("--explain", action="store_true", help="compare with colocate / split / standalone")
    o.add_argument("--top", type=int, default=5, help="alternatives to list")
    o.add_argument("--output", default=None, help="write the plan to this .yaml/.yml or .json file")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("engines (default: the layouts hybridflow train runs)")
    e.add_argument(
        "--engines",
        default="builtin",
        choices=tuple(ENGINES),
        help=f"builtin: only layouts hybridflow's engines run ({ENGINE_LIMITS.describe()}); any: the paper's "
        "full search (pg > 1, replicated KV heads), plans `hybridflow train` refuses; the flags below override",
    )
    e.add_argument(
        "--max-pp", type=int, default=None, help="largest pipeline size p (builtin: any, with any t)"
    )
    e.add_argument(
        "--max-pg", type=int, default=None, help="largest generation pipeline size pg (builtin: 1)"
    )
    e.add_argument(
        "--max-rollout-tg",
        type=int,
        default=None,
        help="largest tg of a one-step-ahead rollout pool (1: plain replicas)",
    )
    e.add_argument(
        "--rollout-full-weights",
        action="store_true",
        help="each one-step-ahead rollout rank holds and is sent the full weights (an engine that slices them "
        "itself); default: only its generation shard, as the built-in trainer's rollout pool",
    )
    e.add_argument(
        "--tp-whole-heads",
        action="store_true",
        help="t must divide the heads, KV heads and MLP width (the built-in engines; no replicated KV heads)",
    )


def plan_from_args(args) -> tuple[Plan, float]:
    """(plan, search seconds) for parsed CLI arguments."""
    dataflow, ahead_df, cluster, wl, limits = _inputs(args)
    start = time.perf_counter()
    results = search(dataflow, cluster, wl, limits)
    ahead = (
        search_ahead(ahead_df, cluster, wl, limits, None, args.frozen_pool)
        if args.schedule != "sync"
        else None
    )
    seconds = time.perf_counter() - start
    return build_plan(dataflow, cluster, wl, results, limits, ahead, args.schedule), seconds


def _inputs(args):
    """(dataflow, its one-step-ahead variant, cluster, workload, limits) for parsed CLI arguments."""
    if args.model_config:
        actor = ModelSpec.from_hf_config(args.model_config)
    else:
        actor = ModelSpec.from_param_count(args.model_size)
    critic = ModelSpec.from_param_count(args.critic_size) if args.critic_size else None
    reward = ModelSpec.from_param_count(args.reward_size) if args.reward_size else None
    device = DeviceProfile.load(args.profile).device(args.dtype) if args.profile else args.gpu
    cluster = ClusterSpec.build(device, args.gpus, args.devices_per_node)
    # where the trainer takes old log-probs, per schedule (trainers/sources/base.py old_log_prob_source): the
    # catalogue's 4-byte entry (cpu) computes in fp32, as model.dtype=auto does on CPU; the built-in
    # rollout's log-probs are exact
    fp32 = cluster.device.bytes_per_param >= 4
    old = [old_log_prob_work(args.ppo_epochs, args.mini_batches, args.kl_in_reward, fp32, a) for a in (0, 1)]
    dataflow = build_dataflow(
        args.algorithm,
        actor,
        critic=critic,
        reward=reward,
        reward_model=args.algorithm not in RULE_REWARD if args.reward_model is None else args.reward_model,
        samples_per_prompt=args.samples_per_prompt,
        old_log_probs=old[0],
    )
    wl = WorkloadSpec(
        prompts=args.prompts,
        samples_per_prompt=args.samples_per_prompt,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        ppo_epochs=args.ppo_epochs,
        mini_batches=args.mini_batches,
    )
    return dataflow, with_old_log_probs(dataflow, old[1]), cluster, wl, limits_from_args(args)


def limits_from_args(args) -> EngineLimits:
    """`--engines`' limits with the sizes given on the command line in place of its own."""
    sizes = {
        k: getattr(args, k) for k in ("max_pp", "max_pg", "max_rollout_tg") if getattr(args, k) is not None
    }
    flags = {k: True for k in ("tp_whole_heads", "rollout_full_weights") if getattr(args, k)}
    if "tp_whole_heads" in flags:
        flags["tp_shards_whole_heads"] = flags.pop("tp_whole_heads")
    return replace(ENGINES[args.engines], **sizes, **flags)


def _fmt_placement(placement, allocation) -> str:
    return " | ".join(f"{'+'.join(s)}:{n}" for s, n in zip(placement, allocation))


def _print_limits(plan: Plan, console) -> None:
    """The layouts the search was limited to, and a note when they go beyond what the trainer runs."""
    if plan.limits != EngineLimits():
        console.print(f"layouts limited to what the engines run: {plan.limits.describe()}")
    if plan.limits != ENGINE_LIMITS:
        console.print(
            f"note: searched beyond what `hybridflow train` runs ({ENGINE_LIMITS.describe()}); it refuses this "
            "plan's layouts outside those (re-plan with --engines builtin to run it)"
        )


def print_plan(plan: Plan, console, top: int = 5, search_seconds: float | None = None) -> None:
    from rich.table import Table

    models = ", ".join(sorted({m.model for m in plan.models}))
    took = (
        f", searched {len(plan.alternatives)} placements in {search_seconds:.2f} s" if search_seconds else ""
    )
    schedule = (
        f" + rollout pool one step ahead ({plan.ahead.n_devices} devices)" if plan.rollout_ahead else ""
    )
    console.print(
        f"[bold]{plan.algorithm.upper()}[/] {models} on {plan.num_devices} x {plan.device} "
        f"({'measured profile' if plan.device_measured else 'catalogue entry, not measured'}): "
        f"[bold]{plan.strategy}{schedule}[/], predicted iteration {plan.iteration_seconds:.1f} s, "
        f"{plan.throughput_tokens_per_s:,.0f} tokens/s{took}"
    )
    _print_limits(plan, console)
    table = Table(title="models", title_justify="left")
    for col in ("role", "pool", "devices", "train (p,t,d)", "gen (pg,tg)", "ckpt", "offload"):
        table.add_column(col, overflow="fold")
    for s in STAGES:
        table.add_column(f"{s} s", justify="right")
    table.add_column("switch s", justify="right")
    table.add_column("GiB/device", justify="right")
    for m in plan.models:
        gen = f"({m.pg},{m.tg})" if m.stage_seconds["generation"] > 0 else "-"
        gen += f" x{m.waves} waves" if m.waves > 1 else ""
        table.add_row(
            m.role, m.pool, str(m.n_devices), f"({m.p},{m.t},{m.d})", gen,
            "yes" if m.checkpoint else "no", "yes" if m.offload else "no",
            *(f"{m.stage_seconds[s]:.2f}" for s in STAGES),
            f"{m.switch_seconds:.2f}", f"{m.persistent_gib:.1f}+{m.transient_gib:.1f}",
        )  # fmt: skip
    console.print(table)
    table = Table(
        title="stages (pools run in parallel; models inside a pool take turns)", title_justify="left"
    )
    table.add_column("pool")
    table.add_column("devices", justify="right")
    for s in STAGES:
        table.add_column(f"{s} s", justify="right")
    table.add_column("peak GiB/device", justify="right")
    for p in plan.pools:
        table.add_row(
            p.name, str(p.n_devices), *(f"{p.stage_seconds[s]:.2f}" for s in STAGES), f"{p.peak_gib:.1f}"
        )
    if plan.rollout_ahead:
        r = plan.ahead
        gen, scoring = f"{r.generation_seconds:.2f}", f"{r.scoring_seconds:.2f}" if r.frozen else "-"
        pool = f"rollout (pg={r.pg}, tg={r.tg})" + (f" + {'+'.join(r.frozen)}" if r.frozen else "")
        table.add_row(pool, str(r.n_devices), gen, scoring, "-", f"{r.weight_gib + r.kv_gib:.1f}")
    table.add_row("[bold]iteration[/]", "", *(f"[bold]{plan.stage_seconds[s]:.2f}[/]" for s in STAGES), "")
    console.print(table)
    if plan.rollout_ahead:
        r = plan.ahead
        scored = f" + {'+'.join(r.frozen)} {r.scoring_seconds:.2f} s" if r.frozen else ""
        if r.frozen_pool == "both":  # the reference on both sides (ahead_both.py)
            scored += f" ({r.ref_rows_on_rollout:.0%} of the reference's rows, the rest on the training side)"
        console.print(
            f"one step ahead (trainer.rollout_ahead=1): iteration = max(generation {r.generation_seconds:.2f} s"
            f"{scored} + weight sync, "
            f"preparation + training {r.training_side_seconds:.2f} s + its share of the sync); weight sync {r.sync_seconds:.3f} s "
            f"({r.sync_bytes / 2**30:.2f} GiB per rollout device; the training side waits for "
            f"{r.sender_waits:.0%} of it) = {r.iteration_seconds:.2f} s"
        )
    table = Table(title=f"best {top} placements (each with its best allocation)", title_justify="left")
    for col in ("rank", "strategy", "pools:devices", "iteration s", "vs best"):
        table.add_column(col, justify="right" if col in ("rank", "iteration s", "vs best") else "left")
    for i, a in enumerate(plan.alternatives[:top]):
        ratio = a.iteration_seconds / plan.iteration_seconds
        table.add_row(
            str(i + 1),
            a.strategy,
            _fmt_placement(a.placement, a.allocation),
            f"{a.iteration_seconds:.1f}",
            f"{ratio:.3f}x",
        )
    console.print(table)


def old_log_probs_line(plan: Plan) -> str:
    """One line: whether each schedule priced the actor's old-log-prob forward (dataflow.py)."""
    what = {
        "actor": "a separate actor forward, priced in preparation",
        "free": "the rollout's or the update's own, no actor forward priced",
    }
    schedules = [("synchronous", plan.old_log_probs)] if plan.synchronous_seconds else []
    schedules += [("one step ahead", plan.ahead.old_log_probs)] if plan.ahead else []
    if len({source for _, source in schedules}) == 1:
        schedules = [("both schedules" if len(schedules) > 1 else schedules[0][0], schedules[0][1])]
    said = "; ".join(f"{name}: {what[source]}" for name, source in schedules)
    return f"old log-probs (as trainers/sources/base.py old_log_prob_source takes them): {said}"


def explain(plan: Plan, console) -> None:
    """The winner against the paper's fixed strategies, stage by stage."""
    from rich.table import Table

    console.print(old_log_probs_line(plan))
    if not plan.alternatives:  # one step ahead fits, no synchronous placement does
        explain_schedules(plan, console)
        return
    best = plan.alternatives[0]
    # one step ahead planned: the fixed strategies are compared with the best synchronous placement
    ref = "the best synchronous placement" if plan.rollout_ahead else "the plan"
    head = "best synchronous" if plan.rollout_ahead else "plan"
    fixed: dict = {}  # best result per strategy: alternatives are ranked, the first seen is the best
    for a in plan.alternatives:
        fixed.setdefault(a.strategy, a)
    table = Table(
        title=f"why this {'placement' if plan.rollout_ahead else 'plan'}: the fixed strategies, each with its best allocation",
        title_justify="left",
    )
    for col in ("strategy", "pools:devices", *(f"{s} s" for s in STAGES), "iteration s", f"vs {head}"):
        table.add_column(col, justify="left" if col in ("strategy", "pools:devices") else "right")
    rows = [(f"{head}: " + best.strategy, best)]
    rows += [
        (k, fixed[k]) for k in ("colocate", "split", "standalone") if k in fixed and fixed[k] is not best
    ]
    for name, a in rows:
        table.add_row(
            name, _fmt_placement(a.placement, a.allocation), *(f"{a.stage_seconds[s]:.2f}" for s in STAGES),
            f"{a.iteration_seconds:.1f}", f"{a.iteration_seconds / best.iteration_seconds:.3f}x",
        )  # fmt: skip
    console.print(table)
    for k in ("colocate", "split", "standalone"):
        if k not in fixed:
            console.print(f"- {k}: does not fit on this cluster")
            continue
        a = fixed[k]
        if a is best:
            console.print(f"- {k}: this is {ref}")
            continue
        delta = {s: a.stage_seconds[s] - best.stage_seconds[s] for s in STAGES}
        loses = [f"{s} +{v:.1f} s" for s, v in delta.items() if v > 0.05]
        gains = [f"{s} {v:.1f} s" for s, v in delta.items() if v < -0.05]
        console.print(
            f"- {k} is {a.iteration_seconds / best.iteration_seconds:.2f}x {ref}'s time: slower in "
            f"{', '.join(loses) or 'no stage'}; faster in {', '.join(gains) or 'no stage'}"
        )
    n_roles = len(plan.models)
    console.print(
        f"searched all {bell_number(n_roles)} placements of {n_roles} models; a placement missing above "
        "cannot fit in memory"
    )
    explain_schedules(plan, console)


def explain_schedules(plan: Plan, console) -> None:
    """The synchronous schedule's best plan beside the one-step-ahead one's (ahead.py)."""
    from rich.table import Table

    sync, ahead = plan.synchronous_seconds or None, plan.ahead
    table = Table(
        title="schedules: synchronous vs one step ahead (trainer.rollout_ahead)", title_justify="left"
    )
    for col in (
        "schedule",
        "pools:devices",
        "generation s",
        "prep + train s",
        "weight sync s",
        "iteration s",
        "vs plan",
    ):
        table.add_column(col, justify="left" if col in ("schedule", "pools:devices") else "right")
    if sync:
        best = plan.alternatives[0]
        g = best.stage_seconds["generation"]
        table.add_row(
            "synchronous (rollout_ahead=0)" + (" <- plan" if not plan.rollout_ahead else ""),
            _fmt_placement(best.placement, best.allocation), f"{g:.2f}", f"{sync - g:.2f}", "-",
            f"{sync:.2f}", f"{sync / plan.iteration_seconds:.3f}x",
        )  # fmt: skip
    if ahead:
        frozen = "+".join(["rollout", *ahead.frozen])
        pools = _fmt_placement(ahead.placement, ahead.allocation) + f" | {frozen}:{ahead.n_devices}"
        gen = f"{ahead.generation_seconds:.2f}" + (f"+{ahead.scoring_seconds:.2f}" if ahead.frozen else "")
        table.add_row(
            "one step ahead (rollout_ahead=1)" + (" <- plan" if plan.rollout_ahead else ""), pools,
            gen, f"{ahead.training_side_seconds:.2f}", f"{ahead.sync_seconds:.3f}",
            f"{ahead.iteration_seconds:.2f}", f"{ahead.iteration_seconds / plan.iteration_seconds:.3f}x",
        )  # fmt: skip
    console.print(table)
    if not ahead:
        console.print(
            "- one step ahead: no plan (--schedule sync, or a rollout pool of its own needs >= 2 devices "
            "and memory for the rest)"
        )
        return
    if not sync:
        console.print("- synchronous: no placement fits; one step ahead does")
        return
    rollout_side = ahead.generation_seconds + ahead.scoring_seconds
    hidden = min(rollout_side, ahead.training_side_seconds)
    verdict = "wins" if ahead.iteration_seconds < sync else "loses"
    console.print(
        f"- one step ahead {verdict} ({ahead.iteration_seconds / sync:.2f}x the synchronous iteration): it hides "
        f"{hidden:.2f} s of the shorter side behind the longer one, but generation runs on {ahead.n_devices} "
        f"of {plan.num_devices} devices and the rest on {plan.num_devices - ahead.n_devices} "
        f"(longer side {max(rollout_side, ahead.training_side_seconds):.2f} s), "
        f"and the weights move every iteration ({ahead.sync_seconds:.3f} s); responses are one step off-policy"
    )


def run(args) -> int:
    from rich.console import Console

    console = Console(width=160)
    try:
        plan, seconds = plan_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]hybridflow plan: {e}[/]")
        return 2
    print_plan(plan, console, args.top, seconds)
    if args.explain:
        explain(plan, console)
        if plan.ahead is not None:
            _, ahead_df, cluster, wl, limits = _inputs(args)
            explain_frozen_pools(plan.ahead.frozen_pool, ahead_df, cluster, wl, limits, console)
    if args.output:
        path = plan.save(args.output)
        console.print(f"plan written to {path}")
    return 0
