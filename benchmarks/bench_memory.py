"""Host memory per rank at init, checkpoint save, resume and export (docs/checkpoints.md).

4 CPU ranks (gloo), a ~100M-parameter Llama (M = its fp32 bytes). For each phase, each rank resets its
peak-RSS counter (`/proc/self/clear_refs` 5), runs the phase, and reads VmHWM: the figure is the peak
during the phase minus the RSS just before it (what the phase added), beside M and beside the goal
M/4 + the largest tensor. Run once with this code and once with a baseline ref of the package
(`--baseline-ref`, extracted with `git archive` into a temp dir; the same script drives both through
the API they share: load_causal_lm, TrainEngine, save/load_engine_state, export_hf).

    .venv/bin/python benchmarks/bench_memory.py --baseline-ref 2b42e07 [--layers 8] [--out docs/bench/memory.md]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _phase(fn):
    """(result, {"rss": peak RSS added, "anon": peak anonymous memory added}) over the RSS before it.

    RSS (VmHWM, exact peak) also counts pages of files mapped and read (safetensors are mmapped: page
    cache, shared and reclaimable); anonymous memory (RssAnon, sampled every ms) is what the process
    itself allocated, the figure the goal is about."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before, anon0 = _status("VmRSS"), _status("RssAnon")
    peak = [anon0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = fn()
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    return out, {"rss": _status("VmHWM") - before, "anon": peak[0] - anon0, "peak_anon": peak[0]}


def rank_main(rank: int, world: int, model_dir: str, work: str, result_file: str) -> None:
    """Runs in a spawned process whose sys.path starts with the code under test."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from hybridflow.checkpoint import export_hf, load_engine_state, save_engine_state
    from hybridflow.checkpoint.manager import CheckpointManager
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_causal_lm
    from hybridflow.models.tiny import random_rl_batch

    dist.init_process_group("gloo", init_method=f"file://{work}/init", rank=rank, world_size=world)
    cfg = EngineConfig(
        parallel=ParallelConfig(dp=world), optim=OptimConfig(lr=1e-5), micro_batch_size_per_device=2
    )

    def build():
        try:
            model = load_causal_lm(model_dir, device="meta")
        except TypeError:  # the baseline loads the full model on every rank
            model = load_causal_lm(model_dir)
        return TrainEngine(model, cfg)

    figures = {"baseline_anon": _status("RssAnon")}
    engine, figures["init"] = _phase(build)
    batch = random_rl_batch(engine.hf_model.config.vocab_size, 2 * world, 8, 8, seed=0).chunk(world)[rank]

    def loss(out, mb):
        m = mb["response_mask"].float()
        return -(out["log_probs"] * mb["advantages"] * m).sum() / m.sum().clamp(min=1), {}

    engine.train_step(batch, loss)  # AdamW moments exist from here on
    manager = CheckpointManager(f"{work}/run")
    holder = [str(manager.begin(1)) if rank == 0 else None]
    dist.broadcast_object_list(holder)
    _, figures["save"] = _phase(lambda e=engine: save_engine_state(e, Path(holder[0]) / "actor", rank))
    dist.barrier()
    if rank == 0:
        manager.commit(1, Path(holder[0]))
    dist.barrier()
    del engine
    fresh = build()
    step_dir = CheckpointManager(f"{work}/run").resolve("auto")
    _, figures["resume"] = _phase(lambda: load_engine_state(fresh, step_dir / "actor", rank))
    dist.barrier()
    if rank == 0:
        del fresh
        out = Path(work) / "export"
        _, figures["export"] = _phase(lambda: export_hf(f"{work}/run", out, model_dir))
    all_figures = [None] * world
    dist.all_gather_object(all_figures, figures)
    if rank == 0:
        Path(result_file).write_text(json.dumps(all_figures))
    dist.barrier()
    dist.destroy_process_group()


def _worker_entry() -> None:
    code_root, rank, world, model_dir, work, result = sys.argv[2:8]
    sys.path.insert(0, code_root)
    rank_main(int(rank), int(world), model_dir, work, result)


def build_model(path: Path, layers: int) -> tuple[int, int]:
    """A random ~100M Llama saved as safetensors; returns (M fp32 bytes, largest tensor bytes)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hybridflow.models.tiny import build_char_tokenizer

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    sizes = [p.numel() * 4 for p in model.parameters()]
    return sum(sizes), max(sizes)


def run_code(code_root: Path, model_dir: Path, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-mem-") as work:
        result = Path(work) / "result.json"
        # Large blocks mmapped (and unmapped on free): otherwise glibc keeps freed heap resident and a
        # phase's figure depends on what earlier phases freed.
        env = {
            **os.environ,
            "PYTHONPATH": str(code_root),
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": "131072",
        }
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                    str(code_root),
                    str(r),
                    str(world),
                    str(model_dir),
                    work,
                    str(result),
                ],
                env=env,
                cwd=work,
            )
            for r in range(world)
        ]
        codes = [p.wait(timeout=1500) for p in procs]
        if any(codes):
            raise SystemExit(f"ranks of {code_root} exited with {codes}")
        return json.loads(result.read_text())


def _row(phase: str, ours: list[dict], base: list[dict] | None, m: int, goal: int) -> str:
    def added(figs):
        return max(f[phase]["anon"] for f in figs if phase in f)

    def above(figs):  # peak anonymous memory above the process's own baseline (Python, torch, gloo)
        return max(f[phase]["peak_anon"] - f["baseline_anon"] for f in figs if phase in f)

    o, oa = added(ours), above(ours)
    cells = [phase, f"{o / MiB:.0f}", "yes" if o <= goal else "no", f"{oa / MiB:.0f}"]
    if base:
        b, ba = added(base), above(base)
        cells += [f"{b / MiB:.0f}", f"{ba / MiB:.0f}", f"{o / max(b, 1):.2f}x", f"{oa / max(ba, 1):.2f}x"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--baseline-ref", default=None, help="git ref of the code to compare with (e.g. main's commit)"
    )
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (8: ~106M parameters)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    import torch

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-mem-model-") as tmp:
        model_dir = Path(tmp) / "model"
        m, largest = build_model(model_dir, args.layers)
        gc.collect()
        ours = run_code(ROOT, model_dir, args.world)
        base = None
        if args.baseline_ref:
            old = Path(tmp) / "baseline"
            old.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline_ref, "hybridflow"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            base = run_code(old, model_dir, args.world)
    goal = m // args.world + largest
    head = ["phase", "ours: added (MiB)", f"added <= M/{args.world} + largest?", "ours: peak above process"]
    if base:
        r = args.baseline_ref
        head += [f"{r}: added", f"{r}: peak above process", "ours / it (added)", "ours / it (peak)"]
    lines = [
        "# Memory benchmark: host memory per rank at init, save, resume, export",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_memory.py{' --baseline-ref ' + args.baseline_ref if args.baseline_ref else ''}"
        f" --layers {args.layers}` (one run, {time.perf_counter() - t0:.0f} s; the 2-core machine was shared with"
        " other jobs: memory figures do not depend on load, times would).",
        "",
        f"Machine: CPU only, {args.world} gloo ranks; torch {torch.__version__}. Model: random Llama, "
        f"{m // 4 / 1e6:.0f}M parameters, M = {m / MiB:.0f} MiB fp32, largest tensor {largest / MiB:.0f} MiB; "
        f"goal M/{args.world} + largest = {goal / MiB:.0f} MiB.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for phase in ("init", "save", "resume", "export"):
        lines.append(_row(phase, ours, base, m, goal))
    lines += [
        "",
        "Anonymous memory (RssAnon, sampled every ms: what the process itself allocated; mmapped safetensors"
        " pages are page cache and not counted), largest over ranks. added = the phase's peak minus the"
        " memory just before it; peak above process = the phase's peak minus the process's own baseline"
        f" (Python, torch, transformers, gloo: {max(f['baseline_anon'] for f in ours) / MiB:.0f} MiB), so it"
        " includes what the rank holds anyway (at save and resume: parameters, gradients and AdamW moments,"
        " about M/4 + M/4 + 2M/4 per rank for a sharded engine). Both runs use MALLOC_MMAP_THRESHOLD_=131072"
        " so that freed memory goes back to the OS and RSS follows what is live. Export runs once, on rank 0,"
        " with no process group.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker_entry()
    else:
        main()
