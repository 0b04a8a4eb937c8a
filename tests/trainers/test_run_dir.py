"""Which settings keep a run the same run for trainer.resume=auto (trainers/run_dir.py): a checkpoint
resumes onto another layout, while another learning rate or seed is another run."""

from __future__ import annotations

from hybridflow.config import load_config
from hybridflow.trainers.run_dir import free_key, hashed_config

BASE = ["model.path=m", "data.dataset=synthetic:arithmetic"]


def _hash(*overrides: str) -> dict:
    return hashed_config(load_config(None, [*BASE, *overrides], validate=False, check_model=False))


def test_the_layout_and_the_run_length_keep_the_hash_and_the_algorithm_settings_do_not():
    same = _hash()
    for layout in ("actor.parallel.pp=2", "resources.n_gpus_per_node=4", "actor.micro_batch_size_per_device=2",
                   "actor.offload=true", "rollout.tg=2", "trainer.total_steps=99",
                   "trainer.experiment_name=other"):  # fmt: skip
        assert _hash(layout) == same, layout
    for setting in (
        "actor.optim.lr=0.5",
        "trainer.seed=7",
        "rollout.temperature=0.5",
        "data.train_batch_size=2",
    ):
        assert _hash(setting) != same, setting
    assert not free_key("trainer") and not free_key("rollout") and free_key("resources")
