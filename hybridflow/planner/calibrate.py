"""`hybridflow calibrate`: time this machine's stages on a tiny model and compare with the simulator.

The planner is only as good as its simulator, so this makes the error visible: it runs the three
kinds of work of an RL iteration on a plain transformers model on one CPU worker (the catalogue's
"cpu" device: one process, one thread by default) - training = forward + backward + AdamW step,
inference = forward without gradients, generation = HF `generate` with a KV cache - and prints
predicted seconds (the same simulator functions the planner uses, p = t = d = 1) beside the median
of a few measured repeats, with the ratio measured / predicted. It finishes well within a minute.

`--out FILE` first runs the micro-benchmarks (microbench.py) `--rounds` times (each coefficient the median
of its rounds', ~40 s a round on 2 cores), then on CPU three short real runs for the calls' cost
(`--rest-steps` each, ~65 s at the default 24), and writes a device profile (profile.py):
the catalogue entry `--device` with every coefficient they measure replaced, per compute dtype (float32,
bfloat16); the table then shows the profile's predictions too. `--on cuda` measures a GPU's compute
figures (the links stay the entry's). `--profile FILE` compares an existing profile instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from hybridflow.errors import RunStopped
from hybridflow.planner import simulate as sim
from hybridflow.planner.fit import (
    REST_STEPS,
    fit_call_terms,
    fit_decode_terms,
    fit_engine_terms,
    fit_fsdp_token_terms,
    fit_pipeline_token_terms,
    fit_switch_terms,
    fit_sync_waits,
    fit_thread_fractions,
    in_process,
)
from hybridflow.planner.profile import DeviceProfile
from hybridflow.planner.specs import DeviceSpec, ModelSpec, WorkloadSpec, get_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "medium"), help="tiny model size")
    parser.add_argument(
        "--device", default="cpu", help="catalogue entry to predict with (and the profile's starting point)"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per stage")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="measurements per stage (median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a CPU 'device' is one worker)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --out: measure the machine this many times, each coefficient the median of the rounds'",
    )
    parser.add_argument(
        "--rest-steps",
        type=int,
        default=REST_STEPS,
        help="with --out on CPU: steps of each real run timing the calls (the first sixth left out); "
        "fewer give a quicker, noisier profile",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="run the micro-benchmarks and write a device profile here (YAML/JSON) for `hybridflow plan "
        "--profile` and resources.planner_profile; the table then adds its predictions",
    )
    parser.add_argument(
        "--on", default="cpu", choices=("cpu", "cuda"), help="with --out: the torch device measured"
    )
    parser.add_argument("--profile", default=None, help="a device profile to predict with beside --device")
    parser.add_argument("--results", default=None, help="also write the table's figures as JSON")


def measure_profile(
    base: str = "cpu",
    device: str = "cpu",
    dtypes=("float32",),
    repeats: int = 5,
    size: str = "tiny",
    rounds: int = 1,
    rest_steps: int = REST_STEPS,
) -> DeviceProfile:
    """`rounds` measurements of the machine (measure_once), each coefficient the median of its rounds'
    (DeviceProfile.median_of); on CPU then the calls as a real run's steps pay them, once (step_rests: three
    short runs, each already a median over its steps). On a GPU the calls stay the idle worker group's."""
    profile = DeviceProfile.median_of(
        [measure_once(base, device, dtypes, repeats, size) for _ in range(rounds)]
    )
    if device != "cpu":
        return profile
    from hybridflow.planner import microbench_path as mbp

    rests = mbp.step_rests(rest_steps)
    terms = fit_call_terms(rests, next(iter(profile.devices.values())))  # not dtype's: the driver's and Ray's
    devices = {k: replace(v, **terms) for k, v in profile.devices.items()}
    return replace(
        profile,
        devices=devices,
        measurements={**profile.measurements, "step_rests": rests, "call_terms": terms},
    )


def measure_once(base: str, device: str, dtypes, repeats: int, size: str) -> DeviceProfile:
    """Run the micro-benchmarks (microbench.py) and write their figures into `base`'s catalogue entry: a
    DeviceSpec per dtype with measured GEMM rate and fall-off, bandwidth, overheads and (on CPU) links.
    The training path's runs on layers of the tiny model `size` (FSDP2's gathers move their bytes)."""
    import platform

    import torch

    from hybridflow.models.cpu import this_cpu
    from hybridflow.planner import microbench as mb
    from hybridflow.planner import microbench_path as mbp

    raw: dict = {"startup_s": mb.startup_seconds(), "memory_bandwidth": mb.memory_bandwidth(device, repeats)}
    links, path = {}, {}
    if device == "cpu":  # two-rank gloo between processes of this machine: what its collectives run on
        raw["collectives"] = links = mb.collectives()
        raw["sync_waits"] = mb.sync_waits()  # where ranks meet after work of their own
        raw["sync_terms"] = fit_sync_waits(raw["sync_waits"], links["latency_s"])
        raw["training_path"] = path = mbp.training_path(3, size)  # (a GPU's runs on NCCL: the entry's)
        raw["engine_passes"] = mbp.engine_passes(size, 3)
        raw["switch_rounds"] = mbp.switch_rounds(size)
    raw["worker_call"] = calls = mbp.worker_call(repeats)
    raw["detokenize"] = mb.detokenize_costs()
    call_terms = {k: v for k, v in calls.items() if k != "empty_step_s"}
    path_terms = {**call_terms, **{k: path[k] for k in PATH_TERMS if k in path}, **raw.get("sync_terms", {})}
    devices, spec = {}, tiny_spec(size)  # the model the path's runs timed
    decoded = tiny_spec("tiny", num_hidden_layers=mb.DECODE_LAYERS)  # the decode steps'
    for name in dtypes:
        dtype = getattr(torch, name)
        rates = mb.gemm_rates(dtype, device, repeats)
        peak, half = mb.fit_gemm(rates)
        per_layer = mb.layer_overhead(dtype, device, repeats)
        per_value = mb.activation_cost(dtype, peak, half, device)
        raw[name] = {
            "gemm_library": "onednn" if mb.onednn(dtype, device) else "default",
            "gemm_flops_by_width": rates,
            "layer_overhead_s": per_layer,
            "activation_s_per_element": per_value,
            "decode_steps": mb.engine_decode_steps(dtype, device),
        }
        entry = get_device(base if name == "float32" or device != "cpu" else "cpu-bf16")
        devices[name] = replace(
            entry,
            name=f"{entry.name}-measured",
            peak_flops=peak,
            compute_efficiency=1.0,  # the fitted peak is what this stack reaches
            gemm_half_width=half,
            hbm_bandwidth=raw["memory_bandwidth"],
            memory_efficiency=1.0,
            layer_overhead_s=per_layer,
            activation_s_per_element=per_value,
            **raw["detokenize"],
            bytes_per_param=dtype.itemsize,
            measured=True,
            **path_terms,
            **({"intra_node_bandwidth": links["bandwidth"], "comm_latency_s": links["latency_s"],
                "comm_efficiency": 1.0} if links else {}),
        )  # fmt: skip
        raw[name]["decode_terms"] = decode = fit_decode_terms(
            raw[name]["decode_steps"], devices[name], decoded
        )
        devices[name] = replace(devices[name], **decode)
    if "engine_passes" in raw:  # measured in fp32: the engine's per-token Python and packing, either dtype
        fp32 = devices.get("float32") or next(iter(devices.values()))
        raw["engine_tokens"] = terms = engine_terms(raw["engine_passes"], fp32, spec)
        devices = {k: replace(v, **terms) for k, v in devices.items()}
    if "switch_rounds" in raw:  # measured in fp32 (the bytes priced per dtype; the fixed costs are Python)
        fp32 = devices.get("float32") or next(iter(devices.values()))
        raw["switch_terms"] = terms = fit_switch_terms(raw["switch_rounds"], fp32, spec)
        devices = {k: replace(v, **terms) for k, v in devices.items()}
    host = {
        "machine": platform.machine(),
        "processor": this_cpu().model,
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": str(torch.__version__),
        "threads": torch.get_num_threads(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return DeviceProfile(f"{get_device(base).name}-measured", devices, host, raw)


# the coefficients microbench_path.training_path measures (the Python of a pass: the same in either dtype)
PATH_TERMS = (
    "micro_batch_overhead_s",
    "tp_layer_overhead_s",
    "tp_token_overhead_s",
    "fsdp_layer_overhead_s",
    "optimizer_layer_overhead_s",
    "optimizer_step_overhead_s",
    "fsdp_optimizer_step_overhead_s",
    "tp_optimizer_step_overhead_s",
)


def engine_terms(passes: dict, fp32: DeviceSpec, spec: ModelSpec) -> dict:
    """The engine's terms from its passes (microbench_path.engine_passes), each fitted with those before it."""
    terms = fit_engine_terms(passes, fp32, spec)
    if "dp2" in passes:
        terms |= fit_fsdp_token_terms(passes, replace(fp32, **terms), spec)
    if "pp2" in passes:
        terms |= fit_pipeline_token_terms(passes, replace(fp32, **terms), spec)
    if "threads" in passes:
        terms |= fit_thread_fractions(passes)
    return terms


def tiny_spec(size: str, **overrides) -> ModelSpec:
    """The planner's spec of the tiny Llama `size` (models/tiny.py) the micro-benchmarks time."""
    from hybridflow.models.tiny import build_tiny_config

    return ModelSpec.from_config_dict(build_tiny_config(size, "llama", **overrides).to_dict())


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

    import hybridflow.models.cpu_gemm as cpu_gemm
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.planner.microbench import onednn

    model = build_tiny_model(size, "llama", seed)
    if onednn(torch.float32, "cpu"):  # its linear layers as a run's engines multiply them
        cpu_gemm.use_onednn(model)
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


def predict(spec: ModelSpec, device: str | DeviceSpec, wl: WorkloadSpec) -> dict:
    """Simulated seconds for the same work on one device (p = t = d = 1)."""
    dev = in_process(get_device(device) if isinstance(device, str) else device)  # a plain HF model
    return {
        "training": sim.training_time(spec, dev, wl, 1, 1, 1, 1, checkpoint=False),
        "inference": sim.inference_time(spec, dev, wl, 1, 1, 1, 1),
        "generation": sim.generation_time(spec, dev, wl, 1, 1, 1, 1),
    }


def calibrate(
    size="tiny", device="cpu", batch=8, prompt_len=32, response_len=32, repeats=3, profile=None
) -> dict:
    """{"model", "device", "stages": {stage: {"predicted_s", "measured_s", "ratio"}}}; with a
    DeviceProfile also "profile_stages", the same predicted with its float32 entry."""
    spec = tiny_spec(size)
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
    measured = measure(size, batch, prompt_len, response_len, repeats)

    def compare(dev) -> dict:
        predicted = predict(spec, dev, wl)
        return {
            k: {"predicted_s": predicted[k], "measured_s": measured[k], "ratio": measured[k] / predicted[k]}
            for k in ("training", "inference", "generation")
        }

    result = {"model": spec.name, "params": spec.num_params, "device": device, "workload": vars(wl)}
    result["stages"] = compare(device)
    if profile is not None:
        result["profile"] = profile.name
        result["profile_stages"] = compare(profile.device("float32"))
    return result


WORK = {
    "training": "forward + backward + AdamW step",
    "inference": "forward, no grad (log-probs)",
    "generation": "HF generate, KV cache",
}


def _bad_out_settings(args) -> str | None:
    if args.rounds < 1:
        return f"--rounds must be at least 1 (got {args.rounds})"
    if args.rest_steps < 2:
        return f"--rest-steps must be at least 2: one left out, one timed (got {args.rest_steps})"
    return None


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    console = Console(width=160)
    start = time.perf_counter()
    profile = None
    if args.out:
        bad = _bad_out_settings(args)
        if bad:
            console.print(f"[red]hybridflow calibrate: {bad}[/]")
            return 2
        dtypes = ("float32", "bfloat16")
        try:
            profile = measure_profile(
                args.device, args.on, dtypes, args.repeats + 2, args.size, args.rounds, args.rest_steps
            )
        except RunStopped as e:  # one of the runs it times failed: what it printed last, nothing written
            console.print(f"[red]hybridflow calibrate: {e}[/]")
            return 1
        console.print(
            f"device profile written to {profile.save(args.out)} ({time.perf_counter() - start:.0f} s)"
        )
    elif args.profile:
        try:
            profile = DeviceProfile.load(args.profile)
        except (ValueError, FileNotFoundError) as e:
            console.print(f"[red]hybridflow calibrate: {e}[/]")
            return 2
    result = calibrate(
        args.size, args.device, args.batch, args.prompt_len, args.response_len, args.repeats, profile
    )
    table = Table(
        title=(
            f"{result['model']} ({result['params']:,} params), batch {args.batch} x "
            f"({args.prompt_len} + {args.response_len}) tokens, {args.threads} thread(s)"
        ),
        title_justify="left",
    )
    columns = ["stage", "work", "measured s", f"'{args.device}' entry s", "measured / predicted"]
    if profile is not None:
        columns += [f"profile {profile.name} s", "measured / predicted"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("stage", "work") else "right")
    for stage, r in result["stages"].items():
        row = [stage, WORK[stage], f"{r['measured_s']:.4f}", f"{r['predicted_s']:.4f}", f"{r['ratio']:.2f}x"]
        if profile is not None:
            q = result["profile_stages"][stage]
            row += [f"{q['predicted_s']:.4f}", f"{q['ratio']:.2f}x"]
        table.add_row(*row)
    console.print(table)
    console.print(f"calibration took {time.perf_counter() - start:.1f} s")
    if args.results:
        with open(args.results, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"results written to {args.results}")
    return 0
