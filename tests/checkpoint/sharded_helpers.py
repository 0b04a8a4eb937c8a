"""Rank entry point for the sharded init / checkpoint test: real gloo groups of 4 and 2 processes.

Phase "save" (4 ranks): a meta-built engine reads its shards from disk (init stats recorded), computes
log-probs of the whole batch, takes step 1 on its dp shard, saves (each rank its shards), takes step 2;
then a fresh engine on the same 4 ranks resumes and redoes step 2.
Phase "resume" (2 ranks): a fresh engine resumes the 4-rank checkpoint and redoes step 2.
Rank 0 writes what the test compares to <run_dir>/<phase>.pt.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch


def _engine(model_dir: str, dp: int):
    from ckpt_helpers import engine_config

    from hybridflow.engines import TrainEngine
    from hybridflow.models import load_causal_lm

    return TrainEngine(load_causal_lm(model_dir, device="meta"), engine_config(dp=dp))


def rank_main(rank: int, world: int, phase: str, model_dir: str, run_dir: str, errors) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        from ckpt_helpers import make_batch, pg_loss

        from hybridflow.checkpoint import CheckpointManager, load_engine_state, save_engine_state

        init = f"file://{run_dir}/init_{phase}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        manager = CheckpointManager(run_dir)
        engine = _engine(model_dir, world)
        batch = make_batch(engine.hf_model.config.vocab_size, batch_size=8, seed=4)
        local = batch.chunk(world)[rank]
        out = {"init_stats": engine.init_stats}
        if phase == "save":
            out["log_probs_init"] = engine.compute_log_probs(batch)[0]
            engine.train_step(local, pg_loss)
            out["log_probs_step1"] = engine.compute_log_probs(batch)[0]
            tmp = manager.begin(1) if rank == 0 else None
            holder = [tmp]
            dist.broadcast_object_list(holder)
            save_engine_state(engine, Path(holder[0]) / "actor", rank)
            if rank == 0:
                manager.commit(1, Path(holder[0]))
            dist.barrier()
            out["draw"] = torch.rand(2)  # the generators as saved
            out["step2"] = engine.train_step(local, pg_loss)
            out["state2"] = engine.full_state_dict()
            engine = _engine(model_dir, world)  # a fresh process's engine on the same 4 ranks
        torch.manual_seed(1000 + rank)  # a resumed process starts from other RNG states
        load_engine_state(engine, manager.resolve("auto") / "actor", rank)
        out["resumed_draw"] = torch.rand(2)  # per-rank RNG restored on the same world size only
        out["resumed_step2"] = engine.train_step(local, pg_loss)
        out["resumed_state2"] = engine.full_state_dict()
        stats = [None] * world
        dist.all_gather_object(stats, (engine.init_stats, out.get("draw"), out["resumed_draw"]))
        out["all_init_stats"] = [s[0] for s in stats]
        out["draws"] = [s[1:] for s in stats]
        if rank == 0:
            torch.save(out, Path(run_dir) / f"{phase}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
