"""The 3D-HybridEngine's switch for an actor in pipeline stages (hybrid_engine/pipeline_switch.py), inside
the actor worker on 4 real gloo ranks (one process launch for every layout).

p = 2 x t = 2 generating with tg = 1 and tg = 2, and p = 2 x d = 2: greedy rollouts equal the p = 1 actor's
(dp = 4, the whole model on each rank) token for token, bytes counted at the collectives equal
cost.pipeline_switch_cost every switch, and the generation weights held are each rank's tg-shard of the
whole model. After one identical update the layouts still agree: grad norms and log-probs within 1e-4
(fp32; Adam at lr 5e-2 magnifies the gradients' summation-order differences, ~1e-7 relative, to ~1e-5 on
log-probs of magnitude ~5), greedy tokens equal.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.roles import worker_config
from hybridflow.controller import ResourcePool, create_colocated_groups
from hybridflow.data import build_prompt_dataset
from hybridflow.models import load_tokenizer
from hybridflow.models.tiny import build_tiny_config, save_tiny_model
from hybridflow.trainers.placement import shutdown
from hybridflow.workers import ActorRolloutRefWorker
from tests.trainers.configs import tiny_config

# name -> (actor pp, actor tp, rollout.tg); dp = 4 / (pp * tp)
LAYOUTS = {"p1": (1, 1, 1), "p2_t2_tg1": (2, 2, 1), "p2_t2_tg2": (2, 2, 2), "p2_d2": (2, 1, 1)}
GREEDY = {"n": 1, "temperature": 0.0}
HIDDEN, FFN = 64, 128  # the tiny Llama's sizes (models/tiny.py)


@pytest.fixture(scope="module")
def setup(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_reshard")
    # a larger init scale so that greedy tokens notice any layout bug
    model = save_tiny_model(tmp / "model", num_key_value_heads=4, initializer_range=0.2)
    roles = {}
    for name, (pp, tp, tg) in LAYOUTS.items():
        cfg = tiny_config(model, tmp / "runs", "grpo", f"actor.parallel.pp={pp}", f"actor.parallel.tp={tp}",
                          f"rollout.tg={tg}", "rollout.response_length=6", "actor.optim.lr=5e-2",
                          "actor.micro_batch_size_per_device=4", devices=4)  # fmt: skip
        roles[name] = (
            ActorRolloutRefWorker,
            {"config": worker_config(cfg, "actor_rollout"), "roles": ("actor", "rollout")},
        )
    pool = ResourcePool(4, name="pipe_reshard4")
    groups = create_colocated_groups(pool, roles, group_name="pipe_reshard4")
    for g in groups.values():
        g.init_model()
    ds = build_prompt_dataset(cfg.data, load_tokenizer(model), "val")
    prompts = ds.collate([ds[i] for i in range(6)])  # 6 prompts: not a multiple of 4 replicas
    yield groups, prompts
    shutdown(groups, [pool])


def test_greedy_rollouts_equal_p1_and_bytes_equal_formula(setup):
    groups, prompts = setup
    ref = groups["p1"].generate_sequences(prompts, sampling=GREEDY)
    assert ref["responses"].shape == (6, 6)
    vocab = build_tiny_config("tiny").vocab_size
    layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN  # one decoder layer's TP-split weights, elements
    for name, (pp, _, tg) in LAYOUTS.items():
        if pp == 1:
            continue
        for _ in range(2):  # every switch, the first (which exchanges the stages' specs) and the next
            out = groups[name].generate_sequences(prompts, sampling=GREEDY)
            assert torch.equal(out["responses"], ref["responses"]), name
            assert torch.equal(out["response_mask"], ref["response_mask"]), name
            torch.testing.assert_close(out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-5, rtol=0)
            m = out.meta.reshard_metrics
            assert m["reshard/bytes_per_rank"] == m["reshard/formula_bytes_per_rank"] > 0, (name, m)
            held = m["reshard/gen_weight_bytes_per_rank"]
            assert held == m["reshard/formula_gen_weight_bytes_per_rank"], (name, m)
            # a tg-shard of the whole model: 2 layers' split weights, 5 norms, embeddings and lm_head
            # (V/tg rows each, vocab-parallel)
            assert held == 4 * (2 * layer // tg + 5 * HIDDEN + 2 * vocab * HIDDEN // tg), (name, m)
        if name == "p2_t2_tg2":
            # d = 1, t = tg: its own stage moves nothing; it receives the other stage's half, the most
            # from stage 1 (the final norm: three norms against two)
            want = 4 * (layer // 2 + 3 * HIDDEN + vocab * HIDDEN // 2)
            assert m["reshard/bytes_per_rank"] == want, m


def test_one_update_then_layouts_still_agree(setup):
    """The same GRPO update on every layout: grad norms and log-probs after it agree within 1e-4, and
    the next switch reads the updated weights (greedy tokens change, and stay equal across layouts)."""
    groups, prompts = setup
    prompts.meta.global_step = 3  # the sampling seed's step
    batch = groups["p1"].generate_sequences(prompts)
    batch["old_log_probs"] = batch["rollout_log_probs"]
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    before = groups["p1"].generate_sequences(prompts, sampling=GREEDY)["responses"]
    norms, after, greedy = {}, {}, {}
    for name in LAYOUTS:
        norms[name] = groups[name].update_actor(batch)["actor/grad_norm"]
        after[name] = groups[name].compute_log_prob(batch)["old_log_probs"]
        greedy[name] = groups[name].generate_sequences(prompts, sampling=GREEDY)["responses"]
    assert not torch.equal(greedy["p1"], before), "the update did not change any greedy token"
    mask = batch["response_mask"].bool()
    for name in LAYOUTS:
        assert torch.equal(greedy[name], greedy["p1"]), name
        assert norms[name] == pytest.approx(norms["p1"], rel=1e-4), name
        torch.testing.assert_close(after[name][mask], after["p1"][mask], atol=1e-4, rtol=1e-4)
