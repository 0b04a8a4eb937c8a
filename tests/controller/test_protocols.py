"""Every built-in protocol on real worker groups of 2 and 4 ranks (gloo), with odd batch sizes."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta
from hybridflow.controller import shard_indices


def _batch(n: int) -> Batch:
    return Batch(
        {"x": torch.arange(n, dtype=torch.float32)},
        {"uid": [f"s{i}" for i in range(n)]},
        BatchMeta(global_step=7),
    )


def _expected_rank_of_rows(n: int, n_shards: int, collect_ranks: list[int]) -> list[int]:
    """The rank that should have produced each original row (padding dropped)."""
    owner = []
    for s in range(n_shards):
        rows, pad = shard_indices(n, n_shards, s)
        count = (rows.stop - rows.start) if isinstance(rows, slice) else len(rows)
        owner += [collect_ranks[s]] * (count - pad)
    return owner


@pytest.mark.parametrize("n", [1, 5, 7])
def test_dp_proto_splits_pads_and_concatenates(groups, n):
    g = groups["dp"]
    out = g.dp(_batch(n))
    assert len(out) == n
    assert out["y"].tolist() == [2.0 * i for i in range(n)]  # order kept, padding dropped
    assert list(out["uid"]) == [f"s{i}" for i in range(n)]
    assert out.meta == BatchMeta(global_step=7)
    assert out["rank"].tolist() == _expected_rank_of_rows(n, g.world_size, list(range(g.world_size)))
    assert set(out["world"].tolist()) == {g.world_size}  # the all_reduce ran over the whole group


@pytest.mark.parametrize("n", [3, 7])
def test_3d_proto_broadcasts_inside_tp_and_collects_one_rank_per_dp(groups, n):
    g = groups["tp"]  # tp=2, dp=world/2: tp groups are consecutive ranks
    world = g.world_size
    lays = g.layouts("train")
    assert [(lay.dp_rank, lay.tp_rank) for lay in lays] == [(r // 2, r % 2) for r in range(world)]
    out = g.three_d(_batch(n))
    assert out["y"].tolist() == [3.0 * i for i in range(n)]
    collectors = list(range(0, world, 2))  # tp rank 0 of each dp group
    assert out["rank"].tolist() == _expected_rank_of_rows(n, world // 2, collectors)
    seen = g.last_x()  # what each rank received: both ranks of a tp group got the same shard
    for r in range(0, world, 2):
        assert seen[r] == seen[r + 1]
    assert sorted({x for r in collectors for x in seen[r]}) == [float(i) for i in range(n)]


@pytest.mark.parametrize("n", [1, 5])
def test_3d_all_micro_dp_splits_over_generation_replicas(groups, n):
    g = groups["tp"]  # rollout layout: tg=2 strided groups, e.g. [0,2],[1,3] for world 4
    world = g.world_size
    replicas = world // 2
    out = g.micro_dp(_batch(n))
    assert out["y"].tolist() == [3.0 * i for i in range(n)]
    assert out["rank"].tolist() == _expected_rank_of_rows(n, replicas, list(range(replicas)))
    seen = g.last_x()
    for r in range(replicas):  # every rank of replica r saw that replica's prompts
        assert seen[r] == seen[r + replicas]


def test_output_with_k_rows_per_input_row_is_unpadded(groups):
    out = groups["dp"].repeat_rows(_batch(5))
    assert out["x"].tolist() == [float(i) for i in range(5) for _ in range(2)]


def test_one_to_all_all_to_all_rank_zero(groups):
    g = groups["dp"]
    world = g.world_size
    infos = g.info(x="hello")
    assert [i["rank"] for i in infos] == list(range(world)) and all(i["x"] == "hello" for i in infos)
    assert g.per_rank([f"a{r}" for r in range(world)]) == [(r, f"a{r}") for r in range(world)]
    with pytest.raises(ValueError, match="one item per rank"):
        g.per_rank(["only one"] * (world + 1))
    assert g.only_zero() == 0
    assert g.execute_all("only_zero") == list(range(world))


def test_3d_pp_only_collects_one_output_per_stage(groups):
    g = groups["pp"]  # pp=2, tp=1, dp=world/2
    out = g.pp_stage()
    assert [o[0] for o in out] == [0, 1]  # ordered by stage
    assert all(o[1] == 0 and o[2] == 0 for o in out)  # from dp rank 0, tp rank 0
    world = g.world_size
    assert [o[3] for o in out] == [0, world // 2]


@pytest.mark.parametrize("n", [4, 7])
def test_dp_metrics_reduces_per_rank_dicts(groups, n):
    g = groups["dp"]
    world = g.world_size
    m = g.metrics(_batch(n))
    per_rank = []
    for s in range(world):
        rows, _ = shard_indices(n, world, s)
        per_rank.append(torch.arange(n, dtype=torch.float32)[rows])
    assert m["loss"] == pytest.approx(sum(float(t.sum()) for t in per_rank) / world)
    assert m["n/sum"] == sum(len(t) for t in per_rank)  # padded rows are counted
    assert m["rank/max"] == world - 1


def test_user_protocol(groups):
    g = groups["dp"]
    assert g.whoami("t") == f"t:{g.world_size - 1}"


def test_colocated_roles_share_processes_but_not_layouts(groups):
    dp, tp = groups["dp"], groups["tp"]
    assert dp.pids == tp.pids == groups["pp"].pids
    assert [i["pid"] for i in dp.info()] == [i["pid"] for i in tp.info()] == dp.pids
    assert len(set(dp.pids)) == dp.world_size  # but one process per rank
    assert [lay.dp_size for lay in dp.layouts("train")] == [dp.world_size] * dp.world_size
    assert [lay.dp_size for lay in tp.layouts("train")] == [tp.world_size // 2] * tp.world_size
