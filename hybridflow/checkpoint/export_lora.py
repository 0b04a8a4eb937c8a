"""Export of a LoRA checkpoint, whose shards hold only the adapters (engine.json "lora", engine_state.py):
a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, loaded by
`peft.PeftModel.from_pretrained(base, dir)`), or with `merge` plain HF weights, each adapted layer's
weight W + (alpha / r) * B @ A computed as it is streamed from the base model's files (one layer's
tensors in memory at a time).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridflow.checkpoint.manager import CheckpointError
from hybridflow.checkpoint.shards import read_full, tensor_index
from hybridflow.checkpoint.stream_write import write_safetensors
from hybridflow.models.lora import ADAPTER, merge, peft_key

ADAPTER_FILE = "adapter_model.safetensors"


def write_adapter(role_dir: Path, lora: dict, out: Path) -> None:
    """PEFT's adapter directory in `out`: its config (base_model_name_or_path: the run's model.path) and
    the adapters by PEFT's key names."""
    from peft import LoraConfig

    entries = tensor_index(role_dir / "model")
    adapters = {n: e for n, e in entries.items() if ".lora_A." in n or ".lora_B." in n}
    LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"],
        fan_in_fan_out=lora["fan_in_fan_out"],
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=lora["base_model"],
        inference_mode=True,
    ).save_pretrained(str(out))
    keys = {peft_key(n): n for n in adapters}
    specs = {k: (adapters[n].shape, adapters[n].dtype) for k, n in keys.items()}
    write_safetensors(out, specs, lambda k: read_full(keys[k], adapters[keys[k]]), file_name=ADAPTER_FILE,
                      metadata={"format": "pt"})  # fmt: skip


def write_merged(role_dir: Path, lora: dict, config: dict, out: Path, max_file_bytes: int) -> None:
    """Plain HF safetensors in `out`: the base model's tensors with the adapters merged in."""
    from safetensors import safe_open

    from hybridflow.models.meta import weight_files

    base = lora["base_model"]
    files = weight_files(base) if base and Path(base).is_dir() else {}
    if not files:
        raise CheckpointError(
            f"the LoRA checkpoint's base model {base!r} (model.path of the run) holds no safetensors; "
            "export the adapter without --merge"
        )
    adapters = tensor_index(role_dir / "model")
    scale = lora["alpha"] / lora["rank"]
    if config.get("tie_word_embeddings") and "lm_head.weight" in files and len(files) > 1:
        del files["lm_head.weight"]  # re-tied on load, as save_pretrained leaves it out
    specs = {}
    for name, path in files.items():
        with safe_open(str(path), framework="pt") as f:
            sl = f.get_slice(name)
            specs[name] = (tuple(sl.get_shape()), _DTYPES[sl.get_dtype()])

    def produce(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt") as f:
            t = f.get_tensor(name)
        layer = name.removesuffix(".weight")
        a_name, b_name = f"{layer}.lora_A.{ADAPTER}.weight", f"{layer}.lora_B.{ADAPTER}.weight"
        if a_name not in adapters:
            return t
        a, b = read_full(a_name, adapters[a_name]), read_full(b_name, adapters[b_name])
        return merge(t, a, b, scale, lora["fan_in_fan_out"], in_place=True)

    write_safetensors(out, specs, produce, max_file_bytes)


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def read_lora(info: dict, merge: bool) -> dict | None:
    """engine.json's "lora" entry, or None for a full checkpoint (where --merge means nothing)."""
    lora = info.get("lora")
    if merge and lora is None:
        raise CheckpointError("--merge applies to a LoRA checkpoint; this one holds the full model")
    return json.loads(json.dumps(lora)) if lora is not None else None
