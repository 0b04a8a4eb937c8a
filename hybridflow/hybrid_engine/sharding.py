"""How a Llama-family actor's weights are split for tensor and pipeline parallelism.

Tensor parallel (Megatron style, the same rule for training size t and generation size tg):
- column-parallel, split along dim 0 (output features): q/k/v, gate/up, and both vocab matrices
  (`embed_tokens` as a vocab-parallel embedding, `lm_head` giving vocab-sharded logits). Sharding the
  embedding rather than replicating it keeps every large matrix sharded, so Table 2's "each rank holds
  M/(tp)" holds up to the norms.
- row-parallel, split along dim 1 (input features): o_proj, down_proj (outputs are all-reduced).
- replicated: the RMSNorm weights (a few thousand numbers per layer).
Contiguous splits make generation shard g of tg exactly training shards g*(t/tg) .. (g+1)*(t/tg)-1
concatenated, which is what lets the switch gather without any re-slicing.

Pipeline parallel: decoder layers are split evenly over p stages; the embedding sits with stage 0,
the final norm and lm_head with stage p-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.hybrid_engine.layout import TrainLayout

SUPPORTED_ARCHS = ("llama", "mistral")


@dataclass(frozen=True)
class LlamaShape:
    """The numbers of a Llama-family decoder that sharding and the TP forward need."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, cfg) -> LlamaShape:
        arch = getattr(cfg, "model_type", "?")
        if (
            arch not in SUPPORTED_ARCHS
            or getattr(cfg, "attention_bias", False)
            or getattr(cfg, "mlp_bias", False)
        ):
            raise ValueError(f"hybrid engine supports bias-free {SUPPORTED_ARCHS} models, got {arch!r}")
        if getattr(cfg, "tie_word_embeddings", False):
            raise ValueError("hybrid engine needs untied embeddings (tie_word_embeddings=False)")
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"only default RoPE is supported, got {rope.get('rope_type')!r}")
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)),
        )

    def check_tp(self, size: int, what: str) -> None:
        """Raise unless every split dimension divides by the TP size `size`."""
        dims = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }
        bad = {k: v for k, v in dims.items() if v % size}
        if bad:
            raise ValueError(f"{what}={size} does not divide {bad}; pick a TP size dividing all of them")


@dataclass(frozen=True)
class ParamSpec:
    """One weight: its HF name, full shape, TP split dim (None = replicated), pipeline stage, decoder layer."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None
    stage: int
    layer: int | None = None  # decoder layer index; None for embedding, final norm, lm_head

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def llama_param_specs(shape: LlamaShape, p: int = 1) -> list[ParamSpec]:
    """Every weight of the model in state-dict order, with its TP split and its stage out of p."""
    if shape.num_layers % p:
        raise ValueError(f"num_layers={shape.num_layers} not divisible by pipeline size p={p}")
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    per_stage = shape.num_layers // p
    specs = [ParamSpec("model.embed_tokens.weight", (shape.vocab_size, h), 0, 0)]
    for i in range(shape.num_layers):
        s, pre = i // per_stage, f"model.layers.{i}."
        specs += [
            ParamSpec(pre + "input_layernorm.weight", (h,), None, s, i),
            ParamSpec(pre + "self_attn.q_proj.weight", (h, h), 0, s, i),
            ParamSpec(pre + "self_attn.k_proj.weight", (kv, h), 0, s, i),
            ParamSpec(pre + "self_attn.v_proj.weight", (kv, h), 0, s, i),
            ParamSpec(pre + "self_attn.o_proj.weight", (h, h), 1, s, i),
            ParamSpec(pre + "post_attention_layernorm.weight", (h,), None, s, i),
            ParamSpec(pre + "mlp.gate_proj.weight", (shape.intermediate_size, h), 0, s, i),
            ParamSpec(pre + "mlp.up_proj.weight", (shape.intermediate_size, h), 0, s, i),
            ParamSpec(pre + "mlp.down_proj.weight", (h, shape.intermediate_size), 1, s, i),
        ]
    specs += [
        ParamSpec("model.norm.weight", (h,), None, p - 1),
        ParamSpec("lm_head.weight", (shape.vocab_size, h), 0, p - 1),
    ]
    return specs


def tp_slice(full: torch.Tensor, spec: ParamSpec, size: int, index: int) -> torch.Tensor:
    """Shard `index` of `size` of a full weight (a view; the full tensor for replicated weights)."""
    if spec.split_dim is None:
        return full
    return full.chunk(size, dim=spec.split_dim)[index]


def build_training_shard(
    state_dict: dict[str, torch.Tensor], specs: list[ParamSpec], train: TrainLayout, rank: int
) -> dict[str, torch.Tensor]:
    """This rank's training weights: its stage's params, TP shard t_i of t (owned, contiguous copies)."""
    _, p_i, t_i = train.coords(rank)
    return {s.name: tp_slice(state_dict[s.name], s, train.t, t_i).clone() for s in specs if s.stage == p_i}


def reference_generation_shard(
    state_dict: dict[str, torch.Tensor],
    specs: list[ParamSpec],
    train: TrainLayout,
    stages: range,
    g_tp: int,
    tg: int,
) -> dict[str, torch.Tensor]:
    """What a generation rank must hold, sliced straight from the full weights (the tests' oracle)."""
    return {s.name: tp_slice(state_dict[s.name], s, tg, g_tp) for s in specs if s.stage in stages}


def split_bytes(specs: list[ParamSpec], element_size: int) -> tuple[int, int]:
    """(bytes of TP-split weights, bytes of replicated weights) of the whole model."""
    split = sum(s.numel for s in specs if s.split_dim is not None) * element_size
    rep = sum(s.numel for s in specs if s.split_dim is None) * element_size
    return split, rep
