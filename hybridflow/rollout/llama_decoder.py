"""A lean functional forward for the Llama / Qwen2 / Mistral family on the HF module's own parameters,
with a preallocated static KV cache that can be compacted.

Why not the HF forward: HF's `DynamicCache` concatenates k/v every step (O(length) copies per layer),
its mask building and cache classes add per-step Python work, and its cache cannot drop finished rows
cheaply. This forward is the same math in ~25 tensor ops per layer, writing k/v in place; greedy
outputs match `generate` token for token. Where it departs from a plain port, for CPU speed:
- weights packed once per `generate` call (fused q/k/v and gate/up, in MKL's packed GEMM format on fp32
  CPU, else stored (in, out); `pack_layer`), optional: pack_weights=False runs on views of the model's
  tensors with no copy; 1-row steps and prefill-sized matmuls use those views anyway (faster there);
- prefill runs norms, projections and the MLP on the real prompt tokens only, packed as (N, hidden);
  only attention sees the left-padded (B, Lp) layout;
- decode attention is matmul/softmax/matmul with GQA as a head-group dimension, not SDPA.

Cache layout per layer: k, v of shape (capacity, kv_heads, max_len, head_dim). Prompts are left-padded,
so every row writes its next token at the same slot; `key_bias` (capacity, max_len) masks prompt
padding. Rows that finished are removed by `select` (compaction), so they stop costing compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def _norm_eps(mod) -> float:
    return float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6)))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's LlamaRMSNorm: fp32 statistics, cast back, then scale (that order keeps bf16 results equal).
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def rotate_half_matrix(head_dim: int, dtype, device) -> torch.Tensor:
    """R (head_dim, head_dim) with x @ R == cat(-x2, x1): HF's rotate_half as one exact matmul
    (one +-1 per column), cheaper on CPU than slice/neg/cat."""
    half = head_dim // 2
    r = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    idx = torch.arange(half, device=device)
    r[idx + half, idx] = -1
    r[idx, idx + half] = 1
    return r


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    # x @ rot is one op (cheapest for a few rows); from ~8 rows slicing + cat moves less data than the
    # small batched matmul (measured on CPU: 70 vs 139 us per layer at 64 rows).
    if x.shape[0] >= 8:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    else:
        rotated = x @ rot
    return torch.addcmul(x * cos, rotated, sin)


class MklPacked:
    """A (out, in) linear weight in MKL's packed GEMM format (`cblas_sgemm_pack`), fp32 CPU only.

    Why: single-threaded MKL multiplies the 2-32-row matrices of decode ~1.2-1.4x faster from a packed
    weight (it skips re-packing the weight at every call, which dominates at small M). The pack is made
    once per `generate` call; a packed B matrix is valid for any number of rows M (only N and K are
    fixed by the pack), which `mkl_pack_works` checks once per process before it is relied on."""

    __slots__ = ("packed", "shape")

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), 64)
        # The op reads N and K from this tensor's shape and falls back to a plain linear on it only
        # when M differs from its batch-size argument; __call__ always passes M, so its data is never
        # read and a zero-stride view (no memory) will do.
        self.shape = weight.new_empty(()).expand(weight.shape)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape, bias, x.shape[0])


_MKL_PACK_OK: bool | None = None
RAW_WEIGHTS_FROM_ROWS = 512
"""Row counts from which the model's own weights beat the packed copies (prefill-sized GEMMs)."""


def mkl_pack_works() -> bool:
    """Whether MKL packed GEMM is available and gives x @ w.T for row counts other than the pack's."""
    global _MKL_PACK_OK
    if _MKL_PACK_OK is None:
        _MKL_PACK_OK = False
        mkl_ops = getattr(torch.ops, "mkl", None)
        if torch.backends.mkl.is_available() and hasattr(mkl_ops, "_mkl_linear"):
            try:
                g = torch.Generator().manual_seed(0)
                w = torch.randn(48, 40, generator=g)
                packed = MklPacked(w)
                _MKL_PACK_OK = all(
                    torch.allclose(packed(x, None), x @ w.t(), rtol=1e-4, atol=1e-4)
                    for x in (torch.randn(m, 40, generator=g) for m in (1, 3, 17, 64, 130))
                )
            except RuntimeError:
                _MKL_PACK_OK = False
    return _MKL_PACK_OK


def _mm(x: torch.Tensor, w_t, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, in) @ w_t (in, out) [+ bias]: a linear layer with the weight already transposed (or packed)."""
    if isinstance(w_t, MklPacked):
        return w_t(x, bias)
    return x @ w_t if bias is None else torch.addmm(bias, x, w_t)


def _mm_residual(x: torch.Tensor, a: torch.Tensor, w_t, bias: torch.Tensor | None):
    """x + (a @ w_t [+ bias]); without a bias the residual add rides in the GEMM (beta=1)."""
    if isinstance(w_t, MklPacked):
        return w_t(a, bias).add_(x)
    return torch.addmm(x, a, w_t) if bias is None else x + torch.addmm(bias, a, w_t)


def _cat_bias(mods) -> torch.Tensor | None:
    biases = [m.bias for m in mods]
    if all(b is None for b in biases):
        return None
    return torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in mods])


def pack_layer(layer, pack: bool, mkl: bool = False) -> tuple:
    """One decoder layer's parameters as (in, out) matrices: ((qkv,) or (q, k, v)), o, ((gate_up,) or
    (gate, up)), down, each a (weight, bias) pair, plus norms and the activation.

    pack=True copies: q/k/v and gate/up concatenated (one matmul each instead of three and two); each
    matrix then stored either in MKL's packed GEMM format (mkl=True; see MklPacked) or transposed and
    contiguous, the (in, out) layout that single-threaded MKL multiplies ~1.3-1.6x faster than the
    (out, in) one at decode shapes. Costs one extra copy of the decoder layers' weights while a
    `generate` call runs. pack=False: transposed views of the model's own tensors."""
    a, m = layer.self_attn, layer.mlp

    def group(mods):
        if pack:
            w = torch.cat([mod.weight for mod in mods]) if len(mods) > 1 else mods[0].weight
            return ((MklPacked(w) if mkl else w.t().contiguous(), _cat_bias(mods)),)
        return tuple((mod.weight.t(), mod.bias) for mod in mods)

    return (
        (layer.input_layernorm.weight, _norm_eps(layer.input_layernorm)),
        group((a.q_proj, a.k_proj, a.v_proj)),
        group((a.o_proj,))[0],
        (layer.post_attention_layernorm.weight, _norm_eps(layer.post_attention_layernorm)),
        group((m.gate_proj, m.up_proj)),
        group((m.down_proj,))[0],
        m.act_fn,
    )


def _project(h: torch.Tensor, group: tuple) -> list[torch.Tensor]:
    return [_mm(h, w, b) for w, b in group]


class LlamaFamilyDecoder:
    """Prefill + incremental decode for one batch at a time. Call `load` once per `generate` call,
    then per batch `start`, `prefill`, and `decode` / `select` alternately; `release` at the end.
    Parameters are re-read from the model at each `load`, so in-place updates by the trainer or
    `load_weights` are always seen."""

    def __init__(self, model: torch.nn.Module, pack_weights: bool = True):
        self.model = model
        self.pack_weights = pack_weights
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.layers: list[tuple] = []
        self.raw_layers: list[tuple] = []
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    # ---- setup ------------------------------------------------------------------------------------
    def load(self) -> None:
        """(Re)read the model's parameters; with pack_weights, build the packed copies (see pack_layer)."""
        base = self.model.model
        weight = self.model.lm_head.weight
        mkl = self.pack_weights and weight.device.type == "cpu" and weight.dtype == torch.float32
        mkl = mkl and mkl_pack_works()
        self.layers = [pack_layer(layer, self.pack_weights, mkl) for layer in base.layers]
        self.embed = base.embed_tokens.weight
        self.final_norm = (base.norm.weight, _norm_eps(base.norm))
        self.lm_head = (MklPacked(weight) if mkl else weight.t(), self.model.lm_head.bias)
        # Views of the model's own (out, in) weights (no copy). MKL multiplies them faster than the
        # packed copies at 1 row (a plain gemv) and at prefill sizes (~10% at ~1,300 rows), so those
        # two cases use them (see _weights_for).
        self.raw_layers = [pack_layer(layer, False) for layer in base.layers] if mkl else self.layers
        self.raw_lm_head = (weight.t(), self.model.lm_head.bias)
        self.rot = rotate_half_matrix(self.head_dim, self.embed.dtype, self.embed.device)

    def start(self, capacity: int, max_len: int, max_position: int) -> None:
        """Allocate the cache for `capacity` rows of up to `max_len` tokens; rope up to max_position."""
        if not self.layers:
            self.load()
        dtype, device = self.embed.dtype, self.embed.device
        shape = (capacity, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.v_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        # Additive attention bias: 0 on real keys, -inf on prompt padding (decode's attention is a
        # plain matmul/softmax, ~1.4x cheaper than SDPA's CPU kernel for one query per row).
        self.key_bias = torch.zeros(capacity, max_len, dtype=dtype, device=device)
        positions = torch.arange(max_position + 1, device=device)[None]
        cos, sin = self.model.model.rotary_emb(self.embed[:1][None], positions)  # (1, P, head_dim)
        self.cos, self.sin = cos[0], sin[0]
        self.rows = 0
        self.length = 0

    def release(self) -> None:
        """Free the cache and the packed weights."""
        self.k_cache, self.v_cache, self.layers, self.raw_layers = [], [], [], []
        self.key_bias = self.cos = self.sin = None

    # ---- forward ----------------------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, layer: tuple, cos: torch.Tensor, sin: torch.Tensor):
        """x: (N, hidden) tokens -> roped q (N, heads, hd), roped k (N, kv, hd), v (N, kv, hd), where
        cos/sin are (N, 1, hd)."""
        nq, nkv = self.num_heads, self.num_kv_heads
        h = _rms_norm(x, *layer[0])
        out = _project(h, layer[1])
        n = x.shape[0]
        if len(out) == 1:
            qk = out[0][:, : (nq + nkv) * self.head_dim].view(n, nq + nkv, self.head_dim)
            qk = _rope(qk, cos, sin, self.rot)
            q, k = qk[:, :nq], qk[:, nq:]
            v = out[0][:, (nq + nkv) * self.head_dim :].view(n, nkv, self.head_dim)
        else:
            q = _rope(out[0].view(n, nq, self.head_dim), cos, sin, self.rot)
            k = _rope(out[1].view(n, nkv, self.head_dim), cos, sin, self.rot)
            v = out[2].view(n, nkv, self.head_dim)
        return q, k, v

    def _mlp_block(self, x: torch.Tensor, a: torch.Tensor, layer: tuple) -> torch.Tensor:
        """x: residual (N, hidden); a: attention output (N, heads * hd) -> next residual (N, hidden)."""
        x = _mm_residual(x, a, *layer[2])
        h = _rms_norm(x, *layer[3])
        act = layer[6]
        gu = _project(h, layer[4])
        if len(gu) == 1:
            gate, up = gu[0].chunk(2, dim=-1)
        else:
            gate, up = gu
        return _mm_residual(x, act(gate) * up, *layer[5])

    def _weights_for(self, rows: int) -> list[tuple]:
        return self.raw_layers if rows == 1 or rows >= RAW_WEIGHTS_FROM_ROWS else self.layers

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """x_last: (b, hidden) -> logits (b, vocab)."""
        head = self.raw_lm_head if x_last.shape[0] == 1 else self.lm_head
        return _mm(_rms_norm(x_last, *self.final_norm), *head)

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, repeat: int = 1
    ) -> torch.Tensor:
        """ids/mask/pos: (B, Lp) left-padded prompts. Fills cache rows [0, B*repeat) (each prompt's
        k/v repeated `repeat` times) and returns the last-position logits (B, vocab), not repeated.

        Only attention sees the padded (B, Lp) layout: norms, projections and the MLP run on the N real
        tokens packed as (N, hidden), so prompt padding costs no matmul work; the last layer runs past
        its k/v projection for the last token of each row only."""
        b, s = ids.shape
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        key_ok = mask.bool()
        real = key_ok.reshape(-1).nonzero().squeeze(1)  # (N,) flat index of each real token
        rows = b * repeat
        self.key_bias[:rows, :s] = torch.where(key_ok, 0.0, float("-inf")).repeat_interleave(repeat, 0)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        # Padding queries may attend to themselves: a fully masked row would give NaN (discarded, but
        # SDPA's kernels need not like it).
        attn_mask = (causal & key_ok[:, None, :]) | torch.eye(s, dtype=torch.bool, device=ids.device)
        flat_pos = pos.reshape(-1)[real]
        cos, sin = self.cos[flat_pos][:, None], self.sin[flat_pos][:, None]  # (N, 1, hd)
        x = F.embedding(ids.reshape(-1)[real], self.embed)  # (N, hidden)
        # Padded q/k/v; padding slots stay 0 (masked as keys, discarded as queries).
        q_pad = x.new_zeros(b * s, nq, hd)
        k_pad, v_pad = x.new_zeros(b * s, nkv, hd), x.new_zeros(b * s, nkv, hd)
        gqa = nkv != nq
        # Left padding: each row's last real token is its last slot, the last packed token of the row.
        ends = key_ok.sum(1).cumsum(0) - 1  # (B,)
        layers = self._weights_for(x.shape[0])
        for i, layer in enumerate(layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            q_pad[real], k_pad[real], v_pad[real] = q, k, v
            qq, kk, vv = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q_pad, k_pad, v_pad))
            # Prefill once per prompt, cache `repeat` copies (n samples per prompt).
            self.k_cache[i][:rows, :, :s] = kk.repeat_interleave(repeat, 0) if repeat > 1 else kk
            self.v_cache[i][:rows, :, :s] = vv.repeat_interleave(repeat, 0) if repeat > 1 else vv
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
        self.rows, self.length = rows, s
        return self._logits(x)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens, pos: (b,) with b = current rows. Appends one token per row; returns (b, vocab)."""
        b, slot = self.rows, self.length
        nkv, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // nkv
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (b, 1, hd)
        bias = self.key_bias[:b, None, None, : slot + 1]  # (b, 1, 1, L)
        x = F.embedding(tokens, self.embed)  # (b, hidden)
        for i, layer in enumerate(self._weights_for(b)):
            q, k, v = self._qkv(x, layer, cos, sin)
            kc, vc = self.k_cache[i][:b], self.v_cache[i][:b]
            kc[:, :, slot] = k
            vc[:, :, slot] = v
            # GQA without repeating k/v: the `group` query heads of a kv head form the rows of one matmul.
            scores = torch.matmul(q.reshape(b, nkv, group, hd), kc[:, :, : slot + 1].transpose(-1, -2))
            probs = torch.softmax(scores.mul_(self.scaling).add_(bias), dim=-1)  # (b, kv, group, L)
            a = torch.matmul(probs, vc[:, :, : slot + 1]).reshape(b, nkv * group * hd)
            x = self._mlp_block(x, a, layer)
        self.length = slot + 1
        return self._logits(x)

    def select(self, idx: torch.Tensor) -> None:
        """Keep only rows idx (k,) of the current batch, in that order, at the front (compaction).
        Only rows whose position changes are copied: with the engine's hole-filling order that is one
        row per finished row, not the whole cache."""
        n, length = idx.shape[0], self.length
        moved = (idx != torch.arange(n, device=idx.device)).nonzero().squeeze(1)
        if moved.numel():
            src = idx[moved]
            for kc, vc in zip(self.k_cache, self.v_cache):
                kc[moved, :, :length] = kc[src, :, :length]
                vc[moved, :, :length] = vc[src, :, :length]
            self.key_bias[moved] = self.key_bias[src]
        self.rows = n
