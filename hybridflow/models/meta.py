"""Models built without their weights: parameters on the meta device, buffers real, and the directory
whose safetensors fill them later, shard by shard (engines/sharded_init.py, docs/checkpoints.md).

`load_*(path, device="meta")` in hf.py uses this when every parameter of the model is stored under its
own name in the directory's safetensors; otherwise (a critic built from a causal LM, renamed keys,
.bin weights) it loads the full model into memory, and the engine shards it after loading.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from torch import nn

WEIGHTS_ATTR = "_hybridflow_weights_dir"  # set on a meta-built HF model: where its safetensors live
ZERO_INIT_ATTR = "_hybridflow_zero_init"  # parameters not in the files that start at zero (a new value head)
_HEADS = ("score", "classifier")  # scalar heads of critics (hf.scalar_head)


def weight_files(directory: str | Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of an HF directory (single file or sharded with an index)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / f for name, f in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


@contextlib.contextmanager
def meta_parameters():
    """Build modules with parameters on the meta device and buffers real (accelerate's
    init_empty_weights(include_buffers=False)): a constructor's torch.empty is moved to meta before
    anyone writes to it, so the host never touches the pages of the full model."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            attrs = dict(param.__dict__)
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(attrs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_on_meta(
    auto_cls,
    path: Path,
    config,
    dtype,
    attn_implementation=None,
    new_head: bool = False,
    trust_remote_code=False,
):
    """The model of `config` with meta parameters, tagged with `path`; None when the directory's
    safetensors do not hold every parameter under the model's own names. new_head: a critic built
    from a causal-LM directory; its value head (absent from the files) starts at zero, as
    `init_critic_from_causal_lm` does."""
    files = weight_files(path)
    if not files:
        return None
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with meta_parameters():
        model = auto_cls.from_config(config, **kwargs)
    missing = [name for name, _ in model.named_parameters() if name not in files]
    heads = [n for n in missing if n.split(".")[0] in _HEADS]
    if len(heads) != len(missing) or (heads and not new_head):
        return None
    setattr(model, WEIGHTS_ATTR, str(path))
    setattr(model, ZERO_INIT_ATTR, heads)
    return model
