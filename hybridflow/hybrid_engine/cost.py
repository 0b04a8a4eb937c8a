"""Table 2 of the paper as pure functions: per-rank bytes moved, peak and redundant memory of each switch.

The one place the switch's cost is written down (docs/hybrid_engine.md derives both tables):
- `switch_cost`: the paper's Table 2, Megatron-style training (each of the d replicas holds M/(pt));
- `fsdp_switch_cost`: the layout this project runs (FSDP2 over dp, TP over t, p = 1), the formula the
  actor worker's counters (resharder.py) must equal; the planner (planner/simulate.py) prices a switch
  with it too. M is the actor's weight bytes.
- `pipeline_switch_cost`: the same extended to p pipeline stages with pg = 1 (pipeline_switch.py).

| method     | communication      | peak memory | redundant copy |
| allgather  | (tpd-1)/(tpd) M    | M           | M/(tpd)        |
| vanilla    | (tp-1)/(tp) M      | M           | M/(tp)         |
| hybridflow | (dg-1)/(tp) M      | M/(tg pg)   | 0              |
| two_copy   | M                  | M/(tg pg)   | M/(tg pg)      |

For two_copy the paper only says "a full weight transfer" and "two copies"; on shared devices the second
copy a rank holds is its generation shard, M/(tg pg), resident all the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

METHODS = ("hybridflow", "allgather", "vanilla", "two_copy")


@dataclass(frozen=True)
class SwitchCost:
    comm_bytes: float  # received by one rank per train -> generate switch
    peak_bytes: float  # extra weight memory one rank holds at the peak of the switch
    redundant_bytes: float  # weight bytes held twice on one rank during generation


def switch_cost(
    method: str, model_bytes: float, p: int, t: int, d: int, pg: int = 1, tg: int = 1
) -> SwitchCost:
    """Per-rank cost of switching an M-byte actor from training (p, t, d) to generation (pg, tg)."""
    if t % tg or p % pg:
        raise ValueError(f"generation tg={tg}, pg={pg} must divide training t={t}, p={p}")
    m, mp, n = float(model_bytes), p * t, p * t * d
    dg = mp // (pg * tg)
    if method == "allgather":
        return SwitchCost((n - 1) / n * m, m, m / n)
    if method == "vanilla":
        return SwitchCost((mp - 1) / mp * m, m, m / mp)
    if method == "hybridflow":
        return SwitchCost((dg - 1) / mp * m, m / (tg * pg), 0.0)
    if method == "two_copy":
        return SwitchCost(m, m / (tg * pg), m / (tg * pg))
    raise ValueError(f"unknown switch method {method!r}; choose one of {METHODS}")


def fsdp_switch_cost(
    method: str,
    split_bytes: int,
    whole_bytes: int,
    t: int,
    d: int,
    tg: int,
    world: int | None = None,
    vocab_bytes: int = 0,
) -> tuple[int, int]:
    """(bytes received, generation-weight bytes held) per rank for one train -> generate switch of the
    layout that runs: t-way TP x d-way FSDP2, generation tg-way TP (p = pg = 1).

    split_bytes: weights TP-split in training (q/k/v/o, gate/up/down); whole_bytes: weights every TP rank
    holds whole (embeddings, norms, lm_head), so M = split + whole; vocab_bytes: the part of whole that
    generation splits over the vocabulary (embeddings and lm_head, V/tg rows per rank; 0 if kept whole).
    Between steps a rank holds split/(td) + whole/d; FSDP's all-gather brings it to split/t + whole
    ((d-1)/d of that received), then:
      hybridflow  micro-DP all-gather to split/tg:        received += split/tg - split/t;
                  held split/tg + whole - vocab + vocab/tg
      allgather, vanilla  TP all-gather to the whole model: received += split - split/t;  held M
      two_copy    rank 0 broadcasts every weight whole:  received += M (the max over ranks, rank 0 excluded);
                  held: the resident copy, split/tg + whole - vocab + vocab/tg
    """
    if t % tg:
        raise ValueError(f"generation tg={tg} must divide training t={t}")
    s, w, v = Fraction(split_bytes), Fraction(whole_bytes), Fraction(vocab_bytes)
    fsdp = (d - 1) * (s / t + w) / d
    if method == "hybridflow":
        received, held = fsdp + s / tg - s / t, s / tg + w - v + v / tg
    elif method in ("allgather", "vanilla"):
        received, held = fsdp + s - s / t, s + w
    elif method == "two_copy":
        received = fsdp + (s + w if (world or t * d) > 1 else 0)
        held = s / tg + w - v + v / tg
    else:
        raise ValueError(f"unknown switch method {method!r}; choose one of {METHODS}")
    return round(received), round(held)


def pipeline_switch_cost(
    stages: list[tuple[int, int, int]], stage: int, t: int, d: int, tg: int
) -> tuple[int, int]:
    """(bytes received, generation-weight bytes held) per rank for one train -> generate switch of an
    actor in p pipeline stages x t-way TP x d-way FSDP2, generating with pg = 1 and tg-way TP
    (pipeline_switch.py). stages: (split, whole, vocab) bytes of each stage's weights, as in
    fsdp_switch_cost (the first and last stages also hold the embeddings, final norm and lm_head); stage:
    this rank's.

    The rank first switches its own stage as fsdp_switch_cost's hybridflow row (dp gather, then the
    micro-DP gather inside its TP group), then receives every other stage's generation shard from its
    pp group: held G = sum over stages of S/tg + W - V + V/tg, received = own stage's + G - G_own. For
    t = tg = 1 that is (d-1)/d M_s + M - M_s; for an even cut, W = 0 and d = 1 it is Table 2's hybridflow
    row, (dg-1)/(pt) M with dg = pt/tg."""
    held = [Fraction(s) / tg + w - v + Fraction(v) / tg for s, w, v in stages]
    s, w, v = (Fraction(x) for x in stages[stage])
    own = (d - 1) * (s / t + w) / d + s / tg - s / t
    return round(own + sum(held) - held[stage]), round(sum(held))


# (name, params, N, p, t, d, pg, tg). 70B follows the issue (T8 P8 Tg8 on 128 GPUs); the smaller models use
# the paper's GPU counts (16/32/64) with parallel sizes chosen here, as the paper's exact ones are not given.
PAPER_SETTINGS = (
    ("7B", 7e9, 16, 1, 4, 4, 1, 2),
    ("13B", 13e9, 32, 1, 8, 4, 1, 4),
    ("34B", 34e9, 64, 4, 8, 2, 1, 8),
    ("70B", 70e9, 128, 8, 8, 2, 1, 8),
)


def paper_table(bytes_per_param: int = 2) -> str:
    """Markdown table of per-GPU communication and peak memory (GB) for the paper's model sizes."""
    head = (
        "| model | train p-t-d | gen pg-tg-dg | "
        + " | ".join(f"{m} comm GB / peak GB" for m in METHODS)
        + " |"
    )
    lines = [head, "|" + "---|" * (3 + len(METHODS))]
    for name, params, _, p, t, d, pg, tg in PAPER_SETTINGS:
        m = params * bytes_per_param
        cells = []
        for meth in METHODS:
            c = switch_cost(meth, m, p, t, d, pg, tg)
            cells.append(f"{c.comm_bytes / 1e9:.1f} / {c.peak_bytes / 1e9:.1f}")
        dg = p * t // (pg * tg)
        lines.append(f"| {name} | {p}-{t}-{d} | {pg}-{tg}-{dg} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
