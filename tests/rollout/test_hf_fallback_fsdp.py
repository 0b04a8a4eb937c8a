"""The HF fallback decoder (GPT-2, Qwen3) inside an FSDP actor: 2 real gloo ranks, dp = 2, rows that stop
at different steps on each rank.

Decoding through the FSDP-wrapped module all-gathers each layer at every step, so a rank whose rows had
finished left the other one waiting in a collective until the gloo timeout (docs/rollout.md, "The HF
fallback under FSDP"). Here rank 0's row stops within 2 tokens and rank 1's runs to 8: generation must
complete (the short gloo timeout turns a regression into a failure, not a hang), equal the unsharded
model's greedy tokens on one process, and leave FSDP's state such that the update after it runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridflow.config.roles import worker_config
from hybridflow.controller import ResourcePool, create_colocated_groups
from hybridflow.models import load_causal_lm
from hybridflow.models.tiny import save_tiny_model
from hybridflow.rollout import SamplingParams
from hybridflow.rollout.engine import BuiltinEngine
from hybridflow.trainers.placement import shutdown
from hybridflow.workers import ActorRolloutRefWorker
from tests.rollout.gen_helpers import TEXTS, prompt_batch
from tests.trainers.configs import tiny_config

ARCHS = ("gpt2", "qwen3")
NEW_TOKENS = 8
EARLY = 2  # rank 0's row stops within this many tokens


@pytest.fixture(scope="module")
def setup(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_fsdp")
    dirs, roles = {}, {}
    for arch in ARCHS:
        # a larger init scale: greedy tokens vary from prompt to prompt, so a stop token can be found
        dirs[arch] = save_tiny_model(tmp / arch, arch=arch, initializer_range=0.2)
        # model.remove_padding left at its default: off for GPT-2, on for Qwen3 (whose replica then
        # shares the packed-attention implementation the training forward is switched to)
        cfg = tiny_config(dirs[arch], tmp / "runs", "grpo", f"rollout.response_length={NEW_TOKENS}",
                          "actor.optim.lr=1e-2", devices=2)  # fmt: skip
        roles[arch] = (
            ActorRolloutRefWorker,
            {"config": worker_config(cfg, "actor_rollout"), "roles": ("actor", "rollout")},
        )
    pool = ResourcePool(2, name="hf_fsdp2")
    # 60 s: a rank left waiting in a collective fails the test in a minute instead of hanging it
    groups = create_colocated_groups(pool, roles, group_name="hf_fsdp2", dist_timeout_s=60)
    for g in groups.values():
        g.init_model()
    yield groups, dirs
    shutdown(groups, [pool])


def uneven_prompts(model):
    """Two prompts and a stop token such that the unsharded model's greedy row 0 (rank 0's) stops within
    EARLY tokens and row 1 (rank 1's) never does; with the reference rollout under that stop token."""
    engine = BuiltinEngine(model)
    for i, j in itertools.permutations(range(len(TEXTS)), 2):
        batch = prompt_batch(texts=[TEXTS[i], TEXTS[j]])
        free = engine.generate(batch, greedy(()))["responses"]
        for stop in free[0, :EARLY].tolist():
            if stop not in free[1].tolist():
                return batch, stop, engine.generate(batch, greedy((stop,)))
    raise AssertionError("no prompt pair whose greedy rows end at different steps")


def greedy(eos: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_ids=eos)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_ending_at_different_steps_per_rank_generate_the_unsharded_tokens(setup, arch):
    groups, dirs = setup
    prompts, stop, ref = uneven_prompts(load_causal_lm(dirs[arch]))
    lengths = ref["response_mask"].sum(1).tolist()
    assert lengths[0] <= EARLY and lengths[1] == NEW_TOKENS, lengths
    sampling = {"n": 1, "temperature": 0.0, "eos_token_ids": (stop,)}
    out = groups[arch].generate_sequences(prompts, sampling=sampling)
    assert torch.equal(out["responses"], ref["responses"])
    assert torch.equal(out["response_mask"], ref["response_mask"])
    torch.testing.assert_close(out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-5, rtol=0)

    # FSDP's root forward still comes first: the update after generation runs and changes the policy
    batch = groups[arch].generate_sequences(prompts)
    batch["old_log_probs"] = batch["rollout_log_probs"]
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    metrics = groups[arch].update_actor(batch)
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    assert metrics["actor/grad_norm"] > 0
    after = groups[arch].compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].bool()
    assert not torch.allclose(after[mask], batch["rollout_log_probs"][mask], atol=1e-4)
