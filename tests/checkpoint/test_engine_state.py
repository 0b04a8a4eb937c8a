"""Engine checkpoints: save -> load gives the uninterrupted run's next step exactly (single process and
2-rank FSDP2 on gloo, and resharded to 1 rank), and export opens in transformers with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from ckpt_helpers import _rank_main, engine_config, make_batch, pg_loss
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


def test_two_rank_fsdp2_resume_and_reshard_to_one_rank(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    manager = CheckpointManager(run_dir)
    tmp = manager.begin(1)  # the driver opens the checkpoint; the ranks write into it
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, 2, str(tiny_model_dir), str(run_dir), str(tmp), errors))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        pytest.fail(f"rank {rank} failed:\n{tb}")
    assert [p.exitcode for p in procs] == [0, 0]
    result = torch.load(run_dir / "result.pt", weights_only=False)
    for draw, draw_b, loss2, loss2_b in result["ranks"]:
        assert torch.equal(draw, draw_b)  # per-rank RNG restored
        assert loss2 == loss2_b
    for name, t in result["state2"].items():
        assert torch.equal(result["state2_b"][name], t), name
    step_dir = manager.resolve("auto")
    parts = manager.validate(step_dir, require=["actor"])["parts"]["actor"]["files"]
    assert {"rng/rank_0.json", "rng/rank_1.json", "train_state.json", "hf_config/config.json"} <= set(parts)
    assert sum(f.startswith("model/shard-") for f in parts) == 2  # one shard file per rank
    assert sum(f.startswith("optim/shard-") for f in parts) == 2
    assert not any(f.endswith((".metadata", ".distcp", ".pt", ".bin")) for f in parts)  # nothing pickled
    assert json.loads((step_dir / "actor" / "engine.json").read_text())["dp"] == 2

    # Reshard: the 2-rank checkpoint resumes in one process (dp=1); one step over the whole batch equals
    # the two ranks' step over its halves (the engine's loss is the global token mean).
    single = TrainEngine(load_causal_lm(tiny_model_dir), engine_config(dp=1))
    load_engine_state(single, step_dir / "actor")
    for name, t in single.full_state_dict().items():
        assert torch.equal(t, result["loaded"][name]), name
    single.train_step(make_batch(single.hf_model.config.vocab_size, seed=4), pg_loss)
    for name, t in single.full_state_dict().items():
        torch.testing.assert_close(t, result["state2"][name], atol=1e-6, rtol=1e-5, msg=name)
