"""A lean functional forward for the Llama / Qwen2 / Mistral family, reading the HF module's own
parameters (no copy), with a preallocated static KV cache that can be compacted.

Why not the HF forward: HF's `DynamicCache` concatenates k/v every step (O(length) copies per layer,
~20% of a step on CPU at 25M params), its mask building and cache classes add per-step Python work,
and its cache cannot drop finished rows cheaply. This forward is the same math in ~15 tensor ops per
layer, writing k/v in place. It is numerically HF's: greedy outputs match `generate` token for token.

Cache layout per layer: k, v of shape (capacity, kv_heads, max_len, head_dim). Prompts are left-padded,
so every row writes its next token at the same slot; `valid` (capacity, max_len) masks prompt
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
    return torch.addcmul(x * cos, x @ rot, sin)


def _linear_params(mod) -> tuple[torch.Tensor, torch.Tensor | None]:
    return mod.weight, mod.bias


class LlamaFamilyDecoder:
    """Prefill + incremental decode for one batch at a time. Call `start`, `prefill`, then `decode`
    / `select` alternately. Parameters are re-read from the model at each `start`, so in-place updates
    by the trainer or `load_weights` are always seen."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    # ---- setup ------------------------------------------------------------------------------------
    def _snapshot(self) -> None:
        base = self.model.model
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    _norm_eps(layer.input_layernorm),
                    *_linear_params(a.q_proj),
                    *_linear_params(a.k_proj),
                    *_linear_params(a.v_proj),
                    *_linear_params(a.o_proj),
                    layer.post_attention_layernorm.weight,
                    _norm_eps(layer.post_attention_layernorm),
                    *_linear_params(m.gate_proj),
                    *_linear_params(m.up_proj),
                    *_linear_params(m.down_proj),
                    m.act_fn,
                )
            )
        self.embed = base.embed_tokens.weight
        self.final_norm = (base.norm.weight, _norm_eps(base.norm))
        self.lm_head = _linear_params(self.model.lm_head)

    def start(self, capacity: int, max_len: int, max_position: int) -> None:
        """Allocate the cache for `capacity` rows of up to `max_len` tokens; rope up to max_position."""
        self._snapshot()
        dtype, device = self.embed.dtype, self.embed.device
        shape = (capacity, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.v_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.valid = torch.ones(capacity, max_len, dtype=torch.bool, device=device)
        positions = torch.arange(max_position + 1, device=device)[None]
        cos, sin = self.model.model.rotary_emb(self.embed[:1][None], positions)  # (1, P, head_dim)
        self.cos, self.sin = cos[0], sin[0]
        self.rot = rotate_half_matrix(self.head_dim, dtype, device)
        self.rows = 0
        self.length = 0

    def release(self) -> None:
        self.k_cache, self.v_cache = [], []
        self.valid = self.cos = self.sin = None

    # ---- forward ----------------------------------------------------------------------------------
    def _layers(self, x, cos, sin, mask, slot_end, repeat=1):
        """x: (b, s, hidden); cos/sin: (b, 1, s, head_dim); mask: bool, broadcastable to
        (b, heads, s, slot_end). Writes k/v of the s new tokens to slots [slot_end - s, slot_end)."""
        b, s, _ = x.shape
        gqa = self.num_kv_heads != self.num_heads
        rows = b * repeat
        for i, (ln1, e1, qw, qb, kw, kb, vw, vb, ow, ob, ln2, e2, gw, gb, uw, ub, dw, db, act) in enumerate(
            self.layers
        ):
            h = _rms_norm(x, ln1, e1)
            q = F.linear(h, qw, qb).view(b, s, -1, self.head_dim).transpose(1, 2)
            k = F.linear(h, kw, kb).view(b, s, -1, self.head_dim).transpose(1, 2)
            v = F.linear(h, vw, vb).view(b, s, -1, self.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin, self.rot), _rope(k, cos, sin, self.rot)
            kc, vc = self.k_cache[i], self.v_cache[i]
            if repeat > 1:  # prefill once per prompt, cache n copies (n samples per prompt)
                kc[:rows, :, slot_end - s : slot_end] = k.repeat_interleave(repeat, 0)
                vc[:rows, :, slot_end - s : slot_end] = v.repeat_interleave(repeat, 0)
                keys, values = k, v
            else:
                kc[:rows, :, slot_end - s : slot_end] = k
                vc[:rows, :, slot_end - s : slot_end] = v
                keys, values = kc[:rows, :, :slot_end], vc[:rows, :, :slot_end]
            a = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=gqa
            )  # (b, heads, s, head_dim)
            a = a.transpose(1, 2).reshape(b, s, -1)
            x = x + F.linear(a, ow, ob)
            h = _rms_norm(x, ln2, e2)
            x = x + F.linear(act(F.linear(h, gw, gb)) * F.linear(h, uw, ub), dw, db)
        return x

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """x_last: (b, hidden) -> logits (b, vocab)."""
        return F.linear(_rms_norm(x_last, *self.final_norm), *self.lm_head)

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, repeat: int = 1
    ) -> torch.Tensor:
        """ids/mask/pos: (B, Lp) left-padded prompts. Fills cache rows [0, B*repeat) (each prompt's
        k/v repeated `repeat` times) and returns the last-position logits (B, vocab), not repeated."""
        b, s = ids.shape
        key_ok = mask.bool()
        self.valid[: b * repeat, :s] = key_ok.repeat_interleave(repeat, 0)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        # Padding queries may attend to themselves: a fully masked row would give NaN that leaks
        # into later layers through 0 * NaN in the attention product.
        attn_mask = (causal & key_ok[:, None, :]) | torch.eye(s, dtype=torch.bool, device=ids.device)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, Lp, head_dim)
        x = F.embedding(ids, self.embed)
        x = self._layers(x, cos, sin, attn_mask[:, None], s, repeat)
        self.rows, self.length = b * repeat, s
        return self._logits(x[:, -1])

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens, pos: (b,) with b = current rows. Appends one token per row; returns (b, vocab)."""
        b, slot_end = self.rows, self.length + 1
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # (b, 1, 1, head_dim)
        mask = self.valid[:b, None, None, :slot_end]
        x = F.embedding(tokens[:, None], self.embed)  # (b, 1, hidden)
        x = self._layers(x, cos, sin, mask, slot_end)
        self.length = slot_end
        return self._logits(x[:, 0])

    def select(self, idx: torch.Tensor) -> None:
        """Keep only rows idx (k,) of the current batch, moved to the front (compaction)."""
        n, length = idx.shape[0], self.length
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[:n, :, :length] = kc[idx, :, :length]
            vc[:n, :, :length] = vc[idx, :, :length]
        self.valid[:n] = self.valid[idx]
        self.rows = n
