"""One RL step's batch while its phases run as futures, and the advantage phase that runs on a worker.

After generation the driver holds the rollout (it needs the responses: rule rewards, ReMax's
baseline, metrics). The phases that only read the rollout (old and reference log-probs, values,
reward and cost models) are issued at once as futures on their groups; their outputs stay in the
object store. The advantage phase, `make_experience`, runs on rank 0 of the actor group
(`Worker.apply`): it receives the rollout (from the object store where the generation's output is
large, with the fields the driver added: `Pending.rollout_parts`) and every future, joins them, shapes the rewards (KL in
the reward), computes the algorithm's advantages and the batch metrics, and returns the finished
batch as a future that the critic and actor updates slice, each rank its own rows. So no tensor
computed by values / ref / reward passes through the driver; the driver reads back only the
metrics (and the KL / Lagrange statistics it keeps as state), published beside the output.

Why on a worker rather than in the driver (docs/design.md §3): the advantages need every phase's
output, and the driver would have to fetch them all and send the result back out. Why whole on one
rank rather than sharded: GRPO / RLOO groups, REINFORCE++'s and GAE's whitening, the KL controller
and the Lagrange multiplier all take statistics over the whole batch; computed whole, the numbers
are exactly those of the driver-side computation, whatever the placement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms import apply_kl_penalty
from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta
from hybridflow.controller import Future, get
from hybridflow.trainers.metrics import data_metrics
from hybridflow.workers import token_level

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import AlgorithmConfig
    from hybridflow.trainers.sources import StepBatch


# Below this a rollout goes out whole from the driver: resolving the generation's Future costs its consumer
# two more round trips, and at 0.2 MB that was slower; from 1.4 MB the Future was faster
# (benchmarks/bench_controller.py, docs/bench/controller.md).
ROWS_FROM_STORE_BYTES = 1 << 20


class Pending:
    """The batch of a step in flight: `step` (what the rollout source handed over: trainers/sources),
    `local` (a Batch the driver holds: the rollout, rule scores) and `parts` (futures of phase outputs,
    same rows; a Batch where a checkpoint restored one). After the advantage phase, `experience` is the
    future of the finished batch. Reading a field the driver does not hold fetches the parts (tests
    inspect finished batches that way); the trainer itself never does during a step."""

    def __init__(self, step: StepBatch):
        self.step, self.local, self.parts = step, step.rollout, []
        self.added: set[str] = set()  # the fields the driver set on `local` (rule scores, baselines, ...)
        self.experience: Future | None = None
        self._fetched: Batch | None = None

    def rollout_parts(self) -> list[Future | Batch]:
        """The rollout as a call's arguments: where the source kept the generation's Future and the rows
        pass ROWS_FROM_STORE_BYTES, its rows from the object store and a Batch of what the driver added
        (those fields and the meta), so the driver does not send every row out again; else the driver's
        copy, whole."""
        if self.step.generated is None or self.local.nbytes() < ROWS_FROM_STORE_BYTES:
            return [self.local]
        return [self.step.generated, self.local.select(sorted(self.added))]

    def add(self, part: Future | Batch) -> Pending:
        self.parts.append(part)
        return self

    @property
    def meta(self) -> BatchMeta:
        return self.local.meta

    def fetch(self) -> Batch:
        """The whole batch, fetched into the driver (once)."""
        if self._fetched is None:
            if self.experience is not None:
                self._fetched = get(self.experience)
            else:
                self._fetched = join(self.local, *get(self.parts))
        return self._fetched

    def __len__(self) -> int:
        return len(self.local)

    def __setitem__(self, key: str, value) -> None:
        self.local[key] = value
        self.added.add(key)

    def __getitem__(self, key: str):
        return self.local[key] if key in self.local else self.fetch()[key]

    def __contains__(self, key: str) -> bool:
        return key in self.local or key in self.fetch()

    def keys(self) -> list[str]:
        return self.fetch().keys()


def join(*parts: Batch) -> Batch:
    """The fields of every part on the rows of the first. A part with fewer rows is a row slice of a
    phase's output (resources.frozen_pool=both: the reference scores rows [0, m) on the rollout pool and
    rows [m, B) on the training pool): consecutive slices are stacked, in the order given, until they
    cover the batch. A part without fields adds its meta (the driver's, beside the generation's rows)."""
    batch, rows, pieces = parts[0], len(parts[0]), []
    for p in parts[1:]:
        if not p.keys():
            batch = batch.union(p)  # its meta only
            continue
        if pieces or len(p) < rows:
            pieces.append(p)
            if sum(len(x) for x in pieces) < rows:
                continue
            p, pieces = Batch.concat(pieces), []
        if len(p) != rows:
            raise ValueError(f"a phase's output has {len(p)} rows, the batch {rows}")
        batch = batch.union(p)
    if pieces:
        raise ValueError(f"row slices of {sum(len(x) for x in pieces)} rows do not cover the batch of {rows}")
    return batch


def make_experience(advantage_fn, algo: AlgorithmConfig, kl_coef: float, state: dict, *parts: Batch) -> Batch:
    """Runs on the actor group's rank 0 (Worker.apply). parts: the rollout and the phases' outputs.

    Sequence scores (`scores` from a rule, else the reward model's `rm_scores`) go on each
    response's last token, less beta * KL when algorithm.kl.in_reward; then `advantage_fn(batch,
    algo, state)` (the algorithm's pure estimator, e.g. ppo.gae_advantages) adds advantages and
    returns and may return metrics. Returns the finished batch; its metrics (with data_metrics) go
    to the driver in meta.call_info."""
    batch = join(*parts)
    if "scores" not in batch:
        batch["scores"] = batch["rm_scores"]
    batch["token_level_scores"] = token_level(batch["scores"], batch["response_mask"])
    metrics: dict[str, float] = {}
    if algo.kl.in_reward:
        batch["token_level_rewards"], kl = apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"],
            batch["response_mask"], kl_coef, algo.kl.kind,
        )  # fmt: skip
        metrics.update({"actor/reward_kl_penalty": float(kl), "actor/reward_kl_penalty_coeff": kl_coef})
    else:
        batch["token_level_rewards"] = batch["token_level_scores"]
    metrics.update(advantage_fn(batch, algo, state) or {})
    metrics.update(data_metrics(batch))
    batch.meta.call_info = metrics
    return batch
