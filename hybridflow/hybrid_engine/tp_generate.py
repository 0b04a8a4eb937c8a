"""Greedy generation through the resharded layout: a tensor- (and pipeline-) parallel Llama forward.

Each rank runs its generation stage's layers on its generation TP shard, given as chunk lists (see
`switch.py`): column-parallel weights (q/k/v, gate/up, lm_head) give their output features chunk by chunk,
row-parallel ones (o, down) sum partial products over their input-feature chunks and then all-reduce over
the generation TP group; the embedding is vocab-parallel (masked lookup + all-reduce), the logits are
all-gathered over the TP group. Pipeline stages pass hidden states point to point; the last stage
broadcasts each new token to its replica. The math follows HF's Llama (RMSNorm in fp32, default RoPE,
GQA by repeating KV heads), so greedy tokens match `model.generate(do_sample=False)`.

Scope: each decode step recomputes the whole sequence (no KV cache): this engine exists to check the
resharded weights and to time the switch on small models; the rollout package holds the fast engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.batch import position_ids_from_mask
from hybridflow.hybrid_engine.layout import GenLayout
from hybridflow.hybrid_engine.sharding import LlamaShape
from hybridflow.hybrid_engine.switch import EngineGroups, GenWeights


@dataclass
class TPContext:
    """What one rank needs to run its part of a generation replica."""

    shape: LlamaShape
    weights: GenWeights
    layers: range  # decoder layers of this rank's generation stage
    tg: int
    g_tp: int
    tp_group: object
    pp_ranks: list[int]  # global ranks of this replica's pipeline, by generation stage
    pp_group: object
    pp_index: int

    @property
    def first(self) -> bool:
        return self.pp_index == 0

    @property
    def last(self) -> bool:
        return self.pp_index == len(self.pp_ranks) - 1


def build_tp_context(
    shape: LlamaShape, weights: GenWeights, gen: GenLayout, groups: EngineGroups
) -> TPContext:
    rank = groups.rank
    _, g_pp, g_tp, _ = gen.coords(rank)
    tp_group, _, pp_group, pp_ranks = groups.generation(gen)
    per_stage = shape.num_layers // gen.pg
    layers = range(g_pp * per_stage, (g_pp + 1) * per_stage)
    return TPContext(shape, weights, layers, gen.tg, g_tp, tp_group, pp_ranks, pp_group, pp_ranks.index(rank))


def _all_reduce(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    if ctx.tg > 1:
        dist.all_reduce(x, group=ctx.tp_group)
    return x


def _col(x: torch.Tensor, chunks: list[torch.Tensor]) -> torch.Tensor:
    """Column-parallel linear: output features chunk by chunk. (..., in) -> (..., sum of chunk rows)."""
    return torch.cat([F.linear(x, w) for w in chunks], dim=-1)


def _row(x: torch.Tensor, chunks: list[torch.Tensor], ctx: TPContext) -> torch.Tensor:
    """Row-parallel linear: x holds this rank's input features; partial sums are all-reduced."""
    out, off = None, 0
    for w in chunks:
        part = F.linear(x[..., off : off + w.shape[1]], w)
        out = part if out is None else out + part
        off += w.shape[1]
    return _all_reduce(out, ctx)


def _norm_weight(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat([c.reshape(-1) for c in chunks])


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(shape: LlamaShape, position_ids: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF default RoPE: (cos, sin), each (B, 1, L, head_dim)."""
    hd = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = (
        inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :].float()
    ).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _embed(ids: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Vocab-parallel embedding. (B, L) -> (B, L, hidden)."""
    lo = ctx.g_tp * ctx.shape.vocab_size // ctx.tg
    h = torch.zeros(
        *ids.shape, ctx.shape.hidden_size, dtype=ctx.weights["model.embed_tokens.weight"][0].dtype
    )
    for w in ctx.weights["model.embed_tokens.weight"]:
        hit = (ids >= lo) & (ids < lo + w.shape[0])
        h += F.embedding((ids - lo).clamp(0, w.shape[0] - 1), w) * hit[..., None]
        lo += w.shape[0]
    return _all_reduce(h, ctx)


def _layer(h: torch.Tensor, i: int, mask: torch.Tensor, cos, sin, ctx: TPContext) -> torch.Tensor:
    """One decoder layer on this rank's heads / features. h: (B, L, hidden)."""
    s, w, pre = ctx.shape, ctx.weights, f"model.layers.{i}."
    b, n = h.shape[:2]
    x = _rms_norm(h, _norm_weight(w[pre + "input_layernorm.weight"]), s.rms_norm_eps)
    q = _col(x, w[pre + "self_attn.q_proj.weight"]).view(b, n, -1, s.head_dim).transpose(1, 2)
    k = _col(x, w[pre + "self_attn.k_proj.weight"]).view(b, n, -1, s.head_dim).transpose(1, 2)
    v = _col(x, w[pre + "self_attn.v_proj.weight"]).view(b, n, -1, s.head_dim).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    rep = s.num_heads // s.num_kv_heads  # local q heads / local kv heads is the same ratio
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.head_dim**-0.5)  # (B, heads, L, hd)
    h = h + _row(a.transpose(1, 2).reshape(b, n, -1), w[pre + "self_attn.o_proj.weight"], ctx)
    x = _rms_norm(h, _norm_weight(w[pre + "post_attention_layernorm.weight"]), s.rms_norm_eps)
    act = F.silu(_col(x, w[pre + "mlp.gate_proj.weight"])) * _col(x, w[pre + "mlp.up_proj.weight"])
    return h + _row(act, w[pre + "mlp.down_proj.weight"], ctx)


def _next_token(ctx: TPContext, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Greedy next token for every row, known to all ranks of the replica. ids: (B, L) -> (B,)."""
    b, n = ids.shape
    position_ids = position_ids_from_mask(attention_mask)
    cos, sin = _rope(ctx.shape, position_ids, ctx.weights[next(iter(ctx.weights))][0].dtype)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    # padded query rows attend to themselves so no row is empty (an empty row would give NaN)
    mask = ((causal & attention_mask.bool()[:, None, :]) | torch.eye(n, dtype=torch.bool))[:, None]
    if ctx.first:
        h = _embed(ids, ctx)
    else:
        h = torch.empty(b, n, ctx.shape.hidden_size, dtype=cos.dtype)
        dist.recv(h, src=ctx.pp_ranks[ctx.pp_index - 1])
    for i in ctx.layers:
        h = _layer(h, i, mask, cos, sin, ctx)
    token = torch.empty(b, dtype=torch.long)
    if not ctx.last:
        dist.send(h, dst=ctx.pp_ranks[ctx.pp_index + 1])
    else:
        x = _rms_norm(h[:, -1], _norm_weight(ctx.weights["model.norm.weight"]), ctx.shape.rms_norm_eps)
        local = _col(x, ctx.weights["lm_head.weight"])  # (B, vocab / tg)
        if ctx.tg > 1:
            parts = [torch.empty_like(local) for _ in range(ctx.tg)]
            dist.all_gather(parts, local, group=ctx.tp_group)
            local = torch.cat(parts, dim=-1)
        token = local.argmax(-1)
    if len(ctx.pp_ranks) > 1:
        dist.broadcast(token, src=ctx.pp_ranks[-1], group=ctx.pp_group)
    return token


@torch.no_grad()
def generate_greedy(
    ctx: TPContext,
    prompts: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
) -> torch.Tensor:
    """Greedy decode of left-padded `prompts` (B, Lp) -> responses (B, max_new_tokens), pad after EOS."""
    b = prompts.shape[0]
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long)
    if b == 0:
        return out
    ids, mask = prompts, attention_mask
    finished = torch.zeros(b, dtype=torch.bool)
    for step in range(max_new_tokens):
        token = _next_token(ctx, ids, mask)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        out[:, step] = token
        finished |= token == eos_token_id
        if finished.all():  # every rank of the replica sees the same tokens, so they stop together
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
    return out
