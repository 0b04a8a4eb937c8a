"""Row streams (rollout/row_streams.py): the CPU decode split by rows over threads gives the same bits as
one thread, on real tiny Llama / Qwen2 models with GQA (4 query heads, 2 kv heads)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, BuiltinEngineConfig, SamplingParams
from hybridflow.rollout.row_streams import RowStreams
from tests.rollout.gen_helpers import TEXTS, check_greedy_matches_hf, prompt_batch

# 10 prompts: greedy (n=1) has >= 8 rows, so two streams of >= 4 rows each run until rows finish.
TEN = [*TEXTS, "2+2=", "zz top", "Once upon a time", "9-3"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_parts_keep_at_least_four_rows_per_stream():
    streams = RowStreams(2)
    try:
        assert streams.parts(7) is None and streams.parts(3) is None
        assert streams.parts(8) == [(0, 4), (4, 8)]
        assert streams.parts(13) == [(0, 6), (6, 13)]
        assert RowStreams(4).parts(13) == [(0, 4), (4, 8), (8, 13)]  # 3 streams of >= 4 rows
    finally:
        streams.close()


def test_run_concatenates_in_order_and_raises_a_pool_error():
    streams = RowStreams(3)
    seen_threads = []

    def part(lo, hi):
        seen_threads.append(torch.get_num_threads())
        return torch.arange(lo, hi)

    assert torch.equal(streams.run(part, [(0, 2), (2, 5), (5, 6)]), torch.arange(6))
    assert seen_threads.count(1) >= 2, "pool threads run with one intra-op thread"

    def bad(lo, hi):
        if lo:
            raise RuntimeError("part failed")
        return torch.zeros(hi - lo)

    with pytest.raises(RuntimeError, match="part failed"):
        streams.run(bad, [(0, 2), (2, 4)])
    streams.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_streams_equal_one_thread_bit_for_bit(tokenizer, arch):
    """2 threads as 2 streams == 1 thread, one stream: tokens, lengths and log-probs, greedy and seeded
    sampling (rows finish at random steps, so compaction moves rows between the streams' parts); greedy
    also equals HF generate."""
    model = build_tiny_model("tiny", arch, seed=0).eval()
    batch = prompt_batch(tokenizer, TEN)
    one = BuiltinEngine(model, BuiltinEngineConfig(cpu_threads=1))
    two = BuiltinEngine(model, BuiltinEngineConfig(cpu_threads=2, cpu_streams=2))
    assert two._row_streams(2) is not None and one._row_streams(1) is None
    _, greedy = check_greedy_matches_hf(two.generate, model, batch)  # an EOS that stops some rows early
    eos = model.config.eos_token_id
    for params in (
        greedy,
        SamplingParams(max_new_tokens=40, temperature=1.0, n=3, seed=7, eos_token_ids=(eos, 11, 12)),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9, n=2, seed=1),
    ):
        a, b = one.generate(batch, params), two.generate(batch, params)
        lengths = a["response_mask"].sum(1)
        assert lengths.min() < lengths.max() or params.top_k, "rows finish at different steps"
        for key in ("responses", "response_mask", "rollout_log_probs"):
            assert torch.equal(a[key], b[key]), (key, params)
        assert b.meta.rollout_metrics == {"rollout/cpu_streams": 2.0}, "the streams ran (and say so)"
        assert a.meta.rollout_metrics == {"rollout/cpu_streams": 1.0}


def test_auto_streams_follow_threads_and_model_size(monkeypatch):
    from hybridflow.rollout import engine as engine_mod

    model = build_tiny_model("tiny", "llama", seed=0)
    auto = BuiltinEngineConfig(cpu_streams=0)
    assert BuiltinEngine(model, auto)._row_streams(2) is None, "a sub-5M model decodes on one thread"
    monkeypatch.setattr(engine_mod, "SMALL_MODEL_PARAMS", 0)
    assert BuiltinEngine(model)._row_streams(2) is None, "off by default (docs/bench/generation.md)"
    engine = BuiltinEngine(model, auto)
    streams = engine._row_streams(2)
    assert (streams.n, streams.threads) == (2, 1)
    assert engine._row_streams(2) is streams, "kept across calls"
    assert engine._row_streams(1) is None
    assert BuiltinEngine(model, BuiltinEngineConfig(cpu_streams=1))._row_streams(2) is None
    wide = BuiltinEngine(model, BuiltinEngineConfig(cpu_streams=2))._row_streams(8)
    assert (wide.n, wide.threads) == (2, 4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.generate(prompt_batch(None, TEN), SamplingParams(max_new_tokens=4, do_sample=False))
        assert torch.get_num_threads() == 2, "the caller's thread count is restored"
    finally:
        torch.set_num_threads(before)
