"""Each compat shim's fallback (hybridflow/compat/), run here by hiding the newer API, gives what the
primary path gives: the all-gather under torch 2.11's name (2 gloo ranks, through TPGroup and
CountedComm), activation checkpointing through transformers' pre-5.23 method, and checkpoint shards
loaded without DCP's hf_storage (2 gloo ranks, into other placements; and in one process)."""

from __future__ import annotations

import io
import sys

import pytest
import torch
import torch.multiprocessing as mp
from compat_ranks import full_tensors, gather_main, shards_main
from transformers import PreTrainedModel

from hybridflow.checkpoint.shards import load_tensors, save_tensors
from hybridflow.compat.hf import enable_activation_checkpointing
from hybridflow.models import load_causal_lm


def _spawn(target, world: int, *args) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(world):
        rank, value = results.get()
        if isinstance(value, str):
            pytest.fail(f"rank {rank} failed:\n{value}")
        got[rank] = torch.load(io.BytesIO(value), weights_only=False)
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    return got


def test_all_gather_without_all_gather_single(tmp_path):
    got = _spawn(gather_main, 2, str(tmp_path / "init"))
    want_logits = torch.cat([torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3) + 10], dim=-1)
    want_flat = torch.cat([torch.arange(4.0), torch.arange(4.0) + 100])
    for rank, r in got.items():
        assert r["had_new"], "this torch has all_gather_single: the primary path was not the one run"
        assert r["deprecated"] == [], f"rank {rank}: the primary path called a deprecated name"
        for path in ("new", "old"):
            torch.testing.assert_close(r[path]["logits"], want_logits, rtol=0, atol=0)
            torch.testing.assert_close(r[path]["flat"], want_flat, rtol=0, atol=0)
            assert int(r[path]["bytes"]) == 16  # one 4-float slot received from the other rank


def _load_zeros_like(full: dict, directory) -> dict:
    """Zero tensors shaped as `full`'s, filled from the checkpoint files in `directory`."""
    state = {n: torch.zeros_like(t) for n, t in full.items()}
    load_tensors(state, directory)
    return state


def test_checkpoint_shards_load_without_dcp_hf_storage(tmp_path, monkeypatch):
    directory = tmp_path / "shards"
    got = _spawn(shards_main, 2, str(tmp_path / "init"), str(directory))
    full = full_tensors()
    for rank, r in got.items():
        for path in ("dcp", "fallback"):
            for name, want in full.items():
                assert r[path][name].dtype == want.dtype
                torch.testing.assert_close(
                    r[path][name], want, rtol=0, atol=0, msg=f"rank {rank} {path} {name}"
                )
    # the 2-rank files into plain tensors, in one process without a group: both readers
    primary = _load_zeros_like(full, directory)
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.hf_storage", None)
    fallback = _load_zeros_like(full, directory)
    for name, want in full.items():
        torch.testing.assert_close(primary[name], want, rtol=0, atol=0)
        torch.testing.assert_close(fallback[name], want, rtol=0, atol=0)
    with pytest.raises(KeyError, match="no tensor 'missing'"):
        load_tensors({"missing": torch.zeros(1), **fallback}, directory)


def test_single_process_save_then_fallback_load(tmp_path, monkeypatch):
    full = full_tensors()
    save_tensors(full, tmp_path)
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.hf_storage", None)
    state = _load_zeros_like(full, tmp_path)
    for name, want in full.items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="checkpoint shape"):
        load_tensors({"w": torch.zeros(4, 4)}, tmp_path)


def _old_gradient_checkpointing_enable(
    self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False
):
    """transformers 5.17-5.22's method, as a strict stand-in on 5.23+ (where the old name forwards to the
    new method, which the test hides): it does the checkpointing itself and takes only the old keyword."""
    self._activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)


def _grads_and_layer_calls(model) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of a fixed loss, and how many times layer 0's MLP started forward (twice under recompute)."""
    calls = []
    handle = model.model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: calls.append(1)
    )  # recompute may stop early, inside the MLP
    ids = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 1, 6, 2]])
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    handle.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(calls)


def test_activation_checkpointing_without_activation_checkpointing_enable(tiny_model_dir, monkeypatch):
    plain, plain_calls = _grads_and_layer_calls(load_causal_lm(tiny_model_dir))
    assert plain_calls == 1
    primary_model = load_causal_lm(tiny_model_dir)
    enable_activation_checkpointing(primary_model, {"use_reentrant": False})
    primary, primary_calls = _grads_and_layer_calls(primary_model)
    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
        monkeypatch.setattr(
            PreTrainedModel, "gradient_checkpointing_enable", _old_gradient_checkpointing_enable
        )
    fallback_model = load_causal_lm(tiny_model_dir)
    enable_activation_checkpointing(fallback_model, {"use_reentrant": False})
    fallback, fallback_calls = _grads_and_layer_calls(fallback_model)
    assert primary_calls == fallback_calls == 2  # forward, then the recompute in backward
    assert set(plain) == set(primary) == set(fallback)
    for name, g in plain.items():
        torch.testing.assert_close(primary[name], g, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fallback[name], primary[name], rtol=0, atol=0)
