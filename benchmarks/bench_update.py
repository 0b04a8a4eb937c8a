"""The actor update of one GRPO step as the worker runs it, against a plain loop of the same arithmetic
(the named baseline: what TRL's GRPOTrainer computes), in one process, per model and precision.

Workload: the natural-EOS benchmark's short rows (benchmarks/vs_trl.py): 8 prompts x 4 responses, prompts
up to 24 tokens, responses up to 32 ending at random lengths, one micro-batch, one optimizer step, KL loss
(low_var_kl, beta 0.01) to given reference log-probs, entropy logged. hybridflow: TrainEngine.train_step with
the worker's loss (workers/losses.py actor_loss_fn) and engine config (workers/common.py engine_config: padding
removed, as `hybridflow train` runs the Llama family). Plain loop: the HF model's full-logits forward,
log_softmax + gather at the response positions, the same loss terms, backward, grad-norm clipping, AdamW;
bf16 as TRL runs it (autocast over fp32 weights). Both: the same batch, threads and steps, alternating.

    .venv/bin/python benchmarks/bench_update.py [--sizes small medium] [--precision fp32 bf16] [--profile]

--profile prints both sides' top ops by self CPU time (torch.profiler) for one step of each cell;
--attention only times causal sdpa forward + backward on CPU in fp32, bf16, bf16 computed in fp32 and bf16 on
sdpa's math kernel (what engines/varlen.py picks for short packed sequences in bf16);
--kernels times the hybridflow update and log-prob pass with that choice against flash, alternating;
--gather the same passes with a packed row's attention in one gathered call per layer against one call per
run of equal lengths (engines/varlen_gather.py), prompts shared by 4 rows (GRPO's groups) and by none.
Times are CPU seconds (process time), steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch

from hybridflow.models.tiny import build_tiny_model, random_rl_batch

BATCH, LP, LR = 32, 24, 32


def engine_and_loss(model, precision: str):
    """The worker's TrainEngine and actor loss for a GRPO config with KL loss (what vs_trl.py runs)."""
    from hybridflow.config import load_config
    from hybridflow.engines.train_engine import TrainEngine
    from hybridflow.workers.common import engine_config
    from hybridflow.workers.losses import actor_loss_fn

    cfg = load_config(None, ["algorithm.name=grpo", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01",
                             "algorithm.kl_loss_kind=low_var_kl", "model.path=unused", "rollout.n=4",
                             "data.dataset=synthetic:arithmetic", "actor.optim.lr=1e-3",
                             "actor.optim.weight_decay=0.0", f"actor.micro_batch_size_per_device={BATCH}"],
                      check_model=False)  # fmt: skip
    dtype = "bfloat16" if precision == "bf16" else "float32"
    eng = TrainEngine(model, engine_config(cfg.actor, 1, "actor", 0, dtype, 100), trainable=True)
    return eng, actor_loss_fn(cfg.actor, cfg.algorithm, LR)


def hybridflow_step(eng, loss_fn, batch):
    return eng.train_step(batch, loss_fn, with_entropy="detached", loss_weighting="tokens")


def plain_step(model, opt, batch, precision: str):
    """TRL's arithmetic: full logits, log-softmax at the response positions, clipped ratio x advantage,
    k3 KL to the reference, entropy for the log, token mean; clip 1.0; AdamW."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    mask = batch["response_mask"].float()
    with ctx:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, -LR - 1 : -1].float()
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    ratio = torch.exp(lp - lp.detach())
    adv = batch["advantages"]
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    d = batch["ref_log_probs"] - lp
    kl = torch.exp(d) - d - 1
    loss = ((pg + 0.01 * kl) * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), (entropy * mask).sum() / mask.sum()


def make_batch(vocab: int, group: int = 1):
    """group > 1: rows in groups of `group` with one prompt each (GRPO's n samples per prompt)."""
    b = random_rl_batch(
        vocab, BATCH, LP, LR, seed=0, min_prompt_len=LP // 2, min_response_len=4, min_token_id=5
    )
    if group > 1:
        lead = torch.arange(BATCH) // group * group
        for k in ("prompts", "input_ids", "attention_mask", "position_ids"):
            b[k][:, :LP] = b[k][lead, :LP]
    b["old_log_probs"] = torch.zeros(BATCH, LR)
    b["ref_log_probs"] = -torch.rand(BATCH, LR) * b["response_mask"]
    return b


def time_cell(size: str, precision: str, steps: int, profile: bool) -> dict:
    torch.manual_seed(0)
    eng, loss_fn = engine_and_loss(build_tiny_model(size), precision)
    plain = build_tiny_model(size)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    batch = make_batch(plain.config.vocab_size)
    steps_of = {
        "hybridflow": lambda: hybridflow_step(eng, loss_fn, batch),
        "plain": lambda: plain_step(plain, opt, batch, precision),
    }
    times = {"hybridflow": [], "plain": []}
    for i in range(steps + 1):  # the first of each is a warm-up
        for side in ("hybridflow", "plain") if i % 2 else ("plain", "hybridflow"):
            start = time.process_time()  # CPU seconds: steadier than wall time on a shared machine
            steps_of[side]()
            if i:
                times[side].append(time.process_time() - start)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        for side, step in steps_of.items():
            with prof(activities=[ProfilerActivity.CPU]) as p:
                step()
            ops = p.key_averages()
            print(f"--- {size} {precision}: {side}, {sum(e.count for e in ops)} op calls; top by self CPU")
            print(ops.table(sort_by="self_cpu_time_total", row_limit=25))
    return {k: statistics.median(v) for k, v in times.items()}


ATTENTION_SHAPES = ((1, 4, 56, 32), (8, 4, 56, 32), (1, 8, 56, 64), (8, 8, 56, 64), (1, 8, 150, 64),
                    (8, 14, 56, 64), (1, 14, 400, 64))  # fmt: skip


def attention_cpu_seconds(dtype, shape, via_fp32: bool = False, reps: int = 20, math: bool = False) -> float:
    """CPU seconds of one causal sdpa forward + backward of (B, H, n, D) inputs in `dtype` (via_fp32: cast to
    fp32 for the call and back; math: sdpa's math kernel instead of PyTorch's choice, flash on CPU)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    cast = (lambda t: t.float()) if via_fp32 else (lambda t: t)

    def step():
        with sdpa_kernel(SDPBackend.MATH) if math else nullcontext():
            F.scaled_dot_product_attention(cast(q), cast(k), cast(v), is_causal=True).to(
                dtype
            ).sum().backward()

    for _ in range(3):
        step()
    start = time.process_time()
    for _ in range(reps):
        step()
    return (time.process_time() - start) / reps


def attention_table() -> str:
    out = ("| B, H, n, D | fp32 ms | bf16 ms | bf16 via fp32 ms | bf16 math kernel ms | bf16 / via fp32 "
           "| bf16 / math kernel |\n|---|---|---|---|---|---|---|\n")  # fmt: skip
    for shape in ATTENTION_SHAPES:
        a, b = attention_cpu_seconds(torch.float32, shape), attention_cpu_seconds(torch.bfloat16, shape)
        c = attention_cpu_seconds(torch.bfloat16, shape, via_fp32=True)
        m = attention_cpu_seconds(torch.bfloat16, shape, math=True)
        out += (f"| {shape} | {a * 1e3:.2f} | {b * 1e3:.2f} | {c * 1e3:.2f} | {m * 1e3:.2f} | {b / c:.2f}x "
                f"| {b / m:.2f}x |\n")  # fmt: skip
    return out


def kernel_cell(size: str, precision: str, steps: int) -> dict:
    """Median CPU seconds of the hybridflow update and log-prob pass with engines/varlen.py's kernel choice
    ("math": MATH_MAX_TOKENS as shipped) and with flash everywhere (MATH_MAX_TOKENS = 0), alternating."""
    from hybridflow.engines import varlen

    torch.manual_seed(0)
    eng, loss_fn = engine_and_loss(build_tiny_model(size), precision)
    batch = make_batch(eng.hf_model.config.vocab_size)
    limits = {"math": varlen.MATH_MAX_TOKENS, "flash": 0}

    def use(kernel):
        varlen.MATH_MAX_TOKENS = limits[kernel]

    times = _alternate(eng, loss_fn, batch, limits, use, steps)
    use("math")
    return times


def gather_cell(size: str, precision: str, steps: int, group: int) -> dict:
    """Median CPU seconds of the hybridflow update and log-prob pass with a packed row's attention in one
    gathered call per layer (engines/varlen_gather.py, as shipped) and per run of equal lengths
    (varlen_gather.CALL_ELEMS = -1: never), alternating; prompts shared in groups of `group` rows."""
    from hybridflow.engines import varlen, varlen_gather

    torch.manual_seed(0)
    eng, loss_fn = engine_and_loss(build_tiny_model(size), precision)
    batch = make_batch(eng.hf_model.config.vocab_size, group)
    limits = {"gathered": varlen_gather.CALL_ELEMS, "per-length": -1}

    def use(kind):
        varlen_gather.CALL_ELEMS = limits[kind]
        varlen._LAST_PLAN[:] = [None, None]  # the decision is cached per row of lengths

    times = _alternate(eng, loss_fn, batch, limits, use, steps)
    use("gathered")
    return times


def _alternate(eng, loss_fn, batch, limits: dict, use, steps: int) -> dict:
    """Median CPU seconds of the update and the log-prob pass under each of `limits` (use(key) sets one),
    alternating their order each round; the first round is a warm-up."""
    passes = {
        "update": lambda: hybridflow_step(eng, loss_fn, batch),
        "log-probs": lambda: eng.compute_log_probs(batch),
    }
    times = {(p, k): [] for p in passes for k in limits}
    for i in range(steps + 1):
        for key in limits if i % 2 else reversed(list(limits)):
            use(key)
            for name, run in passes.items():
                start = time.process_time()
                run()
                if i:
                    times[name, key].append(time.process_time() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def gather_table(args) -> str:
    head = "| model | precision | prompts shared by | pass | per-length CPU s | gathered CPU s | per-length / gathered |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for size in args.sizes:
        for prec in args.precision:
            for group in (4, 1):
                t = gather_cell(size, prec, args.steps, group)
                for name in ("update", "log-probs"):
                    a, b = t[name, "per-length"], t[name, "gathered"]
                    lines.append(f"| {size} | {prec} | {group} | {name} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
                    print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["small", "medium"])
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--attention", action="store_true", help="only the CPU sdpa table: bf16 against fp32")
    p.add_argument(
        "--kernels", action="store_true", help="only the packed attention kernel A/B (math vs flash)"
    )
    p.add_argument(
        "--gather", action="store_true", help="only the packed attention A/B: gathered vs per length"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gather:
        print(gather_table(args))
        return 0
    if args.attention:
        print(attention_table())
        return 0
    if args.kernels:
        print(
            "| model | precision | pass | flash CPU s | as shipped CPU s | flash / as shipped |\n|---|---|---|---|---|---|"
        )
        for size in args.sizes:
            for prec in args.precision:
                t = kernel_cell(size, prec, args.steps)
                for name in ("update", "log-probs"):
                    a, b = t[name, "flash"], t[name, "math"]
                    print(f"| {size} | {prec} | {name} | {a:.3f} | {b:.3f} | {a / b:.2f}x |", flush=True)
        return 0
    print(
        "| model | precision | plain loop CPU s | hybridflow CPU s | plain / hybridflow |\n|---|---|---|---|---|"
    )
    for size in args.sizes:
        for prec in args.precision:
            t = time_cell(size, prec, args.steps, args.profile)
            print(f"| {size} | {prec} | {t['plain']:.3f} | {t['hybridflow']:.3f} | {t['plain'] / t['hybridflow']:.2f}x |",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
