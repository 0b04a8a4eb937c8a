"""OpenMP wait policy for CPU workers: one 2-thread update and one generate call of a tiny model, each
in a fresh process, with OMP_WAIT_POLICY unset (libgomp's default: idle threads spin ~300k turns
before sleeping) vs PASSIVE (they sleep at once) vs a short GOMP_SPINCOUNT (docs/bench/omp_wait.md).

torch's CPU build runs its intra-op threads on GNU OpenMP (libgomp; `torch.__config__.parallel_info()`),
which reads these variables once, when the library loads: so each setting gets its own process, and
hybridflow sets the worker processes' variable in their Ray runtime_env (controller/resource_pool.py
embedded_worker_env; docs/design.md §3).

Settings alternate within each round (the order rotates), so all see the same load; the load average
at each process's start is printed beside its figures. `--busy K` adds K busy-looping processes for the
whole run (a reproducible stand-in for other jobs sharing the cores); they are stopped at the end.
Figures: median wall and CPU seconds (all threads of the process) per call over the rounds, after one
warm-up call of each kind, and each setting's ratio to the unset one.

    .venv/bin/python benchmarks/bench_omp_wait.py [--size medium] [--threads 2] [--rounds 3] [--busy 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "unset": {},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=3000": {"GOMP_SPINCOUNT": "3000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"},
}
CLEARED = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def child(args) -> None:
    """One process: warm up, then time `--calls` updates and generate calls; prints one JSON line."""
    import torch

    from hybridflow.batch import Batch
    from hybridflow.models.tiny import build_tiny_model, random_rl_batch
    from hybridflow.rollout import BuiltinEngine, SamplingParams

    torch.set_num_threads(args.threads)
    model = build_tiny_model(args.size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = random_rl_batch(model.config.vocab_size, args.batch, lp=32, lr=args.length, seed=0)
    engine = BuiltinEngine(model)
    params = SamplingParams(max_new_tokens=args.length, seed=1, eos_token_ids=())
    prompts = Batch.from_dict(
        {"input_ids": batch["prompts"], "attention_mask": (batch["prompts"] > 0).long()}
    )

    def update():
        model.train()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lp = torch.log_softmax(logits[:, -args.length - 1 : -1].float(), -1)
        lp = lp.gather(-1, batch["responses"][..., None]).squeeze(-1)
        mask = batch["response_mask"]
        loss = -(lp * batch["advantages"] * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def generate():
        model.eval()
        engine.generate(prompts, params)

    out = {"threads": torch.get_num_threads()}
    for name, fn in (("update", update), ("generate", generate)):
        fn()  # warm-up: first-call allocations and kernel selection
        walls, cpus = [], []
        for _ in range(args.calls):
            w, c = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        out[name] = (min(walls), statistics.median(cpus))
    print("RESULT " + json.dumps(out), flush=True)


def run_child(args, setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(SETTINGS[setting])
    cmd = [sys.executable, __file__, "--child", "--size", args.size, "--threads", str(args.threads),
           "--batch", str(args.batch), "--length", str(args.length), "--calls", str(args.calls)]  # fmt: skip
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{setting}: child failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return {"load": load, **json.loads(lines[-1].removeprefix("RESULT "))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="medium")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=32, help="response tokens (generated and trained on)")
    p.add_argument("--calls", type=int, default=2, help="timed calls of each kind per process")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, help="busy-looping background processes")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs: dict[str, list[dict]] = {s: [] for s in args.settings}
    try:
        for r in range(args.rounds):
            order = args.settings[r % len(args.settings) :] + args.settings[: r % len(args.settings)]
            for s in order:
                res = run_child(args, s)
                runs[s].append(res)
                u, g = res["update"], res["generate"]
                print(f"round {r + 1} {s:>22}: load {res['load']:5.1f}  update {u[0]:.2f} s wall "
                      f"{u[1]:.2f} s CPU  generate {g[0]:.2f} s wall {g[1]:.2f} s CPU", flush=True)  # fmt: skip
    finally:
        for b in busy:
            b.kill()
            b.wait()
    report(args, runs)
    return 0


def report(args, runs: dict[str, list[dict]]) -> None:
    loads = [x["load"] for rs in runs.values() for x in rs]
    print(f"\n{args.size} model, {args.threads} threads, batch {args.batch} x {args.length} response tokens, "
          f"{args.busy} busy processes beside, {os.cpu_count()} cores, load average {min(loads):.1f}-"
          f"{max(loads):.1f}; median over {args.rounds} rounds (wall: fastest of {args.calls} calls)\n")  # fmt: skip
    print("| setting | update wall s | update CPU s | generate wall s | generate CPU s | update wall vs unset "
          "| generate wall vs unset | CPU vs unset (update / generate) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    med = {s: {k: [statistics.median(x[k][i] for x in rs) for i in (0, 1)] for k in ("update", "generate")}
           for s, rs in runs.items()}  # fmt: skip
    base = med.get("unset")
    for s, m in med.items():
        u, g = m["update"], m["generate"]
        ratio = (lambda a, b: f"{a / b:.2f}x") if base else (lambda a, b: "n/a")
        bu, bg = (base["update"], base["generate"]) if base else (u, g)
        print(f"| {s} | {u[0]:.2f} | {u[1]:.2f} | {g[0]:.2f} | {g[1]:.2f} | {ratio(u[0], bu[0])} | "
              f"{ratio(g[0], bg[0])} | {ratio(u[1], bu[1])} / {ratio(g[1], bg[1])} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
