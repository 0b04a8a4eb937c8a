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

The group is warmed when it is built (one element broadcast over it and each subgroup), so the first sync
does not also pay NCCL's lazy communicator set-up inside the overlap it exists for. With VERIFY_ENV=1 in the
driver's environment (the test suite sets it) every bucket carries an exact checksum: actor rank 0 sends
the integer sums of the bytes of each bucket it broadcast after the last one, and each rollout rank
compares them with what it received; a difference names the bucket's tensors.

Both sides walk the same list of (name, shape, dtype), the rollout model's state dict without tied
duplicates, so they cut the same buckets without sending any layout information per sync. A tensor-parallel
rollout pool (rollout.tg > 1, built-in engine) holds only its generation shards, so the spec has their
shapes and each rank is sent only its slice, over a subgroup per TP index (workers/shard_sync.py).
"""

from __future__ import annotations

import datetime
import math
import os
import socket

import torch
import torch.distributed as dist

from hybridflow.controller import Protocol, register
from hybridflow.hybrid_engine.sync_budget import BUCKET_BYTES, SEND_INFLIGHT_BYTES
from hybridflow.models.lora import hf_name, is_adapter
from hybridflow.workers.shard_sync import build_subgroups, send_shards

VERIFY_ENV = "HYBRIDFLOW_VERIFY_SYNC"
RENDEZVOUS_TIMEOUT_S = 600.0


def verify_enabled() -> bool:
    """Whether the driver asks the sync to check every bucket (VERIFY_ENV=1 in its environment)."""
    return os.environ.get(VERIFY_ENV, "") == "1"


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """An exact, order-free checksum of a bucket, on its device: the sum of its elements' bits as integers
    and that sum weighted by position (a swap of two values changes it), int64 (2,). Integer sums do not
    depend on the reduction order, so two ranks of different thread counts or devices agree bit for bit."""
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    bits = bits.to(torch.int64)
    index = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack((bits.sum(), (bits * index).sum()))


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
        self,
        addr: str,
        port: int,
        world: int,
        first_rank: int,
        timeout_s: float,
        tg: int = 1,
        verify: bool = False,
    ) -> None:
        """Join the sync group as rank first_rank + this rank; an actor group passes first_rank=0 and only
        its rank 0 joins (the other actor ranks only help gather). All members must call concurrently.
        tg > 1 (a rollout pool holding generation shards): also the subgroups of the shard-only sync.
        verify: every bucket's checksum is sent and checked (module docstring)."""
        if first_rank == 0 and self.rank != 0:
            return
        self._sending = []  # a previous group's broadcasts are abandoned with it (its peers are gone)
        self._sync_verify, self._sync_sums = verify, {}
        rank, timeout = first_rank + self.rank, datetime.timedelta(seconds=timeout_s)
        # the rendezvous has no generation to wait for: its members call together
        meet = datetime.timedelta(seconds=min(timeout_s, RENDEZVOUS_TIMEOUT_S))
        if rank == 0:
            store = dist.TCPStore(addr, port, world, True, meet, wait_for_workers=False,
                                  master_listen_fd=self._sync_socket.fileno())  # fmt: skip
        else:
            store = dist.TCPStore(addr, port, world, False, meet)

        def make(store, rank, world):
            if self.context.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                return dist.ProcessGroupNCCL(store, rank, world, opts)
            return dist.ProcessGroupGloo(store, rank, world, timeout)

        self._sync_store, self._sync_group = store, make(store, rank, world)
        self._sync_subgroups = build_subgroups(store, rank, world, tg, make) if tg > 1 else []
        for group in [self._sync_group, *self._sync_subgroups]:  # NCCL builds its communicator lazily
            _broadcast(group, torch.zeros(1, device=self.device))

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
            out = send_shards(
                gathered, spec, dims, self._sync_subgroups, self._send_async, plan_buckets(spec)
            )
            self._send_checksums()
            return out
        wanted, have, sent = {s[0] for s in spec}, {}, 0
        for bucket in plan_buckets(spec):
            for i in bucket:
                while spec[i][0] not in have:
                    name, t = next(gathered)
                    if name in wanted:
                        have[name] = t
            dtype = _dtype(spec[bucket[0]][2])
            flat = torch.cat([have.pop(spec[i][0]).to(dtype).reshape(-1) for i in bucket])  # a copy
            self._send_async(self._sync_group, flat)
            sent += flat.numel() * flat.element_size()
        for _ in gathered:
            pass
        self._send_checksums()
        return {"sync/bytes": float(sent), "sync/bytes_sent": float(sent)}

    def _send_async(self, group, flat: torch.Tensor) -> None:
        """Issue the broadcast of bucket `flat` (a copy) over `group`, held until its bytes are sent (the
        module docstring); its checksum noted when verifying."""
        if self._sync_verify:
            self._sync_sums.setdefault(group, []).append(checksum(flat))
        self._sending.append((_broadcast(group, flat, wait=False), flat))
        while sum(f.numel() * f.element_size() for _, f in self._sending) > SEND_INFLIGHT_BYTES:
            self._sending.pop(0)[0].wait()

    def _send_checksums(self) -> None:
        """Verifying: broadcast each group's bucket checksums after its last bucket."""
        sums, self._sync_sums = self._sync_sums, {}
        for group, per_bucket in sums.items():
            flat = torch.stack(per_bucket)
            self._sending.append((_broadcast(group, flat, wait=False), flat))

    def finish_send(self) -> None:
        """Wait for the broadcasts of the last send_weights (raises if one failed)."""
        sending, self._sending = getattr(self, "_sending", []), []
        for work, _ in sending:
            work.wait()

    @register(Protocol.ONE_TO_ALL)
    def receive_weights(self, spec: list) -> dict:
        """Receive the buckets from actor rank 0 into this rank's rollout engine, in place (over the
        subgroup of this rank's TP index when it holds a shard). -> sync/bytes received."""
        received, sums = [0], []
        group = self._sync_subgroups[0] if self._sync_subgroups else self._sync_group
        buckets = plan_buckets(spec)

        def stream():  # each bucket is received when the engine's loader reaches it
            for bucket in buckets:
                numels = [math.prod(spec[i][1]) for i in bucket]
                flat = torch.empty(sum(numels), dtype=_dtype(spec[bucket[0]][2]), device=self.device)
                _broadcast(group, flat)
                received[0] += flat.numel() * flat.element_size()
                if self._sync_verify:  # before the loader can touch the bucket's views
                    sums.append(checksum(flat))
                yield from ((spec[i][0], p.view(spec[i][1])) for i, p in zip(bucket, flat.split(numels)))

        weights = stream()
        self.rollout.load_weights(weights)  # in place: the built-in engine's model, or vLLM's own copy
        for _ in weights:  # every bucket is a collective with the sender, whatever the loader read
            pass
        if self._sync_verify:
            self._check_checksums(group, spec, buckets, torch.stack(sums))
        return {"sync/bytes": float(received[0])}

    def _check_checksums(self, group, spec: list, buckets: list, got: torch.Tensor) -> None:
        """Receive the sender's bucket checksums and compare them with `got`, this rank's (one host read
        a sync); RuntimeError naming the first bucket that differs and its tensors."""
        sent = torch.empty_like(got)
        _broadcast(group, sent)
        bad = (sent != got).any(1).nonzero().flatten().tolist()
        if bad:
            names = [spec[i][0] for i in buckets[bad[0]]]
            raise RuntimeError(
                f"weight sync verify: {len(bad)} of {len(buckets)} buckets arrived changed on rollout rank "
                f"{self.rank}, first bucket {bad[0]} holding {names[:4]}{' ...' if len(names) > 4 else ''}"
            )
