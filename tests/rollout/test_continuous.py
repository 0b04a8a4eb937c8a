"""Continuous batching in the built-in engine (rollout/continuous.py, rollout/ragged_decoder.py), driven
directly: rows that join late, leave, rejoin with inserted tokens and wait for a cache row must each be
conditioned on exactly the tokens they were fed."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.tiny import build_char_tokenizer, build_tiny_model
from hybridflow.rollout import BuiltinEngine, SamplingParams
from hybridflow.rollout.engine import BuiltinEngineConfig
from hybridflow.rollout.sampling import counter_uniforms, row_keys
from tests.rollout.gen_helpers import prompt_batch

INSERTED = [5, 6, 7, 8]  # what a "tool" inserts: any ids the model's vocabulary holds


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny", "llama", seed=0).eval()


def _prompts(tok) -> list[list[int]]:
    batch = prompt_batch(tok)
    return [r[m.bool()].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]


def _drive(engine, prompts, params, budget=40):
    """Rows join at once (the last shares row 0's prompt); row r leaves after 3 + r tokens of each turn
    and rejoins r % 3 + 1 steps later with INSERTED; finished after `budget` tokens. -> per row, the
    tokens it was fed after its prompt and (position, log-prob) of each token it sampled."""
    seqs = [[] for _ in prompts]
    sampled = [[] for _ in prompts]
    away: dict[int, int] = {}  # row -> step at which it rejoins
    with engine.continuous(params, len(prompts), max(map(len, prompts)) + budget + len(INSERTED)) as cb:
        for r, p in enumerate(prompts):
            cb.join(r, p)
        done, step, turn = set(), 0, [0] * len(prompts)
        while len(done) < len(prompts):
            for r in [r for r, s in away.items() if s <= step]:
                del away[r]
                cb.join(r, INSERTED)
                seqs[r] += INSERTED
            step += 1
            if not cb.ready:
                continue
            rows, tokens, logps = cb.step()
            for r, t, lp in zip(rows, tokens.tolist(), logps.tolist()):
                sampled[r].append((len(prompts[r]) + len(seqs[r]), lp))
                seqs[r].append(t)
                turn[r] += 1
                if len(seqs[r]) >= budget:
                    cb.finish(r)
                    done.add(r)
                elif turn[r] == 3 + r:
                    cb.leave(r)
                    away[r], turn[r] = step + r % 3 + 1, 0
    return seqs, sampled


def test_rows_that_leave_and_rejoin_see_exactly_their_tokens(model):
    """fp32, 2 layers, <= 90 positions: the cache path and one full forward differ by float reassociation
    (~1e-6); 1e-4 is the agent loop's bound. Capacity 4 for 7 rows: rows wait for a finished row's cache
    row, so cache rows are reused and rows swap places in the decode batch."""
    tok = build_char_tokenizer()
    prompts = _prompts(tok)
    prompts.append(prompts[0])
    engine = BuiltinEngine(model, BuiltinEngineConfig(max_num_seqs=4))
    params = SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_ids=(), seed=1)
    seqs, sampled = _drive(engine, prompts, params)
    worst = 0.0
    for prompt, seq, marks in zip(prompts, seqs, sampled):
        ids = torch.tensor([prompt + seq])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
        for pos, lp in marks:
            worst = max(worst, abs(float(logp[pos - 1, ids[0, pos]]) - lp))
    assert worst < 1e-4
    assert all(INSERTED[0] in s for s in seqs)  # every row was away at least once
    assert seqs[0] != seqs[-1]  # one prompt, two rows, their own draws


def test_greedy_rows_that_never_leave_equal_generate(model):
    """The last row repeats row 0's prompt: its cache row is a copy of row 0's prefill."""
    tok = build_char_tokenizer()
    batch = prompt_batch(tok)
    params = SamplingParams(max_new_tokens=16, do_sample=False, eos_token_ids=())
    engine = BuiltinEngine(model)
    want = engine.generate(batch, params)["responses"].tolist()
    want.append(want[0])
    prompts = _prompts(tok)
    prompts.append(prompts[0])
    got = [[] for _ in prompts]
    with engine.continuous(params, len(prompts), max(map(len, prompts)) + 16) as cb:
        for r, p in enumerate(prompts):
            cb.join(r, p)
        for _ in range(16):
            rows, tokens, _ = cb.step()
            for r, t in zip(rows, tokens.tolist()):
                got[r].append(t)
    assert got == want


def test_a_rows_draws_do_not_depend_on_the_rows_beside_it(model):
    """Counter-based draws: row 2 sampled alone (the others finished at once) and in the full batch."""
    tok = build_char_tokenizer()
    prompts = _prompts(tok)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, eos_token_ids=(), seed=7)
    engine = BuiltinEngine(model)
    runs = []
    for alone in (False, True):
        with engine.continuous(params, len(prompts), max(map(len, prompts)) + 20) as cb:
            for r, p in enumerate(prompts):
                cb.join(r, p)
                if alone and r != 2:
                    cb.finish(r)
            got = []
            for _ in range(20):
                rows, tokens, _ = cb.step()
                got.append(tokens[rows.index(2)].item())
        runs.append(got)
    assert runs[0] == runs[1]


def test_counter_uniforms_are_uniform_and_a_function_of_row_and_position():
    keys = row_keys(3, 200).repeat_interleave(500)
    counters = torch.arange(500).repeat(200)
    u = counter_uniforms(keys, counters)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    # 100k draws: the mean's standard error is 0.29 / sqrt(1e5) ~ 1e-3, each decile's count's ~ 95
    assert abs(float(u.mean()) - 0.5) < 5e-3
    assert (u * 10).long().bincount().sub(10_000).abs().max() < 500
    assert torch.equal(counter_uniforms(keys[:7], counters[:7]), u[:7])
    assert not torch.equal(
        counter_uniforms(row_keys(4, 200).repeat_interleave(500)[:50], counters[:50]), u[:50]
    )
