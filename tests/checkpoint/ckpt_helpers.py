"""Shared by the engine checkpoint tests: a synthetic RL batch, a loss, and the 2-rank gloo entry point."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

from hybridflow.batch import Batch
from hybridflow.models.tiny import random_rl_batch


def make_batch(vocab_size: int, batch_size: int = 8, lp: int = 5, lr: int = 6, seed: int = 0) -> Batch:
    """Left-padded prompts, right-padded responses, random advantages."""
    return random_rl_batch(vocab_size, batch_size, lp, lr, seed)


def pg_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["log_probs"] * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1), {}


def engine_config(dp: int = 1):
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig

    # warmup makes the LR schedule's position matter; weight decay makes the step count matter
    optim = OptimConfig(lr=2e-2, warmup_steps=3, weight_decay=0.1)
    return EngineConfig(parallel=ParallelConfig(dp=dp), optim=optim, micro_batch_size_per_device=4)


def _rank_main(rank: int, world: int, model_dir: str, run_dir: str, tmp_dir: str, errors) -> None:
    """Each rank: step 1, save (rank 0 commits as the driver would), step 2; then a fresh engine loads
    the checkpoint and redoes step 2. Rank 0 writes what the test compares."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        from hybridflow.checkpoint import CheckpointManager, load_engine_state, save_engine_state
        from hybridflow.engines import TrainEngine
        from hybridflow.models import load_causal_lm

        dist.init_process_group("gloo", init_method=f"file://{run_dir}/init", rank=rank, world_size=world)
        torch.manual_seed(100 + rank)
        engine = TrainEngine(load_causal_lm(model_dir), engine_config(dp=world))
        batch = make_batch(engine.hf_model.config.vocab_size, seed=4)
        local = batch.chunk(world)[rank]
        engine.train_step(local, pg_loss)
        save_engine_state(engine, Path(tmp_dir) / "actor", rank)
        if rank == 0:
            CheckpointManager(run_dir).commit(1, Path(tmp_dir))
        dist.barrier()
        draw = torch.rand(2)
        loss2 = engine.train_step(local, pg_loss)["loss"]
        state2 = engine.full_state_dict()

        torch.manual_seed(7)  # a resumed process starts from other RNG states
        resumed = TrainEngine(load_causal_lm(model_dir), engine_config(dp=world))
        step_dir = CheckpointManager(run_dir).resolve("auto")
        load_engine_state(resumed, step_dir / "actor", rank)
        loaded = resumed.full_state_dict()
        draw_b = torch.rand(2)
        loss2_b = resumed.train_step(local, pg_loss)["loss"]
        state2_b = resumed.full_state_dict()
        out = [None] * world
        dist.all_gather_object(out, (draw, draw_b, loss2, loss2_b))
        if rank == 0:
            torch.save(
                {"ranks": out, "state2": state2, "state2_b": state2_b, "loaded": loaded},
                Path(run_dir) / "result.pt",
            )
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
