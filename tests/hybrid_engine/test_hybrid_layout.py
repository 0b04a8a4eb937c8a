"""Pure layout, plan and cost checks of the 3D-HybridEngine (no processes)."""

from __future__ import annotations

import itertools

import pytest

from hybridflow.hybrid_engine import (
    GenLayout,
    LlamaShape,
    TrainLayout,
    llama_param_specs,
    paper_table,
    switch_cost,
)
from hybridflow.hybrid_engine.sharding import split_bytes
from hybridflow.hybrid_engine.switch import expected_bytes_received, switch_plan

# the "medium" tiny model's shape (25M params) with a vocab divisible by 16
MEDIUM = LlamaShape(
    vocab_size=128, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=1536
)


def layouts(max_world: int = 16):
    for p, t, d in itertools.product((1, 2, 4), (1, 2, 4, 8), (1, 2)):
        if p * t * d > max_world:
            continue
        for pg, tg in itertools.product((1, 2, 4), (1, 2, 4, 8)):
            if p % pg == 0 and t % tg == 0:
                yield TrainLayout(p, t, d), pg, tg


def test_spec_example_groups():
    train = TrainLayout(p=1, t=4, d=2)
    assert train.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    hf = GenLayout(train, pg=1, tg=2)
    assert hf.dg == 2 and hf.num_replicas == 4
    assert hf.tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hf.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # rank 0 holds training shard 0 of 4; its generation shard 0 of 2 is training shards 0-1
    assert hf.needed_pieces(0) == (range(0, 1), range(0, 2))
    van = GenLayout(train, pg=1, tg=2, style="vanilla")
    assert van.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert van.micro_dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert van.needed_pieces(1) == (range(0, 1), range(2, 4))  # rank 1 holds piece 1: not part of it


@pytest.mark.parametrize("style", ["hybridflow", "vanilla"])
def test_groups_partition_ranks(style):
    for train, pg, tg in layouts():
        gen = GenLayout(train, pg, tg, style)
        n = train.world_size
        for groups, size in ((gen.tp_groups(), tg), (gen.pp_groups(), pg), (gen.micro_dp_groups(), gen.dg)):
            assert sorted(r for g in groups for r in g) == list(range(n))
            assert all(len(g) == size for g in groups)
        assert len(gen.replica_groups()) == train.d * gen.dg == gen.num_replicas
        assert gen.pg * gen.tg * gen.dg * train.d == n


def test_hybridflow_micro_dp_group_holds_exactly_the_generation_shard():
    """The invariant the zero-redundancy switch rests on; vanilla grouping breaks it."""
    broken = 0
    for train, pg, tg in layouts():
        for style in ("hybridflow", "vanilla"):
            gen = GenLayout(train, pg, tg, style)
            for group in gen.micro_dp_groups():
                held = {train.coords(r)[1:] for r in group}
                for r in group:
                    stages, pieces = gen.needed_pieces(r)
                    need = set(itertools.product(stages, pieces))
                    if style == "hybridflow":
                        assert train.coords(r)[1:] in need and held == need
                    else:
                        broken += train.coords(r)[1:] not in need
    assert broken > 0


def test_replica_slices_cover_the_batch_and_collect_one_rank_per_replica():
    gen = GenLayout(TrainLayout(2, 2, 2), pg=1, tg=2)
    for batch in (3, 8, 13):
        rows = [gen.replica_slice(r, batch) for r in gen.collect_ranks()]
        assert [i for s in rows for i in range(batch)[s]] == list(range(batch))
        for group in gen.replica_groups():  # every rank of a replica gets the same prompts
            assert (
                len({(gen.replica_slice(r, batch).start, gen.replica_slice(r, batch).stop) for r in group})
                == 1
            )


def test_bad_layouts_are_rejected_with_a_hint():
    with pytest.raises(ValueError, match="tg=3 must divide training t=4"):
        GenLayout(TrainLayout(1, 4, 1), pg=1, tg=3)
    with pytest.raises(ValueError, match="pg=2 must divide training p=1"):
        GenLayout(TrainLayout(1, 4, 1), pg=2, tg=1)
    with pytest.raises(ValueError, match="does not divide"):
        LlamaShape(96, 64, 2, 4, 2, 128).check_tp(4, "training t")


def test_plan_bytes_equal_paper_formula():
    """Bytes per rank from the gather plans (what the counters count) vs Table 2, for many layouts.

    With one pipeline stage per micro-DP group the plan moves exactly the formula on the TP-split weights
    M_s (the norms never travel); across stages it adds the norms and bucket padding, a sliver of M.
    """
    m_split, m_rep = split_bytes(llama_param_specs(MEDIUM, 1), 4)
    m = m_split + m_rep
    for train, pg, tg in layouts():
        specs = llama_param_specs(MEDIUM, train.p)
        for method in ("hybridflow", "allgather", "vanilla", "two_copy"):
            gen = GenLayout(train, pg, tg, "vanilla" if method == "vanilla" else "hybridflow")
            rank = train.world_size - 1  # not the two_copy source (unless alone)
            if method == "two_copy" and rank == 0:
                continue
            got = expected_bytes_received(method, switch_plan(method, gen, specs, rank, 1 << 40), rank, 4)
            want = switch_cost(method, m, train.p, train.t, train.d, pg, tg).comm_bytes
            exact = switch_cost(method, m_split, train.p, train.t, train.d, pg, tg).comm_bytes
            if train.p == 1:
                assert got == exact, (train, pg, tg, method)
            assert abs(got - want) <= 0.01 * m, (train, pg, tg, method, got, want)


def test_paper_table_70b():
    c = {m: switch_cost(m, 140e9, p=8, t=8, d=2, pg=1, tg=8) for m in ("hybridflow", "allgather", "vanilla")}
    assert c["hybridflow"].comm_bytes == pytest.approx(15.3e9, rel=0.01)
    assert c["allgather"].comm_bytes == pytest.approx(138.9e9, rel=0.01)
    assert c["hybridflow"].peak_bytes == pytest.approx(140e9 / 8) and c["hybridflow"].redundant_bytes == 0
    assert c["vanilla"].comm_bytes == pytest.approx(63 / 64 * 140e9)
    table = paper_table()
    assert "| 70B | 8-8-2 | 1-8-8 | 15.3 / 17.5 | 138.9 / 140.0 |" in table and table.count("\n") == 5
