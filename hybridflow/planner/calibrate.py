"""`hybridflow calibrate`: time this machine's stages on a tiny model and compare with the simulator.

The planner is only as good as its simulator, so this makes the error visible: it runs the three
kinds of work of an RL iteration on a plain transformers model on one CPU worker (the catalogue's
"cpu" device: one process, one thread by default) - training = forward + backward + AdamW step,
inference = forward without gradients, generation = HF `generate` with a KV cache - and prints
predicted seconds (the same simulator functions the planner uses, p = t = d = 1) beside the median
of a few measured repeats, with the ratio measured / predicted. It finishes well within a minute.

`--out FILE` first runs the micro-benchmarks (microbench.py) `--rounds` times (each coefficient the median
of its rounds', ~40 s a round on 2 cores) and writes a device profile (profile.py):
the catalogue entry `--device` with every coefficient they measure replaced, per compute dtype (float32,
bfloat16); the table then shows the profile's predictions too. `--on cuda` measures a GPU's compute
figures (the links stay the entry's). `--profile FILE` compares an existing profile instead.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace

from hybridflow.planner import simulate as sim
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
) -> DeviceProfile:
    """`rounds` measurements of the machine (measure_once), each coefficient the median of its rounds'
    (DeviceProfile.median_of)."""
    return DeviceProfile.median_of([measure_once(base, device, dtypes, repeats, size) for _ in range(rounds)])


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
        raw["training_path"] = path = mbp.training_path(3, size)  # (a GPU's runs on NCCL: the entry's)
        raw["engine_passes"] = mbp.engine_passes(size, 3)
        raw["switch_rounds"] = mbp.switch_rounds(size)
    raw["worker_call"] = calls = mbp.worker_call(repeats)
    raw["detokenize"] = mb.detokenize_costs()
    call_terms = {k: v for k, v in calls.items() if k != "empty_step_s"}
    path_terms = {**call_terms, **{k: path[k] for k in PATH_TERMS if k in path}}
    devices = {}
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
        raw[name]["decode_terms"] = decode = fit_decode_terms(raw[name]["decode_steps"], devices[name])
        devices[name] = replace(devices[name], **decode)
    if "engine_passes" in raw:  # measured in fp32: the engine's per-token Python and packing, either dtype
        fp32 = devices.get("float32") or next(iter(devices.values()))
        terms = fit_engine_terms(raw["engine_passes"], fp32, size)
        if "dp2" in raw["engine_passes"]:
            terms |= fit_fsdp_token_terms(raw["engine_passes"], replace(fp32, **terms), size)
        if "threads" in raw["engine_passes"]:
            terms |= fit_thread_fractions(raw["engine_passes"])
        raw["engine_tokens"] = terms
        devices = {k: replace(v, **terms) for k, v in devices.items()}
    if "switch_rounds" in raw:  # measured in fp32 (the bytes priced per dtype; the fixed costs are Python)
        fp32 = devices.get("float32") or next(iter(devices.values()))
        raw["switch_terms"] = terms = fit_switch_terms(raw["switch_rounds"], fp32, size)
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


def fit_engine_terms(raw: dict, dev: DeviceSpec, size: str) -> dict:
    """train_token_overhead_s and infer_token_overhead_s: per token of a micro-batch, the engine's
    measured seconds (microbench_path.engine_passes, two row counts) beyond the simulator's with `dev`
    for the same rows, slope against slope, so the fixed costs of a pass cancel; then
    train_batch_overhead_s and infer_batch_overhead_s: what the smaller run measured beyond the simulator's
    seconds with that slope priced, the engine's fixed cost per micro-batch that the plain model's fixed
    terms (microbench.layer_overhead, microbench_path.training_path) do not see."""
    spec = _tiny_spec(size)
    # the engine's own terms being what is fitted
    predicted, tokens = _engine_predictions(raw, spec, in_process(dev), ranks=1)

    def residual(key: str) -> tuple[float, float]:
        measured = raw[key][-1] - raw[key][0]
        per_token = max(0.0, (measured - (predicted[key][-1] - predicted[key][0])) / (tokens[-1] - tokens[0]))
        return per_token, max(0.0, raw[key][0] - predicted[key][0] - tokens[0] * per_token)

    (train_token, train_batch), (infer_token, infer_batch) = residual("train_s"), residual("infer_s")
    return {
        "train_token_overhead_s": train_token,
        "infer_token_overhead_s": infer_token,
        "token_overhead_width": float(spec.hidden),
        "train_batch_overhead_s": train_batch,
        "infer_batch_overhead_s": infer_batch,
    }


def fit_fsdp_token_terms(raw: dict, dev: DeviceSpec, size: str) -> dict:
    """fsdp_train_token_overhead_s and fsdp_infer_token_overhead_s: per token of a layer's pass, what the
    engine's passes on 2 FSDP2 ranks (microbench_path.engine_passes' "dp2", the same rows a rank) measured
    beyond the simulator's seconds for them at d = 2 with every other term `dev` has (the engine's included),
    slope against slope, so the fixed costs (FSDP2's per unit among them) cancel."""
    spec = _tiny_spec(size)
    dev = replace(dev, call_overhead_s=0.0, transfer_bandwidth=0.0, fsdp_train_token_overhead_s=0.0,
                  fsdp_infer_token_overhead_s=0.0)  # fmt: skip
    predicted, tokens = _engine_predictions(raw, spec, dev, ranks=2)

    def per_layer_token(key: str, passes: int) -> float:
        measured = raw["dp2"][key][-1] - raw["dp2"][key][0]
        extra = measured - (predicted[key][-1] - predicted[key][0])
        return max(0.0, extra / (tokens[-1] - tokens[0]) / (passes * spec.num_layers))

    return {
        "fsdp_train_token_overhead_s": per_layer_token("train_s", 3),  # forward, backward (two)
        "fsdp_infer_token_overhead_s": per_layer_token("infer_s", 1),
    }


def fit_decode_terms(steps: dict, dev: DeviceSpec) -> dict:
    """decode_step_overhead_s and decode_row_overhead_s: the built-in engine's decode step (microbench.
    engine_decode_steps: {"rows", "step_s"} at two row counts) beyond the simulator's price for it without them,
    at the fewer rows (the step's fixed rest, at least 0) and per row more (sampling, the stop test, the
    written columns: what grows with the batch beyond its FLOPs and bytes)."""
    from hybridflow.planner.microbench import DECODE_LAYERS

    spec = _tiny_spec("tiny", num_hidden_layers=DECODE_LAYERS)
    bare = replace(dev, call_overhead_s=0.0, decode_step_overhead_s=0.0, decode_row_overhead_s=0.0,
                   detokenize_row_s=0.0, detokenize_token_s=0.0)  # fmt: skip

    def residual(rows: int, seconds: float) -> float:
        def priced(new: int) -> float:
            wl = WorkloadSpec(
                rows, 1, 4, new, mini_batches=1, micro_batch_size=rows, inference_micro_batch_size=rows
            )
            return sim.generation_time(spec, bare, wl, 1, 1, 1, 1)

        return seconds - (priced(17) - priced(1)) / 16

    (few, few_s), (many, many_s) = sorted(zip(steps["rows"], steps["step_s"]))
    per_row = max(0.0, (residual(many, many_s) - residual(few, few_s)) / (many - few))
    return {
        "decode_step_overhead_s": max(0.0, residual(few, few_s) - few * per_row),
        "decode_row_overhead_s": per_row,
    }


def _tiny_spec(size: str, **overrides) -> ModelSpec:
    """The planner's spec of the tiny Llama `size` (models/tiny.py) the micro-benchmarks time."""
    from hybridflow.models.tiny import build_tiny_config

    return ModelSpec.from_config_dict(build_tiny_config(size, "llama", **overrides).to_dict())


def fit_thread_fractions(raw: dict) -> dict:
    """thread_fraction_train and thread_fraction_infer: Amdahl's parallel fraction f of the engine's passes,
    from their speedup S on raw["threads"]["count"] = k threads over one (microbench_path.engine_passes,
    the median over its row counts): S = 1 / ((1 - f) + f / k), so f = (1 - 1/S) / (1 - 1/k), in [0, 1]."""
    k = raw["threads"]["count"]

    def fraction(key: str) -> float:
        speedup = statistics.median(a / b for a, b in zip(raw[key], raw["threads"][key]))
        return min(1.0, max(0.0, (1.0 - 1.0 / speedup) / (1.0 - 1.0 / k)))

    return {"thread_fraction_train": fraction("train_s"), "thread_fraction_infer": fraction("infer_s")}


def _engine_predictions(raw: dict, spec: ModelSpec, dev: DeviceSpec, ranks: int) -> tuple[dict, list]:
    """The simulator's seconds for microbench_path.engine_passes' batches (`rows` GRPO rows a rank in one
    micro-batch, on `ranks` data-parallel ranks): ({"train_s": [...], "infer_s": [...]}, tokens a rank)."""
    from hybridflow.planner.microbench_path import GROUP, RESPONSE

    predicted, tokens = {"train_s": [], "infer_s": []}, []
    for rows, prompt in zip(raw["rows"], raw["prompt_len"]):
        wl = WorkloadSpec(
            prompts=ranks * rows // GROUP, samples_per_prompt=GROUP, prompt_len=math.ceil(prompt),
            response_len=RESPONSE, mini_batches=1, micro_batch_size=rows, inference_micro_batch_size=rows,
            shared_prompts=True, mean_prompt_len=prompt,
        )  # fmt: skip
        tokens.append(rows * wl.tokens_per_sequence(rows))
        predicted["train_s"].append(sim.training_time(spec, dev, wl, ranks, 1, 1, ranks, checkpoint=False))
        predicted["infer_s"].append(sim.inference_time(spec, dev, wl, ranks, 1, 1, ranks))
    return predicted, tokens


def fit_switch_terms(raw: dict[str, float], dev: DeviceSpec, size: str) -> dict[str, float]:
    """switch_fsdp_unit_s, switch_tp_unit_s and switch_stage_s: each switch round measured
    (microbench_path.switch_rounds: t1d2, t2d1 and p2t1d1 on 2 ranks, to tg = 1) beyond the simulator's
    seconds for the same round without these terms (its bytes over the link, the counters' all-reduce), per
    unit the round gathers (simulate.switch_overhead): the model's layers and root at d = 2, its layers at
    t = 2, its 2 stages at p = 2."""
    from hybridflow.planner.microbench_path import SWITCH_LAYOUTS

    spec = _tiny_spec(size)
    names = {"t1d2": "switch_fsdp_unit_s", "t2d1": "switch_tp_unit_s", "p2t1d1": "switch_stage_s"}
    bare = replace(dev, **dict.fromkeys(names.values(), 0.0))
    out = {}
    for layout, (p, t, d) in SWITCH_LAYOUTS.items():
        priced = sim.switch_time(spec, bare, 2, p, t, d, 1, 1)
        # the units this layout gathers, as the simulator counts them: its term at 1 s, nothing else
        one = replace(bare, comm_latency_s=0.0, **{names[layout]: 1.0})
        units = sim.switch_overhead(spec, one, p, t, d, 1, 1, "hybridflow")
        out[names[layout]] = max(0.0, raw[layout] - priced) / units
    return out


# what fit_engine_terms measures: the engine's passes beyond the plain model's terms
ENGINE_TERMS = (
    "train_token_overhead_s",
    "infer_token_overhead_s",
    "train_batch_overhead_s",
    "infer_batch_overhead_s",
)


def in_process(dev: DeviceSpec) -> DeviceSpec:
    """`dev` as a run in this process sees it: no worker call, none of the engine's own terms."""
    return replace(dev, call_overhead_s=0.0, transfer_bandwidth=0.0, **dict.fromkeys(ENGINE_TERMS, 0.0))


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
    spec = _tiny_spec(size)
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


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    console = Console(width=160)
    start = time.perf_counter()
    profile = None
    if args.out:
        if args.rounds < 1:
            console.print(f"[red]hybridflow calibrate: --rounds must be at least 1 (got {args.rounds})[/]")
            return 2
        dtypes = ("float32", "bfloat16")
        profile = measure_profile(args.device, args.on, dtypes, args.repeats + 2, args.size, args.rounds)
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
