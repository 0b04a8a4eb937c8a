"""The device profile's coefficients fitted from the micro-benchmarks' raw figures (calibrate.py
measure_once): each term is what its measured passes cost beyond the simulator's seconds for them with
every other term, so the simulator priced with the profile reproduces the measurements."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from hybridflow.planner import simulate as sim
from hybridflow.planner.specs import DeviceSpec, ModelSpec, WorkloadSpec

# the shapes the fitted runs had (microbench_path.py runs them): the engine's passes on GRPO rows of GROUP
# samples a prompt, prompts of PROMPT tokens (shortest, longest), responses of RESPONSE; the switch rounds'
# (pp, tp, dp): FSDP2's unshard, the TP pieces' gather, the stages' exchange
GROUP, PROMPT, RESPONSE = 8, (5, 9), 4
SWITCH_LAYOUTS = {"t1d2": (1, 1, 2), "t2d1": (1, 2, 1), "p2t1d1": (2, 1, 1)}


def fit_engine_terms(raw: dict, dev: DeviceSpec, spec: ModelSpec) -> dict:
    """train_token_overhead_s and infer_token_overhead_s: per token of a micro-batch, the engine's
    measured seconds (microbench_path.engine_passes, two row counts) beyond the simulator's with `dev`
    for the same rows, slope against slope, so the fixed costs of a pass cancel; then
    train_batch_overhead_s and infer_batch_overhead_s: what the smaller run measured beyond the simulator's
    seconds with that slope priced, the engine's fixed cost per micro-batch that the plain model's fixed
    terms (microbench.layer_overhead, microbench_path.training_path) do not see."""
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


def fit_fsdp_token_terms(raw: dict, dev: DeviceSpec, spec: ModelSpec) -> dict:
    """fsdp_train_token_overhead_s and fsdp_infer_token_overhead_s: per token of a layer's pass, what the
    engine's passes on 2 FSDP2 ranks (microbench_path.engine_passes' "dp2", the same rows a rank) measured
    beyond the simulator's seconds for them at d = 2 with every other term `dev` has (the engine's included),
    slope against slope, so the fixed costs (FSDP2's per unit among them) cancel."""
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


def fit_decode_terms(steps: dict, dev: DeviceSpec, spec: ModelSpec) -> dict:
    """decode_step_overhead_s and decode_row_overhead_s: the built-in engine's decode step (microbench.
    engine_decode_steps: {"rows", "step_s"} at two row counts) beyond the simulator's price for it without them,
    at the fewer rows (the step's fixed rest, at least 0) and per row more (sampling, the stop test, the
    written columns: what grows with the batch beyond its FLOPs and bytes). `spec`: the model timed."""
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


def fit_pipeline_token_terms(raw: dict, dev: DeviceSpec, spec: ModelSpec) -> dict:
    """pipeline_train_token_overhead_s and pipeline_infer_token_overhead_s: per token of a stage's pass over
    a micro-batch, what the engine's passes on 2 pipeline stages (microbench_path.engine_passes' "pp2": the
    same rows, padded, in one micro-batch) measured beyond the simulator's seconds for them at p = 2 with
    every other term `dev` has, slope against slope, so the fixed costs cancel."""
    zero = replace(dev, call_overhead_s=0.0, transfer_bandwidth=0.0, pipeline_train_token_overhead_s=0.0,
                   pipeline_infer_token_overhead_s=0.0)  # fmt: skip
    one = replace(zero, pipeline_train_token_overhead_s=1.0, pipeline_infer_token_overhead_s=1.0)
    # the rows padded to the longest prompt, as the pipelined engine runs them
    wls = [
        WorkloadSpec(rows // GROUP, GROUP, PROMPT[1], RESPONSE, mini_batches=1, micro_batch_size=rows,
                     inference_micro_batch_size=rows)
        for rows in raw["rows"]
    ]  # fmt: skip

    def priced(key: str, d: DeviceSpec, wl: WorkloadSpec) -> float:
        if key == "train_s":
            return sim.training_time(spec, d, wl, 2, 2, 1, 1, checkpoint=False)
        return sim.inference_time(spec, d, wl, 2, 2, 1, 1)

    def per_token(key: str) -> float:
        base = [priced(key, zero, wl) for wl in wls]
        units = [priced(key, one, wl) - b for wl, b in zip(wls, base)]  # seconds per 1 s a token
        measured = raw["pp2"][key][-1] - raw["pp2"][key][0]
        return max(0.0, (measured - (base[-1] - base[0])) / (units[-1] - units[0]))

    return {
        "pipeline_train_token_overhead_s": per_token("train_s"),
        "pipeline_infer_token_overhead_s": per_token("infer_s"),
    }


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


def fit_switch_terms(raw: dict[str, float], dev: DeviceSpec, spec: ModelSpec) -> dict[str, float]:
    """switch_fsdp_unit_s, switch_tp_unit_s and switch_stage_s: each switch round measured
    (microbench_path.switch_rounds: t1d2, t2d1 and p2t1d1 on 2 ranks, to tg = 1) beyond the simulator's
    seconds for the same round without these terms (its bytes over the link, the counters' all-reduce), per
    unit the round gathers (simulate.switch_overhead): the model's layers and root at d = 2, its layers at
    t = 2, its 2 stages at p = 2."""
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


def fit_sync_waits(raw: dict, latency_s: float) -> dict[str, float]:
    """sync_wait_s and sync_wait_fraction from microbench.sync_waits ({"chunk_s", "wait_s"} at two chunk
    sizes): the wait a barrier adds after a chunk of each rank's own work, as fixed + fraction x chunk, the
    fixed part beyond the collective's own latency (`latency_s`, priced apart), neither below 0."""
    (w1, w2), (e1, e2) = raw["chunk_s"], raw["wait_s"]
    fraction = max(0.0, (e2 - e1) / (w2 - w1)) if w2 > w1 else 0.0
    return {"sync_wait_s": max(0.0, e1 - fraction * w1 - latency_s), "sync_wait_fraction": fraction}


# the runs microbench_path.step_rests times: GRPO's calls (generation, advantages, update; no reference) on a
# rule reward, this workload at (ranks, prompts) of each run: a small and a large batch on one rank, the small
# on two
REST_RUN = dict(samples_per_prompt=8, prompt_len=16, response_len=4)
REST_RUNS = ((1, 8), (1, 64), (2, 8))
REST_STEPS = 24  # steps of each (`hybridflow calibrate --rest-steps`); the first sixth is left out
REST_RUN_STAGES = ("generation", "training")


def fit_call_terms(raw: dict, dev: DeviceSpec) -> dict[str, float]:
    """call_overhead_s, call_rank_overhead_s and transfer_bandwidth from microbench_path.step_rests: real
    runs' rest (a small and a large batch on one rank, the small on two) less what `dev` prices there beyond
    the calls (the driver's own work), over the run's rounds of calls (its stages' and the advantages').
    The rest's growth with the batch is its rows' cost, priced as their tokens' transfer (pickling a batch's
    text and lists costs more per token than an idle call's tensor: REST_RUN's rows price it as runs pay it),
    each run's rows at the width its batches had (rest_workload: padded to the longest prompt drawn);
    what is left at the small batch is the call itself, and its growth from one rank to two the rank term.
    None below 0; a batch that grew no slower keeps `dev`'s transfer price."""
    rest = {(int(r["ranks"]), int(r["prompts"])): r["rest_s"] for r in raw["runs"]}
    small, large = sorted(p for n, p in rest if n == 1)
    wl = {int(r["prompts"]): rest_workload(raw, r) for r in raw["runs"] if int(r["ranks"]) == 1}
    rounds = len(REST_RUN_STAGES) + 1
    grew = rest[1, large] - rest[1, small]
    moved = rounds * 2 * sim.BATCH_BYTES_PER_TOKEN
    moved *= wl[large].sequences * wl[large].padded_seq_len - wl[small].sequences * wl[small].padded_seq_len
    bandwidth = moved / grew if grew > 0 else dev.transfer_bandwidth
    bare = replace(dev, call_overhead_s=0.0, call_rank_overhead_s=0.0, transfer_bandwidth=bandwidth)
    call = (rest[1, small] - sim.step_rest_time(bare, wl[small], REST_RUN_STAGES)) / rounds
    rank = (rest[2, small] - rest[1, small]) / rounds
    return {
        "call_overhead_s": max(0.0, call),
        "call_rank_overhead_s": max(0.0, rank),
        "transfer_bandwidth": bandwidth,
    }


def rest_workload(raw: dict, run: dict) -> WorkloadSpec:
    """The workload of one of step_rests' runs as its batches carried it: REST_RUN at the run's prompts,
    padded to its steps' longest prompt (the data's, below the config's cap; a file without it: the cap)."""
    longest = round(run.get("longest_prompt_len", 0))
    return WorkloadSpec(**raw["workload"], prompts=int(run["prompts"]), longest_prompt_len=longest,
                        mean_prompt_len=float(run.get("mean_prompt_len", 0.0)))  # fmt: skip
