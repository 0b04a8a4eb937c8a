"""The functional decoder's weights as its forward reads them (rollout/llama_decoder.py): per layer, the
fused q|k|v and gate|up matrices in MKL's packed GEMM format or transposed (`pack_layer`), and the small
linear helpers that multiply by them. Split from llama_decoder.py to keep files small.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hybridflow.models.cpu_gemm import OneDnnWeight
from hybridflow.rollout.cpu.mkl_packed import MklPacked
from hybridflow.rollout.decoder_ops import _functional_act


def _norm_eps(mod) -> float:
    return float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6)))


RAW_WEIGHTS_FROM_ROWS = 512
"""Row counts from which the model's own weights beat the packed copies (prefill-sized GEMMs)."""


def _mm(x: torch.Tensor, w_t, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, in) @ w_t (in, out) [+ bias]: a linear layer with the weight already transposed (or packed)."""
    if isinstance(w_t, (MklPacked, OneDnnWeight)):
        return w_t(x, bias)
    return x @ w_t if bias is None else torch.addmm(bias, x, w_t)


def _mm_residual(x: torch.Tensor, a: torch.Tensor, w_t, bias: torch.Tensor | None):
    """x + (a @ w_t [+ bias]); without a bias the residual add rides in the GEMM (beta=1)."""
    if isinstance(w_t, (MklPacked, OneDnnWeight)):
        return w_t(a, bias).add_(x)
    return torch.addmm(x, a, w_t) if bias is None else x + torch.addmm(bias, a, w_t)


def _cat_bias(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)])


Linear = tuple
"""(weight, bias): weight stored (in, out) (a transposed view or copy), as an MklPacked or as a OneDnnWeight;
bias or None."""


@dataclass
class PackedLayer:
    """One decoder layer's weights as the forward reads them (see pack_layer). Under tensor parallelism
    q/k/v and gate/up hold this rank's output features (column-parallel), o and down its input features
    (row-parallel: their outputs are partial sums, all-reduced over the group); the norms are whole."""

    input_norm: tuple[torch.Tensor, float]  # (weight, eps)
    qkv: tuple[Linear, ...]  # (fused q|k|v,) when packed, else (q, k, v)
    o: Linear
    post_norm: tuple[torch.Tensor, float]
    gate_up: tuple[Linear, ...]  # (fused gate|up,) when packed, else (gate, up)
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]


def pack_layer(weights: Mapping[str, torch.Tensor], layer, prefix: str, pack: bool, kernel: str = ""):
    """Decoder layer `prefix` ("model.layers.3.") as a PackedLayer, from `weights` (HF name -> this
    rank's tensor: the whole weight, or its generation shard under tensor parallelism); `layer` is the
    HF module, read only for the norms' eps and the activation.

    pack=True copies: q/k/v and gate/up concatenated (one matmul each instead of three and two); each
    matrix then stored in MKL's packed GEMM format (kernel="mkl"; see cpu/mkl_packed.py), as a OneDnnWeight
    (kernel="onednn": fp32 through oneDNN, models/cpu_gemm.py) or transposed and contiguous, the (in, out)
    layout that single-threaded MKL multiplies ~1.3-1.6x faster than the (out, in) one at decode shapes.
    Costs one extra copy of the decoder layers' weights while a `generate` call runs. pack=False:
    transposed views of the given tensors."""

    def group(*names: str) -> tuple[Linear, ...]:
        ws = [weights[prefix + n + ".weight"] for n in names]
        bs = [weights.get(prefix + n + ".bias") for n in names]
        if pack:
            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            if kernel == "mkl":
                return ((MklPacked(w), _cat_bias(ws, bs)),)
            if kernel == "onednn":
                return ((OneDnnWeight(w), _cat_bias(ws, bs)),)
            # fp32: (in, out) copies for MKL; 16-bit (oneDNN): the (out, in) tensor's transposed view, 5-10%
            # faster at decode shapes (32 rows of the 25M model) than an (in, out) copy
            w_t = w.t().contiguous() if w.dtype == torch.float32 else w.t()
            return ((w_t, _cat_bias(ws, bs)),)
        return tuple((w.t(), b) for w, b in zip(ws, bs))

    return PackedLayer(
        (weights[prefix + "input_layernorm.weight"], _norm_eps(layer.input_layernorm)),
        group("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        group("self_attn.o_proj")[0],
        (weights[prefix + "post_attention_layernorm.weight"], _norm_eps(layer.post_attention_layernorm)),
        group("mlp.gate_proj", "mlp.up_proj"),
        group("mlp.down_proj")[0],
        _functional_act(layer.mlp.act_fn),
    )


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the model's own tensor (tied weights under every name they have)."""
    return dict(model.named_parameters(remove_duplicate=False))


def _project(h: torch.Tensor, group: tuple) -> list[torch.Tensor]:
    return [_mm(h, w, b) for w, b in group]
