"""Datasets: malformed rows (file + row), truncation/filter counts, exact loader resume, SFT/DPO layout."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.config import DataConfig
from hybridflow.data import (
    DatasetError,
    PromptDataset,
    StatefulDataLoader,
    build_pair_dataset,
    build_prompt_dataset,
    get_dataset,
    write_parquet,
)
from hybridflow.data.prompts import iter_records
from hybridflow.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _row(q: str, gt: str, source: str = "toy") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": q}],
        "reward_model": {"ground_truth": gt},
    }


def test_jsonl_and_parquet_same_samples(tmp_path, tok):
    rows = [_row("1+1=", "2"), {"prompt": "2+2=", "ground_truth": 4, "extra_info": {"k": 1}}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    write_parquet([_row("1+1=", "2"), _row("2+2=", "4", "unknown")], tmp_path / "a.parquet")
    a = build_prompt_dataset(DataConfig(train_files=[str(tmp_path / "a.jsonl")]), tok)
    b = build_prompt_dataset(DataConfig(train_files=[str(tmp_path / "a.parquet")]), tok)
    assert [s.input_ids for s in a] == [s.input_ids for s in b]
    assert a[0].prompt_text == "<|user|>1+1=<|assistant|>"  # the tokenizer's chat template
    assert tok.decode(a[0].input_ids) == a[0].prompt_text
    assert [s.ground_truth for s in a] == ["2", "4"] and a[1].data_source == "unknown"
    assert a[1].extra_info == {"k": 1}
    raw = build_prompt_dataset(
        DataConfig(train_files=[str(tmp_path / "a.jsonl")], apply_chat_template=False), tok
    )
    assert raw[0].prompt_text == "1+1="


def test_trl_style_rows_answer_and_columns(tmp_path, tok):
    """{prompt, answer, ...} rows: `answer` is the ground truth, every other column joins extra_info (where a
    TRL-convention reward reads it); verl's own columns stay where they are."""
    rows = [
        {"prompt": "1+1=", "answer": 2, "level": "easy"},
        {"prompt": "2+2=", "solution": "4"},
        {**_row("3+3=", "6"), "ability": "math", "answer": "x", "extra_info": {"answer": "kept"}},
    ]
    (tmp_path / "trl.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    a = build_prompt_dataset(DataConfig(train_files=[str(tmp_path / "trl.jsonl")]), tok)
    assert [s.ground_truth for s in a] == ["2", "4", "6"]  # reward_model.ground_truth wins in verl rows
    assert a[0].extra_info == {"answer": 2, "level": "easy"} and a[1].extra_info == {"solution": "4"}
    assert a[2].extra_info == {"answer": "kept"}  # extra_info's own key is not overwritten; ability stays out
    assert a.reward_columns() == {"ground_truth", "data_source", "answer", "level", "solution"}


def test_malformed_rows_name_file_and_row(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(_row("1+1=", "2")),
        "{not json",
        json.dumps({"data_source": "x"}),
        "",
        json.dumps({"prompt": [{"role": "user"}]}),
        json.dumps({"prompt": "3+3=", "reward_model": "6"}),
        json.dumps(_row("2+2=", "4")),
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as e:
        build_prompt_dataset(DataConfig(train_files=[str(path)]), tok)
    msg = str(e.value)
    assert "4 malformed row(s)" in msg
    assert f"{path}, row 2: not valid JSON" in msg
    assert f"{path}, row 3: missing 'prompt' column" in msg
    assert f"{path}, row 5: 'prompt'[0] is not a" in msg  # row numbers are line numbers (blank line 4)
    assert f"{path}, row 6: 'reward_model' must be a mapping" in msg
    ds = build_prompt_dataset(DataConfig(train_files=[str(path)], on_malformed="skip"), tok)
    assert len(ds) == 2 and ds.stats["malformed"] == 4 and ds.stats["rows"] == 6


def test_truncation_and_filter_counts(tmp_path, tok, caplog):
    # chat template adds 2 tokens: "<|user|>" + text + "<|assistant|>"
    rows = [_row("1+1=", "2"), _row("12345+1=", "x"), _row("123456789+1=", "y")]
    write_parquet(rows, tmp_path / "p.parquet")
    files = [str(tmp_path / "p.parquet")]
    lengths = [len(s.input_ids) for s in build_prompt_dataset(DataConfig(train_files=files), tok)]
    assert lengths == [6, 10, 14]
    with pytest.raises(DatasetError, match=r"p.parquet, row 2: prompt: 10 tokens exceed the limit of 8"):
        build_prompt_dataset(DataConfig(train_files=files, max_prompt_length=8), tok)
    with caplog.at_level("WARNING", logger="hybridflow.data"):
        ds = build_prompt_dataset(
            DataConfig(train_files=files, max_prompt_length=8, truncation="filter"), tok
        )
    assert len(ds) == 1 and ds.stats["filtered"] == 2
    assert "2 filtered (over 8 tokens)" in caplog.text
    left = build_prompt_dataset(DataConfig(train_files=files, max_prompt_length=8, truncation="left"), tok)
    assert left.stats["truncated"] == 2 and [len(s.input_ids) for s in left] == [6, 8, 8]
    assert left[2].prompt_text == "6789+1=<|assistant|>"  # left truncation keeps the generation prompt
    right = build_prompt_dataset(DataConfig(train_files=files, max_prompt_length=8, truncation="right"), tok)
    assert right[1].prompt_text == "<|user|>12345+1"


def test_batch_layout(tok):
    rows = [_row("1+1=", "2"), _row("10+10=", "20")]
    ds = PromptDataset.from_records([("mem", i, r) for i, r in enumerate(rows, 1)], tok)
    b = ds.collate([ds[0], ds[1]], epoch=3)
    ids, mask, pos = b["input_ids"], b["attention_mask"], b["position_ids"]
    assert ids.shape == (2, 8) and ids[0, :2].tolist() == [tok.pad_token_id] * 2  # left-padded
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]
    assert pos.tolist() == [[0, 0, 0, 1, 2, 3, 4, 5], list(range(8))]
    assert list(b["uid"]) == ["3-0", "3-1"] and list(b["ground_truth"]) == ["2", "20"]


def test_loader_resume_is_exact(tok):
    ds = build_prompt_dataset(
        DataConfig(dataset="synthetic:arithmetic", dataset_kwargs={"num_samples": 30}), tok
    )
    ref = StatefulDataLoader(ds, 4, seed=7)
    assert len(ref) == 7
    full = [list(ref.next_batch()["index"]) for _ in range(20)]  # crosses two epoch boundaries
    assert sorted(i for b in full[:7] for i in b) == sorted(set(i for b in full[:7] for i in b))  # no repeats
    assert full[:7] != full[7:14]  # a fresh shuffle each epoch
    for k in (0, 3, 7, 9):
        a = StatefulDataLoader(ds, 4, seed=7)
        for _ in range(k):
            a.next_batch()
        b = StatefulDataLoader(ds, 4, seed=7)
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # survives JSON (checkpoints)
        assert [list(b.next_batch()["index"]) for _ in range(20 - k)] == full[k:]
    epoch = StatefulDataLoader(ds, 4, seed=7)
    assert [list(x["index"]) for x in epoch] == full[:7] and epoch.epoch == 0
    assert [list(x["index"]) for x in epoch] == full[7:14] and epoch.epoch == 1
    with pytest.raises(ValueError, match="batch_size=4, this run has 5"):
        StatefulDataLoader(ds, 5).load_state_dict(a.state_dict())


def test_synthetic_arithmetic_splits():
    build = get_dataset("synthetic:arithmetic")
    train = build("train", seed=0, num_samples=0, val_size=20, max_operand=9)
    val = build("val", seed=0, num_samples=0, val_size=20, max_operand=9)
    assert len(train) == 80 and len(val) == 20
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert not prompts(train) & prompts(val)
    for r in train:
        a, b = r["prompt"][0]["content"].rstrip("=").split("+")
        assert int(r["reward_model"]["ground_truth"]) == int(a) + int(b)
    assert build("train", seed=0, num_samples=50) == build("train", seed=0, num_samples=50)
    assert build("train", seed=1, num_samples=50) != build("train", seed=0, num_samples=50)
    with pytest.raises(DatasetError, match="did you mean 'synthetic:arithmetic'"):
        get_dataset("synthetic:arithmetc")


def test_sft_and_dpo_batches(tok):
    cfg = DataConfig(dataset="synthetic:arithmetic_dpo", dataset_kwargs={"num_samples": 8})
    dpo = build_pair_dataset(cfg, tok, "dpo")
    b = StatefulDataLoader(dpo, 2, shuffle=False).next_batch()
    assert len(b) == 4 and b.meta.pairs is True
    assert b["uid"][0] == b["uid"][1] != b["uid"][2]
    assert torch.equal(b["prompts"][0], b["prompts"][1])
    rows = get_dataset("synthetic:arithmetic_dpo")("train", seed=1, num_samples=8)
    chosen = tok.decode(b["responses"][0][b["response_mask"][0].bool()].tolist())
    rejected = tok.decode(b["responses"][1][b["response_mask"][1].bool()].tolist())
    assert chosen == rows[0]["chosen"] + "<eos>" and rejected == rows[0]["rejected"] + "<eos>"
    assert chosen != rejected
    Lp = b["prompts"].shape[1]
    assert torch.equal(b["input_ids"][:, Lp:], b["responses"]) and torch.equal(
        b["attention_mask"][:, Lp:], b["response_mask"]
    )
    sft = build_pair_dataset(DataConfig(dataset="synthetic:arithmetic_sft"), tok, "sft")
    s = sft.collate([sft[0]])
    sft_rows = get_dataset("synthetic:arithmetic_sft")("train", seed=1)
    assert tok.decode(s["responses"][0].tolist()) == sft_rows[0]["response"] + "<eos>"
    assert s["response_mask"].sum().item() == len(sft[0].responses[0])


def test_sft_max_length_caps_prompt_plus_response(tok):
    """algorithm.sft.max_length: each response gets what its prompt leaves of the cap (cut per
    data.truncation, or dropped with filter)."""
    full = build_pair_dataset(DataConfig(dataset="synthetic:arithmetic_sft"), tok, "sft")
    p, r = len(full[0].prompt_ids), len(full[0].responses[0])
    assert r >= 3
    cut = build_pair_dataset(
        DataConfig(dataset="synthetic:arithmetic_sft", truncation="right"), tok, "sft", max_length=p + 2
    )
    assert cut[0].prompt_ids == full[0].prompt_ids and cut[0].responses[0] == full[0].responses[0][:2]
    assert all(
        len(s.prompt_ids) + len(s.responses[0]) <= p + 2 for s in cut.samples if len(s.prompt_ids) == p
    )
    assert cut.stats["truncated"] >= 1
    with pytest.raises(ValueError, match="response"):
        build_pair_dataset(DataConfig(dataset="synthetic:arithmetic_sft"), tok, "sft", max_length=p + 2)


def test_iter_records_rejects_unknown_suffix(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        list(iter_records([tmp_path / "x.csv"]))


def test_missing_ground_truth_is_an_error_or_counted_and_warned(tmp_path, tok, caplog):
    path = tmp_path / "gt.jsonl"
    rows = [_row("1+1=", "2"), {"prompt": "2+2="}, {"prompt": "3+3=", "reward_model": {"style": "rule"}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"(?s)2 malformed row\(s\).*gt.jsonl, row 2: no ground truth"):
        build_prompt_dataset(DataConfig(train_files=[str(path)]), tok)
    skipped = build_prompt_dataset(DataConfig(train_files=[str(path)], on_malformed="skip"), tok)
    assert [s.ground_truth for s in skipped] == ["2"]
    with caplog.at_level("WARNING", logger="hybridflow.data"):
        warned = build_prompt_dataset(DataConfig(train_files=[str(path)], missing_ground_truth="warn"), tok)
    assert [s.ground_truth for s in warned] == ["2", None, None] and warned.stats["no_ground_truth"] == 2
    assert "2 of 3 rows have no ground truth (first: " in caplog.text and "gt.jsonl, row 2" in caplog.text
    # a reward model needs none: the trainer passes need_ground_truth=False and nothing is said
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybridflow.data"):
        quiet = build_prompt_dataset(DataConfig(train_files=[str(path)]), tok, need_ground_truth=False)
    assert len(quiet) == 3 and "ground truth" not in caplog.text


def test_non_utf8_rows_and_unreadable_files(tmp_path, tok):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        json.dumps(_row("1+1=", "2")).encode() + b"\n" + '{"prompt": "caf\u00e9"}'.encode("latin-1") + b"\n"
    )
    with pytest.raises(DatasetError, match=r"mixed.jsonl, row 2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        build_prompt_dataset(DataConfig(train_files=[str(path)]), tok)
    ds = build_prompt_dataset(DataConfig(train_files=[str(path)], on_malformed="skip"), tok)
    assert len(ds) == 1 and ds.stats["malformed"] == 1
    (tmp_path / "whole.json").write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(DatasetError, match="whole.json: not UTF-8 text"):
        list(iter_records([tmp_path / "whole.json"]))
    (tmp_path / "t.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="t.parquet: not a readable Parquet file"):
        list(iter_records([tmp_path / "t.parquet"]))


def test_rows_nested_past_the_json_readers_limit_are_malformed_rows(tmp_path, tok):
    """Python's JSON reader recurses per level: a row nested 200,000 deep is a malformed row, not a RecursionError."""
    deep = "[" * 200_000 + "]" * 200_000
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(_row("1+1=", "2")) + "\n" + '{"prompt": ' + deep + "}\n")
    with pytest.raises(DatasetError, match=r"deep.jsonl, row 2: nested deeper than a JSON reader can follow"):
        build_prompt_dataset(DataConfig(train_files=[str(path)]), tok)
    ds = build_prompt_dataset(DataConfig(train_files=[str(path)], on_malformed="skip"), tok)
    assert len(ds) == 1 and ds.stats["malformed"] == 1
    (tmp_path / "whole.json").write_text("[" + deep + "]")
    with pytest.raises(DatasetError, match="whole.json: nested deeper than a JSON reader can follow"):
        list(iter_records([tmp_path / "whole.json"]))


def test_registered_dataset_arguments_are_checked():
    from hybridflow.data.registry import build_rows

    assert len(build_rows("synthetic:arithmetic", "train", 0, {"num_samples": 10, "val_size": 2})) == 10
    with pytest.raises(
        DatasetError, match="takes no argument 'num_sample' \\(did you mean 'num_samples'\\?\\)"
    ):
        build_rows("synthetic:arithmetic", "train", 0, {"num_sample": 10})
    with pytest.raises(DatasetError, match="data.dataset_kwargs: 'synthetic:arithmetic' with"):
        build_rows("synthetic:arithmetic", "train", 0, {"num_samples": "ten"})
