"""The rollout pool's generation shards (rollout/pool_tp.py): the same slices as the hand-made Megatron
split that tests/rollout/test_tp_decoder.py runs tensor-parallel against tg = 1 (q/k/v, gate/up and
biases by rows, o/down by columns, norms whole, embeddings vocab-parallel when V divides by tg), as
views of a full model's tensors; consecutive TP groups; and a rollout rank's model holding only those
slices, read from model.path's safetensors (rollout/pool_tp.py load_shard) or cut from a whole model."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models import load_causal_lm
from hybridflow.models.tiny import build_tiny_model, save_tiny_model
from hybridflow.rollout.pool_tp import (
    consecutive_groups,
    generation_shard,
    keep_shard,
    load_shard,
    param_bytes,
    shard_of,
    split_dim,
)
from tests.rollout.test_tp_decoder import shard


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True)])
def test_shards_are_the_megatron_split_as_views(arch, tied):
    model = build_tiny_model("tiny", arch, seed=0, tie_word_embeddings=tied)
    for vocab in (model.config.vocab_size, model.config.vocab_size + 1):  # divisible by 2 or not
        model.resize_token_embeddings(vocab)
        for rank in range(2):
            ours = generation_shard(model, rank, 2)
            theirs = shard(model, rank, 2, vocab=vocab % 2 == 0)
            assert ours.keys() == theirs.keys()
            for name, t in ours.items():
                assert torch.equal(t, theirs[name]), name
                assert (
                    t.untyped_storage().data_ptr()
                    == dict(model.named_parameters())[name].untyped_storage().data_ptr()
                )
    assert any(k.endswith("q_proj.bias") for k in ours) == (arch == "qwen2")
    assert ("lm_head.weight" in ours) == (not tied)


def test_tp_groups_are_consecutive_ranks():
    assert consecutive_groups(4, 2) == [[0, 1], [2, 3]]
    assert consecutive_groups(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="rollout.tg=2 must divide the rollout pool's 3 ranks"):
        consecutive_groups(3, 2)


@pytest.mark.parametrize("arch,tied,vocab", [("qwen2", False, 92), ("llama", True, 92), ("llama", False, 93)])
def test_a_rank_loads_only_its_shard_as_its_own_tensors(tmp_path, arch, tied, vocab):
    """load_shard (safetensors slices into a meta-built model) and keep_shard (a whole model cut down) give
    the model's parameters exactly generation_shard's slices, each a contiguous tensor of its own, tied
    weights still one tensor; the shard is ~1/tg of the model's bytes (the norms, and embeddings whose
    vocabulary does not divide by tg, whole)."""
    path = save_tiny_model(tmp_path, "tiny", arch, seed=0, tie_word_embeddings=tied, vocab_size=vocab)
    full = load_causal_lm(path)
    whole = param_bytes(full)
    for rank in range(2):
        want = generation_shard(full, rank, 2)
        for model in (
            load_shard(load_causal_lm(path, device="meta"), rank, 2, torch.device("cpu")),
            keep_shard(load_causal_lm(path), rank, 2),
        ):
            ours = dict(model.named_parameters())
            assert ours.keys() == want.keys()
            for name, t in ours.items():
                assert torch.equal(t, want[name]) and t.is_contiguous() and not t.is_meta, name
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name  # no full tensor
            assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
            split = sum(t.numel() * t.element_size() for t in want.values())
            assert param_bytes(model) == split
    norms = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n)
    embeds = (1 if tied else 2) * vocab * full.config.hidden_size * 4
    if vocab % 2:  # embeddings and lm_head whole, the rest halved
        assert split == embeds + (whole - embeds - norms) // 2 + norms
    else:
        assert split == (whole - norms) // 2 + norms
        assert split / whole < 0.51


def test_a_dimension_tg_does_not_divide_is_one_line():
    with pytest.raises(
        ValueError, match=r"rollout.tg=3 must divide model.layers.0.mlp.up_proj.weight's dimension 0"
    ):
        shard_of("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64), 0, 3, False)
    assert split_dim("model.layers.0.self_attn.o_proj.bias", True) is None
    assert split_dim("lm_head.weight", False) is None and split_dim("lm_head.weight", True) == 0


@pytest.mark.parametrize("tg", [1, 2])
def test_a_pool_model_is_cast_before_the_device_and_vllms_is_never_built(tmp_path, tg):
    """workers/actor.load_pool_model: the built-in engine's pool model is read from the safetensors
    straight into the compute dtype (exactly the fp32 weights cast, no fp32 model on the device first);
    vLLM's names the tensors only: every parameter stays on the meta device, in the compute dtype the
    weight sync carries, and the engine streams the stored fp32 weights from the files one at a time."""
    from hybridflow.rollout.vllm_engine import stored_weights
    from hybridflow.workers.actor import load_pool_model

    path = save_tiny_model(tmp_path, "tiny", "llama", seed=0)
    full = load_causal_lm(path)
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    for rank in range(tg):
        model = load_pool_model(str(path), {}, bf16, cpu, rank, tg, on_device=True)
        want = generation_shard(full, rank, tg)
        assert dict(model.named_parameters()).keys() == want.keys()
        for name, t in model.named_parameters():
            assert t.dtype == bf16 and not t.is_meta and torch.equal(t, want[name].to(bf16)), name
        assert all(b.dtype == torch.float32 for b in model.buffers())  # the rotary tables stay fp32
    named = load_pool_model(str(path), {}, bf16, cpu, 0, 1, on_device=False)
    assert all(p.is_meta and p.dtype == bf16 for p in named.parameters())
    streamed = list(stored_weights(named))
    assert [n for n, _ in streamed] == [n for n, _ in full.named_parameters()]
    for (name, t), (_, p) in zip(streamed, full.named_parameters()):
        assert torch.equal(t, p.detach()), name
