"""Auto-mapping (paper §6, docs/design.md §5): choose placement, device allocation and parallelism by simulation.

A pure function from (dataflow, cluster, workload) to a `Plan`; nothing here needs Ray or a GPU.

    from hybridflow.planner import ClusterSpec, ModelSpec, WorkloadSpec, build_dataflow, plan
    p = plan(build_dataflow("ppo", ModelSpec.from_param_count("13B")), ClusterSpec.build("a100-80", 128))
    print(p.strategy, p.iteration_seconds); p.save("plan.yaml")
    # the paper's search by default; only the layouts hybridflow's engines run (`hybridflow plan`'s default):
    plan(..., limits=ENGINE_LIMITS)

Files, in the order data flows: specs (models, devices, workload) -> dataflow (which model does what
in which stage) -> memory, simulate (bytes and seconds of one model under one layout) -> parallel
(`auto_parallel`, per model and device count, cached) -> search (placements x allocations) -> plan.
"""

from hybridflow.planner.dataflow import (
    ALGORITHMS,
    STAGES,
    Dataflow,
    ModelTask,
    build_dataflow,
    old_log_prob_work,
    with_old_log_probs,
)
from hybridflow.planner.parallel import ModelOption, auto_parallel, clear_caches
from hybridflow.planner.plan import (
    Alternative,
    ModelPlan,
    ModelResources,
    Plan,
    PoolPlan,
    Resources,
    plan,
    plan_to_resources,
)
from hybridflow.planner.search import bell_number, search, set_partitions, split_placement, strategy_name
from hybridflow.planner.specs import (
    DEVICES,
    ENGINE_LIMITS,
    ClusterSpec,
    DeviceSpec,
    EngineLimits,
    ModelSpec,
    WorkloadSpec,
    get_device,
)

__all__ = [
    "ALGORITHMS",
    "DEVICES",
    "ENGINE_LIMITS",
    "STAGES",
    "Alternative",
    "ClusterSpec",
    "Dataflow",
    "DeviceSpec",
    "EngineLimits",
    "ModelOption",
    "ModelPlan",
    "ModelResources",
    "ModelSpec",
    "ModelTask",
    "Plan",
    "PoolPlan",
    "Resources",
    "WorkloadSpec",
    "auto_parallel",
    "bell_number",
    "build_dataflow",
    "clear_caches",
    "get_device",
    "old_log_prob_work",
    "plan",
    "plan_to_resources",
    "search",
    "set_partitions",
    "split_placement",
    "strategy_name",
    "with_old_log_probs",
]
