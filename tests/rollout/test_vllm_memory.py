"""vLLM memory hygiene around sleep mode (rollout/vllm_engine.py), without vLLM: a recording stand-in
for `vllm.LLM` logs the engine's calls. On a CUDA device torch's cached blocks go back to the device
before each wake_up (weights, then KV cache, with the actor's weights streamed in between); on CPU no
CUDA function is called at all (a strict stand-in raises if one is)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models import load_causal_lm
from hybridflow.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, release_cached_blocks


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
