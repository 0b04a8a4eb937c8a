"""`hybridflow calibrate`: time this machine's stages on a tiny model and compare with the simulator.

The planner is only as good as its simulator, so this makes the error visible: it runs the three
kinds of work of an RL iteration on a plain transformers model on one CPU worker (the catalogue's
"cpu" device: one process, one thread by default) - training = forward + backward + AdamW step,
inference = forward without gradients, generation = HF `generate` with a KV cache - and prints
predicted seconds (the same simulator functions the planner uses, p = t = d = 1) beside the median
of a few measured repeats, with the ratio measured / predicted. It finishes well within a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from hybridflow.planner import simulate as sim
from hybridflow.planner.specs import ModelSpec, WorkloadSpec, get_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "medium"), help="tiny model size")
    parser.add_argument("--device", default="cpu", help="catalogue entry to predict with")
    parser.add_argument("--batch", type=int, default=8, help="sequences per stage")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="measurements per stage (median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a CPU 'device' is one worker)")
    parser.add_argument("--output", default=None, help="also write the results as JSON")


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, first-call dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(size: str, batch: int, prompt_len: int, response_len: int, repeats: int, seed: int = 0) -> dict:
    """Measured seconds per stage on this machine: {"training", "inference", "generation"}."""
    import torch

    from hybridflow.models.tiny import build_tiny_model

    model = build_tiny_model(size, "llama", seed)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(5, vocab, (batch, prompt_len + response_len), generator=gen)
    prompts = seq[:, :prompt_len]
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train_step():
        model.train()
        out = model(input_ids=seq, labels=seq)
        out.loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    @torch.no_grad()
    def infer():
        model.eval()
        model(input_ids=seq).logits.float().log_softmax(-1)

    @torch.no_grad()
    def generate():
        model.eval()
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=response_len,
            min_new_tokens=response_len,  # the simulator assumes full-length responses
            do_sample=True,
            pad_token_id=0,
        )

    return {
        "training": _median_time(train_step, repeats),
        "inference": _median_time(infer, repeats),
        "generation": _median_time(generate, repeats),
    }


def predict(spec: ModelSpec, device: str, wl: WorkloadSpec) -> dict:
    """Simulated seconds for the same work on one device (p = t = d = 1)."""
    dev = get_device(device)
    return {
        "training": sim.training_time(spec, dev, wl, 1, 1, 1, 1, checkpoint=False),
        "inference": sim.inference_time(spec, dev, wl, 1, 1, 1, 1),
        "generation": sim.generation_time(spec, dev, wl, 1, 1, 1, 1),
    }


def calibrate(size="tiny", device="cpu", batch=8, prompt_len=32, response_len=32, repeats=3) -> dict:
    """{"model", "device", "stages": {stage: {"predicted_s", "measured_s", "ratio"}}}."""
    from hybridflow.models.tiny import build_tiny_config

    spec = ModelSpec.from_config_dict(build_tiny_config(size, "llama").to_dict())
    spec = replace(spec, name=f"tiny-{size}")
    # one mini-batch of `batch` sequences processed as a single micro-batch, as measured
    wl = WorkloadSpec(
        prompts=batch,
        prompt_len=prompt_len,
        response_len=response_len,
        mini_batches=1,
        micro_batch_size=batch,
        inference_micro_batch_size=batch,
    )
    predicted = predict(spec, device, wl)
    measured = measure(size, batch, prompt_len, response_len, repeats)
    stages = {
        k: {"predicted_s": predicted[k], "measured_s": measured[k], "ratio": measured[k] / predicted[k]}
        for k in ("training", "inference", "generation")
    }
    return {
        "model": spec.name,
        "params": spec.num_params,
        "device": device,
        "workload": vars(wl),
        "stages": stages,
    }


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = calibrate(args.size, args.device, args.batch, args.prompt_len, args.response_len, args.repeats)
    console = Console(width=120)
    table = Table(
        title=(
            f"{result['model']} ({result['params']:,} params), batch {args.batch} x "
            f"({args.prompt_len} + {args.response_len}) tokens, {args.threads} thread(s), "
            f"predicted with the '{args.device}' entry"
        ),
        title_justify="left",
    )
    for col in ("stage", "work", "predicted s", "measured s", "measured / predicted"):
        table.add_column(col, justify="left" if col in ("stage", "work") else "right")
    work = {
        "training": "forward + backward + AdamW step",
        "inference": "forward, no grad (log-probs)",
        "generation": f"HF generate, {args.response_len} new tokens, KV cache",
    }
    for stage, r in result["stages"].items():
        table.add_row(
            stage, work[stage], f"{r['predicted_s']:.4f}", f"{r['measured_s']:.4f}", f"{r['ratio']:.2f}x"
        )
    console.print(table)
    console.print(f"calibration took {time.perf_counter() - start:.1f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"written to {args.output}")
    return 0
