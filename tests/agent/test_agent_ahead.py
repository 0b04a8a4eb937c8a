"""Multi-turn rows through the one-step-ahead source (trainer.rollout_ahead=1): the batch the rollout
pool's agent loop makes and the source hands the update is the one the actor's own generation makes for
the same prompts and step (same tokens, same model-token mask with holes at the tool outputs, same
log-probs), and its log-probs are the training forward's on exactly the tokens response_mask marks."""

from __future__ import annotations

import torch

from hybridflow.trainers import build_trainer
from tests.agent.test_agent_train import FILES
from tests.trainers.configs import tiny_config

MULTI_TURN = (
    "rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{FILES}:echo]",
    f"rollout.multi_turn.parser={FILES}:digit_parser", "rollout.multi_turn.max_turns=3",
    "rollout.multi_turn.tool_response_template=<r>{output}</r>",
)  # fmt: skip
ROW_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def test_the_ahead_batch_of_multi_turn_rows_is_the_synchronous_one(ray_cluster, tiny_model_dir, tmp_path):
    cfg = tiny_config(
        tiny_model_dir, tmp_path, "grpo", *MULTI_TURN, "rollout.response_length=24", "trainer.rollout_ahead=1",
        "trainer.total_steps=1", "trainer.val_before_train=false", devices=2,
    )  # fmt: skip
    with build_trainer(cfg) as trainer:
        prompts = trainer.train_loader.next_batch()
        prompts.meta.global_step = 1
        ours = trainer.actor.generate_sequences(prompts)  # what the synchronous source takes
        step = trainer.source.batch(prompts)  # generated on the rollout pool (version 0: model.path)
        theirs = step.rollout
        old = trainer.actor.compute_log_prob(theirs)["old_log_probs"]

    model, inserted = theirs["response_mask"].bool(), theirs["attention_mask"][:, -24:].bool()
    assert (theirs["agent_turns"] > 1).any() and (inserted & ~model).any()  # tool outputs inside responses
    for key in ROW_FIELDS:
        assert torch.equal(ours[key], theirs[key]), key
    assert list(ours["response_text"]) == list(theirs["response_text"])
    # the same fp32 decoder on the same weights and draws; 1e-5: fp32 rounding of a 24-token decode
    assert torch.allclose(ours["rollout_log_probs"], theirs["rollout_log_probs"], atol=1e-5)
    assert step.policy_lag == 0 and step.old_log_probs.value == "update"
    # the update's forward scores the pool's model tokens where the pool sampled them (no shift, no tool
    # token counted): fp32, the KV-cached decode vs one packed forward over <= 40 positions
    gap = (old - theirs["rollout_log_probs"]).abs()[model]
    assert gap.max() < 1e-4, gap.max()
    assert (theirs["rollout_log_probs"][~model] == 0).all()  # inserted tokens carry no log-prob
