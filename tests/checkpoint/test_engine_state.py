"""Engine checkpoints: save -> load gives the uninterrupted run's next step exactly (single process here;
the multi-rank cases are in test_sharded.py), and export opens in transformers with the same logits."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import engine_config, make_batch, pg_loss
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.checkpoint import (
    CheckpointError,
    CheckpointManager,
    export_hf,
    load_engine_state,
    save_engine_state,
    save_trainer_state,
)
from hybridflow.cli import main as cli_main
from hybridflow.engines import TrainEngine
from hybridflow.models import load_causal_lm, load_tokenizer


def _logits(model, batch):
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits


def test_single_process_resume_and_export(tiny_model_dir, tmp_path):
    engine = TrainEngine(load_causal_lm(tiny_model_dir), engine_config())
    batch = make_batch(engine.hf_model.config.vocab_size, seed=1)
    first = engine.train_step(batch, pg_loss)
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    with manager.writing(1, meta={"tokenizer_dir": str(tiny_model_dir)}) as tmp:
        save_engine_state(engine, tmp / "actor", tokenizer=load_tokenizer(tiny_model_dir))
        save_trainer_state(tmp, {"step": 1})
    at_save = _logits(engine.hf_model, batch)
    draws = torch.rand(4)  # saving must not have moved the generators (save_hf builds a fresh model)
    second = engine.train_step(batch, pg_loss)
    third = engine.train_step(batch, pg_loss)
    assert second["lr"] != first["lr"]  # still in warmup: a scheduler not restored would show here

    torch.manual_seed(12345)
    resumed = TrainEngine(load_causal_lm(tiny_model_dir), engine_config())
    info = load_engine_state(resumed, manager.resolve("auto") / "actor")
    assert info["global_step"] == resumed.global_step == 1
    assert torch.equal(torch.rand(4), draws)
    again = [resumed.train_step(batch, pg_loss) for _ in range(2)]
    assert [m["loss"] for m in again] == [second["loss"], third["loss"]]  # bit-identical
    assert [m["lr"] for m in again] == [second["lr"], third["lr"]]
    for name, t in resumed.full_state_dict().items():
        assert torch.equal(t, engine.full_state_dict()[name]), name

    # Export: a plain HF dir with tokenizer; same logits as the engine at step 1.
    out = export_hf(tmp_path / "run", tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.use_cache is True
    torch.testing.assert_close(_logits(model, batch), at_save, atol=1e-5, rtol=1e-5)
    # Split like save_pretrained past max_file_bytes (model-0000i-of-0000n + index): loads the same.
    split = export_hf(tmp_path / "run", tmp_path / "split", max_file_bytes=100_000)
    assert len(list(split.glob("model-*-of-*.safetensors"))) > 1
    assert (split / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(split), batch), at_save)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("1+2=3")["input_ids"], skip_special_tokens=True) == "1+2=3"
    assert tok.chat_template

    # CLI: explicit step, role and tokenizer; errors are one clear line and exit code 2.
    rc = cli_main(
        [
            "export",
            str(tmp_path / "run"),
            "--output",
            str(tmp_path / "cli"),
            "--step",
            "1",
            "--tokenizer",
            str(tiny_model_dir),
        ]  # fmt: skip
    )
    assert rc == 0 and (tmp_path / "cli" / "model.safetensors").is_file()
    assert cli_main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "cli")]) == 2  # not empty
    assert cli_main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "x"), "--step", "5"]) == 2
    assert cli_main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "x"), "--role", "critic"]) == 2
    with pytest.raises(CheckpointError, match="holds no checkpoints"):
        export_hf(tmp_path, tmp_path / "y")
    with pytest.raises(CheckpointError, match="no engine.json|not an engine checkpoint"):
        load_engine_state(resumed, tmp_path / "run")
