"""The 3D-HybridEngine's switch for an actor in pipeline stages (hybrid_engine/pipeline_switch.py), inside
the actor worker on 4 real gloo ranks: p = 2 x t = 2 generating with tg = 2 (each stage's TP shards stay
put; the other stage's arrive over pp; each stage's TP group generates vocab-parallel). Greedy rollouts
equal the p = 1 actor's (dp = 4, the whole model on each rank) token for token, and the bytes counted at
the collectives equal cost.pipeline_switch_cost, and a hand count, at every switch. (tg = 1 and the
updates run through `hybridflow train` in tests/trainers/test_pipeline_3d_train.py.)
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.tiny import build_tiny_config, save_tiny_model
from hybridflow.trainers.placement import shutdown
from tests.hybrid_engine.groups import actor_rollout_groups
from tests.trainers.configs import tiny_config

# name -> (actor pp, actor tp, rollout.tg); dp = 4 / (pp * tp)
LAYOUTS = {"p1": (1, 1, 1), "p2_t2_tg2": (2, 2, 2)}
GREEDY = {"n": 1, "temperature": 0.0}
HIDDEN, FFN = 64, 128  # the tiny Llama's sizes (models/tiny.py)


@pytest.fixture(scope="module")
def setup(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_reshard")
    # a larger init scale so that greedy tokens notice any layout bug
    model = save_tiny_model(tmp / "model", num_key_value_heads=4, initializer_range=0.2)
    configs = {}
    for name, (pp, tp, tg) in LAYOUTS.items():
        configs[name] = tiny_config(model, tmp / "runs", "grpo", f"actor.parallel.pp={pp}", f"actor.parallel.tp={tp}",
                                    f"rollout.tg={tg}", "rollout.response_length=6", "actor.optim.lr=5e-2",
                                    devices=4)  # fmt: skip
    groups, pool, prompts = actor_rollout_groups(configs, model, "pipe_reshard4")
    yield groups, prompts
    shutdown(groups, [pool])


def test_greedy_rollouts_equal_p1_and_bytes_equal_formula(setup):
    groups, prompts = setup
    ref = groups["p1"].generate_sequences(prompts, sampling=GREEDY)
    assert ref["responses"].shape == (6, 6)
    vocab = build_tiny_config("tiny").vocab_size
    layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN  # one decoder layer's TP-split weights, elements
    for _ in range(2):  # every switch: the first (which exchanges the stages' specs) and the next
        out = groups["p2_t2_tg2"].generate_sequences(prompts, sampling=GREEDY)
        assert torch.equal(out["responses"], ref["responses"])
        assert torch.equal(out["response_mask"], ref["response_mask"])
        torch.testing.assert_close(out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-5, rtol=0)
        m = out.meta.reshard_metrics
        assert m["reshard/bytes_per_rank"] == m["reshard/formula_bytes_per_rank"], m
        assert m["reshard/gen_weight_bytes_per_rank"] == m["reshard/formula_gen_weight_bytes_per_rank"], m
        # fp32, d = 1, t = tg = 2: its own stage moves nothing; it receives the other stage's TP half (the
        # embeddings or lm_head: V/2 rows), the most at stage 0's ranks, as stage 1 holds three norms (two
        # layer norms and the final one) against two. Held: half the model, norms whole.
        assert m["reshard/bytes_per_rank"] == 4 * (layer // 2 + 3 * HIDDEN + vocab * HIDDEN // 2), m
        assert m["reshard/gen_weight_bytes_per_rank"] == 4 * (layer + 5 * HIDDEN + vocab * HIDDEN), m
