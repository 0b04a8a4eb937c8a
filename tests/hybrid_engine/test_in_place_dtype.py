"""The in-place switch (tp = 1, one rank, fp32 master weights, bf16 generation) makes one bf16 copy of the
weights per generate call, not two (hybrid_engine/resharder.py, `Resharder.in_place`): the engine is
handed no shard and reads the model's own tensors, so it casts them itself, and a cast copy made by the
switch would be held for the whole call unread. Real TrainEngine, Resharder and built-in engine on the
tiny Llama; the casts of the live weights are counted where torch performs them (aten._to_copy)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.engines import EngineConfig, TrainEngine
from hybridflow.hybrid_engine.resharder import build_resharder
from hybridflow.models import load_causal_lm
from hybridflow.rollout import BuiltinEngine, BuiltinEngineConfig, SamplingParams
from tests.rollout.gen_helpers import prompt_batch

BF16 = torch.bfloat16


class CastCounter(TorchDispatchMode):
    """Counts casts to bf16 whose source is one of `sources` (data_ptr -> name)."""

    def __init__(self, sources: dict[int, str]):
        super().__init__()
        self.sources, self.counts = sources, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == BF16:
            name = self.sources.get(args[0].data_ptr())
            if name is not None:
                self.counts[name] += 1
        return func(*args, **kwargs)


def test_one_bf16_copy_per_call_and_the_same_rollouts(tiny_model_dir):
    engine = TrainEngine(load_causal_lm(tiny_model_dir), EngineConfig(mixed_precision="bf16"))
    assert next(engine.hf_model.parameters()).dtype == torch.float32  # fp32 masters between steps
    switch = build_resharder(engine, dtype=BF16)
    rollout = BuiltinEngine(engine.hf_model, BuiltinEngineConfig(dtype=BF16))
    batch = prompt_batch()
    params = SamplingParams(max_new_tokens=12, n=2, seed=5, eos_token_ids=())
    without_switch = rollout.generate(batch, params)  # the engine's own cast of the same weights
    live = {p.data_ptr(): n for n, p in engine.hf_model.named_parameters()}
    with CastCounter(live) as counter, switch.generation() as (weights, tp):
        assert switch.in_place and tp is None
        rollout.set_shard(None if switch.in_place else weights, tp)  # as workers/actor.py does
        out = rollout.generate(batch, params)
        rollout.set_shard(None)
    # each weight is cast once per call, by the decoder (the switch's own copy would be a second)
    assert counter.counts == Counter(dict.fromkeys(live.values(), 1))
    assert torch.equal(out["responses"], without_switch["responses"])
    assert torch.equal(out["rollout_log_probs"], without_switch["rollout_log_probs"])
    # the held figure is still the bf16 model, as cost.fsdp_switch_cost prices it
    bf16_bytes = sum(p.numel() * 2 for p in engine.hf_model.parameters())
    assert switch.stats.gen_weight_bytes == switch.stats.formula_gen_weight_bytes == bf16_bytes
    assert next(engine.hf_model.parameters()).dtype == torch.float32
