"""LoRA against full fine-tuning on the same ~100M Llama (docs/lora.md): peak memory per rank, checkpoint
bytes, bytes a rollout engine would be sent per step, step time.

2 CPU ranks (gloo, FSDP2 dp=2), each initialised from slices of the safetensors (meta device), the same
random RL batch and policy-gradient loss. Per mode (full, then LoRA rank 16 on all linear layers), every
rank runs `--steps` optimizer steps: step time is the median of all but the first; peak memory is the
process's anonymous memory (RssAnon, sampled every ms) at its highest during init + the steps, above the
RSS before init; checkpoint bytes are the files save_engine_state wrote (all ranks); bytes per step are
`rollout/weight_update_bytes`' definition (workers/actor.py): every parameter (fp32 here) for full
fine-tuning, the adapters for LoRA. One run; the table gives each LoRA figure as a ratio to full's.

    .venv/bin/python benchmarks/bench_lora.py [--layers 8] [--steps 4] [--out docs/bench/lora.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import _phase, build_model  # noqa: E402

MiB = 1024**2


def rank_main(rank: int, world: int, model_dir: str, work: str, mode: str, steps: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from hybridflow.checkpoint import save_engine_state
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.engines.config import LoraConfig
    from hybridflow.models import load_causal_lm, lora
    from hybridflow.models.tiny import random_rl_batch

    dist.init_process_group("gloo", init_method=f"file://{work}/init_{mode}", rank=rank, world_size=world)
    lora_cfg = LoraConfig(rank=16, alpha=32.0) if mode == "lora" else LoraConfig()
    cfg = EngineConfig(parallel=ParallelConfig(dp=world), optim=OptimConfig(lr=1e-4), lora=lora_cfg,
                       micro_batch_size_per_device=2)  # fmt: skip
    batch = random_rl_batch(32000, 4 * world, 64, 64, seed=0).chunk(world)[rank]
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(rank))

    def loss(out, mb):
        m = mb["response_mask"].float()
        return -(out["log_probs"] * mb["advantages"] * m).sum() / m.sum().clamp(min=1), {}

    times = []

    def run():
        engine = TrainEngine(load_causal_lm(model_dir, device="meta"), cfg)
        for _ in range(steps):
            start = time.perf_counter()
            engine.train_step(batch, loss)
            times.append(time.perf_counter() - start)
        return engine

    engine, mem = _phase(run)
    ckpt = Path(work) / f"ckpt_{mode}"
    save_engine_state(engine, ckpt, rank)
    params = engine.num_params() * 4
    synced = lora.adapter_bytes(engine.hf_model) if mode == "lora" else params
    result = {"peak_anon": mem["anon"], "step_s": statistics.median(times[1:]), "synced": synced,
              "ckpt": sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()), "params": params}  # fmt: skip
    Path(work, f"{mode}_{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_mode(model_dir: Path, work: Path, mode: str, steps: int, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, str(model_dir), str(work), mode, steps))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{mode}: ranks exited with {[p.exitcode for p in procs]}")
    return [json.loads((work / f"{mode}_{r}.json").read_text()) for r in range(world)]


def table(full: list[dict], lora: list[dict]) -> str:
    rows = [
        ("peak memory per rank (MiB, max over ranks)", lambda rs: max(r["peak_anon"] for r in rs) / MiB),
        ("checkpoint bytes (MiB, all ranks)", lambda rs: rs[0]["ckpt"] / MiB),
        ("bytes a rollout engine is sent per step (MiB)", lambda rs: rs[0]["synced"] / MiB),
        ("step time (s, median, max over ranks)", lambda rs: max(r["step_s"] for r in rs)),
    ]
    lines = ["| figure | full fine-tuning | LoRA r=16 | LoRA / full |", "|---|---|---|---|"]
    for name, get in rows:
        f, lo = get(full), get(lora)
        lines.append(f"| {name} | {f:.2f} | {lo:.2f} | {lo / f:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the table to this markdown file too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model(work / "model", args.layers)
        full = run_mode(work / "model", work, "full", args.steps)
        lora = run_mode(work / "model", work, "lora", args.steps)
    params = full[0]["params"] // 4
    text = f"{params / 1e6:.0f}M-parameter Llama, 2 CPU ranks (FSDP2), {args.steps} steps\n\n{table(full, lora)}\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
