"""The hybridflow side of benchmarks/vs_trl.py: GRPO (or PPO) through the public trainer API, timed.

Run as a subprocess by vs_trl.py; prints one JSON line with per-iteration timings and the reward
curve. The step loop is `Trainer.fit`'s without validation and checkpoints (TRL's side runs without
eval or saves too): next_batch -> train_step -> timers. Phases come from the driver's own named
timers (timing_s/<phase>, trainers/ppo.py), mapped to the table's columns:

  generation  gen            ref     ref            old  old_log_prob (free when on-policy)
  values      values (PPO's critic forward)         reward  reward + adv
  update      update_actor (+ update_critic for PPO)
  other       the rest of the interval between two step ends (loader, driver glue, metrics)

Equal response lengths: the benchmark's driver passes `eos_token_ids=()` to generate_sequences, so
every response runs to exactly `rollout.response_length` tokens (EOS may still be sampled as an
ordinary token; TRL's side masks EOS instead, via min_new_tokens — same token counts either way).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from vs_trl_common import tree_cpu_seconds, workload_parser

PHASE_KEYS = {
    "generation": ("gen",),
    "ref": ("ref",),
    "old": ("old_log_prob",),
    "values": ("values",),
    "reward": ("reward", "adv"),
    "update": ("update_actor", "update_critic"),
}


def overrides(args) -> list[str]:
    """The workload as `hybridflow train` overrides (the same list the API and the CLI modes run)."""
    seqs = args.batch_size * args.n
    out = [
        f"algorithm.name={args.algorithm}",
        "algorithm.use_kl_loss=true",
        f"algorithm.kl_loss_coef={args.kl_coef}",
        "algorithm.kl_loss_kind=low_var_kl",  # TRL's k3 estimator
        "algorithm.norm_by_std=true",  # TRL scale_rewards="group"
        f"model.path={args.model}",
        f"model.dtype={'bfloat16' if args.precision == 'bf16' else 'float32'}",
        "data.dataset=synthetic:arithmetic",
        f"data.dataset_kwargs={{num_samples: {args.steps * args.batch_size}}}",
        f"data.seed={args.seed}",  # the dataset seed too (same rows as the TRL side)
        f"data.train_batch_size={args.batch_size}",
        "data.shuffle=false",  # both sides take the prompts in dataset order
        f"actor.optim.lr={args.lr}",
        "actor.optim.weight_decay=0.0",
        "actor.optim.grad_clip=1.0",
        "actor.optim.schedule=constant",
        f"actor.ppo_mini_batch_size={args.batch_size}",  # one optimizer step per iteration, as TRL
        "actor.ppo_epochs=1",
        f"actor.micro_batch_size_per_device={seqs}",  # one micro-batch, as TRL
        "actor.loss_agg_mode=token-mean",
        f"ref.micro_batch_size_per_device={seqs}",
        f"rollout.n={args.n}",
        "rollout.temperature=1.0",
        "rollout.top_k=-1",
        "rollout.top_p=1.0",
        f"rollout.response_length={args.response_length}",
        "reward.kind=rule",
        "reward.fn_kwargs={mode: first_number}",
        f"reward.num_workers={args.reward_workers}",
        "resources.device=cpu",
        "resources.placement=colocate",
        f"resources.n_gpus_per_node={args.workers}",
        f"resources.ray_num_cpus={max(args.workers, 2)}",
        f"trainer.total_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.resume=never",
        f"trainer.output_dir={os.path.join(args.workdir, 'hf_runs')}",
        "trainer.loggers=[]",
        f"trainer.seed={args.seed}",
    ]
    if args.algorithm == "ppo":
        out += [
            f"critic.micro_batch_size_per_device={seqs}",
            f"critic.optim.lr={args.lr}",
            "critic.optim.weight_decay=0.0",
        ]
    return out + list(args.set)


def build_config(args):
    from hybridflow.config import load_config

    return load_config(None, overrides(args))


def fixed_length(trainer_cls):
    """The trainer with generation that ignores EOS (every response exactly response_length): a rollout
    source of its own (hybridflow/trainers/sources/base.py)."""
    from hybridflow.trainers.sources import SynchronousSource

    class FixedLengthSource(SynchronousSource):
        def batch(self, prompts):
            rollout = self.trainer.actor.generate_sequences(prompts, sampling={"eos_token_ids": ()})
            return self.step_batch(rollout, prompts, {}, 0, {})

    class FixedLength(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.source = FixedLengthSource(self)

    return FixedLength


def run(args) -> dict:
    from hybridflow.trainers import TRAINERS

    cfg = build_config(args)
    cls = TRAINERS[args.algorithm]
    trainer = (cls if args.stop_at_eos else fixed_length(cls))(cfg)
    steps, rewards = [], []
    try:
        last, last_cpu = time.perf_counter(), tree_cpu_seconds()
        for step in range(1, args.steps + 1):
            trainer.global_step = step
            batch = trainer.train_loader.next_batch()
            batch.meta.global_step = step
            with trainer.timers("step"):
                batch, metrics = trainer.train_step(batch)
            times = trainer.timers.pop()
            now, cpu = time.perf_counter(), tree_cpu_seconds()
            row = {
                phase: sum(times.get(f"timing_s/{k}", 0.0) for k in keys)
                for phase, keys in PHASE_KEYS.items()
            }
            row["iteration"] = now - last
            row["other"] = row["iteration"] - sum(
                v for k, v in row.items() if k not in ("iteration", "other")
            )
            row["cpu"] = cpu - last_cpu
            row["tokens"] = float(batch["attention_mask"].sum())
            steps.append(row)
            rewards.append(float(metrics["reward/mean"]))
            last, last_cpu = now, cpu
    finally:
        trainer.close()
    return {"side": "hybridflow", "algorithm": args.algorithm, "steps": steps, "rewards": rewards}


def _train_once(cmd: list[str], metrics: str) -> tuple[int, list[float]]:
    """Run `cmd`; -> (exit code, CPU seconds of its whole process tree (driver, Ray daemons, workers)
    when each step's line landed in `metrics`)."""
    proc, cpu_at = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr), []
    while proc.poll() is None:
        time.sleep(0.1)
        cpu = tree_cpu_seconds(proc.pid)
        if os.path.exists(metrics):
            with open(metrics) as f:
                lines = sum(1 for line in f if '"timing_s/step"' in line)
            cpu_at += [cpu] * (lines - len(cpu_at))
    return proc.returncode, cpu_at


def run_cli(args) -> dict:
    """`hybridflow train <overrides>` in a subprocess, as a user runs it; per-step figures come from
    its metrics.jsonl (timing_s/step is the driver's step time, perf/total_tokens the step's prompt +
    response tokens). Ray start-up, the final validation and checkpoint are outside the steps."""
    run_dir = os.path.join(args.workdir, "hf_cli_runs")
    cmd = [
        sys.executable, "-m", "hybridflow.cli", "train", *overrides(args),
        f"trainer.output_dir={run_dir}", "trainer.experiment_name=bench", "trainer.loggers=[jsonl]",
        "trainer.save_every_minutes=0",
    ]  # fmt: skip
    metrics = os.path.join(run_dir, "bench", "metrics.jsonl")
    for attempt in range(5):  # on a loaded machine Ray's start-up can time out (a fixed 30 s in ray)
        shutil.rmtree(run_dir, ignore_errors=True)
        returncode, cpu_at = _train_once(cmd, metrics)
        if returncode == 0 or os.path.exists(metrics):
            break
        print(f"hybridflow train exited {returncode} before its first step; retrying", file=sys.stderr)
        time.sleep(10 * (attempt + 1))
    if returncode != 0 or not os.path.exists(metrics):
        raise SystemExit(f"hybridflow train failed (exit {returncode}): {' '.join(cmd)}")
    steps, rewards = [], []
    with open(metrics) as f:
        for line in f:
            m = json.loads(line)
            if "timing_s/step" not in m:
                continue  # validation-only records
            row = {
                phase: sum(m.get(f"timing_s/{k}", 0.0) for k in keys) for phase, keys in PHASE_KEYS.items()
            }
            row["iteration"] = m["timing_s/step"]
            row["other"] = row["iteration"] - sum(v for k, v in row.items() if k not in ("iteration",))
            i = len(steps)  # this step's CPU: between its line and the previous one (0: start-up too)
            row["cpu"] = cpu_at[i] - cpu_at[i - 1] if 0 < i < len(cpu_at) else float("nan")
            row["tokens"] = m["perf/total_tokens"]
            row["response_len"] = m.get("response_length/mean", 0.0)
            row["policy_lag"] = m.get("rollout/policy_lag", 0.0)
            row["response_max"] = m.get("response_length/max", 0.0)  # decode steps (machine_limits.py)
            row["perf"] = {k: v for k, v in m.items() if k.startswith("perf/")}
            steps.append(row)
            rewards.append(m.get("reward/mean", 0.0))
    return {
        "side": "hybridflow",
        "algorithm": args.algorithm,
        "steps": steps,
        "rewards": rewards,
        "cli": True,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = workload_parser(__doc__.split("\n")[0])
    p.add_argument("--algorithm", default="grpo", choices=("grpo", "ppo"))
    p.add_argument("--workers", type=int, default=1, help="worker processes (dp) in the colocated pool")
    p.add_argument("--reward-workers", type=int, default=0, help="reward.num_workers (0 = in-process)")
    p.add_argument("--cli", action="store_true", help="run `hybridflow train` in a subprocess (as users do)")
    p.add_argument("--set", action="append", default=[], help="extra override key=value (repeatable)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(json.dumps(run_cli(args) if args.cli else run(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
