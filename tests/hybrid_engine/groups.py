"""The worker-level 3D-HybridEngine tests' set-up: actor+rollout workers of several layouts colocated on the
same 4 gloo ranks (one process launch for all), and 6 validation prompts (not a multiple of 4 replicas)."""

from __future__ import annotations

from hybridflow.config.roles import worker_config
from hybridflow.controller import ResourcePool, create_colocated_groups
from hybridflow.data import build_prompt_dataset
from hybridflow.models import load_tokenizer
from hybridflow.workers import ActorRolloutRefWorker


def actor_rollout_groups(configs: dict, model, name: str):
    """-> (name -> initialised worker group of that config, the pool, 6 prompts)."""
    roles = {
        key: (
            ActorRolloutRefWorker,
            {"config": worker_config(cfg, "actor_rollout"), "roles": ("actor", "rollout")},
        )
        for key, cfg in configs.items()
    }
    pool = ResourcePool(4, name=name)
    groups = create_colocated_groups(pool, roles, group_name=name)
    for g in groups.values():
        g.init_model()
    ds = build_prompt_dataset(next(iter(configs.values())).data, load_tokenizer(model), "val")
    return groups, pool, ds.collate([ds[i] for i in range(6)])
