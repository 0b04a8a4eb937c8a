"""Parallelism applied by a function to a plain HF model (after its LoRA adapters, if any: models/lora.py),
in torchtitan's order: tensor parallel (DTensor parameters over the "tp" mesh axis, computed on their local
shards: engines/tp_regions.py) -> activation checkpointing -> FSDP2
`fully_shard` over the "dp" axis. Model code stays parallelism-free (docs/design.md §7).

Where this departs from torchtitan:
- Embeddings, final norm and lm_head are not tensor-parallel: they stay whole on each TP rank and are
  only FSDP-sharded over dp. The RL log-prob pass needs the full vocabulary row per token, and the
  chunked lm_head (forward.py) already bounds the logits memory; vocab-parallel loss is future work.
- No sequence parallel: activations between layers are replicated over tp (simple, exact).
- GPT-2 fuses q, k, v into one Conv1D (weight (in, 3*E)). A plain column shard would hand rank 0 all
  of q and part of k, so the columns are permuted first to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (head
  aligned), and `split_size` / `num_heads` of the attention are set to their per-rank values. The
  permutation is recorded (`hf_layout_transforms`) so full state dicts are written back in HF order.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hybridflow.compat.hf import enable_activation_checkpointing
from hybridflow.engines.tp_regions import LocalColwise, LocalRowwise
from hybridflow.models.fused_qkv import fused_qkv_permutation
from hybridflow.models.lora import ADAPTER, is_adapter

# Attribute set on the HF model: {param name: (dim, permutation)} applied to HF-layout tensors.
_LAYOUT_ATTR = "_hybridflow_layout_permutations"

LLAMA_LIKE = ("llama", "qwen2", "mistral")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of an HF model (`layers` in Llama-likes, `h` in GPT-2)."""
    base = model.base_model
    for name in ("layers", "h"):
        if isinstance(getattr(base, name, None), nn.ModuleList):
            return getattr(base, name)
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__} (looked for .layers / .h)")


def _distribute_conv1d(style, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """A Conv1D under `style`: the style's own partition (Conv1D's weight is stored (in, out)) and
    input/output hooks, wired as torch's ColwiseParallel/RowwiseParallel wire them for an nn.Linear."""
    return distribute_module(
        module,
        device_mesh,
        style._partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class _Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for HF's Conv1D (weight stored (in, out): shard dim 1, bias dim 0).
    `permute` reorders output columns before sharding (GPT-2's fused qkv)."""

    def __init__(self, permute: torch.Tensor | None = None):
        super().__init__()
        self.permute = permute

    def _partition(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = 1 if pname == "weight" else 0
            full = param.detach()
            if self.permute is not None:
                full = full.index_select(dim, self.permute)
            dt = distribute_tensor(full, device_mesh, [Shard(dim)])
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    def _apply(self, module, device_mesh):
        return _distribute_conv1d(self, module, device_mesh)


class _Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for HF's Conv1D: weight (in, out) sharded on dim 0, bias replicated."""

    def _partition(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if pname == "weight" else Replicate()
            dt = distribute_tensor(param.detach(), device_mesh, [placement])
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    def _apply(self, module, device_mesh):
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, module, device_mesh)


def _check_divisible(config, tp: int, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None and value % tp:
            raise ValueError(
                f"tensor parallel size tp={tp} must divide {config.model_type} config.{name}={value}; "
                "choose a tp that divides the head counts and hidden sizes"
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard attention and MLP projections of every decoder layer over tp_mesh (colwise in, rowwise out)."""
    tp = tp_mesh.size()
    config = model.config
    kind = config.model_type
    layers = decoder_layers(model)
    if kind in LLAMA_LIKE:
        _check_divisible(config, tp, ("num_attention_heads", "num_key_value_heads", "intermediate_size"))
        # computed on local shards, activations plain tensors (engines/tp_regions.py: why not DTensors)
        plan = {
            "self_attn.q_proj": LocalColwise(),
            "self_attn.k_proj": LocalColwise(),
            "self_attn.v_proj": LocalColwise(),
            "self_attn.o_proj": LocalRowwise(),
            "mlp.gate_proj": LocalColwise(),
            "mlp.up_proj": LocalColwise(),
            "mlp.down_proj": LocalRowwise(),
        }
        for layer in layers:
            parallelize_module(layer, tp_mesh, with_adapters(plan, layer))
    elif kind == "gpt2":
        if any(is_adapter(n) for n, _ in model.named_parameters()):
            raise NotImplementedError(
                "LoRA under tensor parallel needs a Llama-like model; use tp=1 for GPT-2"
            )
        _check_divisible(config, tp, ("n_head", "n_embd"))
        perm = fused_qkv_permutation(config.n_embd, tp)
        layout = {}
        prefix = model.base_model_prefix
        for i, layer in enumerate(layers):
            plan = {
                "attn.c_attn": _Conv1DColwise(permute=perm),
                "attn.c_proj": _Conv1DRowwise(),
                "mlp.c_fc": _Conv1DColwise(),
                "mlp.c_proj": _Conv1DRowwise(),
            }
            parallelize_module(layer, tp_mesh, plan)
            layer.attn.split_size = config.n_embd // tp  # per-rank q/k/v widths after the permutation
            layer.attn.num_heads = config.n_head // tp
            layer.attn.embed_dim = config.n_embd // tp
            layout[f"{prefix}.h.{i}.attn.c_attn.weight"] = (1, perm)
            layout[f"{prefix}.h.{i}.attn.c_attn.bias"] = (0, perm)
        setattr(model, _LAYOUT_ATTR, layout)
    else:
        raise NotImplementedError(
            f"no tensor-parallel plan for model_type {kind!r} (have {LLAMA_LIKE + ('gpt2',)}); use tp=1"
        )


def with_adapters(plan: dict, layer: nn.Module) -> dict:
    """The plan for a layer whose projections may carry LoRA adapters (models/lora.py): the frozen base
    takes the projection's style; a column-parallel one's B (out, r) is split by output rows too (A whole),
    a row-parallel one's A (r, in) by input columns (B whole), so B @ A is split as the base weight is."""
    out = {}
    for path, style in plan.items():
        if not hasattr(layer.get_submodule(path), "base_layer"):
            out[path] = style
            continue
        out[f"{path}.base_layer"] = style
        if isinstance(style, RowwiseParallel):
            out[f"{path}.lora_A.{ADAPTER}"] = RowwiseParallel()
        else:
            out[f"{path}.lora_B.{ADAPTER}"] = ColwiseParallel()
    return out


def hf_layout_transforms(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """{param name: (dim, perm)} such that engine_tensor = hf_tensor.index_select(dim, perm)."""
    return getattr(model, _LAYOUT_ATTR, {})


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (HF's own switch, so parameter names are unchanged)."""
    enable_activation_checkpointing(model, {"use_reentrant": False})


def apply_fsdp(
    root: nn.Module,
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """FSDP2: one unit per decoder layer, the rest (embeddings, final norm, heads) in the root unit.
    `root` is the module whose forward is called (an RLForward or the HF model itself)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last block is needed again first in backward: keep it gathered (torchtitan does the same).
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(root, mesh=dp_mesh, mp_policy=mp)


def parallelize(
    root: nn.Module,
    model: nn.Module,
    mesh: DeviceMesh | None,
    gradient_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Apply TP (if mesh["tp"] > 1), then activation checkpointing (if asked), then FSDP2 over mesh["dp"]
    (if mesh["dp"] > 1; see uses_fsdp).

    model: the plain HF model; root: the module that is called (model itself or a wrapper holding it).
    With mesh None (no process group) only activation checkpointing applies. Returns root.
    """
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    if uses_fsdp(mesh):
        apply_fsdp(root, model, mesh["dp"], param_dtype, reduce_dtype)
    return root


def uses_fsdp(mesh: DeviceMesh | None) -> bool:
    """FSDP2 only when there is something to shard over: with one data-parallel rank it would still
    copy every layer into its all-gather buffer and back, turn the parameters into DTensors (slower
    optimizer and clipping ops) and run its hooks, for nothing (measured: ~2x the update time of a
    0.8M-parameter model inside a 1-rank worker group)."""
    return mesh is not None and mesh["dp"].size() > 1
