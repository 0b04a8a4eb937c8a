"""AdamW's fused kernel per (mesh, placements) group equals the per-tensor loop; a checkpoint of one layout's
param groups resumes into another's (engines/optim.py, engines/checkpoint_io.py). One gloo rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hybridflow.engines.checkpoint_io import _per_group, _saved_settings
from hybridflow.engines.config import OptimConfig
from hybridflow.engines.optim import build_optimizer, build_scheduler, clip_grad_norm_


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield (
            init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)),
            init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp")),
        )
    finally:
        dist.destroy_process_group()


def _params(meshes) -> list[torch.Tensor]:
    """Five layouts: FSDP2's dp shards, a 2-D mesh's column, row and replicated (norm) shards, a plain tensor."""
    dp, dp_tp = meshes
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 4, generator=g) for _ in range(6)]
    tensors = [
        distribute_tensor(full[0], dp, [Shard(0)]),
        distribute_tensor(full[1], dp, [Shard(0)]),
        distribute_tensor(full[2], dp_tp, [Shard(0), Shard(0)]),
        distribute_tensor(full[3], dp_tp, [Shard(0), Shard(1)]),
        distribute_tensor(full[4], dp_tp, [Shard(0), Replicate()]),
        full[5],
    ]
    return [torch.nn.Parameter(t) for t in tensors]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def test_fused_adamw_per_layout_equals_the_per_tensor_loop(meshes):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    fused_params, loop_params = _params(meshes), _params(meshes)
    fused = build_optimizer(fused_params, cfg)
    assert fused.defaults["fused"] and [len(g["params"]) for g in fused.param_groups] == [2, 1, 1, 1, 1]
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(6, 4, generator=g) for _ in fused_params]
        for params in (fused_params, loop_params):
            for p, grad in zip(params, grads):
                grad = grad.clone()  # clipping scales it in place
                p.grad = (
                    distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
                )
            norm = clip_grad_norm_(params, cfg.grad_clip)  # per-layout scaling, then the step
        assert float(norm) == pytest.approx(float(torch.cat([x.flatten() for x in grads]).norm()), rel=1e-6)
        fused.step()
        loop.step()
    # fp32 elementwise updates, no reduction: the two orders of the same ops differ by a few ulps of
    # the parameter (2^-23 ~ 1.2e-7 relative; |p| < 5 here) a step
    for a, b in zip(fused_params, loop_params):
        torch.testing.assert_close(_local(a.detach()), _local(b.detach()), rtol=1e-6, atol=1e-6)
        assert not torch.equal(_local(a.detach()), _params(meshes)[0].to_local())  # it moved


def test_a_checkpoint_s_param_groups_resume_into_another_layout_s(meshes):
    """A one-group state (one dp rank, plain tensors) into five groups: every group gets the saved lr,
    betas and schedule; each keeps its members and this build's kernel."""
    cfg = OptimConfig(lr=1e-2, warmup_steps=4, betas=[0.8, 0.9])
    one = build_optimizer([torch.nn.Parameter(torch.ones(3))], cfg)
    sched = build_scheduler(one, cfg)
    one.step()
    sched.step()
    saved_groups, saved_sched = one.state_dict()["param_groups"], sched.state_dict()
    saved_groups[0]["fused"] = None  # written by a build that looped

    many = build_optimizer(_params(meshes), cfg)
    groups = _saved_settings(saved_groups, many.state_dict()["param_groups"])
    assert len(groups) == 5 and all(g["fused"] and g["betas"] == (0.8, 0.9) for g in groups)
    assert [g["params"] for g in groups] == [g["params"] for g in many.state_dict()["param_groups"]]
    many.load_state_dict({"state": {}, "param_groups": groups})
    resumed = build_scheduler(many, cfg)
    resumed.load_state_dict(_per_group(saved_sched, len(groups)))
    resumed.step()  # step 2 of 4 of the warmup: 3/4 of lr, in every group
    assert [g["lr"] for g in many.param_groups] == pytest.approx([7.5e-3] * 5)
