"""BatchMeta's rules under every Batch operation, its JSON round trip and its pickling (hybridflow/batch_meta.py)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta, Rule
from hybridflow.trainers.sources.base import load_batch, save_batch


def _rows(n: int, **meta) -> Batch:
    return Batch({"x": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]}, BatchMeta(**meta))


def test_every_field_declares_its_rule_and_help():
    for f in dataclasses.fields(BatchMeta):
        assert isinstance(f.metadata["rule"], Rule) and f.metadata["help"], f.name


def test_a_dict_is_no_meta():
    with pytest.raises(TypeError, match="BatchMeta"):
        Batch({"x": torch.zeros(2)}, {}, {"global_step": 1})


# ---- SAME: one value for every row -------------------------------------------------------------
def test_same_fields_survive_split_index_repeat_and_concat():
    b = _rows(5, global_step=3, temperature=0.7, old_log_probs_source="actor")
    parts = b.split(2)
    assert [p.meta.global_step for p in parts] == [3, 3, 3]
    assert b.index([4, 1]).meta.temperature == 0.7 and b.repeat(2).meta.old_log_probs_source == "actor"
    assert Batch.concat(parts).meta == b.meta


def test_concat_of_disagreeing_same_fields_names_the_field_and_the_values():
    with pytest.raises(ValueError, match=r"concat: batches disagree on meta.temperature \(0.7 vs 1.0\)"):
        Batch.concat([_rows(2, temperature=0.7), _rows(2, temperature=1.0)])
    with pytest.raises(ValueError, match=r"union: batches disagree on meta.global_step \(1 vs 2\)"):
        _rows(2, global_step=1).union(Batch({"y": torch.zeros(2)}, {}, BatchMeta(global_step=2)))


def test_an_unset_same_field_takes_the_other_sides_value():
    """A phase's output (no meta) joined to the rollout keeps the rollout's; so does concat."""
    out = _rows(2, temperature=0.7, global_step=4).union(Batch({"lp": torch.zeros(2)}))
    assert (out.meta.temperature, out.meta.global_step) == (0.7, 4)
    out = Batch.concat([_rows(1), _rows(2, pairs=True)])
    assert out.meta.pairs is True and out.meta.temperature is None


# ---- PEAK: per-call figures, merged by max -----------------------------------------------------
def test_metrics_merge_by_max_per_name():
    a = _rows(2, rollout_metrics={"rollout/engine_figure": 1.0, "only_a": 5.0})
    b = _rows(3, rollout_metrics={"rollout/engine_figure": 2.0}, reshard_metrics={"reshard/bytes": 8.0})
    out = Batch.concat([a, b])
    assert out.meta.rollout_metrics == {"rollout/engine_figure": 2.0, "only_a": 5.0}
    assert out.meta.reshard_metrics == {"reshard/bytes": 8.0}
    assert a.union(_rows(2, rollout_metrics={"only_a": 3.0})).meta.rollout_metrics["only_a"] == 5.0
    assert a.meta.rollout_metrics == {"rollout/engine_figure": 1.0, "only_a": 5.0}  # inputs untouched


def test_parts_do_not_share_their_metrics():
    first, second = _rows(4, rollout_metrics={"m": 1.0}).split(2)
    first.meta.rollout_metrics["m"] = 9.0
    assert second.meta.rollout_metrics == {"m": 1.0}


def test_pop_metrics_takes_both_off():
    m = BatchMeta(rollout_metrics={"rollout/engine_figure": 2.0}, reshard_metrics={"reshard/bytes": 8.0})
    assert m.pop_metrics() == {"rollout/engine_figure": 2.0, "reshard/bytes": 8.0}
    assert m.rollout_metrics == {} and m.reshard_metrics == {}


# ---- PADDING: follows the rows -------------------------------------------------------------------
def test_padding_follows_split_concat_and_repeat():
    b = _rows(5, pad_rows=2)  # rows 3 and 4 are padding
    parts = b.split(2)  # [0, 1] [2, 3] [4]
    assert [p.meta.pad_rows for p in parts] == [0, 1, 1]
    assert Batch.concat(parts).meta.pad_rows == 2
    assert b.index(slice(1, 4)).meta.pad_rows == 1 and b.index([0, 1]).meta.pad_rows == 0
    assert b.repeat(3).meta.pad_rows == 6  # a,a,a,b,b,b: the copies of padding rows stay last


def test_padding_never_lands_before_real_rows():
    b = _rows(5, pad_rows=2)
    with pytest.raises(ValueError, match="index: the selection puts some of the 2 padding rows before real"):
        b.index([4, 0])
    with pytest.raises(ValueError, match="concat: part 0 ends in 2 padding rows but a later part holds real"):
        Batch.concat([b, _rows(1)])
    with pytest.raises(ValueError, match="repeat: a,b,a,b order"):
        b.repeat(2, interleave=False)
    with pytest.raises(ValueError, match=r"union: pad_rows differ \(2 vs 1\)"):
        b.union(Batch({"y": torch.zeros(5)}, {}, BatchMeta(pad_rows=1)))
    assert b.union(Batch({"y": torch.zeros(5)})).meta.pad_rows == 2  # a part made without the padding


def test_pad_to_divisor_counts_every_padding_row():
    b = _rows(3).pad_to_divisor(2)
    assert b["x"].tolist() == [0, 1, 2, 0] and b.meta.pad_rows == 1
    b = b.pad_to_divisor(3)  # already padded: the new filler copies rows 0, 1 (real ones) and stays last
    assert b["x"].tolist() == [0, 1, 2, 0, 0, 1] and b.meta.pad_rows == 3


# ---- CALL: one producer's note to the driver -----------------------------------------------------
def test_call_info_is_kept_by_selection_and_refused_by_joins():
    b = _rows(4, call_info={"rows": 4})
    assert b.index(slice(0, 3)).meta.call_info == {"rows": 4}
    with pytest.raises(ValueError, match="concat: a batch still carries meta.call_info"):
        Batch.concat([b, _rows(1)])
    with pytest.raises(ValueError, match="union: a batch still carries meta.call_info"):
        _rows(4).union(b)


# ---- serialisation -------------------------------------------------------------------------------
_FULL = BatchMeta(
    global_step=7, temperature=0.7, rollout_log_probs_exact=False, old_log_probs_source="update", pairs=True,
    rollout_metrics={"rollout/engine_figure": 2.0}, reshard_metrics={"reshard/bytes": 8.0}, pad_rows=1,
    call_info={"actor/kl": 0.5},
)  # fmt: skip


def test_json_round_trip_of_every_field(tmp_path):
    assert BatchMeta.from_dict(json.loads(json.dumps(_FULL.to_dict()))) == _FULL
    b = Batch({"x": torch.arange(3.0)}, {"uid": ["a", "b", "c"]}, _FULL.copy())
    save_batch(b, tmp_path / "pending")  # the rollout-ahead checkpoint's batch in flight (InFlight)
    back = load_batch(tmp_path / "pending")
    assert (
        back.meta == _FULL and back["x"].tolist() == [0.0, 1.0, 2.0] and list(back["uid"]) == ["a", "b", "c"]
    )


def test_reads_the_string_keys_of_older_checkpoints():
    old = {"global_step": 3, "epoch": 0, "batch_in_epoch": 1, "pairs": "interleaved", "temperature": 0.7}
    assert BatchMeta.from_dict(old) == BatchMeta(global_step=3, pairs=True, temperature=0.7)
    with pytest.raises(ValueError, match=r"unknown fields \['colour'\]"):
        BatchMeta.from_dict({"colour": "red"})


def test_pickling_keeps_the_meta_and_sends_tensors_out_of_band():
    """What Ray does with a Batch (pickle protocol 5 with a buffer callback): the tensors' bytes leave the
    pickle as buffers (zero-copy from the object store), the meta travels in the small in-band part."""
    b = Batch(
        {"x": torch.arange(1 << 18, dtype=torch.float32), "h": torch.ones(1 << 18, dtype=torch.bfloat16)}
    )
    b.meta = _FULL.copy()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2 and sum(memoryview(x).nbytes for x in buffers) == b.nbytes() == 3 << 19
    assert len(data) < 4096, len(data)  # 1.5 MB of tensors, a few hundred bytes of pickle
    back = pickle.loads(data, buffers=buffers)
    assert back.meta == _FULL and back.meta is not b.meta
    assert (
        torch.equal(back["x"], b["x"])
        and back["h"].dtype == torch.bfloat16
        and torch.equal(back["h"], b["h"])
    )
