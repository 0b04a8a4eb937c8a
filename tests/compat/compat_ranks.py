"""Rank entry points for the shim tests: real gloo groups of 2 processes (spawned).

`gather_main`: the all-gather call sites (compat/dist.py through TPGroup.gather_last and
CountedComm.all_gather_into) with torch's new name present, then hidden as on torch 2.11/2.12.
`shards_main`: DTensor shards saved on a 2-rank mesh, loaded into other placements through DCP's reader
and through the fallback reader (DCP's hf_storage hidden). Each rank puts what it got on `results`.
"""

from __future__ import annotations

import io
import os
import sys
import traceback
import warnings

import torch


def _put(results, rank: int, value) -> None:
    """Tensors as bytes: a tensor put on a queue as is shares its storage by a file descriptor that the
    rank's exit can close before the test reads it."""
    if not isinstance(value, str):
        buf = io.BytesIO()
        torch.save(value, buf)
        value = buf.getvalue()
    results.put((rank, value))


def _init(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _gathers(rank: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from hybridflow.hybrid_engine.comm import CountedComm
    from hybridflow.rollout.tp_group import TPGroup

    tp = TPGroup(group=dist.group.WORLD, size=2, src=0)
    logits = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank  # (rows, vocab / tg)
    out = torch.empty(8)
    comm = CountedComm()
    comm.all_gather_into(out, torch.arange(4, dtype=torch.float32) + 100 * rank, dist.group.WORLD)
    return {"logits": tp.gather_last(logits), "flat": out, "bytes": torch.tensor(comm.stats.bytes_received)}


def gather_main(rank: int, world: int, init_file: str, results) -> None:
    try:
        import torch.distributed as dist

        _init(rank, world, init_file)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new = _gathers(rank)
        deprecated = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        had_new = hasattr(dist, "all_gather_single")
        if had_new:
            delattr(dist, "all_gather_single")  # torch 2.11 / 2.12: only all_gather_into_tensor
        old = _gathers(rank)
        _put(results, rank, {"new": new, "old": old, "deprecated": deprecated, "had_new": had_new})
        dist.destroy_process_group()
    except Exception:
        _put(results, rank, traceback.format_exc())


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors saved: uneven first dims (5 rows over 2 ranks), a scalar, an int tensor."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 4, generator=g),
        "v": torch.randn(3, 6, generator=g),
        "r": torch.randn(7, generator=g),
        "step": torch.tensor(12.0),
        "ids": torch.arange(10, dtype=torch.int64).view(2, 5),
    }


def _sharded(mesh, saved: bool) -> dict[str, torch.Tensor]:
    """The state as DTensors: saved with one set of placements, loaded into another (zeros)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = full_tensors()
    places = (
        {"w": Shard(0), "v": Shard(1), "r": Replicate(), "step": Replicate(), "ids": Shard(0)}
        if saved
        else {"w": Shard(1), "v": Shard(0), "r": Shard(0), "step": Replicate(), "ids": Shard(1)}
    )
    return {
        n: distribute_tensor(t if saved else torch.zeros_like(t), mesh, [places[n]]) for n, t in full.items()
    }


def shards_main(rank: int, world: int, init_file: str, directory: str, results) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from hybridflow.checkpoint.shards import load_tensors, save_tensors

        _init(rank, world, init_file)
        mesh = init_device_mesh("cpu", (world,))
        save_tensors(_sharded(mesh, saved=True), directory)
        got = {}
        for path in ("dcp", "fallback"):
            if path == "fallback":
                import torch.distributed.checkpoint as dcp

                sys.modules["torch.distributed.checkpoint.hf_storage"] = None  # an import of it now fails

                def no_dcp(*args, **kwargs):
                    raise AssertionError("the fallback reader must not go through DCP")

                dcp.load = no_dcp
            state = _sharded(mesh, saved=False)
            load_tensors(state, directory)
            got[path] = {n: t.full_tensor() for n, t in state.items()}
        _put(results, rank, got)
        dist.destroy_process_group()
    except Exception:
        _put(results, rank, traceback.format_exc())
