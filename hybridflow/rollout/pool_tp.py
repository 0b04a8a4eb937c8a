"""Generation tensor parallelism on a rollout-only pool (trainer.rollout_ahead=1; docs/design.md,
"One-step-ahead rollout").

The rollout pool's ranks form consecutive generation TP groups of rollout.tg ranks (ranks 0..tg-1 are
replica 0, and so on), each group one replica that the prompts are split over. Every rank holds the
full weights (the weight sync broadcasts them whole, workers/weight_sync.py) and generates on views of
its Megatron slice of them, as the 3D-HybridEngine's generation shard is laid out (docs/hybrid_engine.md):
q/k/v and gate/up (and their biases) by output rows, o and down by input columns, norms whole, embeddings
and lm_head vocab-parallel (V/tg rows) when the vocabulary divides by tg. Slicing takes views, so
weights the sync copies in place are what the next generate call reads; no copy is made here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.rollout.tp_group import TPGroup

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def consecutive_groups(world_size: int, tg: int) -> list[list[int]]:
    """The generation TP groups of a rollout pool: consecutive ranks, tg each."""
    if tg < 1 or world_size % tg:
        raise ValueError(f"rollout.tg={tg} must divide the rollout pool's {world_size} ranks")
    return [list(range(s, s + tg)) for s in range(0, world_size, tg)]


def pool_tp_group(rank: int, world_size: int, tg: int) -> TPGroup | None:
    """This rank's generation TP group (None for tg = 1). Collective: every rank of the pool calls it
    (torch.distributed.new_group is called for every group, in the same order, on every rank)."""
    if tg == 1:
        return None
    mine = None
    for ranks in consecutive_groups(world_size, tg):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = TPGroup(group, tg, ranks[0])
    return mine


def generation_shard(model: torch.nn.Module, index: int, tg: int) -> dict[str, torch.Tensor]:
    """HF name -> this TP rank's (`index` of tg) slice of `model`'s full weights, as views. Tied weights
    appear once (named_parameters), so lm_head falls back to the split embeddings in the decoder."""
    vocab = model.get_input_embeddings().num_embeddings % tg == 0
    out = {}
    for name, p in model.named_parameters():
        kind = name.split(".")[-2] if "." in name else name
        if kind in COLUMN or (vocab and kind in VOCAB):
            out[name] = p.detach().chunk(tg, 0)[index]
        elif kind in ROW and name.endswith("weight"):
            out[name] = p.detach().chunk(tg, 1)[index]
        else:  # norms, and a row-parallel bias (added once, after the all-reduce)
            out[name] = p.detach()
    return out
