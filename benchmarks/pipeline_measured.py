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

The bubble table (bench_pipeline.py --bubble, `bubble_main`): the wall-clock bubble of each schedule the
trainer runs (parallel.pp_schedule: gpipe, 1f1b, interleaved_1f1b with v = 2 stages a rank) at p = 2 for
m in BUBBLE_M, on a smaller Llama (BUBBLE_MODEL, 8 layers: 4 stages under interleaving), against the
textbook's (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1). One pair of processes builds one
engine per schedule; per m, a warm-up pass, then TRIALS times: T, the pipelined forward_backward (no
optimizer step), and right after it c, one micro-batch's forward and backward through every stage the rank
holds, alone (median of m); bubble = 1 - m c / T, the median of the trials, the mean of the two ranks.
Measuring c beside each T keeps both under the same load; the sends and receives are still in the bubble.
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
# the bubble table's model: 8 x 3.1M in the layers + 2 x 4.2M embeddings and lm_head = 33M parameters
BUBBLE_MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=1536, vocab_size=8192)  # fmt: skip
BUBBLE_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # schedule: stages a rank (v)
BUBBLE_M, TRIALS = (4, 8), 3


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _batch(vocab: int, m: int):
    from hybridflow.models.tiny import random_rl_batch

    half = SEQ // 2  # full-length rows: the pipelined and unpipelined engines compute the same tokens
    return random_rl_batch(vocab, m * ROWS, half, half, seed=0, min_prompt_len=half, min_response_len=half)


def _loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["log_probs"] * mb["advantages"] * mask).sum() / mask.sum(), {}


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
        out["bubble"] = 1 - m * _compute_alone(engine, batch) / out["step_s"]
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


def _compute_alone(engine, batch) -> float:
    """Median seconds of one micro-batch's forward and backward through every stage this rank holds, alone
    (random hidden states in, ones as the output gradient; no pipeline, no communication)."""
    stage, times = engine.pipeline.stage, []
    stage.configure(SEQ // 2)
    hidden = engine.hf_model.config.hidden_size
    for mb in batch.split(ROWS):
        ints = (mb["input_ids"], mb["attention_mask"], mb["position_ids"])
        start = time.perf_counter()
        for chunk in range(len(stage.stages)):
            x = ints if stage.is_first(chunk) else (torch.randn(ROWS, SEQ, hidden, requires_grad=True), *ints)
            out = stage(*x, chunk=chunk)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bubble_rank(rank: int, model_dir: str, init: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_causal_lm

    out = {}
    for name, v in BUBBLE_SCHEDULES.items():
        parallel = ParallelConfig(pp=WORLD, dp=1, pp_schedule=name, pp_virtual_stages=max(v, 2))
        config = EngineConfig(parallel=parallel, optim=OptimConfig(lr=1e-5), micro_batch_size_per_device=ROWS,
                              remove_padding=False, mixed_precision="none")  # fmt: skip
        engine = TrainEngine(load_causal_lm(model_dir, device="meta"), config)
        for m in BUBBLE_M:
            batch = _batch(engine.hf_model.config.vocab_size, m)
            engine.forward_backward(batch, _loss)  # warm-up: the first pass allocates
            trials = []
            for _ in range(TRIALS):
                dist.barrier()
                start = time.perf_counter()
                engine.forward_backward(batch, _loss)
                step = time.perf_counter() - start
                compute = _compute_alone(engine, batch)
                trials.append((1 - m * compute / step, step, compute))
            out[name, m] = sorted(trials)[len(trials) // 2]
        del engine
    results[rank] = out
    dist.destroy_process_group()


def bubble_main() -> None:
    """The bubble table: each schedule's measured bubble against the textbook's, as a ratio."""
    from hybridflow.models.tiny import save_tiny_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        model_dir = str(save_tiny_model(f"{tmp}/model", "medium", "llama", seed=0, **BUBBLE_MODEL))
        results = manager.dict()
        mp.spawn(_bubble_rank, (model_dir, f"file://{tmp}/store", results), nprocs=WORLD)
        ranks = [results[r] for r in range(WORLD)]
    p = WORLD
    print(f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)")
    print(
        f"{'schedule':<18}{'p':>3}{'v':>3}{'m':>4}  {'T s':>6}  {'c s':>6}  {'bubble':>6}  {'textbook':>8}  ratio"
    )
    for name, v in BUBBLE_SCHEDULES.items():
        for m in BUBBLE_M:
            bubble, step, compute = (statistics.mean(r[name, m][i] for r in ranks) for i in range(3))
            textbook = (p - 1) / (v * m + p - 1)
            print(f"{name:<18}{p:>3}{v:>3}{m:>4}  {step:>6.2f}  {compute:>6.3f}  {bubble:>6.3f}  {textbook:>8.3f}  "
                  f"{bubble / textbook:.2f}x")  # fmt: skip
