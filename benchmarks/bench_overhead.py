"""Per-step overhead on small models: one GRPO step's phases through hybridflow's worker groups vs a
plain in-process PyTorch loop doing the same math (issue 14; docs/bench/overhead.md).

The workload is benchmarks/vs_trl.py's (the config `hybridflow train` builds from its overrides): GRPO,
8 prompts x 4 samples = 32 sequences, 32 response tokens each (EOS ignored), KL loss to the reference,
fp32, one micro-batch of 32, one optimizer step, 1 worker colocating actor + rollout + ref. Each phase
runs in four ways, so the table says where the difference goes:

  plain     one process, the HF model called directly: a KV-cache sampling loop (torch.multinomial),
            a full-logits forward for log-probs, forward + policy/KL loss (the same pure functions,
            hybridflow.algorithms) + backward + grad clipping + torch AdamW for the update
  engine    the same process, hybridflow's engines called directly: BuiltinEngine.generate,
            TrainEngine.compute_log_probs / train_step (micro-batch planning, padding trim, chunked
            log-probs, metric reductions)
  worker    the same process, the role worker's method called directly (ActorRolloutRefWorker:
            sampling params, 3D-HybridEngine switch, text decode, mini-batch loop, metrics)
  ray       the trainer's own phase methods (trainers/rl.py) on its Ray worker group: + driver-side
            split/put, Ray call, (de)serialisation, worker-side resolve, collect

Every row uses --threads intra-op threads (HYBRIDFLOW_CPU_THREADS for the Ray worker). CPU seconds are
the median of --repeats calls after one warm-up (the Ray row's: driver + worker process), wall seconds
the fastest; on a shared machine CPU time is the steadier figure. Two counts that do not depend on the
load at all, from torch.profiler over one call: aten ops (each costs dispatcher time, the overhead
that dominates a small model) and host syncs (aten::_local_scalar_dense: a tensor read by
.item()/float()/int(), which stalls the device on a GPU). With --profile, cProfile's top functions by
own CPU time of the worker's update and generate (in-process) and of the driver's Ray call.

    .venv/bin/python benchmarks/bench_overhead.py [--sizes small medium] [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PHASES = ("generate", "old_log_prob", "ref_log_prob", "update_actor")


def timed(fn, repeats: int, cpu_of=None) -> tuple[float, float, object]:
    """(fastest wall s, median CPU s, last result) of `repeats` calls after one warm-up. On a shared
    machine the fastest wall time is the one least disturbed by other jobs; CPU time is less sensitive."""
    out = fn()
    walls, cpus = [], []
    for _ in range(repeats):
        c0 = cpu_of() if cpu_of else time.process_time()
        t0 = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append((cpu_of() if cpu_of else time.process_time()) - c0)
    return min(walls), statistics.median(cpus), out


# ---- hybridflow through Ray ----------------------------------------------------------------------
def ray_rows(model_dir: str, args, workdir: str) -> tuple[dict, object, object, object]:
    """Time the trainer's phases on its worker group; returns (rows, cfg, prompts, finished batch)."""
    import psutil
    from vs_trl_hybridflow import build_config, fixed_length

    from hybridflow.trainers import TRAINERS

    wl = argparse.Namespace(
        algorithm="grpo", model=model_dir, workdir=workdir, steps=100, batch_size=8, n=4,
        response_length=32, lr=1e-4, kl_coef=0.01, seed=1, reward_workers=0, workers=1, set=[], precision="fp32",
    )  # fmt: skip
    cfg = build_config(wl)
    start_ray_retrying(cfg.resources.ray_num_cpus)
    trainer = fixed_length(TRAINERS["grpo"])(cfg)
    procs = [psutil.Process()] + [psutil.Process(p) for p in trainer.actor.pids]

    def cpu() -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in procs))

    try:
        prompts = trainer.train_loader.next_batch()
        prompts.meta.global_step = 1
        trainer.train_step(prompts)  # warm-up of the whole step
        rows = {}
        rows["generate"] = timed(lambda: trainer.generate(prompts), args.repeats, cpu)
        batch = rows["generate"][2]
        rows["old_log_prob"] = timed(lambda: trainer.actor.compute_log_prob(batch), args.repeats, cpu)
        # the group calls the phases issue (trainers/rl.py issues them as futures), waited for here
        rows["ref_log_prob"] = timed(lambda: trainer.ref.compute_ref_log_prob(batch), args.repeats, cpu)
        # the step's own experience phase (old log-probs free on-policy in fp32, ref, reward, advantages),
        # fetched into the driver: the batch the update and the in-process rows train on
        pending = trainer.old_log_probs(batch)
        batch = trainer.compute_advantages(trainer.reward(trainer.ref_log_probs(pending))).fetch()
        rows["update_actor"] = timed(lambda: trainer.actor.update_actor(batch), args.repeats, cpu)
        if args.profile:
            profile("driver: actor.update_actor through Ray", lambda: trainer.actor.update_actor(batch))
        step = iter(range(2, 10**6))

        def train_step():
            p = trainer.train_loader.next_batch()
            p.meta.global_step = next(step)
            return trainer.train_step(p)

        rows["step"] = timed(train_step, args.repeats, cpu)
        worker_cfg = copy.deepcopy(trainer.cfg)
    finally:
        trainer.close()
    return rows, worker_cfg, prompts, batch


def start_ray_retrying(num_cpus: int, tries: int = 4) -> None:
    """The trainer's embedded cluster, started here so a start that times out under a heavy load (Ray
    gives its raylet 30 s) is retried instead of ending the benchmark."""
    import ray

    from hybridflow.trainers.lifecycle import start_local_ray

    for attempt in range(tries):
        try:
            return start_local_ray(num_cpus, compute_on_cpu=True)  # as `hybridflow train` does on CPU
        except Exception as e:  # noqa: BLE001 — Ray raises a bare Exception on a start timeout
            print(f"Ray did not start ({e}); retrying", file=sys.stderr)
            if ray.is_initialized():
                ray.shutdown()
            if attempt == tries - 1:
                raise


# ---- in-process rows -----------------------------------------------------------------------------
def plain_rows(model_dir: str, cfg, prompts, batch, repeats: int) -> dict:
    """The same math as a hand-written loop on the HF model."""
    import torch

    from hybridflow.algorithms import kl_loss, policy_loss
    from hybridflow.models import load_causal_lm

    a, algo, r = cfg.actor, cfg.algorithm, cfg.rollout
    model = load_causal_lm(model_dir)
    o = a.optim
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
    )
    lr_len = batch["responses"].shape[1]

    @torch.no_grad()
    def generate():
        model.eval()
        ids = prompts["input_ids"].repeat_interleave(r.n, 0)
        mask = prompts["attention_mask"].repeat_interleave(r.n, 0)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        tokens, logps = [], []
        for _ in range(r.response_length):
            lp = torch.log_softmax(logits.float() / r.temperature, -1)
            tok = torch.multinomial(lp.exp(), 1)
            tokens.append(tok)
            logps.append(lp.gather(-1, tok))
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            pos = pos[:, -1:] + 1
            out = model(
                input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
            )
            cache, logits = out.past_key_values, out.logits[:, -1]
        return torch.cat(tokens, 1), torch.cat(logps, 1)

    def log_probs(with_entropy=False):
        logits = (
            model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            )
            .logits[:, -lr_len - 1 : -1]
            .float()
        )
        lp = torch.log_softmax(logits, -1)
        out = lp.gather(-1, batch["responses"][..., None]).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1).detach() if with_entropy else None
        return out, ent

    @torch.no_grad()
    def infer():
        model.eval()
        return log_probs()[0]

    def update():
        model.train()
        mask = batch["response_mask"]
        lp, ent = log_probs(with_entropy=True)
        agg = a.loss_agg_mode
        loss, m = policy_loss(lp, batch["old_log_probs"], batch["advantages"], mask, a.clip_ratio_low,
                              a.clip_ratio_high, a.clip_ratio_c, agg)  # fmt: skip
        loss = loss + algo.kl_loss_coef * kl_loss(lp, batch["ref_log_probs"], mask, algo.kl_loss_kind, agg)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        return float(loss), float((ent * mask).sum() / mask.sum()), {k: float(v) for k, v in m.items()}

    fns = {"generate": generate, "old_log_prob": infer, "ref_log_prob": infer, "update_actor": update}
    return {ph: (*timed(fn, repeats), op_counts(fn)) for ph, fn in fns.items()}


def engine_rows(model_dir: str, cfg, prompts, batch, repeats: int) -> dict:
    """hybridflow's engines, called directly (no worker, no Ray)."""
    from hybridflow.config.roles import worker_config
    from hybridflow.engines import TrainEngine
    from hybridflow.models import load_causal_lm
    from hybridflow.rollout import SamplingParams
    from hybridflow.rollout.factory import build_generation_engine
    from hybridflow.workers.common import engine_config
    from hybridflow.workers.losses import actor_loss_fn

    ecfg = engine_config(cfg.actor, 1, "actor", cfg.trainer.seed, cfg.model.dtype, 100)
    actor = TrainEngine(load_causal_lm(model_dir), ecfg)
    rollout = build_generation_engine(worker_config(cfg, "actor_rollout"), actor.hf_model, 1)
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.response_length, n=r.n, temperature=r.temperature, seed=1,
                            eos_token_ids=())  # fmt: skip
    loss_fn = actor_loss_fn(cfg.actor, cfg.algorithm)
    rows = batch.select(["input_ids", "attention_mask", "position_ids", "responses", "response_mask",
                         "old_log_probs", "advantages", "ref_log_probs"])  # fmt: skip
    return {
        "generate": timed(lambda: rollout.generate(prompts, params), repeats),
        "old_log_prob": timed(lambda: actor.compute_log_probs(batch), repeats),
        "ref_log_prob": timed(lambda: actor.compute_log_probs(batch), repeats),
        "update_actor": timed(
            lambda: actor.train_step(rows, loss_fn, with_entropy="detached", global_metrics=True), repeats
        ),
    }


def worker_rows(cfg, prompts, batch, repeats: int, profile_update: bool) -> dict:
    """The role worker's methods, called directly in this process (a 1-rank gloo group, as in Ray)."""
    from hybridflow.config.roles import worker_config
    from hybridflow.controller import local_worker_context
    from hybridflow.workers import ActorRolloutRefWorker

    local_worker_context()
    w = ActorRolloutRefWorker(
        worker_config(cfg, "actor_rollout"), roles=("actor", "rollout", "ref"), total_optim_steps=100
    )
    w.init_model()
    sampling = {"eos_token_ids": ()}
    fns = {
        "generate": lambda: w.generate_sequences(prompts, sampling),
        "old_log_prob": lambda: w.compute_log_prob(batch),
        "ref_log_prob": lambda: w.compute_ref_log_prob(batch),
        "update_actor": lambda: w.update_actor(batch),
    }
    rows = {ph: (*timed(fn, repeats), op_counts(fn)) for ph, fn in fns.items()}
    if profile_update:
        profile("worker: ActorRolloutRefWorker.update_actor in-process", lambda: w.update_actor(batch))
        profile("worker: ActorRolloutRefWorker.generate_sequences in-process",
                lambda: w.generate_sequences(prompts, sampling))  # fmt: skip
    return rows


def op_counts(fn) -> tuple[int, int]:
    """(aten ops, host syncs: aten::_local_scalar_dense, i.e. .item()/float()/int() of a tensor) of one
    call, from torch.profiler: counts, unlike times, do not depend on the machine's load."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    return ops, sum(e.count for e in events if e.key == "aten::_local_scalar_dense")


def profile(title: str, fn, calls: int = 5, top: int = 14) -> None:
    prof = cProfile.Profile(time.process_time)  # CPU time: other jobs' load does not count
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    print(f"\n--- cProfile, {title}: top {top} by own time over {calls} calls (s per call) ---")
    stats = pstats.Stats(prof)
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in entries:
        where = f"{Path(file).name}:{line}" if line else ""
        print(f"  {tottime / calls * 1e3:7.2f} ms own  {cumtime / calls * 1e3:8.2f} ms cum  "
              f"{ncalls // calls:6d} calls  {name} {where}")  # fmt: skip


def init_single_rank_group() -> None:
    """A 1-rank gloo group: the worker's engines then run as they do in a 1-device worker group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        init = tempfile.mktemp(prefix="bench_overhead_pg_")
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)


def report(size: str, n_params: int, rows: dict, args) -> None:
    ways = ("plain", "engine", "worker", "ray")
    print(f"\n## {size}: {n_params / 1e6:.1f}M params, 32 sequences x (prompt + 32 response tokens), "
          f"{args.threads} thread(s); CPU s: median of {args.repeats}, wall s: fastest of {args.repeats}\n")  # fmt: skip
    print("| phase | plain CPU s | engine CPU s | worker CPU s | Ray CPU s (driver + worker) | Ray / plain CPU | "
          "engine - plain | worker - engine | Ray - worker | plain wall s | Ray wall s | Ray / plain wall |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ph in PHASES:
        c = {w: rows[w][ph][1] for w in ways}
        pw, rw = rows["plain"][ph][0], rows["ray"][ph][0]
        print(f"| {ph} | " + " | ".join(f"{c[w]:.3f}" for w in ways) + f" | {c['ray'] / c['plain']:.2f}x | "
              f"{(c['engine'] - c['plain']) * 1e3:+.0f} ms | {(c['worker'] - c['engine']) * 1e3:+.0f} ms | "
              f"{(c['ray'] - c['worker']) * 1e3:+.0f} ms | {pw:.3f} | {rw:.3f} | {rw / pw:.2f}x |")  # fmt: skip
    print(
        "\n| phase | aten ops per call: plain | worker | host syncs per call: plain | worker |\n|---|---|---|---|---|"
    )
    for ph in PHASES:
        (po, ps), (wo, ws) = rows["plain"][ph][3], rows["worker"][ph][3]
        print(f"| {ph} | {po} | {wo} | {ps} | {ws} |")
    step, plain = rows["ray"]["step"], rows["plain"]
    tot = [sum(plain[ph][i] for ph in PHASES if ph != "old_log_prob") for i in (0, 1)]
    print(f"\nwhole GRPO step, `train_step` through Ray (old log-probs free on-policy): CPU {step[1]:.3f} s, "
          f"wall {step[0]:.3f} s; plain generate + ref + update: CPU {tot[1]:.3f} s, wall {tot[0]:.3f} s "
          f"(CPU {step[1] / tot[1]:.2f}x, wall {step[0] / tot[0]:.2f}x)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["small", "medium"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    os.environ["HYBRIDFLOW_CPU_THREADS"] = str(args.threads)

    import ray
    import torch

    from hybridflow.models.tiny import build_tiny_model, save_tiny_model

    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="bench_overhead_")
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start")
    for size in args.sizes:
        model_dir = str(save_tiny_model(Path(workdir) / size, size))
        n_params = sum(q.numel() for q in build_tiny_model(size).parameters())
        rows = {}
        rows["ray"], cfg, prompts, batch = ray_rows(model_dir, args, workdir)
        if ray.is_initialized():
            ray.shutdown()
        init_single_rank_group()
        rows["plain"] = plain_rows(model_dir, cfg, prompts, batch, args.repeats)
        rows["engine"] = engine_rows(model_dir, cfg, prompts, batch, args.repeats)
        rows["worker"] = worker_rows(cfg, prompts, batch, args.repeats, args.profile)
        report(size, n_params, rows, args)
    print(f"\nload average {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
