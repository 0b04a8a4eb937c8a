"""Sharded init and pickle-free sharded checkpoints on real gloo groups (4 ranks, resumed on 4, 2 and 1):
bytes materialised per rank at init <= M/4 + the largest tensor, outputs equal the single-process model,
each rank writes only its shards, resume continues exactly, export streams into a transformers model
with the same log-probs, and a planted DCP `.metadata` pickle is never opened."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.multiprocessing as mp
from ckpt_helpers import engine_config, make_batch, pg_loss
from sharded_helpers import rank_main
from transformers import AutoModelForCausalLM

from hybridflow.checkpoint import CheckpointManager, export_hf, load_engine_state, save_engine_state
from hybridflow.checkpoint.shards import tensor_index
from hybridflow.engines import TrainEngine
from hybridflow.engines.forward import RLForward
from hybridflow.engines.micro_batch import response_length
from hybridflow.models import load_causal_lm, load_tokenizer


def _spawn(world: int, phase: str, model_dir, run_dir) -> dict:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    args = (world, phase, str(model_dir), str(run_dir), errors)
    procs = [ctx.Process(target=rank_main, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        pytest.fail(f"{phase}: rank {rank} failed:\n{tb}")
    assert [p.exitcode for p in procs] == [0] * world
    return torch.load(run_dir / f"{phase}.pt", weights_only=False)


def _log_probs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        ids, attn, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        return RLForward(model, 256)(ids, attn, pos, response_length(batch), 1.0, False)["log_probs"]


def _aligned(lp: torch.Tensor, ref: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Both on the response tokens only (the engine writes 0 on padding)."""
    mask = batch["response_mask"][:, -ref.shape[1] :].bool()
    return lp[:, -ref.shape[1] :][mask], ref[mask]


def test_four_rank_sharded_init_save_resume_on_four_two_one_and_export(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = _spawn(4, "save", tiny_model_dir, run_dir)

    # Init: every rank allocated and read at most M/4 + the largest tensor of parameter bytes.
    for s in saved["all_init_stats"]:
        bound = s.full_model_bytes / 4 + s.largest_tensor_bytes
        assert 0 < s.bytes_allocated <= bound and s.bytes_read <= bound, s
        assert s.full_model_bytes == 4 * sum(p.numel() for p in load_causal_lm(tiny_model_dir).parameters())
    # ... and the sharded model computes what the single-process model does.
    batch = make_batch(load_causal_lm(tiny_model_dir).config.vocab_size, batch_size=8, seed=4)
    reference = _log_probs(load_causal_lm(tiny_model_dir), batch)
    torch.testing.assert_close(*_aligned(saved["log_probs_init"], reference, batch), atol=1e-5, rtol=1e-5)

    # Each rank wrote its own shard file, holding about a quarter of the tensors' bytes; no pickle.
    step_dir = CheckpointManager(run_dir).resolve("auto")
    files = sorted(p.name for p in (step_dir / "actor" / "model").iterdir())
    assert len(files) == 4 and all(f.endswith(".safetensors") for f in files), files
    index = tensor_index(step_dir / "actor" / "model")
    per_file: dict = {}
    for entry in index.values():
        for path, _, size in entry.chunks:
            per_file[path] = per_file.get(path, 0) + entry.dtype.itemsize * int(torch.Size(size).numel())
    full = sum(e.nbytes for e in index.values())
    largest = max(e.nbytes for e in index.values())
    assert all(b <= full / 4 + largest for b in per_file.values()), (per_file, full)
    assert not list(step_dir.rglob("*.metadata")) and not list(step_dir.rglob("*.distcp"))

    # Resume on the same 4 ranks: every rank's RNG is restored and the next step is bit-identical.
    for draw, resumed_draw in saved["draws"]:
        assert torch.equal(draw, resumed_draw)
    assert saved["resumed_step2"] == saved["step2"]
    for name, t in saved["state2"].items():
        assert torch.equal(saved["resumed_state2"][name], t), name
    # Resume on 2 ranks: the same global step (loss is the global token mean; grads reduce in another
    # order, so equal to float tolerance).
    two = _spawn(2, "resume", tiny_model_dir, run_dir)
    for s in two["all_init_stats"]:
        assert s.bytes_allocated <= s.full_model_bytes / 2 + s.largest_tensor_bytes
    assert two["resumed_step2"]["grad_norm"] == pytest.approx(saved["step2"]["grad_norm"], rel=1e-5)
    for name, t in saved["state2"].items():
        torch.testing.assert_close(two["resumed_state2"][name], t, atol=1e-6, rtol=1e-5, msg=name)

    # ... and in one process without a process group (dp=1): the step-1 model.
    single = TrainEngine(load_causal_lm(tiny_model_dir, device="meta"), engine_config(dp=1))
    load_engine_state(single, step_dir / "actor")
    assert single.global_step == 1
    torch.testing.assert_close(
        *_aligned(saved["log_probs_step1"], single.compute_log_probs(batch)[0], batch), atol=1e-6, rtol=1e-6
    )

    # Export streams the 4 shards into one HF directory; transformers loads it with the step-1 outputs.
    out = export_hf(run_dir, tmp_path / "export", tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(out)
    exported = _log_probs(model, batch)
    torch.testing.assert_close(*_aligned(saved["log_probs_step1"], exported, batch), atol=1e-5, rtol=1e-5)
    assert json.loads((out / "config.json").read_text())["use_cache"] is True


class _PlantFile:
    """Unpickling this creates a file: the proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_forged_dcp_metadata_is_never_unpickled(tiny_model_dir, tmp_path):
    engine = TrainEngine(load_causal_lm(tiny_model_dir), engine_config())
    batch = make_batch(engine.hf_model.config.vocab_size, seed=1)
    engine.train_step(batch, pg_loss)
    manager = CheckpointManager(tmp_path / "run")
    marker = tmp_path / "PWNED"
    forged = pickle.dumps(_PlantFile(str(marker)))
    pickle.loads(pickle.dumps(_PlantFile(str(tmp_path / "probe"))))
    assert (tmp_path / "probe").exists()  # the payload works: unpickling it would create the marker
    with manager.writing(1) as tmp:
        save_engine_state(engine, tmp / "actor", tokenizer=load_tokenizer(tiny_model_dir))
        for d in ("", "model", "optim"):  # where DCP's FileSystemReader would look for its metadata
            (tmp / "actor" / d / ".metadata").write_bytes(forged)
    role = manager.resolve("auto") / "actor"
    resumed = TrainEngine(load_causal_lm(tiny_model_dir), engine_config())
    load_engine_state(resumed, role)
    assert not marker.exists()
    assert resumed.global_step == 1
    for name, t in engine.full_state_dict().items():
        assert torch.equal(resumed.full_state_dict()[name], t), name
    export_hf(tmp_path / "run", tmp_path / "export")
    assert not marker.exists()
