"""Training throughput of TrainEngine on the ~25M-parameter ("medium") tiny Llama, CPU.

One run, side by side with the named baseline: a plain Hugging Face loop (full-logits forward,
masked token-mean loss, torch AdamW, 1 process). Rows: the engine in one process, the engine with
token-budget micro-batches, and FSDP2 over 2 gloo ranks. Every process uses 1 thread, so the 2-rank
rows show data-parallel scaling over the machine's 2 cores (the machine is shared: timings are
noisy). tokens/s counts attended (non-pad) tokens of the batch per optimizer step; peak RSS is each
process's resident high-water mark (VmHWM, includes Python + torch + transformers).

    .venv/bin/python benchmarks/bench_train.py [--steps 2] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.batch import Batch
from hybridflow.models.tiny import random_rl_batch


def make_batch(vocab: int, batch: int, lp: int, lr: int, seed: int = 0) -> Batch:
    # at least a quarter of each prompt/response is real tokens, ids >= 5 (clear of special tokens)
    return random_rl_batch(
        vocab, batch, lp, lr, seed, min_prompt_len=lp // 4, min_response_len=lr // 4, min_token_id=5
    )


def pg_loss(out, mb):
    m = mb["response_mask"].float()
    return -(out["log_probs"] * mb["advantages"] * m).sum() / m.sum().clamp(min=1), {}


def peak_rss_gb() -> float:
    """VmHWM: this process's resident high-water mark (unlike ru_maxrss it is not inherited over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def time_steps(step, steps: int) -> float:
    step()  # warm-up (allocations, lazy init)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def run_hf_baseline(model_dir, batch: Batch, steps: int, threads: int) -> dict:
    from hybridflow.models import load_causal_lm

    torch.set_num_threads(threads)
    model = load_causal_lm(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    lr = batch["responses"].shape[1]

    def step():
        model.train()
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, -lr - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][..., None]).squeeze(-1)
        loss, _ = pg_loss({"log_probs": lp}, batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return {"sec": time_steps(step, steps), "rss": peak_rss_gb()}


def run_engine(model_dir, batch: Batch, steps: int, threads: int, engine_kwargs: dict) -> dict:
    from hybridflow.engines import EngineConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_causal_lm

    torch.set_num_threads(threads)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = TrainEngine(
        load_causal_lm(model_dir), EngineConfig(parallel=ParallelConfig(dp=world), **engine_kwargs)
    )
    local = batch.chunk(world)[dist.get_rank() if world > 1 else 0]
    sec = time_steps(lambda: engine.train_step(local, pg_loss), steps)
    return {"sec": sec, "rss": peak_rss_gb()}


def _rank(rank, world, init_file, model_dir, batch, steps, engine_kwargs, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result = run_engine(model_dir, batch, steps, 1, engine_kwargs)
    queue.put((rank, result))
    dist.destroy_process_group()


def _single(fn, args, queue):
    queue.put(fn(*args))


def in_fresh_process(fn, *args) -> dict:
    """Run one configuration in its own process, so its peak RSS is its own."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    p = ctx.Process(target=_single, args=(fn, args, queue))
    p.start()
    result = queue.get()
    p.join()
    return result


def run_fsdp(world, model_dir, batch, steps, engine_kwargs) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    init_file = tempfile.mktemp(prefix="bench_train_init_")
    procs = [
        ctx.Process(target=_rank, args=(r, world, init_file, model_dir, batch, steps, engine_kwargs, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    results = dict(queue.get() for _ in range(world))
    return {"sec": max(r["sec"] for r in results.values()), "rss": [results[r]["rss"] for r in range(world)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    args = parser.parse_args()

    from hybridflow.models import load_causal_lm
    from hybridflow.models.tiny import save_tiny_model

    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "medium", "medium", "llama", seed=0)
    model = load_causal_lm(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    batch = make_batch(model.config.vocab_size, args.batch, args.prompt_len, args.response_len)
    tokens = int(batch["attention_mask"].sum())
    budget = args.batch * (args.prompt_len + args.response_len) // 4
    rows = [
        (
            "HF loop (baseline), 1 proc x 1 thread, full batch",
            in_fresh_process(run_hf_baseline, model_dir, batch, args.steps, 1),
        ),
        (
            "TrainEngine, 1 proc x 1 thread, micro-batch 8",
            in_fresh_process(run_engine, model_dir, batch, args.steps, 1, {"micro_batch_size_per_device": 8}),
        ),
        (
            f"TrainEngine, 1 proc x 1 thread, token budget {budget}",
            in_fresh_process(
                run_engine, model_dir, batch, args.steps, 1, {"max_tokens_per_micro_batch": budget}
            ),
        ),
        (
            "TrainEngine FSDP2, 2 ranks x 1 thread, micro-batch 8",
            run_fsdp(2, str(model_dir), batch, args.steps, {"micro_batch_size_per_device": 8}),
        ),
        (
            f"TrainEngine FSDP2, 2 ranks x 1 thread, token budget {budget}",
            run_fsdp(2, str(model_dir), batch, args.steps, {"max_tokens_per_micro_batch": budget}),
        ),
    ]
    base = tokens / rows[0][1]["sec"]
    print(
        f"\nmodel: tiny 'medium' Llama, {n_params / 1e6:.1f}M params; batch {args.batch} x (<= {args.prompt_len} prompt "
        f"+ <= {args.response_len} response), {tokens} attended tokens; {args.steps} timed steps after 1 warm-up; "
        f"{os.cpu_count()} CPU cores\n"
    )
    print("| configuration | s / step | tokens/s | vs baseline | peak RSS per rank (GB) |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        rss = r["rss"] if isinstance(r["rss"], list) else [r["rss"]]
        tps = tokens / r["sec"]
        print(
            f"| {name} | {r['sec']:.2f} | {tps:.0f} | {tps / base:.2f}x | {', '.join(f'{x:.2f}' for x in rss)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
