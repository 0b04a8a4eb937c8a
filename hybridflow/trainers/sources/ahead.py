"""The one-step-ahead schedule of trainer.rollout_ahead=1, a rollout source (base.py; docs/design.md,
"One-step-ahead rollout").

Step k takes the batch the rollout pool generated during step k-1, syncs the actor's weights (version
k-1: the updates so far) to the rollout pool, and issues the generation of step k+1's prompts as a Future
before the rest of the step runs; the actor trains on batch k meanwhile. So batch k was sampled with
weights one update older than those it is trained from: rollout/policy_lag = 1 (0 at the first step,
which has nothing drawn ahead), corrected in the loss by truncated importance weights (workers/losses.py).

Versions count the actor updates: the actor runs step k with version k-1; a batch remembers the version
of the rollout weights that sampled it. A new rollout pool holds model.path's weights (version 0).

Frozen models on the rollout pool (resources.frozen_pool=rollout, the default): the reference, reward and
cost models live in the rollout pool's processes and score each batch there right after generating it,
chained on the generation's Future (no pass through the driver), so batch k+1's reference log-probs and
reward-model scores are computed while the actor trains on batch k; they reach step k+1's ref / reward
phases in its StepBatch's `scored`. The rule reward stays in the driver. With resources.frozen_pool=both
the reference there scores only rows [0, m) of each batch, and the training pool's reference the rest
before the update (`_ref_parts`); m evens the two sides' busy time, step by step (ref_split.py).

Checkpoints: the batch in flight (an InFlight, base.py) is waited for and written into the checkpoint
(rollout_ahead/: prompts, rollouts and the frozen models' outputs as safetensors + JSON, no pickle), with
the loader already past its prompts; a resumed run trains on that very batch, so it continues with the same lag and the same numbers
as an uninterrupted one.
"""

from __future__ import annotations

import time

from hybridflow.batch import Batch
from hybridflow.config.rollout_pool import FROZEN_ROLES
from hybridflow.controller import Future
from hybridflow.trainers.ref_split import RefSplit
from hybridflow.trainers.sources.base import InFlight, RolloutSource, StepBatch
from hybridflow.workers.shard_sync import split_dims
from hybridflow.workers.weight_sync import tensor_bytes, verify_enabled

# The sync group's collective timeout. Actor rank 0's broadcasts wait in the backend until the rollout pool
# has finished the generation queued before its receive, so the timeout must outlast the longest generation:
# shorter, and NCCL's watchdog ends a healthy run. A dead peer is found sooner (_get_both), a hung one by
# trainer.hang_timeout_s.
SYNC_TIMEOUT_S = 6 * 3600.0


class OneStepAheadSource(RolloutSource):
    """The batch in flight (`in_flight`), the rollout pool's weight version and the sync group; with the
    reference on both pools, the split of each batch's rows and the busy seconds it is balanced on."""

    on_policy = False
    times_generation = False  # the generate phase takes a batch generated during the last step
    roles = {"rollout": {}}  # a rollout-only worker group on a pool of its own

    def __init__(self, trainer):
        super().__init__(trainer)
        self.rollout_version = 0
        self.metrics: dict[str, float] = {}  # sync/* of the syncs issued since the last batch
        self._spec, self._dims, self._tg, self._connected_to = None, None, 1, None
        self._syncing: tuple[Future, Future] | None = None  # (send, receive) of the sync in flight
        # the placement built groups["ref_training"] (resources.frozen_pool=both, or a plan that chose
        # both): the training side's calls of the last step and the rollout side's last receive
        self.split = RefSplit(trainer.cfg.rollout.n) if "ref_training" in trainer.groups else None
        self.training_calls: list[tuple[str, Future, float]] = []  # (what, call, its batch's tokens)
        self._receive_s, self._tokens, self._tokens_per_row = 0.0, 0.0, 0.0

    @property
    def group(self):
        return self.trainer.groups["rollout"]

    # ---- the step's batch ------------------------------------------------------------------------------
    def batch(self, prompts: Batch) -> StepBatch:
        """Take the batch issued a step ago (the first step: generate it now), then issue the next
        step's; with the reference split, score this batch's other rows on the training pool."""
        trainer = self.trainer
        step = prompts.meta.global_step
        actor_version = step - 1
        p = self.take_in_flight(step)
        if p is not None:
            rollout = p.rollouts.get() if isinstance(p.rollouts, Future) else p.rollouts
            self._check_sync()  # received before that batch was generated
            self._balance(p, rollout)
        else:  # the first step (or a schedule just turned on): nothing was drawn ahead
            self.sync(actor_version)
            p = self._issue(prompts, step)
            rollout = p.rollouts.get()
        self._tokens = float(rollout["attention_mask"].sum())
        self._tokens_per_row = self._tokens / max(len(rollout), 1)
        if step < trainer.total_steps:
            self.sync(actor_version)
            ahead = trainer.train_loader.next_batch()
            ahead.meta.global_step = step + 1
            self.in_flight = self._issue(ahead, step + 1)
        metrics, self.metrics = self.metrics, {}
        split = self.split is not None and p.ref_rows is not None
        if split:
            metrics["rollout/ref_rows_on_rollout_pool"] = float(p.ref_rows)
        frozen = {r: [f] for r, f in p.frozen.items()}
        out = self.step_batch(rollout, prompts, frozen, actor_version - p.version, metrics)
        if split:  # issued after the next step's sync and generation, which go first
            out.scored["ref"] = self._ref_parts(out.scored.pop("ref", []), p.ref_rows, out.rollout)
        return out

    def _issue(self, prompts: Batch, step: int) -> InFlight:
        """Generate `prompts` on the rollout pool and chain the frozen models there on its output (each
        rank fetches its rows of the generation itself), all as Futures."""
        trainer = self.trainer
        future = self.group.generate_sequences.future(prompts)
        p = InFlight(step, self.rollout_version, prompts, future)
        for role in self.frozen_roles:
            rows = future
            if role == "ref" and self.split is not None:
                rows_next = len(prompts) * trainer.cfg.rollout.n
                p.ref_rows = self.split.rows_for(rows_next, self._tokens, self._tokens_per_row)
                if p.ref_rows == 0:
                    continue  # the training pool scores them all
                rows = future.rows(0, p.ref_rows)
            p.frozen[role] = self.chain_on_rollout(role, rows)
        return p

    def _ref_parts(self, scored: list, ref_rows: int, rollout: Batch) -> list:
        """frozen_pool=both: the batch's reference log-probs in row order: rows [0, ref_rows) as the
        rollout pool scored them, the rest issued now on the training pool."""
        if ref_rows < len(rollout):
            rest = rollout.index(slice(ref_rows, None))
            with self.trainer.timers.phase("ref"):
                scored.append(self.trainer.groups["ref_training"].compute_ref_log_prob.future(rest))
            tokens = float(rollout["attention_mask"][ref_rows:].sum())
            self.training_calls.append(("ref", scored[-1], tokens))
        return scored

    def note_update(self, update: Future) -> None:
        """The actor's update of this step: the training side's work the split is balanced against."""
        if self.split is not None:
            self.training_calls.append(("update", update, self._tokens))

    def _balance(self, p: InFlight, batch: Batch) -> None:
        """Feed the split the busy seconds of `batch`, just taken (its generation and rollout-side
        reference), and of the training side's last step (update and reference on the other rows)."""
        calls, self.training_calls = self.training_calls, []
        ref = p.frozen.get("ref")
        if self.split is None or p.restored or isinstance(ref, Batch):
            return  # restored from a checkpoint: nothing measured
        refs = [(f.busy_seconds(), tokens) for what, f, tokens in calls if what == "ref"]
        updates = [(f.busy_seconds(), tokens) for what, f, tokens in calls if what == "update"]
        self.split.observe(
            rollout_s=self._receive_s + p.rollouts.busy_seconds(),
            rollout_ref_s=0.0 if ref is None else ref.busy_seconds(),
            rollout_tokens=float(batch["attention_mask"][: p.ref_rows].sum()),
            training_ref_s=sum(s for s, _ in refs),
            training_tokens=sum(n for _, n in refs),
            update_s=sum(s for s, _ in updates),
            update_tokens=sum(n for _, n in updates),
        )

    @property
    def frozen_roles(self) -> list[str]:
        """The frozen models this run has in the rollout pool's processes (resources.frozen_pool); not a
        LoRA run's reference, which is the actor's own group (its adapters off)."""
        trainer, groups = self.trainer, self.trainer.groups
        return [
            r
            for r in FROZEN_ROLES
            if r in groups
            and groups[r] is not groups.get("actor_rollout")
            and trainer.placement.pool_of(r) == trainer.placement.pool_of("rollout")
        ]

    # ---- weight sync --------------------------------------------------------------------------------
    def sync(self, version: int) -> None:
        """Bring the rollout pool to the actor's weights (of `version`) unless it has them already.

        Issued, not awaited: the actor's rank 0 returns once its broadcasts are queued (workers/
        weight_sync.py) and goes on to the update, the rollout ranks receive before the generation the
        driver queues behind (a group runs its calls in order). The sizes are checked when the next
        sync, a checkpoint or the next step's batch is due (`_check_sync`)."""
        self._connect()
        if self.rollout_version == version:
            return
        trainer = self.trainer
        self._check_sync()
        with trainer.timers.phase("weight_sync"):  # the workers' busy time: in effect, the rollout's receive
            self._syncing = (
                trainer.actor.send_weights.future(self._spec, self._dims),
                self.group.receive_weights.future(self._spec),
            )
        # sync/bytes: what each rollout rank receives (the spec's shapes: its shard when rollout.tg > 1);
        # sync/bytes_sent: what actor rank 0 broadcasts in all (one equal payload per TP index)
        self.metrics["sync/bytes"] = float(sum(tensor_bytes(shape, dt) for _, shape, dt in self._spec))
        self.metrics["sync/bytes_sent"] = self._tg * self.metrics["sync/bytes"]
        self.rollout_version = version

    def _check_sync(self) -> None:
        """Wait for the sync in flight (if any): a failure on either side is raised at once, and the
        rollout ranks must have received every byte the actor sent."""
        if self._syncing is None:
            return
        pair, self._syncing = self._syncing, None
        sent, received = _get_both(*pair)
        self._receive_s = pair[1].busy_seconds()
        if {m["sync/bytes"] for m in received} != {max(m["sync/bytes"] for m in sent)}:
            raise RuntimeError(
                f"weight sync: sent {sent[0]} to each rollout rank but they received {received}"
            )

    def _connect(self) -> None:
        """Build the sync group (actor rank 0 + the rollout ranks) once per pair of groups; a new rollout
        pool (first use, or after a restart) holds model.path's weights, version 0."""
        trainer = self.trainer
        if self._connected_to is self.group:
            return
        addr, port = trainer.actor.weight_sync_address()
        world, tg = 1 + self.group.world_size, self.group.weight_sync_tg()  # tg > 1: shard-only sync
        verify = verify_enabled()
        _get_both(
            trainer.actor.init_weight_sync.future(addr, port, world, 0, SYNC_TIMEOUT_S, tg, verify),
            self.group.init_weight_sync.future(addr, port, world, 1, SYNC_TIMEOUT_S, tg, verify),
        )
        spec = self.group.weight_spec()
        self._dims = split_dims(spec, trainer.actor.weight_shapes(), tg)  # ValueError: the models differ
        self._spec, self._tg, self._connected_to, self.rollout_version = spec, tg, self.group, 0

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self, directory) -> None:
        """Write the batch in flight (waiting for it) into the checkpoint; the sync in flight is checked."""
        self._check_sync()
        super().save(directory)

    def load(self, directory) -> None:
        """The actor's weights came from the checkpoint, so the rollout pool's are stale until the next sync."""
        super().load(directory)
        self.rollout_version = -1

    def reset(self) -> None:
        """Forget the batch and the sync in flight (their groups are gone: a restart)."""
        super().reset()
        self._syncing, self.training_calls = None, []


def _get_both(a: Future, b: Future) -> tuple:
    """Both results; whichever side fails first is raised at once (its partner would otherwise wait in the
    collective until SYNC_TIMEOUT_S), so a dead worker reaches the trainer's restart without that wait."""
    pending = [a, b]
    while pending:
        for f in [f for f in pending if f.done()]:
            f.wait()  # raises WorkerError / WorkerDiedError naming the group and rank
            pending.remove(f)
        if pending:
            time.sleep(0.002)
    return a.get(), b.get()
