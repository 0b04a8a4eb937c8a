"""The one-step-ahead schedule of trainer.rollout_ahead=1, driven from the generate phase (docs/design.md,
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
reward-model scores are computed while the actor trains on batch k; step k+1's ref / reward phases take
them (`scored`). The rule reward stays in the driver. With resources.frozen_pool=both the reference
there scores only rows [0, m) of each batch, and the training pool's reference the rest before the
update (`ref_parts`); m evens the two sides' busy time, step by step (ref_split.py).

Checkpoints: the batch in flight is waited for and written into the checkpoint (rollout_ahead/: prompts,
rollouts and the frozen models' outputs as safetensors + JSON, no pickle), with the loader already past its
prompts; a resumed run trains on that very batch, so it continues with the same lag and the same numbers
as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta
from hybridflow.checkpoint import atomic_write_text
from hybridflow.config.rollout_pool import FROZEN_ROLES
from hybridflow.controller import Future
from hybridflow.trainers.ref_split import RefSplit
from hybridflow.workers.shard_sync import split_dims
from hybridflow.workers.weight_sync import tensor_bytes

PART = "rollout_ahead"  # the checkpoint part holding the batch in flight
SYNC_TIMEOUT_S = 600.0
# a frozen model's method on a batch, and the phase its time is reported under (timing_s/<phase>)
SCORING = {"ref": ("compute_ref_log_prob", "ref"), "reward": ("compute_reward", "reward"),
           "cost": ("compute_reward", "reward")}  # fmt: skip


class RolloutAhead:
    """Driver state of the schedule: the generation in flight, the rollout pool's weight version, the
    sync group. `trainer` is the RLTrainer it serves (its groups, loader, metrics, timers)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.enabled = bool(trainer.cfg.trainer.rollout_ahead)
        self.pending: dict | None = None  # step, prompts, result and scores (Futures or Batches), version
        self.scores: dict = {}  # frozen role -> its output for the current step's batch (see `scored`)
        self.rollout_version = 0
        self._spec, self._dims, self._tg, self._connected_to = None, None, 1, None
        self._syncing: tuple[Future, Future] | None = None  # (send, receive) of the sync in flight
        # the reference's rows split between the pools (the placement built groups["ref_training"]:
        # resources.frozen_pool=both, or a plan that chose both): rows of the current batch the rollout pool
        # scored, and the busy seconds the split is balanced on (the training side's calls of the last
        # step, the rollout side's last receive)
        self.split = RefSplit(trainer.cfg.rollout.n) if "ref_training" in trainer.groups else None
        self.ref_rows: int | None = None
        self.training_calls: list[tuple[str, Future, float]] = []  # (what, call, its batch's tokens)
        self._receive_s, self._tokens, self._tokens_per_row, self._rest_tokens = 0.0, 0.0, 0.0, 0.0

    @property
    def group(self):
        return self.trainer.groups["rollout"]

    def serves(self, step: int) -> bool:
        """Whether the generate phase of `step` goes through here (the schedule is on, or a resumed run
        has this step's batch from a checkpoint)."""
        return self.enabled or self._pending_for(step)

    def _pending_for(self, step: int) -> bool:
        return self.pending is not None and self.pending["step"] == step

    def next_prompts(self, step: int) -> Batch | None:
        """The prompts of `step` when they were drawn a step ahead (else None: the loader's next)."""
        return self.pending["prompts"] if self._pending_for(step) else None

    # ---- the generate phase -------------------------------------------------------------------------
    def generate(self, prompts: Batch) -> Batch:
        trainer = self.trainer
        step = prompts.meta.global_step
        actor_version = step - 1
        if self._pending_for(step):
            p, self.pending = self.pending, None
            batch, version, self.scores = _result(p["result"]), p["version"], p["scores"]
            self._check_sync()  # received before that batch was generated
            self._balance(p, batch)
        else:  # the first step (or a schedule just turned on): nothing was drawn ahead
            self.sync(actor_version)
            p = self._issue(prompts)
            batch, version, self.scores = p["result"].get(), actor_version, p["scores"]
        self.ref_rows = p.get("ref_rows")
        if self.ref_rows and self.ref_rows < len(batch) and isinstance(self.scores.get("ref"), Batch):
            # restored from a checkpoint: the rollout pool's part of the rows is a Batch now, which cannot
            # travel beside the whole batch (the advantage phase splits its Batch arguments together), so
            # the training pool scores every row of this one batch
            del self.scores["ref"]
            self.ref_rows = 0
        self._tokens = float(batch["attention_mask"].sum())
        self._tokens_per_row = self._tokens / max(len(batch), 1)
        # tokens of the rows the training pool scores (frozen_pool=both)
        self._rest_tokens = float(batch["attention_mask"][self.ref_rows or 0 :].sum())
        trainer.metrics["rollout/policy_lag"] = float(actor_version - version)
        if self.ref_rows is not None:
            trainer.metrics["rollout/ref_rows_on_rollout_pool"] = float(self.ref_rows)
        if self.enabled and step < trainer.total_steps:
            self.sync(actor_version)
            ahead = trainer.train_loader.next_batch()
            ahead.meta.global_step = step + 1
            self.pending = {"step": step + 1, "version": self.rollout_version, **self._issue(ahead)}
        return batch

    def _issue(self, prompts: Batch) -> dict:
        """Generate `prompts` on the rollout pool and chain the frozen models there on its output (each
        rank fetches its rows of the generation itself); -> {prompts, result: the generation, scores:
        {role: scoring}, ref_rows (frozen_pool=both: the rows the reference scores here)} as Futures."""
        trainer = self.trainer
        future, scores = self.group.generate_sequences.future(prompts), {}
        out = {"prompts": prompts, "result": future, "scores": scores}
        for role in self.frozen_roles:
            method, phase = SCORING[role]
            rows = future
            if role == "ref" and self.split is not None:
                rows_next = len(prompts) * trainer.cfg.rollout.n
                out["ref_rows"] = self.split.rows_for(rows_next, self._tokens, self._tokens_per_row)
                if out["ref_rows"] == 0:
                    continue  # the training pool scores them all
                rows = future.rows(0, out["ref_rows"])
            with trainer.timers.phase(phase):  # its workers' busy time, under the phase it stands in for
                scores[role] = getattr(trainer.groups[role], method).future(rows)
        return out

    def ref_parts(self, local: Batch) -> list | None:
        """frozen_pool=both: the current batch's reference log-probs in row order: rows [0, ref_rows) as
        the rollout pool scored them, the rest issued now on the training pool; None without the split
        (the phase calls the reference's group itself)."""
        if self.split is None or self.ref_rows is None:
            return None
        parts = [self.scores.pop("ref")] if self.ref_rows else []
        if self.ref_rows < len(local):
            rest = local.index(slice(self.ref_rows, None))
            parts.append(self.trainer.groups["ref_training"].compute_ref_log_prob.future(rest))
            self.training_calls.append(("ref", parts[-1], self._rest_tokens))
        return parts

    def note_update(self, future: Future) -> None:
        """The actor's update of this step: the training side's work the split is balanced against."""
        if self.split is not None:
            self.training_calls.append(("update", future, self._tokens))

    def _balance(self, p: dict, batch: Batch) -> None:
        """Feed the split the busy seconds of `batch`, just taken (its generation and rollout-side
        reference), and of the training side's last step (update and reference on the other rows)."""
        calls, self.training_calls = self.training_calls, []
        ref = p["scores"].get("ref")
        if self.split is None or not isinstance(p["result"], Future) or isinstance(ref, Batch):
            return  # restored from a checkpoint: nothing measured
        refs = [(f.busy_seconds(), tokens) for what, f, tokens in calls if what == "ref"]
        updates = [(f.busy_seconds(), tokens) for what, f, tokens in calls if what == "update"]
        self.split.observe(
            rollout_s=self._receive_s + p["result"].busy_seconds(),
            rollout_ref_s=0.0 if ref is None else ref.busy_seconds(),
            rollout_tokens=float(batch["attention_mask"][: p["ref_rows"]].sum()),
            training_ref_s=sum(s for s, _ in refs),
            training_tokens=sum(n for _, n in refs),
            update_s=sum(s for s, _ in updates),
            update_tokens=sum(n for _, n in updates),
        )

    @property
    def frozen_roles(self) -> list[str]:
        """The frozen models this run has in the rollout pool's processes (resources.frozen_pool)."""
        trainer = self.trainer
        return [
            r
            for r in FROZEN_ROLES
            if r in trainer.groups and trainer.placement.pool_of(r) == trainer.placement.pool_of("rollout")
        ]

    def scored(self, role: str) -> Future | Batch | None:
        """Frozen model `role`'s output for the current step's batch, computed on the rollout pool (a
        Future, or a Batch restored from a checkpoint); None: the phase calls the model's group itself."""
        return self.scores.pop(role, None)

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
        trainer.metrics["sync/bytes"] = float(sum(tensor_bytes(shape, dt) for _, shape, dt in self._spec))
        trainer.metrics["sync/bytes_sent"] = self._tg * trainer.metrics["sync/bytes"]
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
        _get_both(
            trainer.actor.init_weight_sync.future(addr, port, world, 0, SYNC_TIMEOUT_S, tg),
            self.group.init_weight_sync.future(addr, port, world, 1, SYNC_TIMEOUT_S, tg),
        )
        spec = self.group.weight_spec()
        self._dims = split_dims(spec, trainer.actor.weight_shapes(), tg)  # ValueError: the models differ
        self._spec, self._tg, self._connected_to, self.rollout_version = spec, tg, self.group, 0

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Write the batch in flight (waiting for it) into checkpoint directory `directory`/rollout_ahead."""
        self._check_sync()
        if self.pending is None:
            return
        p = self.pending
        p["result"] = _result(p["result"])  # the next step uses them as they are
        out = Path(directory) / PART
        out.mkdir(parents=True, exist_ok=True)
        _save_batch(p["prompts"], out / "prompts")
        _save_batch(p["result"], out / "rollouts")
        # the scores stay Futures in flight (fetched here only to be written): a reference part of some of
        # the rows must reach the advantage phase as a Future (see generate)
        for role, scores in p["scores"].items():
            _save_batch(_result(scores), out / f"scores_{role}")
        state = {"step": self.pending["step"], "version": self.pending["version"]}
        atomic_write_text(out / "state.json", json.dumps(state))

    def load(self, directory: Path) -> None:
        """Restore the batch in flight of checkpoint `directory` (none: nothing in flight). The actor's
        weights came from the checkpoint, so the rollout pool's are stale until the next sync."""
        self.pending, self.scores, self.rollout_version = None, {}, -1
        part = Path(directory) / PART
        if part.is_dir():
            state = json.loads((part / "state.json").read_text())
            scores = {r: _load_batch(part / f"scores_{r}") for r in FROZEN_ROLES if (part / f"scores_{r}.json").is_file()}  # fmt: skip
            self.pending = {"step": int(state["step"]), "version": int(state["version"]), "scores": scores,
                            "prompts": _load_batch(part / "prompts"), "result": _load_batch(part / "rollouts")}  # fmt: skip
            if self.split is not None:
                self.pending["ref_rows"] = len(scores["ref"]) if "ref" in scores else 0
            elif "ref" in scores and len(scores["ref"]) < len(self.pending["result"]):
                del scores["ref"]  # saved with frozen_pool=both, resumed without: scored whole again

    def reset(self) -> None:
        """Forget the batch and the sync in flight (their groups are gone: a restart)."""
        self.pending, self.scores, self._syncing = None, {}, None
        self.ref_rows, self.training_calls = None, []


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


def _result(x: Future | Batch) -> Batch:
    return x.get() if isinstance(x, Future) else x


def _save_batch(batch: Batch, stem: Path) -> None:
    """A Batch as stem.safetensors (tensors) + stem.json (non-tensor fields and meta): nothing pickled."""
    from safetensors.torch import save_file

    from hybridflow.checkpoint.trainer_state import _to_json

    save_file({k: v.contiguous() for k, v in batch.tensors.items()}, f"{stem}.safetensors")
    fields = {
        "non_tensors": {k: v.tolist() for k, v in batch.non_tensors.items()},
        "meta": batch.meta.to_dict(),
    }
    atomic_write_text(Path(f"{stem}.json"), json.dumps(fields, default=_to_json))


def _load_batch(stem: Path) -> Batch:
    from safetensors.torch import load_file

    fields = json.loads(Path(f"{stem}.json").read_text())
    return Batch(load_file(f"{stem}.safetensors"), fields["non_tensors"], BatchMeta.from_dict(fields["meta"]))
