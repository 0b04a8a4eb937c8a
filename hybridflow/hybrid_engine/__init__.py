"""3D-HybridEngine: switch the actor between its training and generation layouts on the same ranks
(docs/hybrid_engine.md).

layout.py     training (p, t, d) and generation (pg, tg, dg) layouts, replicas and groups (pure)
cost.py       Table 2 of the paper and the formula of the layout that runs (pure; planner and worker)
sync_budget.py  the rollout_ahead weight sync's bucket and in-flight sizes (pure; planner and worker)
comm.py       counted collectives and a buffer ledger (the measured cost)
resharder.py  Resharder: the switch inside the actor worker, from the engine's DTensors
pipeline_switch.py  the switch of an actor in pipeline stages (p > 1): each stage's switch, then a pp exchange
baselines.py  the paper's baseline methods (allgather, vanilla, two_copy) as Resharder subclasses, for the
              comparison benchmarks only; nothing in the core imports it
"""

from hybridflow.hybrid_engine.cost import (
    METHODS,
    SwitchCost,
    fsdp_switch_cost,
    paper_table,
    pipeline_switch_cost,
    switch_cost,
)
from hybridflow.hybrid_engine.layout import GenLayout, TrainLayout, generation_layout_errors

__all__ = [
    "METHODS",
    "GenLayout",
    "SwitchCost",
    "TrainLayout",
    "fsdp_switch_cost",
    "pipeline_switch_cost",
    "generation_layout_errors",
    "paper_table",
    "switch_cost",
]
