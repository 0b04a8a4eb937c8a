"""A lean functional forward for the Llama / Qwen2 / Mistral family on the HF module's own parameters,
with a preallocated static KV cache that can be compacted.

Why not the HF forward: HF's `DynamicCache` concatenates k/v every step (O(length) copies per layer),
its mask building and cache classes add per-step Python work, and its cache cannot drop finished rows
cheaply. This forward is the same math in ~25 tensor ops per layer, writing k/v in place; greedy
outputs match `generate` token for token. Where it departs from a plain port, for CPU speed:
- on the host CPU, weights packed once per `generate` call (fused q/k/v and gate/up, in MKL's packed GEMM
  format in fp32, else stored (in, out); `decoder_weights.pack_layer`); pack_weights=False, or an
  accelerator (`packs_on`), runs on views of the model's tensors with no copy; 1-row steps and
  prefill-sized matmuls use those views anyway (faster there);
- prefill runs norms, projections and the MLP on the real prompt tokens only, packed as (N, hidden);
  only attention sees the left-padded (B, Lp) layout;
- decode attention is matmul/softmax/matmul with GQA as a head-group dimension, not SDPA; in 16-bit on
  CPU it reads the cache's whole rows (written slots unmasked) once that beats the strided slice that
  torch's bf16 bmm would copy (`_attend_full`).

Tensor parallel (the 3D-HybridEngine's generation layout, docs/hybrid_engine.md): given a TPGroup of size
tg and this rank's generation shard of the weights, the same forward runs Megatron-style: q/k/v and
gate/up column-parallel (heads/tg heads, intermediate/tg columns per rank, biases split alike), o and
down row-parallel with one all-reduce each per layer; norms whole; embeddings and lm_head vocab-parallel
when the shard holds V/tg of their rows (the lookup all-reduced, the logits all-gathered), else whole.

Cache layout: one tensor (layers, 2, capacity, kv_heads, max_len, head_dim), so each layer's k and v are
contiguous (capacity, kv_heads, max_len, head_dim) views and compaction moves a row of every layer in one
indexed copy. Prompts are left-padded,
so every row writes its next token at the same slot; `key_bias` (capacity, max_len) masks prompt
padding. Rows that finished are removed by `select` (compaction), so they stop costing compute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from hybridflow.models import cpu_gemm
from hybridflow.rollout.cpu.mkl_packed import MklPacked, mkl_pack_works
from hybridflow.rollout.decoder_ops import _rms_norm, _rope, _scalar, signed_sin
from hybridflow.rollout.decoder_weights import (
    RAW_WEIGHTS_FROM_ROWS,
    Linear,
    PackedLayer,
    _mm,
    _mm_residual,
    _norm_eps,
    _project,
    model_weights,
    pack_layer,
)
from hybridflow.rollout.tp_group import TPGroup

_HEADS = {"mkl": MklPacked, "onednn": cpu_gemm.OneDnnWeight}  # lm_head in the layers' packed format

FAMILY = ("llama", "qwen2", "mistral")


def unsupported_reason(model: torch.nn.Module, max_len: int | None = None) -> str | None:
    """Why this functional forward cannot run `model` (None if it can)."""
    cfg = model.config
    if cfg.model_type not in FAMILY:
        return f"model_type {cfg.model_type!r} is not in {FAMILY}"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "model has no .model.layers / .model.rotary_emb"
    attn = base.layers[0].self_attn
    if hasattr(attn, "q_norm") or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention block differs from the Llama layout"
    rope = getattr(base.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):
        return f"rope_type {rope!r} depends on the sequence length"
    window = getattr(cfg, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if cfg.model_type == "mistral":
        sliding = window is not None
    if sliding and window is not None and (max_len is None or max_len > window):
        return f"sliding-window attention (window {window}) with sequences up to {max_len}"
    return None


def _attend_full(length: int, max_len: int) -> bool:
    """Whether 16-bit CPU decode attention should read the cache's whole rows (max_len slots, contiguous)
    instead of the first `length` (a strided view, which torch's bf16 bmm copies first). Measured at 32
    rows x 4 KV heads x head_dim 64: the strided path costs ~0.10 ms + 3.6 us per slot and the whole rows
    ~0.01 ms + 1.2 us per slot, so they cross near length = max_len / 3."""
    return 3 * length >= max_len


def _full_rows(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode attention may read whole cache rows (`_attend_full`): 16-bit on CPU, where torch's bmm
    copies a strided operand. Its own function so a test can force it in fp32, where the masked slots must
    then give the sliced path's numbers to fp32 rounding."""
    return dtype != torch.float32 and device.type == "cpu"


def _cast(weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights in `dtype`: a copy of each one stored otherwise (a tied tensor cast once), else itself.
    The cache, rope tables and activations then follow (they take the embedding's dtype)."""
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in weights.items():
        if t.dtype == dtype or not t.is_floating_point():
            out[name] = t
        else:
            if id(t) not in cast:
                cast[id(t)] = t.detach().to(dtype)
            out[name] = cast[id(t)]
    return out


def packs_on(device: torch.device) -> bool:
    """Whether generation packs its weights (fused q|k|v and gate|up copies; decoder_weights.pack_layer)
    on `device`: on the host CPU only, where the copies make decode's small GEMMs faster. On an accelerator
    they would hold a second copy of the decoder's weights for the whole call, so it reads views of the
    weights it is given. Device-strict mode's stand-in accelerator (an indexed "cpu:0") counts as one."""
    return device.type == "cpu" and device.index is None


class LlamaFamilyDecoder:
    """Prefill + incremental decode for one batch at a time. Call `load` once per `generate` call,
    then per batch `start`, `prefill`, and `decode` / `select` alternately; `release` at the end.

    weights: HF name -> tensor this rank computes with; None = the model's own parameters, re-read at
    each `load`, so in-place updates by the trainer or `load_weights` are always seen. With `tp` (a
    TPGroup of size tg) the weights are this rank's generation shard: q/k/v, gate/up split on their
    output features, o/down on their input features, norms whole, embeddings and lm_head whole or
    vocab-parallel (V/tg rows each: the lookup is all-reduced, the logits all-gathered); each rank runs
    heads/tg heads and intermediate/tg MLP columns and all-reduces o's and down's outputs.

    dtype: the compute dtype (None: the weights' own); weights stored otherwise are cast at each `load`
    (rollout/engine.py, BuiltinEngineConfig.dtype). Attention's softmax and the sampling
    (rollout/sampling.py) compute in fp32 either way, as HF's eager attention and generate do."""

    def __init__(
        self,
        model: torch.nn.Module,
        pack_weights: bool = True,
        weights: Mapping[str, torch.Tensor] | None = None,
        tp: TPGroup | None = None,
        dtype: torch.dtype | None = None,
        cpu_gemm: str = "auto",
    ):
        self.model = model
        self.dtype = dtype  # compute dtype; None = the weights' own (see load)
        self.cpu_gemm = cpu_gemm  # fp32 CPU GEMMs through MKL or oneDNN (models/cpu_gemm.py)
        self.pack_weights = pack_weights
        self.weights, self.tp = weights, tp
        cfg = model.config
        tg = tp.size if tp is not None else 1
        if cfg.num_attention_heads % tg or cfg.num_key_value_heads % tg:
            raise ValueError(
                f"generation tensor-parallel size {tg} must divide num_attention_heads="
                f"{cfg.num_attention_heads} and num_key_value_heads={cfg.num_key_value_heads}"
            )
        attn = model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads // tg
        self.num_kv_heads = cfg.num_key_value_heads // tg
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.layers: list[PackedLayer] = []
        self.raw_layers: list[PackedLayer] = []
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    # ---- setup ------------------------------------------------------------------------------------
    def load(self) -> None:
        """(Re)read the weights; with pack_weights, build the packed copies (see pack_layer)."""
        w = self.weights if self.weights is not None else model_weights(self.model)
        if self.dtype is not None:
            w = _cast(w, self.dtype)
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        head_bias = w.get("lm_head.bias")
        kernel = self._kernel(head)
        mods = self.model.model.layers
        names = [f"model.layers.{i}." for i in range(len(mods))]
        pack = self.pack_weights and packs_on(head.device)
        self.layers = [pack_layer(w, m, p, pack, kernel) for m, p in zip(mods, names)]
        self.embed = w["model.embed_tokens.weight"]
        self.final_norm = (w["model.norm.weight"], _norm_eps(self.model.model.norm))
        self.lm_head = (_HEADS.get(kernel, torch.Tensor.t)(head), head_bias)
        # Views of the (out, in) weights (no copy). MKL multiplies them faster than its packed copies at
        # 1 row (a plain gemv) and at prefill sizes (~10% at ~1,300 rows), so those two cases use them
        # (see _weights_for); oneDNN runs every size but the gemv from its own.
        self.raw_layers = [pack_layer(w, m, p, False) for m, p in zip(mods, names)] if kernel else self.layers
        self.raw_lm_head = (head.t(), head_bias)
        self.raw_from_rows = math.inf if kernel == "onednn" else RAW_WEIGHTS_FROM_ROWS
        # Vocab-parallel (docs/hybrid_engine.md): a generation shard with 1/tg of the embedding rows holds
        # rows [rank * V/tg, (rank + 1) * V/tg) of the embeddings and lm_head.
        whole = self.tp is None or self.embed.shape[0] == self.model.get_input_embeddings().num_embeddings
        self.vocab_start = None if whole else self.tp.rank() * self.embed.shape[0]

    def start(self, capacity: int, max_len: int, max_position: int) -> None:
        """Allocate the cache for `capacity` rows of up to `max_len` tokens; rope up to max_position."""
        if not self.layers:
            self.load()
        dtype, device = self.embed.dtype, self.embed.device
        shape = (len(self.layers), 2, capacity, self.num_kv_heads, max_len, self.head_dim)
        # one tensor for every layer's k and v: compaction moves a row of all of them in one copy
        # 16-bit on CPU: torch's bf16/fp16 bmm copies a strided operand whole, so decode attention runs over
        # the full cache rows (contiguous) once that is cheaper (see _attend_full); the slots not written yet
        # must then hold finite numbers (masked, but 0 * NaN would not be 0)
        self.full_attention = _full_rows(dtype, device)
        self.kv = (torch.zeros if self.full_attention else torch.empty)(shape, dtype=dtype, device=device)
        self.k_cache, self.v_cache = list(self.kv[:, 0]), list(self.kv[:, 1])
        self._rows_views: dict[int, list] = {}  # rows -> per layer (k, v) views of the first `rows` rows
        # Additive attention bias: 0 on real keys, -inf on prompt padding (decode's attention is a
        # plain matmul/softmax, ~1.4x cheaper than SDPA's CPU kernel for one query per row).
        # (-inf past what is written: the full-row attention reads those slots; decode opens each slot)
        self.key_bias = torch.full((capacity, max_len), float("-inf"), dtype=dtype, device=device)
        positions = torch.arange(max_position + 1, device=device)[None]
        cos, sin = self.model.model.rotary_emb(self.embed[:1][None], positions)  # (1, P, head_dim)
        # (P, 2, hd): one index per step gives both factors of a position (see signed_sin)
        self.rope = torch.stack((cos[0], signed_sin(sin[0])), dim=1)
        self.rows = 0
        self.length = 0

    def release(self) -> None:
        """Free the cache and the packed weights."""
        self.k_cache, self.v_cache, self.layers, self.raw_layers = [], [], [], []
        self.kv = self.key_bias = self.rope = None
        self._rows_views = {}

    # ---- forward ----------------------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, layer: PackedLayer, cos: torch.Tensor, sin: torch.Tensor):
        """x: (N, hidden) tokens -> roped q (N, heads, hd), roped k (N, kv, hd), v (N, kv, hd), where
        cos/sin are (N, 1, hd)."""
        nq, nkv = self.num_heads, self.num_kv_heads
        h = _rms_norm(x, *layer.input_norm)
        out = _project(h, layer.qkv)
        n = x.shape[0]
        if len(out) == 1:
            qk = out[0][:, : (nq + nkv) * self.head_dim].view(n, nq + nkv, self.head_dim)
            qk = _rope(qk, cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
            v = out[0][:, (nq + nkv) * self.head_dim :].view(n, nkv, self.head_dim)
        else:
            q = _rope(out[0].view(n, nq, self.head_dim), cos, sin)
            k = _rope(out[1].view(n, nkv, self.head_dim), cos, sin)
            v = out[2].view(n, nkv, self.head_dim)
        return q, k, v

    def _mlp_block(self, x: torch.Tensor, a: torch.Tensor, layer: PackedLayer) -> torch.Tensor:
        """x: residual (N, hidden); a: attention output (N, heads * hd) -> next residual (N, hidden)."""
        x = self._row_residual(x, a, layer.o)
        h = _rms_norm(x, *layer.post_norm)
        gu = _project(h, layer.gate_up)
        if len(gu) == 1:
            half = gu[0].shape[-1] // 2
            gate, up = gu[0][:, :half], gu[0][:, half:]
        else:
            gate, up = gu
        return self._row_residual(x, layer.act(gate).mul_(up), layer.down)

    def _row_residual(self, x: torch.Tensor, a: torch.Tensor, linear: Linear) -> torch.Tensor:
        """x + a @ w (+ bias). Row-parallel under TP: a and w hold this rank's input features, so the
        product is a partial sum, all-reduced before the residual add (and the bias added once)."""
        if self.tp is None:
            return _mm_residual(x, a, *linear)
        out = x + self.tp.all_reduce(_mm(a, linear[0], None))
        return out if linear[1] is None else out.add_(linear[1])

    def _kernel(self, head: torch.Tensor) -> str:
        """The packed weights' format: "onednn" or "mkl" for fp32 on CPU (models/cpu_gemm.py,
        cpu/mkl_packed.py), "" for plain tensors."""
        if not self.pack_weights or not packs_on(head.device) or head.dtype != torch.float32:
            return ""
        if cpu_gemm.resolve(self.cpu_gemm, head.device):
            return "onednn"
        return "mkl" if mkl_pack_works() else ""

    def _weights_for(self, rows: int) -> list[PackedLayer]:
        return self.raw_layers if rows == 1 or rows >= self.raw_from_rows else self.layers

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """x_last: (b, hidden) -> logits (b, vocab)."""
        head = self.raw_lm_head if x_last.shape[0] == 1 else self.lm_head
        logits = _mm(_rms_norm(x_last, *self.final_norm), *head)
        return logits if self.vocab_start is None else self.tp.gather_last(logits)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_start is None:
            return F.embedding(ids, self.embed)
        return self.tp.embedding(ids, self.embed, self.vocab_start)

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, repeat: int = 1
    ) -> torch.Tensor:
        """ids/mask/pos: (B, Lp) left-padded prompts. Fills cache rows [0, B*repeat) (each prompt's
        k/v repeated `repeat` times) and returns the last-position logits (B, vocab), not repeated.

        Only attention sees the padded (B, Lp) layout: norms, projections and the MLP run on the N real
        tokens packed as (N, hidden), so prompt padding costs no matmul work; the last layer runs past
        its k/v projection for the last token of each row only."""
        b, s = ids.shape
        self.rows, self.length = b * repeat, s
        layers = self._weights_for(int(mask.sum()))
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        key_ok = mask.bool()
        real = key_ok.reshape(-1).nonzero().squeeze(1)  # (N,) flat index of each real token
        self.key_bias[: b * repeat, :s] = torch.where(key_ok, 0.0, float("-inf")).repeat_interleave(repeat, 0)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        # Padding queries may attend to themselves: a fully masked row would give NaN (discarded, but
        # SDPA's kernels need not like it).
        attn_mask = (causal & key_ok[:, None, :]) | torch.eye(s, dtype=torch.bool, device=ids.device)
        flat_pos = pos.reshape(-1)[real]
        cs = self.rope[flat_pos]
        cos, sin = cs[:, :1], cs[:, 1:]  # (N, 1, hd)
        x = self._embed(ids.reshape(-1)[real])  # (N, hidden)
        # Padded q/k/v; padding slots stay 0 (masked as keys, discarded as queries).
        q_pad = x.new_zeros(b * s, nq, hd)
        k_pad, v_pad = x.new_zeros(b * s, nkv, hd), x.new_zeros(b * s, nkv, hd)
        gqa = nkv != nq
        # Left padding: each row's last real token is its last slot, the last packed token of the row.
        ends = key_ok.sum(1).cumsum(0) - 1  # (B,)
        for i, layer in enumerate(layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            q_pad[real], k_pad[real], v_pad[real] = q, k, v
            qq, kk, vv = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q_pad, k_pad, v_pad))
            # Prefill once per prompt, cache `repeat` copies (n samples per prompt).
            self.k_cache[i][: b * repeat, :, :s] = kk.repeat_interleave(repeat, 0) if repeat > 1 else kk
            self.v_cache[i][: b * repeat, :, :s] = vv.repeat_interleave(repeat, 0) if repeat > 1 else vv
            if i == len(layers) - 1:
                # Only the last position's output reaches anything (the logits): the last layer runs
                # attention, o_proj and the MLP for that one query per row (~10% of prefill's matmuls
                # at 8 layers). Its k/v for every position are already in the cache.
                a = F.scaled_dot_product_attention(
                    qq[:, :, -1:], kk, vv, attn_mask=key_ok[:, None, None], scale=self.scaling, enable_gqa=gqa
                )  # (b, heads, 1, hd)
                x = self._mlp_block(x[ends], a.reshape(b, nq * hd), layer)
                break
            a = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=attn_mask[:, None], scale=self.scaling, enable_gqa=gqa
            )  # (b, heads, s, hd)
            a = a.transpose(1, 2).reshape(b * s, nq * hd)[real]
            x = self._mlp_block(x, a, layer)
        return self._logits(x)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens, pos: (b,) with b = current rows. Appends one token per row at cache slot `length`;
        returns (b, vocab)."""
        b, slot = self.rows, self.length
        self.key_bias[:b, slot] = 0.0  # every row writes its token at this slot
        self.length = slot + 1
        return self._decode_at(tokens, pos, (slice(None), slice(None), slot), slot + 1)

    def _decode_at(self, tokens: torch.Tensor, pos: torch.Tensor, where: tuple, length: int) -> torch.Tensor:
        """One token per row of the first b = len(tokens) cache rows, its k/v written at `kc[where]` of each
        layer's (b, kv, max_len, hd) cache (every row's slot, or each row's own); attention reads slots
        [0, length), key_bias masking the rest. -> logits (b, vocab)."""
        b = tokens.shape[0]
        nkv, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // nkv
        cs = self.rope[pos]
        cos, sin = cs[:, :1], cs[:, 1:]  # (b, 1, hd)
        if self.full_attention and _attend_full(length, self.key_bias.shape[1]):
            length = self.key_bias.shape[1]  # the whole rows: contiguous; unwritten slots masked by key_bias
        bias = self.key_bias[:b, None, None, :length]  # (b, 1, 1, L)
        x = self._embed(tokens)  # (b, hidden)
        views = self._rows_views.get(b)
        if views is None:  # views of these rows, rebuilt only when compaction changed the row count
            views = self._rows_views[b] = [(kc[:b], vc[:b]) for kc, vc in zip(self.k_cache, self.v_cache)]
        for layer, (kc, vc) in zip(self._weights_for(b), views):
            q, k, v = self._qkv(x, layer, cos, sin)
            kc[where] = k
            vc[where] = v
            # GQA without repeating k/v: the `group` query heads of a kv head form the rows of one matmul.
            # bmm on (b * kv)-batched views: the kernel torch.matmul reaches for these 4-d operands, without
            # its ~15 ops of expand/reshape bookkeeping.
            scores = torch.bmm(q.reshape(b * nkv, group, hd), kc[:, :, :length].reshape(-1, length, hd).mT)
            probs = torch.softmax(
                scores.view(b, nkv, group, length)
                .mul_(_scalar(self.scaling, scores) if scores.dtype == torch.float32 else self.scaling)
                .add_(bias),
                dim=-1,
                dtype=torch.float32,  # a no-op in fp32; in bf16 the weights' sum stays 1 (HF's eager does the same)
            ).to(scores.dtype)
            a = torch.bmm(probs.view(-1, group, length), vc[:, :, :length].reshape(-1, length, hd))
            x = self._mlp_block(x, a.view(b, nkv * group * hd), layer)
        return self._logits(x)

    def select(self, idx: torch.Tensor) -> None:
        """Keep only rows idx (k,) of the current batch, in that order, at the front (compaction).
        Only rows whose position changes are copied: with the engine's hole-filling order that is one
        row per finished row, not the whole cache."""
        n, length = idx.shape[0], self.length
        moved = (idx != torch.arange(n, device=idx.device)).nonzero().squeeze(1)
        if moved.numel():
            src = idx[moved]
            self.kv[:, :, moved, :, :length] = self.kv[:, :, src, :, :length]
            self.key_bias[moved] = self.key_bias[src]
        if n != self.rows:
            self._rows_views = {}
        self.rows = n
