"""The pipeline measured on 2 gloo CPU ranks (bench_pipeline.py --measured): a ~100M Llama trained with the
actor's TrainEngine at p = 1 (FSDP2 over d = 2) and at p = 2 (two stages, d = 1), fp32, padded rows of
SEQ tokens, micro-batches of ROWS rows, the same global batch of m micro-batches.

Each layout runs in a fresh pair of processes, so a rank's peak RSS (ru_maxrss) is that layout's: after
building the engine (weights and their shards) and after two training steps (AdamW state, activations,
gradients). Per step: the second step's wall time. The wall-clock bubble of a p = 2 step is the share of
it a rank is not computing: 1 - m c / T, c the time its stage takes to run one micro-batch's forward and
backward alone (no pipeline, no communication; median of the m runs), T the pipelined step's time; the
textbook's is (p - 1) / (m + p - 1). It includes the sends and receives, which the textbook does not
count. The switch to generation (tg = 1, every rank gets the whole model) is timed and its bytes counted
at p = 1 (FSDP's all-gather, hybrid_engine/resharder.py) and p = 2 (the stage exchange,
pipeline_switch.py) on the same 2 ranks, the mean of three switches.
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, SEQ, ROWS = 2, 128, 1
# (hidden, layers, heads, kv heads, intermediate, vocab): 12 x 6.3M in the layers + 2 x 12.6M embeddings
# and lm_head = 101M parameters
MODEL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=16384)  # fmt: skip
CASES = [(1, 4), (2, 4), (2, 8)]  # (p, m)


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _batch(vocab: int, m: int):
    from hybridflow.models.tiny import random_rl_batch

    half = SEQ // 2  # full-length rows: the pipelined and unpipelined engines compute the same tokens
    return random_rl_batch(vocab, m * ROWS, half, half, seed=0, min_prompt_len=half, min_response_len=half)


def _loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["log_probs"] * mb["advantages"] * mask).sum() / mask.sum(), {}


def _stage_compute(engine, batch) -> float:
    """Median seconds of one micro-batch's forward and backward through this rank's stage alone."""
    stage, times = engine.pipeline.stage, []
    stage.configure(SEQ // 2)
    hidden = engine.hf_model.config.hidden_size
    for mb in batch.split(ROWS):
        ints = (mb["input_ids"], mb["attention_mask"], mb["position_ids"])
        start = time.perf_counter()
        if stage.first:
            out = stage(*ints)[0]
        else:
            out = stage(torch.randn(ROWS, SEQ, hidden, requires_grad=True), *ints)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _switch(engine, pp: int) -> dict:
    """Mean seconds and bytes received of three train -> generate -> train switches, tg = 1."""
    from hybridflow.hybrid_engine.pipeline_switch import PipelineResharder
    from hybridflow.hybrid_engine.resharder import Resharder

    r = PipelineResharder(engine, None) if pp > 1 else Resharder(engine)
    seconds = []
    for _ in range(3):
        with r.generation():
            pass
        seconds.append(r.stats.seconds)
    return {"switch_s": statistics.mean(seconds), "switch_bytes": r.stats.bytes_received,
            "switch_formula": r.stats.formula_bytes}  # fmt: skip


def _rank(rank: int, pp: int, m: int, model_dir: str, init: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_causal_lm

    base = _rss_gb()  # the interpreter, torch and transformers, before any weight
    dp = WORLD // pp
    config = EngineConfig(parallel=ParallelConfig(pp=pp, dp=dp), optim=OptimConfig(lr=1e-5),
                          micro_batch_size_per_device=ROWS, remove_padding=False, mixed_precision="none")  # fmt: skip
    engine = TrainEngine(load_causal_lm(model_dir, device="meta"), config)
    out = {"base_gb": base, "built_gb": _rss_gb()}
    batch = _batch(engine.hf_model.config.vocab_size, m)
    local = batch.chunk(dp)[rank % dp] if dp > 1 else batch
    engine.train_step(local, _loss)  # the first step allocates AdamW's state
    dist.barrier()
    start = time.perf_counter()
    engine.train_step(local, _loss)
    out["step_s"] = time.perf_counter() - start
    out["peak_gb"] = _rss_gb()
    if pp > 1:
        out["bubble"] = 1 - m * _stage_compute(engine, batch) / out["step_s"]
    out.update(_switch(engine, pp))
    results[rank] = out
    dist.destroy_process_group()


def run_case(pp: int, m: int, model_dir: str) -> list[dict]:
    """Every rank's figures for layout p = pp over 2 ranks and m micro-batches."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, (pp, m, model_dir, f"file://{tmp}/store", results), nprocs=WORLD)
        return [results[r] for r in range(WORLD)]


def main() -> None:
    from hybridflow.models.tiny import save_tiny_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model(f"{tmp}/model", "medium", "llama", seed=0, **MODEL))
        runs = {case: run_case(*case, model_dir) for case in CASES}
    print(f"{'p':>2}{'m':>3}  {'base GB':>7}  {'built GB':>8}  {'peak GB':>7}  {'step s':>6}  {'bubble':>6}  {'textbook':>8}"
          f"  {'switch MB':>9}  {'formula MB':>10}  {'switch s':>8}")  # fmt: skip
    for (p, m), ranks in runs.items():
        top = {k: max(r.get(k, 0.0) for r in ranks) for k in ranks[0]}  # the slowest / largest rank
        bubble = statistics.mean(r["bubble"] for r in ranks) if p > 1 else 0.0
        print(f"{p:>2}{m:>3}  {top['base_gb']:>7.2f}  {top['built_gb']:>8.2f}  {top['peak_gb']:>7.2f}  {top['step_s']:>6.2f}  "
              f"{bubble:>6.3f}  {(p - 1) / (m + p - 1):>8.3f}  {top['switch_bytes'] / 1e6:>9.1f}  "
              f"{top['switch_formula'] / 1e6:>10.1f}  {top['switch_s']:>8.3f}")  # fmt: skip
    base, pipe = runs[CASES[0]], runs[CASES[1]]
    ratio = {
        k: max(r[k] for r in pipe) / max(r[k] for r in base) for k in ("peak_gb", "switch_bytes", "switch_s")
    }
    print(f"p=2 / p=1 at m={CASES[0][1]}: peak RSS {ratio['peak_gb']:.2f}x, switch bytes "
          f"{ratio['switch_bytes']:.2f}x, switch time {ratio['switch_s']:.2f}x")  # fmt: skip
