"""Two stages of the GPU check (scripts/gpu_check.sh, docs/bench/gpu.md) that need a model directory:

    python scripts/gpu_stages.py decode MODEL_DIR --device cuda|cpu --out decode.json [--rehearse]
    python scripts/gpu_stages.py plan-memory RUN_DIR --out plan.json [--rehearse]

decode: the built-in engine's decode tokens/s against plain `transformers` `generate` on the same model
(loaded in bf16), the same prompts, lengths and sampling (temperature 1, top-k 50, every row decoding all
its tokens), each timed after a warm-up call, the two alternated. Proof of the device as the preflight's
(gpu_preflight.device_problems).
plan-memory: a finished `hybridflow train` run's peak device memory (the largest
perf/memory/<role>/max_memory_allocated_gb in its metrics.jsonl) against the planner's prediction for
its config.yaml (trainers/auto_placement.plan_for_config: the pool's persistent bytes plus its largest
transient peak). Passes when the run measured device memory and the plan does not under-predict it by
more than MAX_OVER_PLAN.
--rehearse (on CPU): the stage runs, and the check a GPU run gets must refuse it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_preflight import device_problems, prompt_batch  # noqa: E402

# The planner prices Megatron-style state (18 bytes/param) and flash-attention activations; a peak more
# than twice its prediction would make an auto placement it calls safe run out of memory.
MAX_OVER_PLAN = 2.0


def timed_runs(fns: dict, repeats: int, sync) -> dict:
    """name -> (tokens, seconds) summed over `repeats` alternated calls of each fn() -> tokens."""
    totals = {name: [0, 0.0] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            tokens = fn()
            sync()
            totals[name][0] += tokens
            totals[name][1] += time.perf_counter() - t0
    return totals


def decode(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.rollout import BuiltinEngine, SamplingParams

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.bfloat16).to(device).eval()
    engine = BuiltinEngine(model)  # the weights' own dtype: bf16
    batch = prompt_batch(args.prompts)
    length = args.response_length
    params = SamplingParams(max_new_tokens=length, temperature=1.0, top_k=50, seed=0, eos_token_ids=(-1,))
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)

    def builtin(n: int = length) -> int:
        return int(engine.generate(batch, replace(params, max_new_tokens=n))["response_mask"].sum())

    def hf(n: int = length) -> int:
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=50,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0, use_cache=True)  # fmt: skip
        return int(out[:, ids.shape[1] :].numel())

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        builtin(8), hf(8)  # warm-up: kernels, the engine's weight packing
        totals = timed_runs({"builtin": builtin, "hf": hf}, args.repeats, sync)
    expected = args.repeats * args.prompts * length
    out = {"model": args.path, "params": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16",
           "prompts": args.prompts, "response_length": length, "repeats": args.repeats}  # fmt: skip
    for name, (tokens, seconds) in totals.items():
        out[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    out["ratio"] = out["builtin"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    devices = {"model": next(model.parameters()).device, "generation": engine._device()}
    out["device_check"] = check(args, devices, torch.cuda.max_memory_allocated() if cuda else 0)
    ran = all(out[n]["tokens"] == expected for n in totals) and math.isfinite(out["ratio"])
    return {**out, "pass": ran and out["device_check"]["pass"]}


def check(args, devices: dict, peak: int) -> dict:
    """The cuda proof (rehearsing: run against this CPU computation, where it must refuse)."""
    problems = device_problems("cuda" if args.rehearse else args.device, devices, peak)
    ok = bool(problems) if args.rehearse else not problems
    return {"rehearsal": args.rehearse, "max_memory_allocated_bytes": peak, "problems": problems, "pass": ok}


def measured_peak_gib(run_dir: Path) -> float | None:
    """The largest perf/memory/<role>/max_memory_allocated_gb of the run (GiB), None if never logged."""
    values = []
    for f in run_dir.glob("*/metrics.jsonl"):
        for line in f.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            values += [v for k, v in row.items() if k.endswith("/max_memory_allocated_gb")]
    return max(values) if values else None


def plan_memory(args) -> dict:
    from hybridflow.config import load_config
    from hybridflow.trainers.auto_placement import plan_for_config

    run_dir = Path(args.path)
    config = sorted(run_dir.glob("*/config.yaml"))
    if not config:
        return {"pass": False, "error": f"no */config.yaml under {run_dir}"}
    plan = plan_for_config(load_config(str(config[0]), [], validate=False))
    predicted = max(pool.peak_gib for pool in plan.pools)
    measured = measured_peak_gib(run_dir)
    out = {"run": str(config[0].parent), "plan_device": plan.device, "predicted_gib": predicted,
           "measured_gib": measured, "max_over_plan": MAX_OVER_PLAN,
           "pools": {p.name: {"roles": p.roles, "peak_gib": p.peak_gib} for p in plan.pools}}  # fmt: skip
    problems = [] if measured else ["no max_memory_allocated_gb in metrics.jsonl: it computed on the CPU"]
    out["device_check"] = {"rehearsal": args.rehearse, "problems": problems}
    if args.rehearse:
        return {**out, "pass": bool(problems) and predicted > 0}
    if measured:
        out["measured_over_predicted"] = measured / predicted
    return {**out, "pass": not problems and measured / predicted <= MAX_OVER_PLAN}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["decode", "plan-memory"])
    p.add_argument("path", help="decode: the model directory; plan-memory: the run's output_dir")
    p.add_argument("--out", required=True, help="JSON file for the figures")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--response-length", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rehearse", action="store_true", help="on CPU: the cuda check must refuse it")
    args = p.parse_args(argv)
    if args.rehearse and args.device != "cpu":
        p.error("--rehearse runs on CPU: use it with --device cpu")
    result = (decode if args.stage == "decode" else plan_memory)(args)  # named by its file (smoke_report.py)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    figures = {k: result.get(k) for k in ("ratio", "predicted_gib", "measured_gib") if k in result}
    problems = result.get("device_check", {}).get("problems", [])
    print(f"{args.stage}: {'PASS' if result['pass'] else 'FAIL'} | {figures} | device: "
          f"{'; '.join(problems) or 'on the device asked for'}")  # fmt: skip
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
