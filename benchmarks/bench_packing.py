"""Padding removal (model.remove_padding) on natural-EOS batches: TrainEngine's log-prob pass and update,
packed vs padded, in one process.

Baseline: the same engine with the padded forward (`model.remove_padding=false`: each micro-batch trimmed
to its longest prompt + longest response, as before padding removal). Rows: the padded engine with
token-budget micro-batches (sorted by length, verl's dynamic batch size) and the packed engine. The batch
is the natural-EOS workload of benchmarks/vs_trl.py: 32 sequences (8 prompts x n=4), prompts of 14-24
tokens left-padded, responses stopping at EOS with probability 1/90 per token (a fresh tiny model's rate)
up to the cap, right-padded. One micro-batch of 32 rows unless the row says otherwise, as vs_trl runs.

Every figure is the median over interleaved repeats of one process with 1 thread; CPU seconds
(process_time) are the steadier figure on a shared machine, wall seconds are given beside them.

    .venv/bin/python benchmarks/bench_packing.py [--sizes small medium] [--lengths 32 128] [--repeats 5]
    .venv/bin/python benchmarks/bench_packing.py --break-even --sizes small medium --lengths 32
    .venv/bin/python benchmarks/bench_packing.py --share --sizes medium [--lengths 32 128]

--share (model.share_prompt): the batch is 8 prompts x n=4 in consecutive rows, as GRPO's; baseline is the
packed engine with share_prompt=false, beside it the packed engine computing each prompt once and the padded one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridflow.batch import Batch, position_ids_from_mask
from hybridflow.engines import EngineConfig, TrainEngine
from hybridflow.models import load_causal_lm
from hybridflow.models.tiny import save_tiny_model


def natural_eos_batch(vocab: int, lr: int, seqs: int = 32, seed: int = 0, n: int = 1) -> Batch:
    """n > 1: seqs / n prompts, each repeated n times in consecutive rows (GRPO's groups)."""
    g = torch.Generator().manual_seed(seed)
    lp = 24
    prompt_lens = torch.randint(14, lp + 1, (seqs // n,), generator=g).repeat_interleave(n)
    u = torch.rand(seqs, generator=g).clamp(min=1e-9)
    resp_lens = (torch.log(u) / torch.log(torch.tensor(1 - 1 / 90))).long().clamp(0, lr - 1) + 1
    pm = (torch.arange(lp)[None] >= lp - prompt_lens[:, None]).long()
    rm = (torch.arange(lr)[None] < resp_lens[:, None]).long()
    prompts = torch.randint(5, vocab, (seqs // n, lp), generator=g).repeat_interleave(n, 0) * pm
    responses = torch.randint(5, vocab, (seqs, lr), generator=g) * rm
    attn = torch.cat([pm, rm], 1)
    return Batch.from_dict(
        dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
             attention_mask=attn, position_ids=position_ids_from_mask(attn), response_mask=rm,
             advantages=torch.randn(seqs, lr, generator=g) * rm, old_log_probs=torch.zeros(seqs, lr))
    )  # fmt: skip


def pg_loss(out, mb):
    m = mb["response_mask"].float()
    ratio = torch.exp(out["log_probs"] - out["log_probs"].detach())
    return -(ratio * mb["advantages"] * m).sum() / m.sum().clamp(min=1), {"entropy": out["entropy"].mean()}


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


PADDING_VARIANTS = {
    "padded (baseline)": (dict(remove_padding=False), {"micro_batch_size": 32}),
    "padded, token budget 1024": (dict(remove_padding=False), {"max_tokens": 1024}),
    "packed (remove_padding)": (dict(remove_padding=True, share_prompt=False), {"micro_batch_size": 32}),
}
# --share: 8 prompts x n=4 (vs_trl's GRPO batch); the baseline is the packed engine without shared prompts
SHARE_VARIANTS = {
    "packed, share_prompt=false (baseline)": (
        dict(remove_padding=True, share_prompt=False),
        {"micro_batch_size": 32},
    ),
    "packed, share_prompt=true": (dict(remove_padding=True, share_prompt=True), {"micro_batch_size": 32}),
    "padded": (dict(remove_padding=False), {"micro_batch_size": 32}),
}


def run_row(model_dir: Path, lr: int, repeats: int, share: bool = False) -> dict:
    variants = SHARE_VARIANTS if share else PADDING_VARIANTS
    engines = {
        name: TrainEngine(load_causal_lm(model_dir), EngineConfig(optim=_no_step(), **cfg))
        for name, (cfg, _) in variants.items()
    }
    vocab = next(iter(engines.values())).hf_model.config.vocab_size
    batch = natural_eos_batch(vocab, lr, n=4 if share else 1)
    times: dict = {(n, p): [] for n in variants for p in ("log-probs", "update")}
    for rep in range(repeats + 1):  # the first round warms up
        for name, (_, mb) in variants.items():
            eng = engines[name]
            lp = timed(lambda: eng.compute_log_probs(batch, **mb))  # noqa: B023
            up = timed(lambda: eng.train_step(batch, pg_loss, with_entropy="detached", **mb))  # noqa: B023
            if rep:
                times[(name, "log-probs")].append(lp)
                times[(name, "update")].append(up)
    attn = batch["attention_mask"]
    return {
        "real": int(attn.sum()),
        "padded": int(attn.shape[0] * (attn[:, :24].sum(-1).max() + attn[:, 24:].sum(-1).max())),
        "resp_mean": float(attn[:, 24:].sum(-1).float().mean()),
        "tokens_note": _shared_tokens(batch, lr) if share else "",
        "times": {k: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for k, v in times.items()},
        "variants": list(variants),
    }


def _shared_tokens(batch: Batch, lr: int) -> str:
    """The tokens a shared-prompt forward computes, for the table."""
    from hybridflow.engines import shared_prompt

    p = shared_prompt.plan(batch["attention_mask"], batch["input_ids"], batch["position_ids"], lr)
    return f" (shared: {p.cols})"


def _no_step():
    from hybridflow.engines import OptimConfig

    return OptimConfig(lr=0.0)  # weights stay put: every repeat sees the same model


def table(rows: dict) -> str:
    out = "| model | Lr | real / padded tokens | setting | log-probs CPU s (wall) | update CPU s (wall) | "
    base_name = next(iter(rows.values()))["variants"][0].removesuffix(" (baseline)")
    out += f"**CPU speed-up vs {base_name}: log-probs, update** |\n" + "|---" * 7 + "|\n"
    for (size, lr), r in rows.items():
        base = r["times"]
        for name in r["variants"]:
            (lw, lc), (uw, uc) = base[(name, "log-probs")], base[(name, "update")]
            (_, blc), (_, buc) = base[(r["variants"][0], "log-probs")], base[(r["variants"][0], "update")]
            out += (
                f"| {size} | {lr} | {r['real']} / {r['padded']}{r['tokens_note']} | {name} | {lc:.3f} ({lw:.3f}) | "
                f"{uc:.3f} ({uw:.3f}) | **{blc / lc:.2f}x, {buc / uc:.2f}x** |\n"
            )
    return out


def padded_fraction_batch(vocab: int, lr: int, fraction: float, seqs: int = 32, lp: int = 24) -> Batch:
    """Full prompts, responses shortened at random so that about `fraction` of the (seqs, lp + lr) tokens
    is padding (one response keeps the cap, so trimming leaves the shape)."""
    g = torch.Generator().manual_seed(0)
    u = torch.rand(seqs, generator=g)
    u[0] = 0
    resp = (lr - (u * 2 * fraction * (lp + lr)).round().long()).clamp(1, lr)
    rm = (torch.arange(lr)[None] < resp[:, None]).long()
    attn = torch.cat([torch.ones(seqs, lp, dtype=torch.long), rm], 1)
    ids = torch.randint(5, vocab, (seqs, lp + lr), generator=g) * attn
    return Batch.from_dict(
        dict(prompts=ids[:, :lp], responses=ids[:, lp:], input_ids=ids, attention_mask=attn,
             position_ids=position_ids_from_mask(attn), response_mask=rm,
             advantages=torch.randn(seqs, lr, generator=g) * rm, old_log_probs=torch.zeros(seqs, lr))
    )  # fmt: skip


def break_even(model_dir: Path, lr: int, repeats: int, fractions=(0.0, 0.03, 0.06, 0.1)) -> str:
    """Packed / padded CPU time of the update and the log-prob pass against the padding fraction, with
    packing forced on every micro-batch: where packing.MIN_PADDING_TO_PACK comes from."""
    from hybridflow.engines import packing

    engines = {
        k: TrainEngine(load_causal_lm(model_dir), EngineConfig(optim=_no_step(), remove_padding=k))
        for k in (False, True)
    }
    vocab = engines[False].hf_model.config.vocab_size
    out = "| padding | update CPU packed / padded | log-probs CPU packed / padded |\n|---|---|---|\n"
    rule, packing.MIN_PADDING_TO_PACK = packing.MIN_PADDING_TO_PACK, -1.0  # pack whatever the padding
    try:
        for f in fractions:
            batch = padded_fraction_batch(vocab, lr, f)
            t = {(k, p): [] for k in engines for p in "ul"}
            for rep in range(repeats + 1):
                for k, eng in engines.items():
                    step = dict(with_entropy="detached", micro_batch_size=32)
                    up = timed(lambda e=eng, b=batch, kw=step: e.train_step(b, pg_loss, **kw))
                    lp = timed(lambda e=eng, b=batch: e.compute_log_probs(b, micro_batch_size=32))
                    if rep:
                        t[(k, "u")].append(up[1])
                        t[(k, "l")].append(lp[1])
            med = {k: statistics.median(v) for k, v in t.items()}
            pad = 1 - float(batch["attention_mask"].sum()) / batch["attention_mask"].numel()
            out += f"| {pad:.1%} | {med[(True, 'u')] / med[(False, 'u')]:.3f} | {med[(True, 'l')] / med[(False, 'l')]:.3f} |\n"
    finally:
        packing.MIN_PADDING_TO_PACK = rule
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["small", "medium"])
    p.add_argument("--lengths", nargs="+", type=int, default=[32, 128])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--break-even", action="store_true", help="the packed / padded ratio against the padding fraction"
    )
    p.add_argument(
        "--share", action="store_true", help="8 prompts x n=4: packed with shared prompts vs packed without"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_packing_"))
    started, load = time.time(), os.getloadavg()
    rows = {}
    for size in args.sizes:
        model_dir = save_tiny_model(root / size, size, "llama", seed=0)
        for lr in args.lengths:
            if args.break_even:
                print(
                    f"{size}, Lr {lr}, 32 sequences:\n" + break_even(model_dir, lr, args.repeats), flush=True
                )
                continue
            rows[(size, lr)] = run_row(model_dir, lr, args.repeats, args.share)
            print(table(rows), flush=True)
    print(f"load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{time.time() - started:.0f} s; {args.repeats} repeats; 1 thread")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
