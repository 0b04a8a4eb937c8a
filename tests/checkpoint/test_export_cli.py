"""`hybridflow export` refusing a non-empty output names its own flag, --overwrite, and then replaces it."""

from __future__ import annotations

from ckpt_helpers import engine_config

from hybridflow.checkpoint import CheckpointManager, save_engine_state
from hybridflow.cli import main as cli_main
from hybridflow.engines import TrainEngine
from hybridflow.models import load_causal_lm, load_tokenizer


def test_a_non_empty_output_is_refused_naming_the_flag(tiny_model_dir, tmp_path, capsys):
    engine = TrainEngine(load_causal_lm(tiny_model_dir), engine_config())
    with CheckpointManager(tmp_path / "run").writing(1) as tmp:
        save_engine_state(engine, tmp / "actor", tokenizer=load_tokenizer(tiny_model_dir))
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli_main(["export", str(tmp_path / "run"), "--output", str(out)]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("hybridflow export:")]
    assert (
        line
        == f"hybridflow export: {out} exists and is not empty; choose another --output or pass --overwrite"
    )
    assert cli_main(["export", str(tmp_path / "run"), "--output", str(out), "--overwrite"]) == 0
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()
