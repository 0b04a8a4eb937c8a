"""Benchmark: PPO on split pools (actor + reference | critic + reward model), overlapped phases vs sequential.

One set of worker groups (2 CPU devices: one per pool) is driven by two trainers that differ only in
trainer.overlap_phases: true (values, reference and reward issued together as futures, critic and
actor updates together) and false (each phase waits for the one before; the same dataflow, no
overlap). They alternate step by step, so both see the same machine load and a policy at the same
stage of training; the first step of each is a warm-up and not counted.

Each pool is one device. On CPU a rank's torch threads follow the placement (controller/process.py
cpu_threads): both pools can compute at once, so on 2 cores each rank takes 1 thread; `--threads N`
pins them instead (HYBRIDFLOW_CPU_THREADS; `--threads 2` on 2 cores is the rule before pools shared
the cores: each rank took every core). The ideal bound removes, from the sequential iteration,
everything two pools could run at once: per section, the busy time of the shorter pool (experience:
reference vs values + reward; update: actor vs critic update). CPU time is the worker processes'
(user + system, from /proc): equal in both modes when overlap adds no work, so a wall-time gap
between the two is the scheduler's (other jobs on the machine), not ours.

    .venv/bin/python benchmarks/bench_overlap.py [--size small] [--steps 6] [--threads N] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PHASES = ("gen", "old_log_prob", "values", "ref", "reward", "adv", "update_critic", "update_actor")


def config(model_dir, rm_dir, run_dir, args, overlap: bool):
    from hybridflow.config import load_config

    return load_config(None, [
        "algorithm.name=ppo", f"model.path={model_dir}", "reward.kind=model", f"model.reward_model_path={rm_dir}",
        "algorithm.kl.in_reward=true", "data.dataset=synthetic:arithmetic", "data.max_prompt_length=16",
        f"data.dataset_kwargs={{num_samples: {args.batch * (args.steps + 1)}, val_size: 4}}",
        f"data.train_batch_size={args.batch}", f"actor.ppo_mini_batch_size={args.batch}",
        f"rollout.n={args.n}", f"rollout.response_length={args.response_length}", "resources.device=cpu",
        "resources.n_gpus_per_node=2", "resources.placement=split", "trainer.loggers=[]",
        f"trainer.output_dir={run_dir}", f"trainer.experiment_name={'overlapped' if overlap else 'sequential'}",
        "trainer.resume=never", f"trainer.overlap_phases={str(overlap).lower()}",
    ])  # fmt: skip


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc; 0 elsewhere)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def step(trainer, pids: list[int]) -> dict:
    trainer.global_step += 1
    batch = trainer.train_loader.next_batch()
    batch.meta.global_step = trainer.global_step
    cpu, start = cpu_seconds(pids), time.perf_counter()
    _, metrics = trainer.train_step(batch)
    metrics["iteration"] = time.perf_counter() - start
    metrics["cpu"] = cpu_seconds(pids) - cpu
    metrics.update(trainer.timers.pop())
    return metrics


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def share(rows: list[dict]) -> float:
    """Cores the worker processes received (median over steps): overlap can only gain when this grows."""
    return statistics.median(r["cpu"] / r["iteration"] for r in rows)


def autogroup() -> str:
    """On Linux with autogroup scheduling, every process of one login session (here the driver, Ray and
    both pools) shares one fair share of the CPUs, however many of them are runnable."""
    flag = Path("/proc/sys/kernel/sched_autogroup_enabled")
    on = flag.exists() and flag.read_text().strip() == "1"
    return "; kernel autogroup scheduling on (one CPU share for the whole session)" if on else ""


def ideal(row: dict) -> float:
    """The sequential iteration less what two pools could run at once (per section, the shorter pool)."""
    b = {p: row.get(f"timing_s/{p}", 0.0) for p in PHASES}
    actor, critic = b["old_log_prob"] + b["ref"], b["values"] + b["reward"]
    return row["iteration"] - min(actor, critic) - min(b["update_actor"], b["update_critic"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", help="tiny model size (hybridflow/models/tiny.py)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per mode (after one warm-up)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per step")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: the placement's share)"
    )
    ap.add_argument("--write-docs", action="store_true", help="write docs/bench/overlap.md")
    args = ap.parse_args()
    if args.threads:
        os.environ["HYBRIDFLOW_CPU_THREADS"] = str(args.threads)

    import ray
    import torch

    from hybridflow.models import load_reward_model, save_hf_model
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.trainers import build_trainer
    from hybridflow.trainers.lifecycle import start_local_ray

    tmp = Path(tempfile.mkdtemp(prefix="bench_overlap_"))
    model_dir = save_tiny_model(tmp / "policy", size=args.size, arch="llama", seed=0)
    torch.manual_seed(3)
    rm_dir = save_hf_model(load_reward_model(model_dir), tmp / "rm")
    start_local_ray(8, compute_on_cpu=True)  # as `hybridflow train` starts it for a CPU run
    rows: dict[bool, list[dict]] = {True: [], False: []}
    load = [os.getloadavg()[0]]
    try:
        with build_trainer(config(model_dir, rm_dir, tmp / "runs", args, True)) as overlapped:
            seq_cfg = config(model_dir, rm_dir, tmp / "runs", args, False)
            with build_trainer(seq_cfg, groups=overlapped.groups) as sequential:
                groups = {g.pool.name: g for g in overlapped.groups.values()}  # one per pool
                threads = {n: g.execute_all("apply", torch.get_num_threads) for n, g in groups.items()}
                pids = sorted({pid for g in groups.values() for pid in g.pids})
                for i in range(args.steps + 1):
                    for mode, trainer in ((True, overlapped), (False, sequential)):
                        row = step(trainer, pids)
                        if i:
                            rows[mode].append(row)
    finally:
        ray.shutdown()
    load.append(os.getloadavg()[0])
    print_table(rows, args, threads, load)


def print_table(rows: dict[bool, list[dict]], args, threads: dict, load: list[float]) -> None:
    seq, ovl = rows[False], rows[True]
    seq_it, ovl_it = med(seq, "iteration"), med(ovl, "iteration")
    ideal_it = statistics.median(ideal(r) for r in seq)
    lines = [
        f"PPO, split pools (actor + ref | critic + reward model, 1 CPU device each), model '{args.size}', "
        f"{args.batch} prompts x {args.n} samples, responses <= {args.response_length} tokens; "
        f"median of {args.steps} steps per mode, alternating",
        "",
        "| | sequential (overlap_phases=false) | overlapped (true) | overlapped / sequential |",
        "|---|---|---|---|",
        f"| iteration (s) | {seq_it:.3f} | {ovl_it:.3f} | {ovl_it / seq_it:.2f}x time ({seq_it / ovl_it:.2f}x speed) |",
        f"| worker CPU time per iteration (s) | {med(seq, 'cpu'):.3f} | {med(ovl, 'cpu'):.3f} "
        f"| {med(ovl, 'cpu') / max(med(seq, 'cpu'), 1e-9):.2f}x |",
        f"| CPU received (cores: CPU time / iteration) | {share(seq):.2f} | {share(ovl):.2f} "
        f"| {share(ovl) / max(share(seq), 1e-9):.2f}x |",
    ]
    for section in ("experience", "update"):
        s, o = med(seq, f"timing_s/overlap/{section}"), med(ovl, f"timing_s/overlap/{section}")
        lines.append(f"| {section} section wall (s) | {s:.3f} | {o:.3f} | {o / s:.2f}x |")
    lines.append(
        f"| ideal bound (s) | | {ideal_it:.3f} | {ideal_it / seq_it:.2f}x time ({seq_it / ideal_it:.2f}x speed) |"
    )
    lines += ["", "Busy time per phase (s, median; max over a phase's ranks, from the workers' own stamps):", "",
              "| phase | " + " | ".join(PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]  # fmt: skip
    for name, rs in (("sequential", seq), ("overlapped", ovl)):
        lines.append(f"| {name} | " + " | ".join(f"{med(rs, f'timing_s/{p}'):.3f}" for p in PHASES) + " |")
    per_rank = ", ".join(f"{name} {t}" for name, t in threads.items())
    machine = (
        f"{os.cpu_count()} cores, {platform.machine()}, CPU only; torch threads per rank: {per_rank}; "
        f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end{autogroup()}"
    )
    table = "\n".join(lines)
    print(f"Machine: {machine}\n\n{table}")
    if args.write_docs:
        cmd = " ".join(["benchmarks/bench_overlap.py", *sys.argv[1:]])
        doc = Path(__file__).resolve().parents[1] / "docs" / "bench" / "overlap.md"
        doc.write_text(f"# Overlapped phases (PPO, split pools)\n\nCommand: `.venv/bin/python {cmd}`\n\n"
                       f"Machine: {machine}\n\n{table}\n")  # fmt: skip


if __name__ == "__main__":
    main()
