"""Weight sync from the actor's pool to the rollout pool (trainer.rollout_ahead=1; docs/design.md,
"One-step-ahead rollout").

The two pools are separate worker groups, each with its own torch.distributed process group. The sync
uses a third one that spans actor rank 0 and every rank of the rollout pool (gloo on CPU, NCCL on GPU),
built from a TCPStore on actor rank 0's node beside the pools' own groups. After an update every actor
rank takes part in gathering the full tensors (the FSDP2 / TP all-gathers are collectives over the
actor's group: engines/train_engine.iter_full_state_dict) and actor rank 0 broadcasts them, packed into
buckets of one dtype; each rollout rank streams them into its engine's load_weights as they arrive: the
built-in engine copies them into its model in place (rollout/base.load_named_weights), vLLM into its own
weights (rollout/vllm_engine.py, reload in place; nothing touches disk).

The sender does not wait for its broadcasts: each bucket is a copy (the flat tensor it was packed into),
so actor rank 0 returns as soon as they are issued and starts the next update while the collective
backend's own threads push the bytes (gloo's worker threads; NCCL's stream). Only the rollout pool, which
needs the weights before it generates, waits for them. The next sync (or a new sync group) first waits
for the previous one's broadcasts; at most SEND_INFLIGHT_BYTES of buckets are held at once, so a large
model's sync overlaps its last SEND_INFLIGHT_BYTES with the update and waits for the rest.

Both sides walk the same list of (name, shape, dtype), the rollout model's state dict without tied
duplicates, so they cut the same buckets without sending any layout information per sync. A tensor-parallel
rollout pool (rollout.tg > 1, built-in engine) holds only its generation shards, so the spec has their
shapes and each rank is sent only its slice, over a subgroup per TP index (workers/shard_sync.py).
"""

from __future__ import annotations

import datetime
import math
import socket

import torch
import torch.distributed as dist

from hybridflow.controller import Protocol, register
from hybridflow.hybrid_engine.sync_budget import BUCKET_BYTES, SEND_INFLIGHT_BYTES
from hybridflow.models.lora import hf_name, is_adapter
from hybridflow.workers.shard_sync import build_subgroups, send_shards


def plan_buckets(spec: list, bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `spec` ([name, shape, dtype] entries) cut into consecutive buckets of one dtype and at
    most `bucket_bytes` each (a larger tensor gets a bucket of its own)."""
    buckets, size, dtype = [], 0, None
    for i, (_, shape, dt) in enumerate(spec):
        nbytes = tensor_bytes(shape, dt)
        if not buckets or dt != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += nbytes
    return buckets


def tensor_bytes(shape: list, dtype: str) -> int:
    """Bytes of one spec entry's tensor (shape, dtype name as in weight_spec): what a sync sends of it."""
    return math.prod(shape) * _dtype(dtype).itemsize


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _broadcast(group, tensor: torch.Tensor, wait: bool = True):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([tensor], opts)
    return work.wait() if wait else work


class WeightSyncMixin:
    """Worker methods of the sync; mixed into ActorRolloutRefWorker (sender: its actor engine, rank 0;
    receiver: a rollout-only worker's model)."""

    @register(Protocol.RANK_ZERO)
    def weight_sync_address(self) -> tuple[str, int]:
        """Open the sync group's rendezvous socket on this node's address (not every interface), kept open
        for init_weight_sync; -> (address, port)."""
        import ray

        addr = ray.util.get_node_ip_address()
        self._sync_socket = socket.create_server((addr, 0), backlog=1024)
        return addr, self._sync_socket.getsockname()[1]

    @register(Protocol.ONE_TO_ALL)
    def init_weight_sync(
        self, addr: str, port: int, world: int, first_rank: int, timeout_s: float, tg: int = 1
    ) -> None:
        """Join the sync group as rank first_rank + this rank; an actor group passes first_rank=0 and only
        its rank 0 joins (the other actor ranks only help gather). All members must call concurrently.
        tg > 1 (a rollout pool holding generation shards): also the subgroups of the shard-only sync."""
        if first_rank == 0 and self.rank != 0:
            return
        self._sending = []  # a previous group's broadcasts are abandoned with it (its peers are gone)
        rank, timeout = first_rank + self.rank, datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = dist.TCPStore(addr, port, world, True, timeout, wait_for_workers=False,
                                  master_listen_fd=self._sync_socket.fileno())  # fmt: skip
        else:
            store = dist.TCPStore(addr, port, world, False, timeout)

        def make(store, rank, world):
            if self.context.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                return dist.ProcessGroupNCCL(store, rank, world, opts)
            return dist.ProcessGroupGloo(store, rank, world, timeout)

        self._sync_store, self._sync_group = store, make(store, rank, world)
        self._sync_subgroups = build_subgroups(store, rank, world, tg, make) if tg > 1 else []

    @register(Protocol.RANK_ZERO)
    def weight_sync_tg(self) -> int:
        """How many slices of a split tensor the rollout pool's ranks hold: its generation TP size when
        they hold only their shards (the built-in engine, rollout/pool_tp.py), else 1 (whole weights)."""
        return self.pool_tp.size if self.pool_tp is not None else 1

    @register(Protocol.RANK_ZERO)
    def weight_spec(self) -> list:
        """[name, shape, dtype] of the tensors a sync carries: the rollout model's state dict, tied
        duplicates left out (copying the first updates its twin)."""
        model = self.rollout.model  # on the meta device when vLLM holds the weights: names and shapes only
        first = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}  # no twins
        return [
            [name, list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name, t in model.state_dict().items()
            if name in first and t.is_floating_point()
        ]

    @register(Protocol.RANK_ZERO)
    def weight_shapes(self) -> dict:
        """The actor's full (unsharded) shape of each tensor a sync can send, to check a spec against: with
        LoRA the merged weights under their HF names (iter_full_state_dict merges the adapters)."""
        live = self._engine("actor").hf_model.state_dict().items()
        return {hf_name(n): list(t.shape) for n, t in live if not is_adapter(n)}

    @register(Protocol.ONE_TO_ALL)
    def send_weights(self, spec: list, dims: list | None = None) -> dict:
        """Every actor rank gathers the full tensors; rank 0 issues the broadcasts of the spec's, in
        buckets, and returns without waiting for them (the module docstring says why and how long the
        buckets are kept). dims: per spec entry, the dimension a shard-only sync cuts it along
        (shard_sync.split_dims). -> sync/bytes (what each rollout rank receives; 0 on the other actor
        ranks), sync/bytes_sent (all rank 0 broadcast)."""
        gathered = self._engine("actor").iter_full_state_dict(device=self.device)
        if self.rank != 0:
            for _ in gathered:  # each gather is a collective over the actor's group
                pass
            return {"sync/bytes": 0.0, "sync/bytes_sent": 0.0}
        self.finish_send()
        if self._sync_subgroups:
            return send_shards(
                gathered, spec, dims, self._sync_subgroups, self._send_async, plan_buckets(spec)
            )
        wanted, have, sent = {s[0] for s in spec}, {}, 0
        for bucket in plan_buckets(spec):
            for i in bucket:
                while spec[i][0] not in have:
                    name, t = next(gathered)
                    if name in wanted:
                        have[name] = t
            dtype = _dtype(spec[bucket[0]][2])
            flat = torch.cat([have.pop(spec[i][0]).to(dtype).reshape(-1) for i in bucket])  # a copy
            self._sending.append((_broadcast(self._sync_group, flat, wait=False), flat))
            sent += flat.numel() * flat.element_size()
            while sum(f.numel() * f.element_size() for _, f in self._sending) > SEND_INFLIGHT_BYTES:
                self._sending.pop(0)[0].wait()
        for _ in gathered:
            pass
        return {"sync/bytes": float(sent), "sync/bytes_sent": float(sent)}

    def _send_async(self, group, flat: torch.Tensor) -> None:
        """Issue shard_sync's broadcast of `flat` (a copy) over `group`, held as send_weights' own are."""
        self._sending.append((_broadcast(group, flat, wait=False), flat))
        while sum(f.numel() * f.element_size() for _, f in self._sending) > SEND_INFLIGHT_BYTES:
            self._sending.pop(0)[0].wait()

    def finish_send(self) -> None:
        """Wait for the broadcasts of the last send_weights (raises if one failed)."""
        sending, self._sending = getattr(self, "_sending", []), []
        for work, _ in sending:
            work.wait()

    @register(Protocol.ONE_TO_ALL)
    def receive_weights(self, spec: list) -> dict:
        """Receive the buckets from actor rank 0 into this rank's rollout engine, in place (over the
        subgroup of this rank's TP index when it holds a shard). -> sync/bytes received."""
        received = [0]
        group = self._sync_subgroups[0] if self._sync_subgroups else self._sync_group

        def stream():  # each bucket is received when the engine's loader reaches it
            for bucket in plan_buckets(spec):
                numels = [math.prod(spec[i][1]) for i in bucket]
                flat = torch.empty(sum(numels), dtype=_dtype(spec[bucket[0]][2]), device=self.device)
                _broadcast(group, flat)
                received[0] += flat.numel() * flat.element_size()
                yield from ((spec[i][0], p.view(spec[i][1])) for i, p in zip(bucket, flat.split(numels)))

        weights = stream()
        self.rollout.load_weights(weights)  # in place: the built-in engine's model, or vLLM's own copy
        for _ in weights:  # every bucket is a collective with the sender, whatever the loader read
            pass
        return {"sync/bytes": float(received[0])}
