"""The DAPO driver (trainers/dapo.py) on the tiny model with a local Ray cluster: dynamic sampling fills
the batch from extra generation batches and counts them, the overlong penalty and the truncated-row
mask reach the experience, a resumed run repeats the uninterrupted one, and what it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.algorithms.dynamic_sampling import overlong_penalty
from hybridflow.controller import strict_device
from hybridflow.errors import RunStopped, UserError
from hybridflow.models import load_reward_model, save_hf_model
from hybridflow.trainers import build_trainer
from tests.trainers.lifecycle_helpers import comparable
from tests.trainers.test_strict_device import forbid_cuda_in_driver

REWARDS = Path(__file__).with_name("dapo_rewards.py")
HALF = f"reward.fn={REWARDS}:half_constant"
FILTER = ("algorithm.filter_groups.enable=true", HALF)
DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"


def _step(trainer):
    batch = trainer.train_loader.next_batch()
    trainer.global_step += 1
    batch.meta.global_step = trainer.global_step
    out, metrics = trainer.train_step(batch)
    trainer.timers.pop()
    return out, metrics


def _groups(batch) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for uid, s in zip(batch["uid"], batch["scores"].tolist()):
        groups.setdefault(uid, []).append(s)
    return groups


def test_dynamic_sampling_fills_the_batch_and_counts_generation_batches(ray_cluster, make_config):
    cfg = make_config("dapo", *FILTER, "trainer.total_steps=3")
    used = []
    with build_trainer(cfg) as trainer:
        for _ in range(3):
            out, m = _step(trainer)
            groups = _groups(out)
            # exactly train_batch_size groups of n, each varying; no even answer (all-zero group) among them
            assert len(out) == 4 * 2 and len(groups) == 4 and all(len(v) == 2 for v in groups.values())
            assert all(np.std(v) > 0 for v in groups.values()), groups
            assert all(int(gt) % 2 == 1 for gt in out["ground_truth"])
            k = int(m["dapo/num_gen_batches"])
            assert m["dapo/groups_kept"] + m["dapo/groups_dropped"] == 4 * k
            assert m["dapo/groups_kept"] >= 4 and m["actor/grad_norm"] > 0
            used.append(k)
        state = trainer.train_loader.state_dict()
    # the loader moved by every generation batch drawn (64 samples = 16 batches per epoch)
    assert state["epoch"] * 64 + state["position"] == 4 * sum(used)
    assert max(used) >= 2, used  # half the prompts are all-equal: refills happen


def test_overlong_penalty_and_truncated_mask_reach_the_experience(ray_cluster, make_config):
    # long enough for the untrained model to stop (EOS) in some rows and run to the cap in others
    over = ("rollout.response_length=16", "rollout.n=4", "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=8", "reward.overlong_buffer.penalty_factor=0.5", "actor.mask_truncated=true",
            DIGITS)  # fmt: skip
    with build_trainer(make_config("dapo", *over)) as trainer:
        out, m = _step(trainer)
    rollout_mask = out.local["response_mask"]
    lengths = rollout_mask.sum(-1)
    raw = torch.tensor([sum(c.isdigit() for c in t) / 4.0 for t in out.local["response_text"]])
    # cap 16, buffer 8: a response of l > 8 tokens loses (l - 8) / 16 (exact in binary)
    expected = raw - (lengths - 8).clamp(min=0) / 16.0
    torch.testing.assert_close(out.local["scores"], expected.float(), rtol=0, atol=0)
    penalty = overlong_penalty(lengths, 16, 8, 0.5)
    trained_mask = out.fetch()["response_mask"]
    truncated = lengths == 16
    assert truncated.any() and (~truncated).any(), lengths  # both kinds present in this seeded batch
    assert trained_mask[truncated].sum() == 0
    assert torch.equal(trained_mask[~truncated], rollout_mask[~truncated])
    assert m["dapo/masked_truncated"] == pytest.approx(float(truncated.float().mean()))
    assert m["response_length/clip_ratio"] == pytest.approx(float(truncated.float().mean()))
    assert m["dapo/overlong_penalty_mean"] == pytest.approx(float(penalty.mean()))


def test_resumed_dapo_run_repeats_the_uninterrupted_run(ray_cluster, make_config):
    settings = (*FILTER, "trainer.total_steps=4", "trainer.save_every=2", "trainer.val_every=0")
    with build_trainer(make_config("dapo", *settings, "trainer.experiment_name=whole")) as trainer:
        whole = trainer.fit()
    cfg = make_config("dapo", *settings, "trainer.experiment_name=parts", "trainer.resume=auto")
    with build_trainer(cfg) as trainer:
        first = trainer.fit(stop_after=2)
    with build_trainer(cfg) as trainer:  # fresh worker processes; the loader moved by the refills too
        rest = trainer.fit()
    assert sum(h["dapo/num_gen_batches"] for h in whole if "dapo/num_gen_batches" in h) > 4
    for a, b in zip(whole, first + rest, strict=True):
        assert comparable(a) == comparable(b), a["step"]


def test_dapo_with_its_additions_off_is_grpo_number_for_number(ray_cluster, make_config):
    """Scoring moved into the generation phase changes nothing: same samples, scores, losses."""
    runs = {}
    for name in ("grpo", "dapo"):
        with build_trainer(make_config(name, DIGITS, "trainer.val_every=0")) as trainer:
            runs[name] = [comparable(h) for h in trainer.fit()]
    dapo = [{k: v for k, v in row.items() if not k.startswith("dapo/")} for row in runs["dapo"]]
    assert dapo == runs["grpo"]
    assert [row["dapo/num_gen_batches"] for row in runs["dapo"] if row["step"]] == [1.0, 1.0]


def test_a_step_that_cannot_fill_its_batch_stops_the_run_in_one_line(ray_cluster, make_config):
    # exact match: the untrained model never answers, so every group is all zeros
    cfg = make_config(
        "dapo", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"
    )
    with build_trainer(cfg) as trainer, pytest.raises(RunStopped) as err:
        trainer.fit()
    assert str(err.value).startswith("step 1: dynamic sampling kept 0 of the 4 groups needed in ")
    assert "max_num_gen_batches=2 generation batches (8 groups scored all alike)" in str(err.value)


def test_the_acc_metric_keeps_groups_by_the_reward_functions_acc(ray_cluster, make_config):
    # acc is constant within every group (a property of the prompt): nothing is ever kept
    acc = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
           "algorithm.filter_groups.max_num_gen_batches=1", f"reward.fn={REWARDS}:half_constant_acc")  # fmt: skip
    with build_trainer(make_config("dapo", *acc)) as trainer, pytest.raises(RunStopped, match="kept 0 of"):
        trainer.fit()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("algorithm.name=grpo", "algorithm.filter_groups.enable=true"),
            "algorithm.filter_groups.enable: runs in",
        ),
        (
            ("algorithm.name=grpo", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2"),
            "reward.overlong_buffer.enable: runs in the dapo driver only",
        ),  # fmt: skip
        (("algorithm.name=ppo", "actor.mask_truncated=true"), "actor.mask_truncated: runs in the dapo"),
        (
            ("trainer.rollout_ahead=1", "resources.n_gpus_per_node=2"),
            "trainer.rollout_ahead: 1 is not supported",
        ),
        (("reward.overlong_buffer.enable=true",), r"reward.overlong_buffer.len: must be in \[1, "),
        (("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=5"), "got 5"),
        (("algorithm.filter_groups.max_num_gen_batches=-1",), "must be >= 0, got -1"),
    ],
)
def test_refused_before_any_worker_starts(make_config, overrides, message):
    with pytest.raises(UserError, match=message):
        make_config("dapo", *overrides)


def test_reward_model_path_on_two_ranks_under_device_strict_mode(
    ray_cluster, make_config, tmp_path, monkeypatch
):
    """The GPU path (docs/operations.md, device-strict mode): scores from a reward model on 2 ranks, fetched
    for the filter; refills concatenated; truncated rows masked on the actor's rank 0; no CUDA call in
    the driver. Reward-model scores are continuous, so groups vary and the filter keeps them."""
    torch.manual_seed(3)
    rm = save_hf_model(load_reward_model(make_config("dapo").model.path), tmp_path / "rm")
    monkeypatch.setenv(strict_device.ENV, "1")
    forbid_cuda_in_driver(monkeypatch)
    args = ("reward.kind=model", f"model.reward_model_path={rm}", "algorithm.filter_groups.enable=true",
            "rollout.response_length=16", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8",
            "actor.mask_truncated=true", "actor.ppo_mini_batch_size=2", "trainer.val_before_train=false")  # fmt: skip
    with build_trainer(make_config("dapo", *args, devices=2)) as trainer:
        history = trainer.fit()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["dapo/num_gen_batches"] >= 1 and h["dapo/groups_kept"] >= 4
        assert np.isfinite([h["actor/pg_loss"], h["reward/mean"], h["dapo/overlong_penalty_mean"]]).all()
        assert h["dapo/masked_truncated"] == h["response_length/clip_ratio"]
