"""Ray-free preflight of the GPU check (scripts/gpu_check.sh, docs/bench/gpu.md): one process, one device.

    python scripts/gpu_preflight.py --device cuda|cpu --out preflight.json [--rehearse]

What it checks before any Ray cluster or process group exists, so that a failure names the layer:
1. a tiny Qwen2 built locally (hybridflow.models.tiny) on the device;
2. generate: the built-in engine (rollout/engine.py BuiltinEngine) samples n responses per prompt in
   bf16, timed after one warm-up call (tokens/s);
3. the train-vs-rollout log-prob gap over response tokens, |log p_train - log p_rollout|: the
   TrainEngine's compute_log_probs against the rollout's own `rollout_log_probs`, once in fp32 (the two
   code paths must agree: a gap there is a bug, not rounding) and once in bf16 (the decoder's rounding
   differs from the training forward's; this is what an RL run's off-policy noise starts from);
4. one bf16 training step (TrainEngine.train_step, fp32 master weights) with the PPO clipped loss on
   those samples: finite loss and grad norm, weights moved, the surrogate lower afterwards;
5. where it all ran (device_problems): every parameter and every output on the requested device type
   and, for cuda, torch.cuda.max_memory_allocated() > 0. A "cuda" run that computed on the CPU fails here
   whatever its numbers, so a result labelled with a GPU's name is a GPU's.
--rehearse (with --device cpu): the same stages on CPU, then the cuda check of stage 5 run against them;
it passes only if that check refuses them (the rehearsal of docs/bench/gpu.md).
Writes every figure and a pass/fail per stage to --out (JSON); exits 0 only if every stage passed.
tests/test_gpu_kit.py runs it on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter

# The fp32 gap is between two code paths computing the same thing in the same precision (KV-cache
# decode vs one full forward): only summation order differs (CPU: max 1e-6). The bf16 gap is rounding
# (CPU: mean 1.2e-3, max 7.6e-3; docs/bench/gpu.md). Log-probs read one position off (a token-shift bug)
# differ by a mean 0.17 on this random model, so both bounds catch that, with room for other kernels.
FP32_GAP_MAX = 1e-3
BF16_GAP_MEAN_MAX = 0.02


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Ray-free preflight: tiny model, generate, log-prob gap, bf16 step"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", required=True, help="JSON file for the figures")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--size", default="small", help="hybridflow.models.tiny size")
    p.add_argument("--rehearse", action="store_true", help="on CPU: the cuda device check must refuse it")
    args = p.parse_args(argv)
    if args.rehearse and args.device != "cpu":
        p.error("--rehearse runs on CPU: use it with --device cpu")
    return args


def gap(a, b, mask) -> dict:
    """Mean and max |a - b| over the response tokens (mask == 1)."""
    d = (a - b).abs()[mask.bool()]
    return {"mean": float(d.mean()), "max": float(d.max()), "tokens": int(d.numel())}


def prompt_batch(n_prompts: int):
    from hybridflow.batch import Batch
    from hybridflow.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    texts = [f"{i % 17}+{(7 * i) % 13}=" for i in range(n_prompts)]
    enc = tok(texts, padding=True, return_tensors="pt")  # left-padded: the engine's contract
    return Batch.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def build_engine(size: str, mixed_precision: str, device: str):
    from hybridflow.engines.config import EngineConfig, OptimConfig
    from hybridflow.engines.train_engine import TrainEngine
    from hybridflow.models.tiny import build_tiny_model

    model = build_tiny_model(size, arch="qwen2", seed=0)
    cfg = EngineConfig(mixed_precision=mixed_precision, micro_batch_size_per_device=64,
                       optim=OptimConfig(lr=1e-3, weight_decay=0.0))  # fmt: skip
    return TrainEngine(model, cfg, device=device)  # the engine's own default is the CPU


def device_problems(requested: str, devices: dict, peak_bytes: int) -> list[str]:
    """Why a computation is no proof of running on `requested` ([] = proof): every place it ran (name ->
    torch.device) of that type and, for cuda, something allocated there (the allocator's peak). Outputs
    are no evidence: the engines hand results back on the host whatever computed them."""
    problems = [f"{name} on {d.type}, not {requested}" for name, d in devices.items() if d.type != requested]
    if requested == "cuda" and peak_bytes <= 0:
        problems.append("torch.cuda.max_memory_allocated() is 0: nothing was computed on the GPU")
    return problems


def stage_device(requested: str, engine, gen_device, rehearse: bool) -> dict:
    """Where the stages computed: the trained parameters, the engine's device, the decoder's. Rehearsing,
    the cuda check runs against a CPU computation and must refuse it."""
    import torch

    # the parameters by device type, so one line says how many are off the device
    kinds = Counter(str(p.device) for p in engine.hf_model.parameters())
    devices = {f"{n} parameters": torch.device(kind) for kind, n in kinds.items()}
    devices.update({"train engine": engine.device, "generation": gen_device})
    peak = torch.cuda.max_memory_allocated() if requested == "cuda" else 0
    problems = device_problems(requested, devices, peak)
    out = {
        "rehearsal": rehearse,
        "requested": requested,
        "device_types": sorted({d.type for d in devices.values()}),
        "max_memory_allocated_bytes": peak,
        "problems": problems,
    }
    return {**out, "pass": bool(problems) if rehearse else not problems}


def generate(engine, prompts, params, dtype):
    """(rollout batch, seconds of the timed call, the device it decoded on): one warm-up call first
    (kernels, weight packing)."""
    import torch

    from hybridflow.rollout.engine import BuiltinEngine, BuiltinEngineConfig

    rollout = BuiltinEngine(engine.hf_model, BuiltinEngineConfig(dtype=dtype))
    rollout.generate(prompts, params)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = rollout.generate(prompts, params)
    sync()
    return out, time.perf_counter() - t0, rollout._device()


def stage_gap(engine, rollout, limit_mean: float | None, limit_max: float | None) -> dict:
    train_lp, _ = engine.compute_log_probs(rollout)
    g = gap(train_lp, rollout["rollout_log_probs"], rollout["response_mask"])
    ok = math.isfinite(g["mean"]) and math.isfinite(g["max"])
    ok = (
        ok
        and (limit_mean is None or g["mean"] <= limit_mean)
        and (limit_max is None or g["max"] <= limit_max)
    )
    return {**g, "limit_mean": limit_mean, "limit_max": limit_max, "pass": bool(ok)}


def synthetic_advantages(rollout, n: int):
    """GRPO advantages of a score that varies within each group (share of digit tokens in the response),
    so the step has a gradient; a random model almost never answers a sum right."""
    import torch

    from hybridflow.algorithms import compute_grpo_advantages
    from hybridflow.models.tiny import build_char_tokenizer

    digits = torch.tensor(build_char_tokenizer().convert_tokens_to_ids(list("0123456789")))
    resp, mask = rollout["responses"], rollout["response_mask"]
    score = (torch.isin(resp, digits) * mask).sum(1) / mask.sum(1).clamp(min=1)
    groups = torch.arange(len(resp)) // n  # rows i*n .. i*n+n-1 are prompt i's samples
    adv, _ = compute_grpo_advantages(score.float(), groups, mask.float())
    return adv


def stage_train(engine, rollout, n: int) -> dict:
    """One bf16 PPO step on the rollout; the surrogate is evaluated before and after it."""
    import torch

    from hybridflow.algorithms import policy_loss

    batch = rollout
    batch["advantages"] = synthetic_advantages(rollout, n)
    batch["old_log_probs"], _ = engine.compute_log_probs(batch)

    def loss_fn(out, mb):
        return policy_loss(out["log_probs"], mb["old_log_probs"], mb["advantages"], mb["response_mask"])

    def surrogate() -> float:
        lp, _ = engine.compute_log_probs(batch)
        return float(policy_loss(lp, batch["old_log_probs"], batch["advantages"], batch["response_mask"])[0])

    before = {k: v.detach().float().clone() for k, v in engine.hf_model.named_parameters()}
    s0 = surrogate()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    metrics = engine.train_step(batch, loss_fn)
    sync()
    seconds = time.perf_counter() - t0
    change = max(
        float((p.detach().float() - before[k]).abs().max()) for k, p in engine.hf_model.named_parameters()
    )
    s1 = surrogate()
    out = {
        "seconds": seconds,
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "max_weight_change": change,
        "surrogate_before": s0,
        "surrogate_after": s1,
        "param_dtype": str(next(engine.hf_model.parameters()).dtype),
        "compute_dtype": str(engine.compute_dtype),
    }
    ok = all(math.isfinite(v) for v in (out["loss"], out["grad_norm"], s1)) and change > 0 and s1 < s0
    return {**out, "pass": bool(ok)}


def peak_memory_gb(device) -> dict:
    import resource

    import torch

    out = {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device.type == "cuda":
        out["device_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["device_max_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def run(args) -> dict:
    import torch
    import transformers

    from hybridflow.rollout.base import SamplingParams

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_preflight: --device cuda but torch sees no CUDA device")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_start = time.perf_counter()
    torch.manual_seed(0)
    prompts = prompt_batch(args.prompts)
    # eos -1 never comes: every row decodes all its tokens (a fixed token count to time)
    params = SamplingParams(
        max_new_tokens=args.response_length, n=args.n, temperature=1.0, seed=0, eos_token_ids=(-1,)
    )
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    fp32 = build_engine(args.size, "none", args.device)
    result["model"] = f"tiny qwen2 '{args.size}', {fp32.num_params() / 1e6:.2f}M parameters"
    rollout32, _, _ = generate(fp32, prompts, params, None)
    result["log_prob_gap_fp32"] = stage_gap(fp32, rollout32, None, FP32_GAP_MAX)
    del fp32, rollout32

    engine = build_engine(args.size, "bf16", args.device)
    rollout, seconds, gen_device = generate(engine, prompts, params, torch.bfloat16)
    tokens = int(rollout["response_mask"].sum())
    result["generate_bf16"] = {
        "rows": len(rollout), "response_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "pass": tokens == len(rollout) * args.response_length,
    }  # fmt: skip
    result["log_prob_gap_bf16"] = stage_gap(engine, rollout, BF16_GAP_MEAN_MAX, None)
    result["train_step_bf16"] = stage_train(engine, rollout, args.n)
    result["peak_memory"] = peak_memory_gb(engine.device)
    # rehearsing, the check a cuda run gets is run against this CPU computation
    checked = "cuda" if args.rehearse else args.device
    result["device_check"] = stage_device(checked, engine, gen_device, args.rehearse)
    result["wall_s"] = time.perf_counter() - t_start
    stages = ["log_prob_gap_fp32", "generate_bf16", "log_prob_gap_bf16", "train_step_bf16", "device_check"]
    result["pass"] = all(result[s]["pass"] for s in stages)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # the same stages on CPU even where a GPU is visible
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    g32, g16, t = result["log_prob_gap_fp32"], result["log_prob_gap_bf16"], result["train_step_bf16"]
    print(f"preflight on {result['device']}: generate {result['generate_bf16']['tokens_per_s']:.0f} tokens/s (bf16) | "
          f"log-prob gap fp32 mean {g32['mean']:.2e} max {g32['max']:.2e} | bf16 mean {g16['mean']:.2e} "
          f"max {g16['max']:.2e} | bf16 step {t['seconds']:.2f} s, surrogate {t['surrogate_before']:.4f} -> "
          f"{t['surrogate_after']:.4f} | {'PASS' if result['pass'] else 'FAIL'}")  # fmt: skip
    d = result["device_check"]
    if args.rehearse:
        verdict = "refused" if d["pass"] else "DID NOT refuse"
        print(f"rehearsal: the cuda device check {verdict} this CPU run: "
              f"{'; '.join(d['problems'][:2]) or 'no problem found'}")  # fmt: skip
    elif d["problems"]:
        print(f"preflight: not a {args.device} computation: {'; '.join(d['problems'])}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
