"""Micro-benchmarks on the path a run's work takes: a worker group's call over Ray, and a parallelized
model's training step over gloo. They measure the fixed costs the FLOP and bandwidth terms of
microbench.py leave out, which on small models are most of a stage (docs/bench/planner.md):

    worker-group call   a registered DP_PROTO method that returns its shard, on a 2-rank WorkerGroup:
                        seconds per call with an 8-row batch (Ray round trip, split, put, gather) and
                        bytes per second of the driver's batch transfer (a 4 MiB batch, less that call)
    empty step          a GRPO step's calls with empty work, as the trainer issues and collects them: beyond
                        the calls the step's rest prices, the driver's own work per step
    step rests          real GRPO runs of the tiny model (`hybridflow train`, 24 steps): 64 and 512 rows on 1
                        rank, 64 on 2: their steps' rest beyond their stages (trainers/plan_metrics.py), whose
                        calls cost more than idle ones, more to 2 ranks than to 1, and more per row than an
                        idle call's tensor (calibrate.py fits all three)
    training step       forward + backward of a tiny Llama over 2 gloo ranks, parallelized as the engines
                        do it (engines/parallelize.py) at t1d1, t1d2 and t2d1, with 1 and 5 layers: the
                        per-layer slope and the fixed rest per micro-batch; the optimizer step likewise;
                        t1d1 and t2d1 again at 512 tokens: tensor parallelism's per-layer cost per token
    engine passes       the engine's own training step and log-prob pass (TrainEngine) on 64 and 256
                        GRPO-shaped rows in one process: per token, what the simulator's FLOP, activation
                        and fixed terms leave out (calibrate.py fits it against them); again on 2 ranks
                        sharded by FSDP2: what dp = 2 adds per token beyond its fixed cost per unit
    switch rounds       the 3D-HybridEngine's train -> generate -> train round (hybrid_engine/resharder.py,
                        pipeline_switch.py) of a TrainEngine at t1d2, t2d1 and p2t1d1 on 2 gloo ranks, to
                        tg = 1, with the worker's exchange of the round's counters: calibrate.py fits the
                        fixed cost per unit gathered beyond the bytes

The slopes' differences are the per-layer costs of FSDP2 over dp (gathers, reduce-scatters, hooks) and
of tensor parallelism (DTensor dispatch and the all-reduces of its row-wise layers). Each figure is the
fastest of a few samples (microbench.best_seconds). The processes they spawn start as a run's CPU workers
(`as_workers`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

from hybridflow.controller import Protocol, Worker, register
from hybridflow.planner.fit import GROUP, PROMPT, RESPONSE, REST_RUN, REST_RUNS, REST_STEPS, SWITCH_LAYOUTS
from hybridflow.planner.microbench import best_seconds, spawn_ranks

LAYERS = (1, 5)
LAYOUTS = ("t1d1", "t1d2", "t2d1")
TOKENS = (2, 16)  # one micro-batch per rank: rows x tokens (the fixed costs; FLOPs are priced apart)
# t = 1 and t = 2 again at a micro-batch of real size: DTensor's cost per layer grows with the tokens it
# redistributes and reduces, which the 32 tokens above do not reach
TP_TOKENS = (16, 32)
TP_LAYOUTS = ("t1d1", "t2d1")


class EchoWorker(Worker):
    """Returns its shard: a call that costs only the path."""

    @register(Protocol.DP_PROTO)
    def echo(self, batch):
        return batch

    @register(Protocol.DP_PROTO)
    def first(self, batch, *others):
        """The advantages' shape: fed by the rollout and every preparation phase's output."""
        return batch


# the calls the step's rest prices (simulate.step_rest_time): generation's, preparation's, training's and
# the advantages'; empty_step issues them as a GRPO step does
REST_CALLS = 4


def empty_step(group, batch) -> None:
    """A GRPO step's calls as the trainer issues them (trainers/ppo.py), every stage's work empty: the
    rollout comes back to the driver, preparation's two forwards go out at once, the advantages' call is
    fed by their futures, the update by its; the phases' timers collect them (controller/timers.py)."""
    from hybridflow.controller.timers import Timers

    timers = Timers()
    with timers.phase("gen"):
        rollout = group.echo(batch)
    with timers.phase("old_log_prob"):
        log_probs = group.echo.future(rollout)
    with timers.phase("ref"):
        ref = group.echo.future(rollout)
    with timers.phase("adv"):
        experience = group.first.future(rollout, log_probs, ref)
    with timers.phase("update_actor"):
        update = group.echo.future(experience)
    timers.collect()
    update.get()
    timers.pop()


def interleaved_best(fns, repeats: int) -> list[float]:
    """The fastest of `repeats` timings of each of `fns`, taken in turns (after one warm-up each): on a
    shared machine the figures are subtracted from one another, so each sees the same load."""
    import time

    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def worker_call(repeats: int = 5) -> dict[str, float]:
    """call_overhead_s, transfer_bandwidth and driver_step_overhead_s of a 2-rank worker group (starts and
    stops a local Ray); empty_step_s, the empty step those came from, for the record."""
    import ray

    from hybridflow.batch import Batch
    from hybridflow.controller import ResourcePool, WorkerGroup, ensure_ray

    started = not ray.is_initialized()
    # started as `hybridflow train` starts it for a run on CPU
    ensure_ray(compute_on_cpu=True, address="local", num_cpus=2, log_to_driver=False)
    try:
        with ResourcePool(2, name="microbench") as pool:
            group = WorkerGroup(EchoWorker, pool)
            small = Batch({"x": torch.ones(8, 16, dtype=torch.long)})
            big = Batch({"x": torch.ones(2**16, 8, dtype=torch.long)})  # 4 MiB
            call, big_call, step = interleaved_best(
                (lambda: group.echo(small), lambda: group.echo(big), lambda: empty_step(group, small)),
                repeats,
            )
            group.shutdown()
    finally:
        if started:
            ray.shutdown()
    nbytes = 2 * big["x"].numel() * 8  # to the workers and back
    return {
        "call_overhead_s": call,
        "transfer_bandwidth": nbytes / max(big_call - call, 1e-9),
        # an empty step beyond the calls the rest prices: the driver's own work (futures, timers, joins)
        "driver_step_overhead_s": max(0.0, step - REST_CALLS * call),
        "empty_step_s": step,
    }


def step_rests(steps: int = REST_STEPS) -> dict:
    """{"runs": [{"ranks", "prompts", "rest_s", "longest_prompt_len", "mean_prompt_len"}], "workload":
    REST_RUN}: the median rest of real runs' steps (their time beyond the stages' busy intervals, as
    trainers/plan_metrics.py measures a plan's), the tiny model's GRPO through `hybridflow train` in a process
    of its own, at each of REST_RUNS, and the median of its steps' longest and mean prompt (tokens). The
    first sixth of each run's steps (at least one) warms up and is left out."""
    import json
    import statistics
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from hybridflow.errors import RunStopped
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.planner.dataflow import STAGE_PHASES, stage_seconds

    # the rule reward scores in the driver: it ends its stage but does not start it (trainers/plan_metrics.py)
    in_driver = frozenset({"reward"})
    out: dict = {"runs": [], "workload": REST_RUN}
    with tempfile.TemporaryDirectory(prefix="hybridflow-rest-") as tmp:
        model = save_tiny_model(Path(tmp) / "model", "tiny")
        for ranks, prompts in REST_RUNS:
            run = Path(tmp) / f"run{ranks}x{prompts}"
            args = [
                "algorithm.name=grpo", f"model.path={model}", "data.dataset=synthetic:arithmetic",
                "data.dataset_kwargs={num_samples: 0, val_size: 4, max_operand: 19}",
                f"data.max_prompt_length={REST_RUN['prompt_len']}", f"data.train_batch_size={prompts}",
                f"actor.ppo_mini_batch_size={prompts}", f"rollout.n={REST_RUN['samples_per_prompt']}",
                f"rollout.response_length={REST_RUN['response_len']}", "reward.kind=rule", "reward.num_workers=0",
                "resources.device=cpu", f"resources.n_gpus_per_node={ranks}", "resources.placement=colocate",
                f"trainer.total_steps={steps}", "trainer.val_before_train=false", "trainer.val_every=0",
                "trainer.save_every=0", "trainer.save_every_minutes=0", "trainer.loggers=[jsonl]",
                f"trainer.output_dir={run}", "trainer.experiment_name=rest", "trainer.resume=never",
            ]  # fmt: skip
            cmd = [sys.executable, "-m", "hybridflow.cli", "train", *args]
            done = subprocess.run(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False
            )
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise RunStopped(
                    f"the {ranks}-rank GRPO run timing the calls failed (exit {done.returncode}): {last}"
                )
            logged = [json.loads(line) for line in next(run.rglob("*.jsonl")).read_text().splitlines()]
            measured = logged[max(1, steps // 6) :]
            rests = []
            for m in measured:
                stages = [stage_seconds(m, phases, in_driver) for phases in STAGE_PHASES.values()]
                rests.append(m["timing_s/step"] - sum(s for s in stages if s))
            out["runs"].append({
                "ranks": ranks, "prompts": prompts, "rest_s": statistics.median(rests),
                # the prompts as the batches carried them: padded to the step's longest, not the config's cap
                "longest_prompt_len": statistics.median(m["prompt_length/max"] for m in measured),
                "mean_prompt_len": statistics.median(m["prompt_length/mean"] for m in measured),
            })  # fmt: skip
    return out


@contextlib.contextmanager
def as_workers() -> Iterator[None]:
    """Processes spawned inside start as a run's CPU workers do (controller/resource_pool.py
    embedded_worker_env): Ray's jemalloc preloaded with the workers' settings, libgomp's short spin; not
    glibc's allocator, under which a pass's large tensors page-fault their memory in afresh."""
    from hybridflow.controller.resource_pool import embedded_worker_env, ray_jemalloc

    env = embedded_worker_env(compute_on_cpu=True)
    if env.pop("RAY_LD_PRELOAD_ON_WORKERS", None):  # Ray's own switch; a spawned process reads LD_PRELOAD
        env["LD_PRELOAD"] = ray_jemalloc()
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in previous.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _model(size: str, layers: int, tp: int, dp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from hybridflow.engines.parallelize import parallelize
    from hybridflow.models.tiny import build_tiny_config

    cfg = build_tiny_config(size, "llama", num_hidden_layers=layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if tp * dp > 1 else None
    return parallelize(model, model, mesh), cfg.vocab_size


def _step_times(
    size: str, layers: int, tp: int, dp: int, repeats: int, tokens: tuple[int, int] = TOKENS
) -> tuple[float, float]:
    """(forward + backward, optimizer step) seconds of one micro-batch; the step as the engine's
    (engines/optim.py: clipping by the global norm, then AdamW as the engine builds it)."""
    from hybridflow.engines.config import OptimConfig
    from hybridflow.engines.optim import build_optimizer, clip_grad_norm_

    model, vocab = _model(size, layers, tp, dp)
    ids = torch.randint(5, vocab, tokens, generator=torch.Generator().manual_seed(0))
    optim = build_optimizer(model.parameters(), OptimConfig(lr=1e-5, grad_clip=1.0))

    def fwd_bwd():
        model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()

    def step():
        clip_grad_norm_(model.parameters(), 1.0)
        optim.step()

    train = best_seconds(fwd_bwd, repeats, min_s=0.0)
    return train, best_seconds(step, repeats, min_s=0.0)


def _training_child(rank: int, init_file: str, out: str, repeats: int, size: str) -> None:
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    for layout in LAYOUTS:
        tp, dp = int(layout[1]), int(layout[3])
        for layers in LAYERS:
            dist.barrier()  # both ranks time the same layout at once, as a run's ranks do
            result[f"{layout}/{layers}"] = _step_times(size, layers, tp, dp, repeats)
    for layout in TP_LAYOUTS:
        tp, dp = int(layout[1]), int(layout[3])
        for layers in LAYERS:
            dist.barrier()
            result[f"{layout}/{layers}@{_count(TP_TOKENS)}"] = _step_times(
                size, layers, tp, dp, repeats, TP_TOKENS
            )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def training_path(repeats: int = 5, size: str = "tiny") -> dict[str, float]:
    """Per-layer and per-micro-batch costs of a training step as the engines run it on 2 gloo ranks, on
    layers of the tiny model `size` (models/tiny.py: FSDP2's gathers move its layers' bytes)."""
    with as_workers():
        raw = spawn_ranks(_training_child, (repeats, size))
    return fit_training_path({k: tuple(v) for k, v in raw.items()})


# GRPO-shaped rows a micro-batch (examples/configs/grpo_tiny.yaml): 5-9-token prompts shared by n = 8
# samples of 4 tokens; two counts, so the slope is per token and a pass's fixed costs cancel
ENGINE_ROWS = (64, 256)


def grpo_rows(vocab: int, rows: int, seed: int = 0):
    """`rows` rows of GROUP samples per prompt (consecutive), left-padded prompts, full responses."""
    from hybridflow.batch import position_ids_from_mask
    from hybridflow.models.tiny import random_rl_batch

    lo, hi = PROMPT
    b = random_rl_batch(
        vocab, rows, lp=hi, lr=RESPONSE, seed=seed, min_prompt_len=lo, min_response_len=RESPONSE
    )
    first = torch.arange(rows) // GROUP * GROUP
    prompts = b["prompts"][first]
    attn = torch.cat([(prompts != 0).long(), b["response_mask"]], 1)
    b["prompts"], b["input_ids"], b["attention_mask"] = prompts, torch.cat([prompts, b["responses"]], 1), attn
    b["position_ids"] = position_ids_from_mask(attn)
    return b


def _pg_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["log_probs"] * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1), {}


def _engine_child(
    rank: int, init_file: str, out: str, size: str, repeats: int, dp: int = 1, threads: int = 1, pp: int = 1
) -> None:
    import json

    import torch.distributed as dist

    from hybridflow.engines.config import EngineConfig, OptimConfig, ParallelConfig
    from hybridflow.engines.train_engine import TrainEngine
    from hybridflow.models.tiny import build_tiny_model

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=dp * pp)
    cfg = EngineConfig(
        optim=OptimConfig(lr=1e-5),
        micro_batch_size_per_device=max(ENGINE_ROWS),
        remove_padding=pp == 1,  # pipeline stages run padded rows
        share_prompt=pp == 1,
        parallel=ParallelConfig(dp=dp, pp=pp),
    )
    engine = TrainEngine(build_tiny_model(size, "llama", seed=0), cfg)
    result = {"rows": list(ENGINE_ROWS), "prompt_len": [], "train_s": [], "infer_s": []}
    for rows in ENGINE_ROWS:
        # each rank its own rows, as a run's ranks get theirs: at dp = 2 every gather waits for the slower
        # (a pipeline's stages hold the same rows)
        batch = grpo_rows(engine.hf_model.config.vocab_size, rows, seed=rank if pp == 1 else 0)
        result["prompt_len"].append(float((batch["prompts"] != 0).sum()) / rows)
        result["train_s"].append(
            best_seconds(lambda b=batch: engine.train_step(b, _pg_loss), repeats, min_s=0.0)
        )
        result["infer_s"].append(
            best_seconds(lambda b=batch: engine.compute_log_probs(b), repeats, min_s=0.0)
        )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def engine_passes(size: str = "tiny", repeats: int = 3) -> dict:
    """Seconds of the engine's own training step (TrainEngine.train_step: packed, shared prompts, the
    log-prob chunks, clipping, AdamW) and log-prob pass (compute_log_probs) on ENGINE_ROWS GRPO-shaped rows
    of the tiny model `size` a rank: {"rows", "prompt_len" (their mean), "train_s", "infer_s"} in one
    process, under "dp2" the same on 2 ranks sharded by FSDP2 (rank 0's figures), under "pp2" on 2 pipeline
    stages (padded rows: engines/pipeline_engine.py), and under "threads" the one process again on all of
    this machine's cores ("count"), where it has more than one."""
    from hybridflow.controller.process import usable_cores

    cores = usable_cores()
    # (key, dp, threads, pp)
    runs = [(1, 1, 1, 1), (2, 2, 1, 1), ("pp2", 1, 1, 2)] + ([("threads", 1, cores, 1)] if cores > 1 else [])
    result = {}
    for key, dp, threads, pp in runs:
        with as_workers():
            result[key] = spawn_ranks(_engine_child, (size, repeats, dp, threads, pp), nprocs=dp * pp)
    passes = ("train_s", "infer_s")
    out = {
        **result[1],
        "dp2": {k: result[2][k] for k in passes},
        "pp2": {k: result["pp2"][k] for k in passes},
    }
    if "threads" in result:
        out["threads"] = {"count": cores, **{k: result["threads"][k] for k in passes}}
    return out


def _switch_child(rank: int, init_file: str, out: str, size: str, repeats: int) -> None:
    import json

    import torch.distributed as dist

    from hybridflow.engines.config import EngineConfig, OptimConfig, ParallelConfig
    from hybridflow.engines.train_engine import TrainEngine
    from hybridflow.hybrid_engine.pipeline_switch import PipelineResharder
    from hybridflow.hybrid_engine.resharder import Resharder
    from hybridflow.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    for layout, (pp, tp, dp) in SWITCH_LAYOUTS.items():
        parallel = ParallelConfig(pp=pp, tp=tp, dp=dp)
        engine = TrainEngine(
            build_tiny_model(size, "llama"), EngineConfig(optim=OptimConfig(), parallel=parallel)
        )
        if pp > 1:  # the generation engine's names: a whole model, parameters on meta (as the worker's)
            skeleton = build_tiny_model(size, "llama")
            for module in skeleton.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=False)
            resharder = PipelineResharder(engine, skeleton, 1, split_vocab=True)
        else:
            resharder = Resharder(engine, 1, split_vocab=True)

        samples = []
        for _ in range(repeats + 1):  # the first round allocates and exchanges the layout: left out
            dist.barrier()  # both ranks start together: their skew is not the switch's
            start = time.perf_counter()
            with resharder.generation():
                pass
            counters = torch.tensor(list(resharder.stats.as_metrics().values()), dtype=torch.float64)
            dist.all_reduce(counters, op=dist.ReduceOp.MAX)  # the worker's max over ranks (workers/actor.py)
            samples.append(time.perf_counter() - start)
        result[layout] = min(samples[1:])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def switch_rounds(size: str = "tiny", repeats: int = 8) -> dict[str, float]:
    """Seconds of one switch round (train -> generate -> train, nothing generated) at each of
    SWITCH_LAYOUTS on 2 gloo ranks, the tiny model `size`: {"t1d2": s, "t2d1": s, "p2t1d1": s}."""
    with as_workers():
        return spawn_ranks(_switch_child, (size, repeats))


def _count(tokens: tuple[int, int]) -> int:
    return tokens[0] * tokens[1]


def fit_training_path(raw: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Coefficients from {"<layout>/<layers>": (fwd+bwd s, optimizer step s)}: per layer and per pass
    (a training micro-batch is 3 passes: forward, backward counted as two), and the fixed rest; with
    "<layout>/<layers>@<tokens>" at TP_TOKENS too, tensor parallelism's per-layer cost as fixed + per token."""
    lo, hi = LAYERS

    def slope(layout: str, i: int, at: str = "") -> float:
        return (raw[f"{layout}/{hi}{at}"][i] - raw[f"{layout}/{lo}{at}"][i]) / (hi - lo)

    def rest(layout: str) -> float:  # the optimizer step's intercept at 0 layers
        return raw[f"{layout}/{lo}"][1] - lo * slope(layout, 1)

    base = slope("t1d1", 0)
    return {
        "train_layer_pass_s": base / 3,
        "micro_batch_overhead_s": max(0.0, raw[f"t1d1/{lo}"][0] - lo * base) / 3,
        "fsdp_layer_overhead_s": max(0.0, slope("t1d2", 0) - base) / 3,  # per unit: a layer, or the root
        **fit_tp_layer(raw, slope),
        "optimizer_layer_overhead_s": max(0.0, slope("t1d1", 1)),
        "optimizer_step_overhead_s": max(0.0, raw[f"t1d1/{lo}"][1] - lo * slope("t1d1", 1)),
        # the same step on DTensors: the clipping norm's reductions and each layout's kernel through
        # DTensor's dispatch, a cost per step (the fused kernels' per-layer slope is no steeper)
        "fsdp_optimizer_step_overhead_s": max(0.0, rest("t1d2") - rest("t1d1")),
        "tp_optimizer_step_overhead_s": max(0.0, rest("t2d1") - rest("t1d1")),
        "raw": {k: list(v) for k, v in raw.items()},
    }


def fit_tp_layer(raw: dict, slope) -> dict[str, float]:
    """tp_layer_overhead_s + tp_token_overhead_s x tokens: what a layer pass at t = 2 costs beyond t = 1's
    at two token counts (32 and TP_TOKENS'), less the half of t = 1's token-dependent work t = 2 still does
    (its GEMMs and activations are split across the ranks, which the simulator prices apart). Without the
    second count (an older measurement) the per-token term is 0 and the fixed one is the 32 tokens' figure."""
    n_lo, n_hi, at = _count(TOKENS), _count(TP_TOKENS), f"@{_count(TP_TOKENS)}"
    at_lo = (slope("t2d1", 0) - slope("t1d1", 0)) / 3
    if f"t2d1/{LAYERS[0]}{at}" not in raw:
        return {"tp_layer_overhead_s": max(0.0, at_lo), "tp_token_overhead_s": 0.0}
    split = (slope("t1d1", 0, at) - slope("t1d1", 0)) / 2  # t = 1's growth with tokens, half of it per rank
    at_hi = (slope("t2d1", 0, at) - slope("t1d1", 0, at) + split) / 3
    per_token = max(0.0, (at_hi - at_lo) / (n_hi - n_lo))
    return {"tp_layer_overhead_s": max(0.0, at_lo - n_lo * per_token), "tp_token_overhead_s": per_token}
