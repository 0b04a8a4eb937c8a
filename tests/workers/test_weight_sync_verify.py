"""The rollout_ahead weight sync's verify mode (workers/weight_sync.py) between two real gloo processes
(torch.multiprocessing, no Ray): the sync group is built and warmed as the workers build it, the buckets
stream into the receiver's loader, and a bucket whose checksum differs from the sender's is named."""

from __future__ import annotations

import os
import socket
import tempfile
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from hybridflow.workers import weight_sync
from hybridflow.workers.weight_sync import WeightSyncMixin, checksum, plan_buckets

# three buckets: two fp32 tensors, then a bf16 one and a second fp32 run (one dtype a bucket)
SPEC = [["a", [4, 3], "float32"], ["b", [5], "float32"], ["c", [2, 2], "bfloat16"], ["d", [3], "float32"]]


def _weights() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=gen).to(getattr(torch, dt)) for n, shape, dt in SPEC}


class _Side(WeightSyncMixin):
    """One end of the sync with what the mixin reads of a worker: its rank, device, backend, the actor
    engine's full weights (sender) or a rollout engine's loader (receiver)."""

    def __init__(self):
        self.rank, self.device = 0, torch.device("cpu")  # rank in its own group: both are rank 0 there
        self.context = SimpleNamespace(backend="gloo")
        self.loaded: dict = {}
        self.rollout = SimpleNamespace(
            load_weights=lambda ws: self.loaded.update((n, t.clone()) for n, t in ws)
        )
        engine = SimpleNamespace(iter_full_state_dict=lambda device: iter(_weights().items()))
        self._engine = lambda role: engine


def _run(rank: int, port_file: str, corrupt_bucket: int, results) -> None:
    torch.set_num_threads(1)
    side = _Side()
    if corrupt_bucket >= 0 and rank == 0:  # the sender reports a wrong checksum for one bucket
        real, calls = weight_sync.checksum, []

        def wrong(flat):
            calls.append(None)
            return real(flat) + (len(calls) - 1 == corrupt_bucket)

        weight_sync.checksum = wrong
    try:
        if rank == 0:
            side._sync_socket = socket.create_server(("127.0.0.1", 0), backlog=16)
            with open(port_file + ".tmp", "w") as f:
                f.write(str(side._sync_socket.getsockname()[1]))
            os.replace(port_file + ".tmp", port_file)
            port = side._sync_socket.getsockname()[1]
        else:
            while not os.path.exists(port_file):
                pass
            port = int(open(port_file).read())
        side.init_weight_sync("127.0.0.1", port, 2, rank, 60.0, 1, verify=True)
        if rank == 0:
            results[rank] = side.send_weights(SPEC)
            side.finish_send()
        else:
            results[rank] = (side.receive_weights(SPEC), {n: t.float() for n, t in side.loaded.items()})
    except RuntimeError as e:
        results[rank] = str(e)


def _sync(corrupt_bucket: int = -1) -> dict:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run, args=(os.path.join(tmp, "port"), corrupt_bucket, results), nprocs=2)
        return dict(results)


def test_checksum_is_exact_and_sees_a_swap():
    x = torch.randn(1000)
    assert torch.equal(checksum(x), checksum(x.clone()))
    y = x.clone()
    y[3] = torch.nextafter(y[3], torch.tensor(float("inf")))  # one ulp
    assert not torch.equal(checksum(x), checksum(y))
    z = x.clone()
    z[[1, 2]] = z[[2, 1]]
    assert not torch.equal(checksum(x), checksum(z))
    assert torch.equal(checksum(x.bfloat16()), checksum(x.bfloat16().clone()))


def test_verified_sync_delivers_every_tensor_and_names_a_changed_bucket():
    assert len(plan_buckets(SPEC)) == 3
    ok = _sync()
    (received, loaded) = ok[1]
    assert received["sync/bytes"] == ok[0]["sync/bytes"] > 0
    for name, t in _weights().items():
        assert torch.equal(loaded[name], t.float()), name
    bad = _sync(corrupt_bucket=1)[1]
    assert isinstance(bad, str) and "weight sync verify: 1 of 3 buckets arrived changed" in bad, bad
    assert "first bucket 1 holding ['c']" in bad
