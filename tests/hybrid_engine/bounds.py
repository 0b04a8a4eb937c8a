"""The documented bound on the generation weights a rank holds (docs/hybrid_engine.md): the formula's
S/tg + W plus at most one FSDP unit in flight, here for the tiny Llama the hybrid-engine tests build
(hidden 64, intermediate 128, 4 KV heads)."""

from __future__ import annotations


def unit_bytes(tp: int, tg: int, method: str, vocab: int) -> int:
    """The most one FSDP unit adds to the held generation weights on one rank, fp32: the root (embeddings
    + lm_head + final norm, whole), or a decoder layer of the tiny model, either unsharded (its TP pieces
    + 2 norms) with its packed bucket slot, or its gathered bucket (the pieces of n = micro-DP or TP group
    members; two_copy moves one weight at a time, counted within the layer)."""
    h, inter = 64, 128
    split = 4 * h * h + 3 * h * inter
    n = tp // tg if method == "hybridflow" else tp
    layer = max(2 * split // tp + 2 * h, n * split // tp)
    return 4 * max(layer, 2 * vocab * h + h)
