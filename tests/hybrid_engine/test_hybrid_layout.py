"""Pure layout and cost checks of the 3D-HybridEngine (no processes)."""

from __future__ import annotations

import itertools

import pytest

from hybridflow.config.schema import ParallelConfig
from hybridflow.hybrid_engine import (
    GenLayout,
    TrainLayout,
    fsdp_switch_cost,
    generation_layout_errors,
    paper_table,
    pipeline_switch_cost,
    switch_cost,
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


def test_generation_layout_errors_name_the_clashing_numbers(tmp_path):
    from hybridflow.models.tiny import save_tiny_model

    model = str(save_tiny_model(tmp_path / "m", size="tiny", arch="llama"))  # 4 heads, 2 kv heads
    assert generation_layout_errors(ParallelConfig(tp=4), 2, 1, model) == []
    assert generation_layout_errors(ParallelConfig(tp=4), 3, 1, model) == [
        "rollout.tg = 3 must divide actor.parallel.tp = 4 (try tg in [1, 2, 4])"
    ]
    assert generation_layout_errors(ParallelConfig(tp=4), 4, 1, model) == [
        "rollout.tg = 4 must divide the model's num_attention_heads = 4 and num_key_value_heads = 2"
    ]
    errs = generation_layout_errors(ParallelConfig(tp=2, pp=2), 1, 2, None, "allgather")
    assert errs[0].startswith("rollout.reshard = allgather with actor.parallel.pp > 1")
    assert [e.split(":")[0] for e in errs[1:]] == ["rollout.pg = 2"]
    for tp, tg in ((1, 1), (2, 1), (2, 2)):  # what pipeline stages run: pg = 1, tg dividing tp
        assert generation_layout_errors(ParallelConfig(pp=2, tp=tp), tg, 1, model) == []
    assert "not 'gpt2'" in generation_layout_errors(ParallelConfig(pp=2), 1, 1, gpt2 := _gpt2(tmp_path))[0]
    assert (
        "model_type 'gpt2' generates on the HF forward"
        in generation_layout_errors(ParallelConfig(tp=2), 1, 1, gpt2)[0]
    )


def test_pipeline_switch_cost_hand_computed():
    """p = 2 stages of (split, whole, vocab) bytes: stage 0 (800, 40, 32), stage 1 (800, 48, 32);
    t = 4, d = 2, tg = 2. Own stage as fsdp_switch_cost's hybridflow row, then the other stage's
    generation shard S/tg + W - V + V/tg whole."""
    stages = [(800, 40, 32), (800, 48, 32)]
    held0, held1 = 400 + 8 + 16, 400 + 16 + 16
    assert pipeline_switch_cost(stages, 0, 4, 2, 2) == (320 + held1, held0 + held1)
    assert pipeline_switch_cost(stages, 1, 4, 2, 2) == (120 + 4 + 400 - 200 + held0, held0 + held1)
    # t = tg = 1 (everything whole): (d-1)/d M_s + M - M_s, the whole model held
    assert pipeline_switch_cost([(0, 40, 0), (0, 60, 0)], 0, 1, 2, 1) == (20 + 60, 100)
    # an even cut, W = 0, d = 1: Table 2's hybridflow row (dg-1)/(pt) M, dg = pt/tg
    m, p, t, tg = 1600, 2, 4, 2
    got = pipeline_switch_cost([(m // p, 0, 0)] * p, 1, t, 1, tg)[0]
    assert got == switch_cost("hybridflow", m, p, t, 1, 1, tg).comm_bytes == (p * t // tg - 1) * m / (p * t)


def test_fsdp_switch_cost_hand_computed():
    """t = 4, d = 2, tg = 2; split weights S = 800 bytes, whole weights W = 40 bytes (docs/hybrid_engine.md).
    Between steps a rank holds S/8 + W/2; FSDP's all-gather receives S/8 + W/2 = 120."""
    s, w = 800, 40
    assert fsdp_switch_cost("hybridflow", s, w, 4, 2, 2) == (120 + 400 - 200, 400 + 40)  # + S/tg - S/t
    assert fsdp_switch_cost("allgather", s, w, 4, 2, 2) == (120 + 800 - 200, 840)  # + S - S/t; M held
    assert fsdp_switch_cost("vanilla", s, w, 4, 2, 2) == (120 + 800 - 200, 840)
    assert fsdp_switch_cost("two_copy", s, w, 4, 2, 2) == (120 + 840, 440)  # + a full weight broadcast
    # the paper's rows for the TP-split part with d = 1: HybridFlow (dg-1)/t M, all-gather (t-1)/t M
    assert (
        fsdp_switch_cost("hybridflow", s, 0, 4, 1, 2)[0]
        == switch_cost("hybridflow", s, 1, 4, 1, 1, 2).comm_bytes
    )
    assert (
        fsdp_switch_cost("allgather", s, 0, 4, 1, 2)[0]
        == switch_cost("allgather", s, 1, 4, 1, 1, 2).comm_bytes
    )
    assert fsdp_switch_cost("hybridflow", s, w, 1, 1, 1) == (0, 840)  # one rank: nothing moves
    # 32 of W's 40 bytes are embeddings / lm_head, split over the vocabulary in generation: held
    # S/tg + (W - V) + V/tg = 400 + 8 + 16; the bytes moved do not change (each rank slices its rows)
    assert fsdp_switch_cost("hybridflow", s, w, 4, 2, 2, vocab_bytes=32) == (320, 424)
    assert fsdp_switch_cost("two_copy", s, w, 4, 2, 2, vocab_bytes=32) == (960, 424)
    assert fsdp_switch_cost("allgather", s, w, 4, 2, 2, vocab_bytes=32) == (720, 840)  # holds M anyway
    with pytest.raises(ValueError, match="tg=3 must divide training t=4"):
        fsdp_switch_cost("hybridflow", s, w, 4, 1, 3)


def test_paper_table_70b():
    c = {m: switch_cost(m, 140e9, p=8, t=8, d=2, pg=1, tg=8) for m in ("hybridflow", "allgather", "vanilla")}
    assert c["hybridflow"].comm_bytes == pytest.approx(15.3e9, rel=0.01)
    assert c["allgather"].comm_bytes == pytest.approx(138.9e9, rel=0.01)
    assert c["hybridflow"].peak_bytes == pytest.approx(140e9 / 8) and c["hybridflow"].redundant_bytes == 0
    assert c["vanilla"].comm_bytes == pytest.approx(63 / 64 * 140e9)
    table = paper_table()
    assert "| 70B | 8-8-2 | 1-8-8 | 15.3 / 17.5 | 138.9 / 140.0 |" in table and table.count("\n") == 5


def _gpt2(tmp_path) -> str:
    from hybridflow.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path / "g", size="tiny", arch="gpt2"))
