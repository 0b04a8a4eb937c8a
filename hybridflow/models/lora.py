"""Low-rank adapters (LoRA, through peft) applied by a function to the plain HF model, before tensor
parallel and FSDP2 (engines/parallelize.py's order: adapters are one more transformation of the plain
model, and nothing here is parallel).

peft's layers are injected into the model in place (`inject_adapter_in_model`), not wrapped in a
PeftModel, so the model keeps its class, its `base_model` and its decoder layers: parallelize and the RL
forward see the same tree with `q_proj` now a peft `lora.Linear` holding
`base_layer` (the frozen weight), `lora_A.default` (r, in) and `lora_B.default` (out, r). The update a
layer adds is scale * B @ A with scale = alpha / r (peft's `scaling`).

Dtypes: the base is frozen and stored in the compute dtype (bf16 on GPU: half its bytes, no fp32 master
copy), the adapters (and a critic's value head) stay fp32, and the optimizer holds only them.

The reference model is this model with its adapters switched off (`adapters_disabled`): B @ A is skipped,
so its log-probs are the base model's and no second copy of the base is loaded (docs/lora.md).

Initial adapter values do not depend on the layout: A is drawn from a generator seeded by (seed, name)
on the whole tensor and each rank keeps its slice (engines/sharded_init.py), B starts at zero (peft's default:
the model starts as the base), so dp=1, dp=2 and tp=2 runs start from the same weights.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

ADAPTER = "default"  # peft's adapter name; one adapter per model
_BASE = ".base_layer"


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float = 0.0,
    keep_trainable: tuple[str, ...] = (),
) -> None:
    """Inject rank-`rank` adapters (scale alpha / rank) into `model`'s `target_modules` (["all-linear"]: every
    linear layer but the output head) and freeze every other parameter, except the modules named in
    `keep_trainable` (a critic's value head, trained whole like peft's modules_to_save)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules[0] if list(target_modules) == ["all-linear"] else list(target_modules),
        exclude_modules=list(keep_trainable) or None,
        bias="none",
    )
    inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    if not lora_layers(model):
        raise ValueError(
            f"model.lora.target_modules={list(target_modules)} matched no linear layer of the model"
        )
    for name, p in model.named_parameters():
        head = any(name.startswith(k + ".") for k in keep_trainable)
        p.requires_grad_(is_adapter(name) or head)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (lora_A / lora_B)."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The HF checkpoint name of a base parameter ("...q_proj.base_layer.weight" -> "...q_proj.weight")."""
    return name.replace(_BASE + ".", ".")


def lora_layers(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """{module name: (scale, fan_in_fan_out)} of the adapted layers (fan_in_fan_out: GPT-2's Conv1D,
    whose weight is stored (in, out))."""
    from peft.tuners.lora import LoraLayer

    return {
        name: (float(m.scaling[ADAPTER]), bool(getattr(m, "fan_in_fan_out", False)))
        for name, m in model.named_modules()
        if isinstance(m, LoraLayer)
    }


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The model computes as its base for the duration (the reference model). peft's own switch
    (`enable_adapters(False)`) also turns off the adapters' requires_grad, which FSDP2 reads when it
    builds unsharded parameters: the flag it checks in forward is set directly instead."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def initial_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole initial value of adapter parameter `name`: A as peft draws it (kaiming-uniform, a=sqrt(5):
    bound 1/sqrt(in)) from a generator seeded by (seed, name); B zero. fp32, on CPU."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Set every (whole, non-meta) adapter parameter to its layout-independent initial value."""
    for name, p in model.named_parameters():
        if is_adapter(name) and not p.is_meta:
            p.copy_(initial_adapter(name, tuple(p.shape), seed))


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool,
          in_place: bool) -> torch.Tensor:  # fmt: skip
    """weight + scale * B @ A in weight's dtype (transposed for a Conv1D weight stored (in, out)).
    weight (out, in) or (in, out), a (r, in), b (out, r); any matching TP slices of them."""
    delta = (b.float() @ a.float()) * scale  # (out, in)
    delta = (delta.T if fan_in_fan_out else delta).to(weight.dtype)
    return weight.add_(delta) if in_place else weight + delta


def merge_named(
    items: Iterable[tuple[str, torch.Tensor]], layers: dict[str, tuple[float, bool]], in_place: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs with each adapted layer's weight merged (W + scale * B @ A) from a stream
    of the model's own (name, tensor) pairs: a layer's base weight is held only until its A and B have
    come by, so at most one layer's tensors are held at a time. Adapter tensors are consumed."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in items:
        layer, part = adapted_part(name, layers)
        if layer is None:
            yield name, t
            continue
        if part.endswith(".bias"):
            yield hf_name(name), t
            continue
        held = pending.setdefault(layer, {})
        held[part] = t
        if len(held) == 3:
            del pending[layer]
            scale, fan = layers[layer]
            w = merge(held["base"], held["A"], held["B"], scale, fan, in_place)
            yield f"{layer}.weight", w
    if pending:
        raise RuntimeError(f"adapted layers without all of base, A and B: {sorted(pending)}")


def adapted_part(name: str, layers: dict) -> tuple[str | None, str]:
    """(layer, "base" | "A" | "B" | ".bias") of a parameter of an adapted layer, else (None, "")."""
    for suffix, part in ((f".lora_A.{ADAPTER}.weight", "A"), (f".lora_B.{ADAPTER}.weight", "B"),
                         (f"{_BASE}.weight", "base"), (f"{_BASE}.bias", ".bias")):  # fmt: skip
        if name.endswith(suffix) and name[: -len(suffix)] in layers:
            return name[: -len(suffix)], part
    return None, ""


def merge_into(weights: dict[str, torch.Tensor], layers: dict, names: Iterable[str], in_place: bool) -> None:
    """Replace, in `weights` (model name -> tensor), the base / adapter tensors among `names` by the merged
    weights under their HF names (the generation weights of one FSDP unit: hybrid_engine/resharder.py)."""
    mine = [n for n in names if n in weights]
    merged = dict(merge_named(((n, weights.pop(n)) for n in mine), layers, in_place))
    weights.update(merged)


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of the adapters' parameters (whole tensors): what an adapter-only weight sync sends."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_adapter(n))


def peft_key(name: str) -> str:
    """The key PEFT's adapter_model.safetensors stores adapter parameter `name` under (PeftModel prefix,
    no adapter name): "model.layers.0.q_proj.lora_A.default.weight" ->
    "base_model.model.model.layers.0.q_proj.lora_A.weight"."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")
