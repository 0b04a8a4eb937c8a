"""vLLM memory hygiene around sleep mode (rollout/vllm_engine.py), without vLLM: a recording stand-in
for `vllm.LLM` logs the engine's calls. On a CUDA device torch's cached blocks go back to the device
before each wake_up (weights, then KV cache, with the actor's weights streamed in between); on CPU no
CUDA function is called at all (a strict stand-in raises if one is). And the memory vLLM is asked for:
a tg-way rank's KV cache holds its heads only, and the default (gpu_memory_utilization 0) asks for a
utilisation vLLM's start-up check passes with the device shared, or refuses in one line."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from hybridflow.engines.precision import cast_parameters
from hybridflow.errors import ConfigError
from hybridflow.models import load_causal_lm
from hybridflow.models.tiny import build_tiny_model
from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, release_cached_blocks
from hybridflow.rollout.vllm_memory import auto_memory_utilization, kv_cache_bytes, memory_settings

GIB = 2**30


class RecordingLLM:
    """The slice of vllm.LLM the weight path uses; `log` is shared with the CUDA stand-in."""

    def __init__(self, log: list[str]):
        self.log, self.loaded = log, {}

    def wake_up(self, tags):
        self.log.append("wake_up:" + ",".join(tags))

    def sleep(self, level):
        self.log.append(f"sleep:{level}")

    def collective_rpc(self, method, kwargs):
        self.log.append(method)
        self.loaded = {name: t.clone() for name, t in kwargs["weights_iterator"]}

    def reset_prefix_cache(self):
        self.log.append("reset_prefix_cache")


def _engine(model, device: str, log: list[str]) -> VLLMEngine:
    """A VLLMEngine around the recorder (its constructor would build a real vllm.LLM)."""
    engine = object.__new__(VLLMEngine)
    engine.model, engine.config = model, VLLMEngineConfig()
    engine.device, engine.gpu = torch.device(device), device.startswith("cuda")
    engine.pad_head_dim, engine.llm, engine._asleep = None, RecordingLLM(log), False
    engine.sent_bytes = 0
    return engine


def _no_cuda(*args, **kwargs):
    raise AssertionError("a CUDA function was called on the CPU path")


def test_cuda_cache_is_emptied_before_each_wake_up(tiny_model_dir, monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    model = load_causal_lm(tiny_model_dir)
    engine = _engine(model, "cuda:0", log)
    engine.sleep()
    assert log == ["sleep:2"] and engine._asleep
    log.clear()
    engine._wake_and_sync()
    assert log == [
        "empty_cache",  # the training side's cached blocks, before vLLM maps its weights
        "wake_up:weights",
        "reload_weights",
        "reset_prefix_cache",
        "empty_cache",  # the streamed full tensors' blocks, before vLLM maps its KV cache
        "wake_up:kv_cache",
    ]
    assert not engine._asleep
    want = dict(model.named_parameters())
    assert set(engine.llm.loaded) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(engine.llm.loaded[name], t.detach(), rtol=0, atol=0)


def test_cpu_path_makes_no_cuda_call(tiny_model_dir, monkeypatch):
    for name in ("empty_cache", "synchronize", "_lazy_init", "memory_allocated", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, _no_cuda)
    log: list[str] = []
    engine = _engine(load_causal_lm(tiny_model_dir), "cpu", log)
    engine.sleep()  # nothing to free on CPU
    engine._wake_and_sync()
    assert log == ["reload_weights", "reset_prefix_cache"]
    release_cached_blocks(torch.device("cpu"))  # and directly: no CUDA call
    with pytest.raises(AssertionError, match="CUDA function"):
        release_cached_blocks(torch.device("cuda", 0))  # the stand-in does catch a call


def test_kv_budget_is_this_ranks_heads():
    config = build_tiny_model("tiny", "llama").config  # 2 KV heads; 512 fp32 bytes per token (test_factory)
    whole = 3 * 8 * 16 * 512  # 3 sequences x (7 blocks of 100 tokens + 1 spare) x 16 tokens
    assert kv_cache_bytes(config, torch.float32, 3, 100) == whole
    assert kv_cache_bytes(config, torch.float32, 3, 100, tg=2) == whole // 2  # one head per rank
    assert kv_cache_bytes(config, torch.float32, 3, 100, tg=4) == whole // 2  # replicated, not split
    for tg in (1, 2):
        c = VLLMEngineConfig(max_num_seqs=3, max_model_len=100, tensor_parallel_size=tg)
        assert memory_settings(config, torch.float32, c) == {"kv_cache_memory_bytes": whole // tg}


def test_auto_utilisation_passes_vllms_startup_check_or_refuses():
    free, total, kv, weights = 20 * GIB, 80 * GIB, 6 * GIB, 4 * GIB
    assert free < 0.92 * total  # vLLM's default utilisation would refuse this shared device
    util = auto_memory_utilization(free, total, kv, weights)
    assert util == 10 / 80 and util * total <= free  # vLLM starts when free >= utilisation x total
    with pytest.raises(ConfigError) as e:
        auto_memory_utilization(8 * GIB, total, kv, weights)
    assert len(e.value.errors) == 1 and "\n" not in e.value.errors[0]
    assert "needs 10.00 GiB free" in e.value.errors[0] and "8.00 of 80.00 GiB free" in e.value.errors[0]
    config = build_tiny_model("tiny", "llama").config
    c = VLLMEngineConfig(max_num_seqs=3, max_model_len=100)
    got = memory_settings(config, torch.bfloat16, c, device_memory=(free, total), weight_bytes=weights)
    kv = kv_cache_bytes(config, torch.bfloat16, 3, 100)
    assert got == {"kv_cache_memory_bytes": kv, "gpu_memory_utilization": (kv + weights) / total}
    explicit = VLLMEngineConfig(gpu_memory_utilization=0.5)
    assert memory_settings(config, torch.bfloat16, explicit, device_memory=(free, total)) == {
        "gpu_memory_utilization": 0.5
    }


def test_a_pool_engine_on_cuda_asks_for_what_this_rank_needs_and_streams_from_the_files(
    tiny_model_dir, monkeypatch
):
    """The engine's own constructor on a CUDA device, for a rollout pool (own_weights) whose model is on
    the meta device in bf16 (workers/actor.load_pool_model): free/total read there
    (torch.cuda.mem_get_info), this rank's bf16 weights and KV cache asked for, and the weights streamed
    from the model's safetensors, cast; vLLM itself is a stand-in recording its arguments and weights."""
    asked: list = []
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (20 * GIB, 80 * GIB)
    )
    built: dict = {}

    def llm(model, **kw):
        built.update(kw)
        return RecordingLLM([])

    fake = types.ModuleType("vllm")
    fake.LLM = llm
    monkeypatch.setitem(sys.modules, "vllm", fake)
    bf16 = torch.bfloat16
    model = load_causal_lm(tiny_model_dir, device="meta")
    cast_parameters(model, bf16)
    config = VLLMEngineConfig(max_num_seqs=4, max_model_len=64, own_weights=True, dtype=bf16)
    engine = VLLMEngine(model, config, device="cuda:0")
    assert engine.gpu and asked == [torch.device("cuda:0")]
    kv = kv_cache_bytes(model.config, bf16, 4, 64)
    weights = sum(p.numel() for p in model.parameters()) * 2
    assert built["kv_cache_memory_bytes"] == kv
    assert built["gpu_memory_utilization"] == (kv + weights) / (80 * GIB)
    stored = dict(load_causal_lm(tiny_model_dir).named_parameters())
    assert engine.llm.loaded.keys() == stored.keys()
    for name, t in stored.items():
        assert torch.equal(engine.llm.loaded[name], t.detach().to(bf16)), name
    assert all(p.is_meta for p in model.parameters())  # never materialised
