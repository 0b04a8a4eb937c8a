"""Rank entry points for the multi-process engine tests: real gloo process groups, one thread each.

`run_group(world, cases, tmp)` spawns `world` processes; each runs every case (a dict: arch, model_dir,
tp, dp, engine kwargs) and rank 0 writes its results to tmp/<case name>.pt for the test to compare
against a single-process reference. Several cases share one group because starting processes costs
seconds on a 2-core machine.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_case(case: dict, out_dir: Path) -> dict:
    """Two train steps of `pg_loss` (or of the actor's loss under loss_agg_mode case["agg"]) on this rank's
    dp shard; returns what the tests compare."""
    from rl_data import actor_agg_loss, make_rl_batch, pg_loss

    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_causal_lm

    tp, dp = case["tp"], case["dp"]
    config = EngineConfig(
        parallel=ParallelConfig(tp=tp, dp=dp),
        optim=OptimConfig(lr=1e-2, grad_clip=1.0, eps=1e-6),  # eps: see test_parallel.reference
        logits_chunk_size=4,
        **case.get("engine", {}),
    )
    # meta: each rank reads only its shards from disk (sharded init) instead of loading the full model
    engine = TrainEngine(
        load_causal_lm(case["model_dir"], device="meta" if case.get("meta") else None), config
    )
    batch = make_rl_batch(engine.hf_model.config.vocab_size, **case["batch"])
    local = batch.chunk(dp)[dist.get_rank() // tp]  # tp ranks of one dp group share a shard
    log_probs, entropy = engine.compute_log_probs(local, with_entropy=True)
    loss_fn, weighting = actor_agg_loss(case["agg"]) if "agg" in case else (pg_loss, "tokens")
    metrics = engine.forward_backward(local, loss_fn, loss_weighting=weighting)
    grads = dict(engine.iter_full_grads())
    step = engine.optimizer_step()
    second = engine.train_step(local, loss_fn, loss_weighting=weighting)
    state = engine.full_state_dict()
    if case.get("save_dir"):
        engine.save_hf(case["save_dir"])
    # Gather every dp shard's log-probs and local (token-weighted) loss to rank 0.
    shards = [None] * dist.get_world_size()
    n_tokens = float(local["response_mask"].sum())
    dist.all_gather_object(shards, (log_probs, entropy, metrics["loss"], second["loss"], n_tokens))
    return {
        "log_probs": torch.cat([s[0] for s in shards[::tp]]),
        "entropy": torch.cat([s[1] for s in shards[::tp]]),
        "losses": [(s[2], s[3], s[4]) for s in shards[::tp]],
        "grads": grads,
        "step": step,
        "state": state,
        "shared_prompt_tokens": engine.take_shared_prompt_tokens(),
    }


def _rank_main(
    rank: int, world: int, init_file: str, cases: list[dict], out_dir: str, errors, runner
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # DTensor warns on every 2-D redistribute that it is "suboptimal"; expected for a (dp, tp) mesh.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        for case in cases:
            result = runner(case, Path(out_dir))
            if os.environ.get("HF_TEST_TIMING"):
                print(f"rank {rank} {case['name']} done at {time.perf_counter() - t0:.1f}s", flush=True)
            if rank == 0:
                torch.save(result, Path(out_dir) / f"{case['name']}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # surfaced by the parent: a failing rank would otherwise only hang the others
        errors.put((rank, traceback.format_exc()))
        raise


def run_group(
    world: int, cases: list[dict], out_dir: Path, timeout: float = 300, runner=run_case
) -> dict[str, dict]:
    """Each case's rank-0 result of `runner(case, out_dir)` (a module-level function: ranks import it)."""
    # forkserver with torch/transformers preloaded: the imports (seconds each on a loaded 2-core
    # machine) are paid once by the server, not once per rank; ranks are forked before any thread starts.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "hybridflow.engines", "hybridflow.models", "rl_data"]
    )
    errors = ctx.SimpleQueue()
    init_file = str(out_dir / f"init_{world}")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, init_file, cases, str(out_dir), errors, runner))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"ranks exited with {[p.exitcode for p in procs]}")
    return {c["name"]: torch.load(out_dir / f"{c['name']}.pt", weights_only=False) for c in cases}
