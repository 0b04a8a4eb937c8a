"""The RL dataflow as the planner sees it: which models exist and what each does in which stage.

An iteration is three stages that run one after another (docs/design.md §2): generation, preparation
(experience making: forward passes of critic / reference / reward) and training. Within a stage,
models on different device pools run in parallel and models sharing a pool run one after another,
which is all the planner needs to know about dependencies.

The built-in dataflows follow the paper's evaluation: PPO (actor, critic, reference, reward), ReMax
(no critic, one extra greedy response per prompt), GRPO (no critic, n responses per prompt) and
Safe-RLHF (PPO plus a cost model; the paper counts 5 models, so its cost critic is folded into the
critic).

The actor's preparation forward (old log-probs, pi_old of the PPO ratio) exists only where the trainer
runs one: `old_log_probs="actor"`. With one optimizer step per iteration the trainer takes them from the
rollout or from the update's own forward instead (trainers/sources/base.py `old_log_prob_source`), and
`old_log_probs="free"` prices no such forward. `old_log_prob_work` is that rule on the planner's inputs
(`hybridflow plan`); auto placement asks the trainer's own function (docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridflow.planner.specs import ModelSpec

STAGES = ("generation", "preparation", "training")
# the trainer's phases (timing_s/timeline/<phase>) each stage is measured from (trainers/plan_metrics.py)
STAGE_PHASES = {
    "generation": ("gen",),
    "preparation": ("old_log_prob", "values", "ref", "reward"),
    "training": ("update_critic", "update_actor"),
}
MIN_PHASE_SECONDS = 1e-3
"""A phase's span below which it did no work (the timers' resolution in practice): the old log-probs taken
from the update are a point in the driver's time, set before the next phase's call reaches its workers.
Counted, it would start the stage there and put that call's round trip, which the plan prices in the
rest, inside the stage."""


def stage_seconds(
    times: dict[str, float], phases: tuple[str, ...], in_driver: frozenset[str] = frozenset()
) -> float | None:
    """Wall seconds from the first of `phases` to start to the last to end, over the phases that worked
    (MIN_PHASE_SECONDS); those `in_driver` count at the start only where no worker phase worked
    (trainers/plan_metrics.py says why). None if none worked."""
    spans = {
        p: (times[f"timing_s/timeline/{p}/start"], times[f"timing_s/timeline/{p}/end"])
        for p in phases
        if f"timing_s/timeline/{p}/start" in times
    }
    spans = {p: (start, end) for p, (start, end) in spans.items() if end - start >= MIN_PHASE_SECONDS}
    if not spans:
        return None
    starts = [start for p, (start, _) in spans.items() if p not in in_driver] or [
        s for s, _ in spans.values()
    ]
    return max(end for _, end in spans.values()) - min(starts)


WORK_KINDS = ("generate", "infer", "train")  # per stage, what a model does in it
# where the old log-probs come from, as the planner prices it: a separate actor forward in preparation,
# or free (the rollout's own, or the update's own forward: trainers/sources/base.py old_log_prob_source)
OLD_LOG_PROBS = ("actor", "free")


@dataclass(frozen=True)
class ModelTask:
    """One model of the dataflow and the work it does per iteration."""

    role: str  # actor, critic, reference, reward, cost
    spec: ModelSpec
    work: tuple[tuple[str, str], ...]  # (stage, kind) pairs, e.g. (("training", "train"),)
    # sequences generated per prompt in the generation stage, relative to the workload's
    # samples_per_prompt (ReMax adds one greedy response: factor (n + 1) / n)
    generation_factor: float = 1.0

    def kinds(self) -> set[str]:
        return {k for _, k in self.work}

    @property
    def trains(self) -> bool:
        return "train" in self.kinds()

    @property
    def generates(self) -> bool:
        return "generate" in self.kinds()


@dataclass(frozen=True)
class Dataflow:
    """An algorithm's models, in a fixed order (the order fixes the plan's tie-breaking)."""

    algorithm: str
    models: tuple[ModelTask, ...] = field(default_factory=tuple)
    old_log_probs: str = "actor"  # OLD_LOG_PROBS: whether the actor's work has its preparation forward

    def __post_init__(self):
        if self.old_log_probs not in OLD_LOG_PROBS:
            raise ValueError(f"old_log_probs must be one of {OLD_LOG_PROBS}, got {self.old_log_probs!r}")
        roles = [m.role for m in self.models]
        if len(set(roles)) != len(roles):
            raise ValueError(f"dataflow {self.algorithm!r} has duplicate roles {roles}")
        if not self.models:
            raise ValueError(f"dataflow {self.algorithm!r} has no models")
        for m in self.models:
            for stage, kind in m.work:
                if stage not in STAGES or kind not in WORK_KINDS:
                    raise ValueError(f"{m.role}: unknown work ({stage!r}, {kind!r}); stages are {STAGES}")

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(m.role for m in self.models)

    def model(self, role: str) -> ModelTask:
        for m in self.models:
            if m.role == role:
                return m
        raise KeyError(f"dataflow {self.algorithm!r} has no model {role!r}; it has {self.roles}")


_OLD_LOG_PROB_FORWARD = ("preparation", "infer")
_ACTOR = (("generation", "generate"), _OLD_LOG_PROB_FORWARD, ("training", "train"))
_CRITIC = (("preparation", "infer"), ("training", "train"))
_INFER = (("preparation", "infer"),)


def build_dataflow(
    algorithm: str,
    actor: ModelSpec,
    critic: ModelSpec | None = None,
    reference: ModelSpec | None = None,
    reward: ModelSpec | None = None,
    reward_model: bool = True,
    samples_per_prompt: int = 1,
    old_log_probs: str = "actor",
) -> Dataflow:
    """The dataflow of a built-in algorithm; unspecified models default to the actor's size.

    `reward_model=False` means a rule-based reward (no model to place), as GRPO usually uses.
    `samples_per_prompt` only matters for ReMax (its extra greedy sample per prompt).
    `old_log_probs="free"` drops the actor's preparation forward (one optimizer step: `old_log_prob_work`).
    """
    algorithm = algorithm.lower().replace("_", "-")
    critic, reference, reward = critic or actor, reference or actor, reward or actor
    models = [ModelTask("actor", actor, _ACTOR)]
    if algorithm in ("ppo", "safe-rlhf"):
        models.append(ModelTask("critic", critic, _CRITIC))
    elif algorithm not in ("grpo", "remax"):
        raise ValueError(f"no built-in dataflow for {algorithm!r}; choose one of {ALGORITHMS}")
    models.append(ModelTask("reference", reference, _INFER))
    if reward_model:
        models.append(ModelTask("reward", reward, _INFER))
    if algorithm == "safe-rlhf":
        models.append(ModelTask("cost", reward, _INFER))
    if algorithm == "remax":
        models[0] = replace(models[0], generation_factor=(samples_per_prompt + 1) / samples_per_prompt)
    return with_old_log_probs(Dataflow(algorithm, tuple(models)), old_log_probs)


def with_old_log_probs(dataflow: Dataflow, old_log_probs: str) -> Dataflow:
    """`dataflow` with the actor's preparation forward priced ("actor") or not ("free")."""
    if old_log_probs not in OLD_LOG_PROBS:
        raise ValueError(f"old_log_probs must be one of {OLD_LOG_PROBS}, got {old_log_probs!r}")
    models = []
    for m in dataflow.models:
        if m.role == "actor":
            work = {w for w in m.work if w != _OLD_LOG_PROB_FORWARD}
            if old_log_probs == "actor":
                work.add(_OLD_LOG_PROB_FORWARD)
            m = replace(m, work=tuple(sorted(work, key=lambda w: STAGES.index(w[0]))))
        models.append(m)
    return Dataflow(dataflow.algorithm, tuple(models), old_log_probs)


def old_log_prob_work(
    ppo_epochs: int,
    mini_batches: int,
    kl_in_reward: bool = False,
    fp32: bool = False,
    rollout_ahead: int = 0,
    rollout_exact: bool = True,
) -> str:
    """Whether the trainer runs an actor forward for old log-probs ("actor") or not ("free"):
    trainers/sources/base.py `old_log_prob_source` on the planner's inputs (tests/planner check that the two
    agree). Several optimizer steps (epochs x mini-batches) move the weights before
    the later mini-batches, so the actor recomputes pi_old; with one step the synchronous fp32 rollout's
    own log-probs (from an engine whose log-probs are exact) or the update's own forward serve, except
    that KL in the reward reads old log-probs before the update."""
    if ppo_epochs != 1 or mini_batches != 1:
        return "actor"
    if not rollout_ahead and fp32 and rollout_exact:
        return "free"  # the rollout's own
    return "actor" if kl_in_reward else "free"  # the update's own forward


ALGORITHMS = ("ppo", "grpo", "remax", "safe-rlhf")
