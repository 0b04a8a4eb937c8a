"""GSM8K / MATH preprocessing on rows the test writes in each dataset's standard format."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from hybridflow.cli import main
from hybridflow.config import DataConfig
from hybridflow.data import build_prompt_dataset
from hybridflow.data.preprocess import extract_gsm8k_answer, last_boxed
from hybridflow.models.tiny import build_char_tokenizer

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day for $2. Revenue?", "answer": "1200*2=2400\n#### 2,400"},
    {"question": "Temperature drops from 2 to -5. Change?", "answer": "-5-2=-7\n#### -7"},
]


def test_answer_extraction():
    assert extract_gsm8k_answer("blah\n#### 1,234") == "1234"
    assert last_boxed(r"so $\boxed{\frac{1}{2}}$ and then \boxed{3}") == "3"
    assert last_boxed(r"the answer is $\boxed{\frac{\sqrt{3}}{2}}$.") == r"\frac{\sqrt{3}}{2}"
    assert last_boxed(r"\fbox{x+1}") == "x+1"
    assert last_boxed(r"it is $\boxed 5$") == "5"
    assert last_boxed("no box") is None and last_boxed(r"\boxed{unbalanced") is None


def test_gsm8k_cli(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    out = tmp_path / "gsm8k" / "train.parquet"
    assert main(["data", "gsm8k", "--input", str(src), "--output", str(out)]) == 0
    assert "wrote 3 rows" in capsys.readouterr().out
    rows = pq.read_table(out).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "2400", "-7"]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["prompt"][0]["role"] == "user"
    assert rows[0]["prompt"][0]["content"].startswith(GSM8K[0]["question"])
    assert '"####"' in rows[0]["prompt"][0]["content"] and rows[2]["extra_info"]["index"] == 2
    # the written file feeds the prompt dataset directly
    ds = build_prompt_dataset(
        DataConfig(train_files=[str(out)], max_prompt_length=512), build_char_tokenizer()
    )
    assert [s.ground_truth for s in ds] == ["7", "2400", "-7"]

    src.write_text(json.dumps(GSM8K[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    assert main(["data", "gsm8k", "--input", str(src), "--output", str(out)]) == 1
    assert f"{src}, row 2: answer has no '#### <number>' line" in capsys.readouterr().err


def test_math_from_problem_dir_and_jsonl(tmp_path, capsys):
    problems = [
        {
            "problem": "What is $1+1$?",
            "solution": r"It is $\boxed{2}$.",
            "level": "Level 1",
            "type": "Algebra",
        },
        {
            "problem": "Simplify $\frac{2}{4}$.",
            "solution": r"$\boxed{\frac{1}{2}}$",
            "level": "Level 2",
            "type": "Algebra",
        },
    ]
    root = tmp_path / "MATH" / "train" / "algebra"
    root.mkdir(parents=True)
    for i, p in enumerate(problems):
        (root / f"{i}.json").write_text(json.dumps(p))
    out = tmp_path / "math.parquet"
    assert main(["data", "math", "--input", str(tmp_path / "MATH"), "--output", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", r"\frac{1}{2}"]
    assert (
        rows[1]["extra_info"]["level"] == "Level 2"
        and rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    )
    assert r"\boxed{}" in rows[0]["prompt"][0]["content"]

    jl = tmp_path / "test.jsonl"
    jl.write_text(json.dumps(problems[0]) + "\n" + json.dumps({"problem": "x", "solution": "no box"}) + "\n")
    assert main(["data", "math", "--input", str(jl), "--output", str(out), "--limit", "1"]) == 0
    assert main(["data", "math", "--input", str(jl), "--output", str(out)]) == 1
    assert f"{jl}, row 2: solution has no \\boxed" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["gsm8k"])
def test_missing_input(kind, tmp_path, capsys):
    assert main(["data", kind, "--output", str(tmp_path / "o.parquet")]) == 2
    assert (
        main(["data", kind, "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o.parquet")])
        == 1
    )
    assert "does not exist" in capsys.readouterr().err


def test_gsm8k_from_hf_snapshot_dir_and_glob(tmp_path, capsys):
    """--input as an HF dataset snapshot folder (main/ and socratic/ configs, train/test shards) or a glob."""
    from hybridflow.data import write_parquet

    snap = tmp_path / "datasets--openai--gsm8k" / "snapshots" / "abc123"
    write_parquet(GSM8K[:2], snap / "main" / "train-00000-of-00002.parquet")
    write_parquet(GSM8K[2:], snap / "main" / "train-00001-of-00002.parquet")
    write_parquet(GSM8K[:1], snap / "main" / "test-00000-of-00001.parquet")
    write_parquet(GSM8K, snap / "socratic" / "train-00000-of-00001.parquet")
    (snap / ".cache").mkdir()
    (snap / ".cache" / "x.json").write_text("{}")
    for split, truths in (("train", ["7", "2400", "-7"]), ("test", ["7"])):
        out = tmp_path / f"{split}.parquet"
        assert main(["data", "gsm8k", "--input", str(snap), "--split", split, "--output", str(out)]) == 0
        rows = pq.read_table(out).to_pylist()
        assert [r["reward_model"]["ground_truth"] for r in rows] == truths  # main/ only, shards in order
        assert rows[0]["extra_info"]["split"] == split
    out = tmp_path / "glob.parquet"
    assert main(["data", "gsm8k", "--input", str(snap / "socratic" / "*.parquet"), "--output", str(out)]) == 0
    assert len(pq.read_table(out)) == 3
    capsys.readouterr()
    assert main(["data", "gsm8k", "--input", str(tmp_path / "none-*.parquet"), "--output", str(out)]) == 1
    assert "no .parquet/.jsonl/.json files match" in capsys.readouterr().err
