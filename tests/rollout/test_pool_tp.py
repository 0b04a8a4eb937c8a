"""The rollout pool's generation shards (rollout/pool_tp.py): the same slices as the hand-made Megatron
split that tests/rollout/test_tp_decoder.py runs tensor-parallel against tg = 1 (q/k/v, gate/up and
biases by rows, o/down by columns, norms whole, embeddings vocab-parallel when V divides by tg), as
views of the model's own tensors (a sync copying in place is what the next call reads); consecutive
TP groups."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.tiny import build_tiny_model
from hybridflow.rollout.pool_tp import consecutive_groups, generation_shard
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
