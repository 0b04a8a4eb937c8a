"""Generation tokens/s: the built-in engine vs `transformers` `generate` (and vLLM's CPU build, when it is
importable: run it with .venv-vllm/bin/python), same model, prompts, lengths and sampling settings, in one run.

Both engines sample (temperature 1, top-k 50) from a randomly initialised tiny model, whose next-token
distribution is near uniform over the ~90-token vocabulary; EOS is the set {eos, 3 more tokens}, so
each sequence stops at a random, geometrically distributed length (mean ~23 tokens, capped at
max_new_tokens) the same way for both engines. Tokens/s counts generated tokens up to and including
the stop token, over wall time of whole `generate` calls (prefill included), summed over runs.

    .venv/bin/python benchmarks/bench_generation.py [--sizes tiny medium] [--batches 16 64]
        [--threads 1] [--no-stop-rows] [--natural-eos]
    .venv/bin/python benchmarks/bench_generation.py --sizes medium --batches 32 --natural-eos --bf16

--natural-eos runs rows that stop at the model's EOS only (instead of the stop set) (id 2: ~1 in 90 tokens, mean length ~70-90 of
128, the natural-EOS workload of benchmarks/vs_trl.py).
    .venv-vllm/bin/python benchmarks/bench_generation.py --vllm   # + vLLM rows (docs/bench/generation.md)

With --vllm every engine runs the tiny model with 2 attention heads (head_dim 32; vLLM's CPU attention has
no kernel for the default head_dim 16), and vLLM's time is that of `VLLMEngine.generate` as `hybridflow
train` calls it: the actor's weights are streamed into vLLM at every call (its own column says how long).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from functools import partial

import torch

from hybridflow.batch import Batch
from hybridflow.models.tiny import build_tiny_model
from hybridflow.rollout import BuiltinEngine, BuiltinEngineConfig, SamplingParams

STOP = (2, 10, 20, 30)
EOS = (2,)  # the tiny models' eos_token_id


def make_prompts(batch: int, vocab: int, seed: int) -> Batch:
    """Random prompts of 8..32 tokens, left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 33, (batch,), generator=g)
    lp = int(lengths.max())
    ids = torch.randint(5, vocab, (batch, lp), generator=g)
    mask = (torch.arange(lp)[None, :] >= (lp - lengths)[:, None]).long()
    return Batch.from_dict({"input_ids": ids * mask, "attention_mask": mask})


def generated_tokens(responses: torch.Tensor, stop: tuple[int, ...]) -> int:
    """Tokens up to and including the first stop token in each row."""
    if not stop:
        return responses.numel()
    hit = torch.isin(responses, torch.tensor(stop)).long()  # (B, L)
    lengths = torch.where(hit.any(1), hit.argmax(1) + 1, responses.shape[1])  # argmax: first stop
    return int(lengths.sum())


def run_hf(model, batch: Batch, max_new: int, stop: tuple[int, ...], seed: int) -> tuple[int, float, float]:
    torch.manual_seed(seed)
    t, c = time.perf_counter(), time.process_time()
    out = model.generate(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        do_sample=True,
        temperature=1.0,
        top_k=50,
        top_p=1.0,
        max_new_tokens=max_new,
        min_new_tokens=0 if stop else max_new,
        eos_token_id=list(stop) or None,
        pad_token_id=0,
        use_cache=True,
    )
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return generated_tokens(out[:, batch["input_ids"].shape[1] :], stop), dt, dc


def run_builtin(
    engine, batch: Batch, max_new: int, stop: tuple[int, ...], seed: int
) -> tuple[int, float, float]:
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, top_k=50, eos_token_ids=stop, seed=seed)
    t, c = time.perf_counter(), time.process_time()
    out = engine.generate(batch, params)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return int(out["response_mask"].sum()), dt, dc


def run_vllm(
    engine, batch: Batch, max_new: int, stop: tuple[int, ...], seed: int
) -> tuple[int, float, float]:
    tok, dt, dc = run_builtin(engine, batch, max_new, stop, seed)
    engine.sync_total = getattr(engine, "sync_total", 0.0) + engine.last_stats["rollout/weight_sync_seconds"]
    engine.sync_calls = getattr(engine, "sync_calls", 0) + 1
    return tok, dt, dc


def build_vllm(model, batch_size: int, max_len: int):
    from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    return VLLMEngine(model, VLLMEngineConfig(max_model_len=max_len, max_num_seqs=batch_size))


def measure(fns: dict, repeats: int, min_seconds: float) -> dict[str, tuple[float, float, float]]:
    """Run the engines alternately (so load from other processes hits both alike), at least `repeats`
    times and until every engine has run `min_seconds`. Returns name -> (tokens per wall second,
    tokens per process-CPU second, mean tokens per run). With 1 thread, CPU time is the figure that
    other jobs on a shared box disturb least."""
    tokens = dict.fromkeys(fns, 0)
    wall = dict.fromkeys(fns, 0.0)
    cpu = dict.fromkeys(fns, 0.0)
    runs = 0
    while runs < repeats or min(wall.values()) < min_seconds:
        for name, fn in fns.items():
            tok, dt, dc = fn(runs)
            tokens[name] += tok
            wall[name] += dt
            cpu[name] += dc
        runs += 1
    return {name: (tokens[name] / wall[name], tokens[name] / cpu[name], tokens[name] / runs) for name in fns}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "medium"])
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=8, help="fewest runs per engine and setting")
    ap.add_argument("--min-seconds", type=float, default=10.0, help="run each engine at least this long")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable timings on a shared 2-core box)"
    )
    ap.add_argument(
        "--no-stop-rows", action="store_true", help="also run without stop tokens (all rows full)"
    )
    ap.add_argument("--vllm", action="store_true", help="add vLLM rows (needs .venv-vllm: `make vllm`)")
    ap.add_argument("--natural-eos", action="store_true", help="rows that stop at the model's EOS only")
    ap.add_argument(
        "--bf16", action="store_true", help="also the built-in engine generating in bf16 (model.dtype)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    stops = {"random": STOP, "none": ()} if args.no_stop_rows else {"random": STOP}
    if args.natural_eos:
        stops = {"eos": EOS}

    rows = []
    heads = dict(num_attention_heads=2, num_key_value_heads=1) if args.vllm else {}
    for size in args.sizes:
        model = build_tiny_model(size, "llama", seed=0, **(heads if size == "tiny" else {})).eval()
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        engine = BuiltinEngine(model)
        # --bf16: the same engine generating in bf16 (BuiltinEngineConfig.dtype, as model.dtype=bfloat16 runs it)
        bf16 = BuiltinEngine(model, BuiltinEngineConfig(dtype=torch.bfloat16)) if args.bf16 else None
        for batch_size in args.batches:
            batch = make_prompts(batch_size, model.config.vocab_size, seed=batch_size)
            vllm = build_vllm(model, batch_size, 32 + args.max_new_tokens) if args.vllm else None
            for stop_name, stop in stops.items():
                max_new = args.max_new_tokens
                fns = {
                    "hf": partial(run_hf, model, batch, max_new, stop),
                    "builtin": partial(run_builtin, engine, batch, max_new, stop),
                }
                if vllm is not None:
                    fns["vllm"] = partial(run_vllm, vllm, batch, max_new, stop)
                if bf16 is not None:
                    fns["bf16"] = partial(run_builtin, bf16, batch, max_new, stop)
                with torch.inference_mode():
                    run_hf(model, batch, 8, stop, 0)  # warm-up
                    run_builtin(engine, batch, 8, stop, 0)
                    if bf16 is not None:
                        run_builtin(bf16, batch, 8, stop, 0)
                    if vllm is not None:
                        run_builtin(vllm, batch, 8, stop, 0)
                        vllm.sync_total, vllm.sync_calls = 0.0, 0
                    res = measure(fns, args.repeats, args.min_seconds)
                sync = vllm.sync_total / vllm.sync_calls if vllm is not None else 0.0
                rows.append((size, params_m, batch_size, stop_name, res, sync))
                print(f"# {rows[-1]}", file=sys.stderr, flush=True)
            if vllm is not None:
                vllm.close()

    print(
        f"\nGeneration throughput, llama arch, fp32 CPU ({platform.machine()}, {args.threads} threads), "
        f"torch {torch.__version__}, max_new_tokens={args.max_new_tokens}, temperature 1, top-k 50, "
        f"prompts 8-32 tokens, stop set {STOP} ('none': no stop, all rows run to the cap; 'eos': {EOS} only), "
        f"engines alternated, >= {args.repeats} runs and >= {args.min_seconds:.0f} s each, "
        "tokens/s = all generated tokens / all seconds, "
        f"load average at the end {os.getloadavg()[0]:.1f}\n"
    )
    print_table(rows, args.vllm, args.bf16)
    return 0


def print_table(rows, with_vllm: bool, with_bf16: bool = False) -> None:
    head = (
        "| model | params | batch | stop | mean len HF / built-in | HF tok/s | built-in tok/s | ratio (wall) "
    )
    head += "| HF tok/CPU-s | built-in tok/CPU-s | ratio (CPU time) |"
    if with_vllm:
        head += " vLLM mean len | vLLM tok/s | built-in / vLLM (wall) | vLLM tok/CPU-s | built-in / vLLM (CPU) | vLLM weight sync s |"
    if with_bf16:
        head += " bf16 mean len | built-in bf16 tok/s | bf16 / fp32 built-in (wall) | bf16 / HF fp32 (wall) |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for size, params_m, b, stop_name, res, sync in rows:
        (hf, hf_cpu, hf_len), (ours, ours_cpu, our_len) = res["hf"], res["builtin"]
        line = (
            f"| {size} | {params_m:.2f}M | {b} | {stop_name} | {hf_len / b:.1f} / {our_len / b:.1f} "
            f"| {hf:,.0f} | {ours:,.0f} | **{ours / hf:.2f}x** | {hf_cpu:,.0f} | {ours_cpu:,.0f} "
            f"| **{ours_cpu / hf_cpu:.2f}x** |"
        )
        if with_vllm:
            v, v_cpu, v_len = res["vllm"]
            line += f" {v_len / b:.1f} | {v:,.0f} | **{ours / v:.2f}x** | {v_cpu:,.0f} | **{ours_cpu / v_cpu:.2f}x** | {sync:.3f} |"
        if with_bf16:
            h, _, h_len = res["bf16"]
            line += f" {h_len / b:.1f} | {h:,.0f} | **{h / ours:.2f}x** | **{h / hf:.2f}x** |"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
