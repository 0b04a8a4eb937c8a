"""The micro-benchmarks behind a device profile (profile.py): each coefficient of the cost model, timed alone.

    gemm            (rows x w) @ (w x w) at widths 32..1024: FLOP/s per width, fitted to the simulator's
                    rate(w) = peak * w / (w + half_width) (least squares on 1/rate = 1/peak + half/peak / w)
    bandwidth       a 128 MiB copy: bytes read + written per second (what a decode step's weight reads see)
    layer overhead  a tiny Llama's forward on one token with 9 layers minus with 1, per layer: the fixed
                    Python and dispatch cost a layer adds beyond its FLOPs
    decode step     HF generate's seconds per new token on a 1-layer model, less that layer's overhead:
                    sampling, cache bookkeeping and the generate loop
    activations     a tiny Llama's forward + backward at 32 and 2,048 tokens: the seconds per activation
                    value its non-matmul ops write (norms, rotary, SiLU, softmax), beyond its GEMMs
    collectives     gloo all-reduce between two processes: 4 bytes (latency) and 8 MiB (bandwidth)
    sync waits      two processes doing the same chunks of work, with a barrier after each and without: what
                    a collective costs where the ranks reach it from work of their own, at two chunk sizes
    start-up        a fresh Python importing torch and transformers (recorded; paid once per run, so the
                    per-iteration model does not price it)

Each timing is the fastest of a few repeats after a warm-up, on `threads` torch threads (a CPU "device" is
one worker process with HYBRIDFLOW_CPU_THREADS threads). On a GPU the compute figures are the GPU's; the
links keep the catalogue's (two-rank NCCL needs two GPUs; docs/planner.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

WIDTHS = (32, 64, 128, 256, 512, 1024)
GEMM_ROWS = 1024


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_seconds(fn, repeats: int = 5, device: str = "cpu", min_s: float = 0.02) -> float:
    """Seconds of one call of `fn`: the fastest of `repeats` samples, each looping until `min_s` passed
    (short calls average). The fastest, not the median: on a shared machine the others are other
    processes' time, which no coefficient of this device should carry."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        samples.append(elapsed / n)
    return min(samples)


def onednn(dtype: torch.dtype, device: str) -> bool:
    """Whether a run's fp32 linear layers go through oneDNN here (model.cpu_gemm=auto, the default:
    models/cpu_gemm.py), so the profile times the products the engines run."""
    import hybridflow.models.cpu_gemm as cpu_gemm

    return dtype == torch.float32 and cpu_gemm.resolve("auto", device)


def gemm_rates(dtype: torch.dtype, device: str = "cpu", repeats: int = 5) -> dict[str, float]:
    """FLOP/s of (GEMM_ROWS x w) @ (w x w) per width w (keys are strings: a profile's JSON keeps them so),
    through the library a run's linear layers use (`onednn`)."""
    import hybridflow.models.cpu_gemm as cpu_gemm

    mm = cpu_gemm.matmul if onednn(dtype, device) else (lambda a, b: a @ b.t())
    rates = {}
    for w in WIDTHS:
        a = torch.randn(GEMM_ROWS, w, device=device).to(dtype)
        b = torch.randn(w, w, device=device).to(dtype)
        seconds = best_seconds(lambda a=a, b=b: mm(a, b), repeats, device)
        rates[str(w)] = 2.0 * GEMM_ROWS * w * w / seconds
    return rates


def fit_gemm(rates: dict[str, float]) -> tuple[float, float]:
    """(peak FLOP/s, half width) of rate(w) = peak * w / (w + half) closest to `rates` in log space: for
    each half width on a geometric grid (0 and 1..4096) the best peak is the geometric mean of
    rate * (w + half) / w, and the pair with the least squared log error wins."""
    best = (math.inf, 0.0, 0.0)
    for half in [0.0] + [2 ** (k / 4) for k in range(49)]:
        logs = [math.log(r * (int(w) + half) / int(w)) for w, r in rates.items()]
        log_peak = sum(logs) / len(logs)
        err = sum((x - log_peak) ** 2 for x in logs)
        best = min(best, (err, math.exp(log_peak), half))
    return best[1], best[2]


def memory_bandwidth(device: str = "cpu", repeats: int = 5, mib: int = 128) -> float:
    """Bytes per second of a large copy (each byte read once and written once)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), repeats, device)
    return 2 * src.numel() * 4 / seconds


def _tiny(layers: int, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    import hybridflow.models.cpu_gemm as cpu_gemm
    from hybridflow.models.tiny import build_tiny_config

    cfg = build_tiny_config("tiny", "llama", num_hidden_layers=layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    if onednn(dtype, device):  # as the engines run it
        cpu_gemm.use_onednn(model)
    return model


@torch.no_grad()
def layer_overhead(dtype: torch.dtype, device: str = "cpu", repeats: int = 5) -> float:
    """Seconds a layer adds to a one-token forward beyond its (negligible) FLOPs."""
    ids = torch.ones(1, 1, dtype=torch.long, device=device)
    times = {
        n: best_seconds(lambda m=_tiny(n, dtype, device): m(input_ids=ids), repeats, device) for n in (1, 9)
    }
    return max(0.0, (times[9] - times[1]) / 8)


ACTIVATION_TOKENS = ((2, 16), (32, 64))  # rows x tokens: a fixed-cost-bound and a token-bound micro-batch


def activation_cost(
    dtype: torch.dtype, peak: float, half_width: float, device: str = "cpu", repeats: int = 3
) -> float:
    """Seconds per activation value (ModelSpec.layer_activation_elements) of a training pass: a tiny
    Llama's forward + backward at two token counts, the difference less its GEMM FLOPs at the fitted rate,
    over the difference in values written (a training micro-batch is 3 passes)."""
    from hybridflow.planner.specs import ModelSpec

    model = _tiny(2, dtype, device).train()
    spec = ModelSpec.from_config_dict(model.config.to_dict())
    rate = peak * spec.hidden / (spec.hidden + half_width)
    cost = []
    for rows, n in ACTIVATION_TOKENS:
        ids = torch.randint(5, spec.vocab_size, (rows, n), device=device)

        def fwd_bwd(ids=ids):
            model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()

        seconds = best_seconds(fwd_bwd, repeats, device, min_s=0.0)
        tokens = rows * n
        flops = 3 * tokens * spec.forward_flops_per_token(n / 2)
        values = (
            3
            * tokens
            * (spec.num_layers * spec.layer_activation_elements(n / 2) + spec.head_activation_elements())
        )
        cost.append((seconds - flops / rate, values))
    (lo_s, lo_v), (hi_s, hi_v) = cost
    return max(0.0, (hi_s - lo_s) / (hi_v - lo_v))


DECODE_ROWS, DECODE_LAYERS = (1, 256), 2


@torch.no_grad()
def engine_decode_steps(dtype: torch.dtype, device: str = "cpu", repeats: int = 3) -> dict[str, list]:
    """The built-in generation engine's (rollout/engine.py: what a run generates with) seconds per decode
    step of DECODE_ROWS rows on a DECODE_LAYERS-layer tiny model: {"rows", "step_s"}, from 17 new tokens less
    1 (the prompt's prefill cancels). fit.fit_decode_terms prices what the simulator leaves out."""
    from hybridflow.batch import Batch
    from hybridflow.rollout.base import SamplingParams
    from hybridflow.rollout.engine import BuiltinEngine

    engine = BuiltinEngine(_tiny(DECODE_LAYERS, dtype, device))
    out = {"rows": list(DECODE_ROWS), "step_s": []}
    for rows in DECODE_ROWS:
        ids = torch.ones(rows, 4, dtype=torch.long, device=device)
        prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

        def gen(new: int, prompts=prompts):  # no stop token: exactly `new` steps
            params = SamplingParams(max_new_tokens=new, eos_token_ids=(), seed=0)
            return lambda: engine.generate(prompts, params)

        t1, t17 = (best_seconds(gen(n), repeats, device) for n in (1, 17))
        out["step_s"].append(max(0.0, (t17 - t1) / 16))
    return out


DETOKENIZE_ROWS, DETOKENIZE_TOKENS = 256, (4, 32)


def detokenize_costs(repeats: int = 5) -> dict[str, float]:
    """The responses' text a rollout rank decodes after generating (rollout/base.py decode_responses: the
    ids to lists, the tokenizer's batch_decode), with the tiny models' tokenizer: seconds per row and per token,
    from DETOKENIZE_ROWS rows at two lengths."""
    from hybridflow.models.tiny import build_char_tokenizer
    from hybridflow.rollout.base import decode_responses

    tokenizer = build_char_tokenizer()
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for n in DETOKENIZE_TOKENS:
        ids = torch.randint(5, tokenizer.vocab_size, (DETOKENIZE_ROWS, n), generator=gen)
        lengths = torch.full((DETOKENIZE_ROWS,), n)
        seconds.append(
            best_seconds(lambda i=ids, ln=lengths: decode_responses(tokenizer, i, ln), repeats, min_s=0.0)
        )
    (short, long), (a, b) = seconds, DETOKENIZE_TOKENS
    per_token = max(0.0, (long - short) / (DETOKENIZE_ROWS * (b - a)))
    return {
        "detokenize_token_s": per_token,
        "detokenize_row_s": max(0.0, short / DETOKENIZE_ROWS - a * per_token),
    }


def _all_reduce_child(rank: int, init_file: str, out: str, repeats: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    for label, numel in (("latency", 1), ("bandwidth", 2 * 2**20)):
        buf = torch.ones(numel)
        for _ in range(3):
            dist.all_reduce(buf)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            samples.append(time.perf_counter() - start)
        result[label] = min(samples)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def spawn_ranks(child, args: tuple, nprocs: int = 2):
    """Run child(rank, init_file, out_file, *args) in `nprocs` fresh processes (each joins a gloo group
    through init_file) and return what rank 0 wrote to out_file, as JSON."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(child, args=(init, out, *args), nprocs=nprocs, join=True)
        with open(out) as f:
            return json.load(f)


def collectives(repeats: int = 20) -> dict[str, float]:
    """Two-rank gloo all-reduce: latency_s (4 bytes) and bandwidth (bytes/s, from 8 MiB, which a
    two-rank ring moves once per rank, less the latency)."""
    raw = spawn_ranks(_all_reduce_child, (repeats,))
    latency, big = raw["latency"], raw["bandwidth"]
    nbytes = 2 * 2**20 * 4
    return {"latency_s": latency, "bandwidth": nbytes / max(big - latency, 1e-9)}


# matmul steps of a chunk of work (64 x 64, ~7 us each on one core): a short and a long chunk; per run
SYNC_CHUNKS, SYNC_STEPS = 10, (20, 400)


def _chunk(steps: int) -> None:
    a = torch.ones(64, 64)
    for _ in range(steps):
        a = torch.mm(a, a).mul_(1e-2)  # bounded: the values stay finite


def _sync_child(rank: int, init_file: str, out: str, repeats: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    for steps in SYNC_STEPS:
        for synced in (False, True):
            _chunk(steps)
            spans = []
            for _ in range(repeats):
                dist.barrier()  # both ranks start together, as a step's call reaches them
                start = time.perf_counter()
                for _ in range(SYNC_CHUNKS):
                    _chunk(steps)
                    if synced:
                        dist.barrier()
                spans.append(time.perf_counter() - start)
            spans.sort()
            result[f"{steps}/{'synced' if synced else 'alone'}"] = spans[len(spans) // 2]  # the median
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def sync_waits(repeats: int = 15) -> dict[str, list[float]]:
    """Two gloo ranks, each running SYNC_CHUNKS chunks of the same work side by side, with a barrier after
    every chunk and without: {"chunk_s": [a chunk's seconds], "wait_s": [what each barrier added]} at the
    two chunk sizes of SYNC_STEPS (medians of `repeats`). The wait is the collective's own latency plus the
    drift of the ranks' run times over the chunk, which a barrier-started, back-to-back all-reduce
    (`collectives`) does not see; fit.fit_sync_waits prices it."""
    raw = spawn_ranks(_sync_child, (repeats,))
    return {
        "chunk_s": [raw[f"{n}/alone"] / SYNC_CHUNKS for n in SYNC_STEPS],
        "wait_s": [(raw[f"{n}/synced"] - raw[f"{n}/alone"]) / SYNC_CHUNKS for n in SYNC_STEPS],
    }


def startup_seconds() -> float:
    """A fresh Python importing torch and transformers: what each worker process pays once."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True, capture_output=True)
    return time.perf_counter() - start
