"""Sampling transforms on controlled distributions (statistical tests with fixed seeds)."""

from __future__ import annotations

import zlib

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.rollout.base import SamplingParams, prompt_ids
from hybridflow.rollout.sampling import apply_top_k, apply_top_p, counter_uniforms, sample_keys, sample_next

PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])  # sorted: 1 (.4), 3 (.3), 4 (.15), 2 (.1), 0 (.05)
DRAWS = 40_000


def draw(params: SamplingParams) -> torch.Tensor:
    logits = PROBS.log().expand(DRAWS, -1).contiguous()
    tokens, logp = sample_next(logits, params, torch.Generator().manual_seed(0))
    return torch.bincount(tokens, minlength=5).float() / DRAWS, tokens, logp


def expected(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    p = torch.zeros(5)
    p[keep] = PROBS[keep] ** (1 / temperature)
    return p / p.sum()


@pytest.mark.parametrize(
    "params,keep",
    [
        (SamplingParams(top_k=2), [1, 3]),
        (SamplingParams(top_k=3), [1, 3, 4]),
        (SamplingParams(top_p=0.75), [1, 3, 4]),  # mass before token 4 is .7 < .75, before 2 is .85
        (SamplingParams(top_p=0.5), [1, 3]),
        (SamplingParams(top_p=0.3), [1]),
        (SamplingParams(top_k=3, top_p=0.6), [1, 3]),
        (SamplingParams(), [0, 1, 2, 3, 4]),
    ],
)
def test_frequencies_follow_filtered_distribution(params, keep):
    freq, _, _ = draw(params)
    assert set(freq.nonzero().flatten().tolist()) == set(keep)
    # 4 standard deviations of a frequency estimated from 40k draws is < 0.01.
    torch.testing.assert_close(freq, expected(keep), atol=0.01, rtol=0)


def test_temperature_sharpens_and_log_probs_are_unfiltered():
    freq, tokens, logp = draw(SamplingParams(temperature=0.5, top_k=3))
    torch.testing.assert_close(freq, expected([1, 3, 4], 0.5), atol=0.01, rtol=0)
    # log-probs are log_softmax(logits / T) over the full vocabulary, not the truncated one.
    full = (PROBS.log() / 0.5).log_softmax(-1)
    torch.testing.assert_close(logp, full[tokens])


def test_greedy_is_argmax_with_t1_log_probs():
    tokens, logp = sample_next(
        PROBS.log()[None].repeat(3, 1), SamplingParams(do_sample=False, temperature=0.3)
    )
    assert tokens.tolist() == [1, 1, 1]
    torch.testing.assert_close(logp, PROBS.log()[[1, 1, 1]])


def test_filters_keep_at_least_one_token_and_ignore_disabled_values():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert torch.isfinite(apply_top_p(logits, 1e-6)).sum() == 1
    assert torch.equal(apply_top_k(logits, 0), logits) and torch.equal(apply_top_k(logits, 10), logits)


def test_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(temperature=0).greedy and SamplingParams(eos_token_ids=(5,)).stop_ids(2) == (5,)
    assert SamplingParams(stop_token_ids=(9,)).stop_ids([2, 3]) == (2, 3, 9)


def test_sample_keys_depend_on_the_prompt_id_and_sample_not_on_the_batch():
    """A sample's key (so its draws) is the same whether its prompt is alone or among others, in any
    order; the n samples of a prompt, the prompts and the seeds all get keys of their own."""
    ids = prompt_ids(Batch.from_dict({"x": torch.zeros(3, 1)}, {"uid": ["0-7", "0-3", "1-7"]}))
    assert ids.tolist() == [
        zlib.crc32(u.encode()) for u in ("0-7", "0-3", "1-7")
    ]  # the same in every process
    whole = sample_keys(11, ids, 4)
    assert torch.equal(sample_keys(11, ids[[2, 0]], 4).view(2, 4), whole.view(3, 4)[[2, 0]])
    assert len(set(whole.tolist())) == 12 and not set(whole.tolist()) & set(sample_keys(12, ids, 4).tolist())
    u = counter_uniforms(whole, 5)
    assert u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(counter_uniforms(whole[:4], 5), u[:4]) and not torch.equal(
        counter_uniforms(whole, 6), u
    )
    # no uid (a direct call): rows are numbered in the call
    assert prompt_ids(Batch.from_dict({"x": torch.zeros(2, 1)})).tolist() == [0, 1]
