"""3D-HybridEngine: switch the actor between its training and generation layouts on the same ranks.

layout.py       training (p, t, d) and generation (pg, tg, dg) layouts and their process groups (pure)
sharding.py     how a Llama-family model's weights split over TP and PP
plan.py         which weight regions go into which all-gather bucket (pure)
comm.py         counted collectives and a buffer ledger (the measured cost)
switch.py       HybridEngine: the switch, four methods behind one interface
tp_generate.py  greedy generation with tensor/pipeline parallelism on the generation shards
cost.py         Table 2 of the paper as pure functions (analytic cost)
"""

from hybridflow.hybrid_engine.cost import SwitchCost, paper_table, switch_cost
from hybridflow.hybrid_engine.layout import GenLayout, TrainLayout
from hybridflow.hybrid_engine.sharding import LlamaShape, ParamSpec, build_training_shard, llama_param_specs
from hybridflow.hybrid_engine.switch import (
    METHODS,
    EngineGroups,
    HybridEngine,
    SwitchStats,
    generation_layout,
)
from hybridflow.hybrid_engine.tp_generate import build_tp_context, generate_greedy

__all__ = [
    "METHODS",
    "EngineGroups",
    "GenLayout",
    "HybridEngine",
    "LlamaShape",
    "ParamSpec",
    "SwitchCost",
    "SwitchStats",
    "TrainLayout",
    "build_training_shard",
    "build_tp_context",
    "generate_greedy",
    "generation_layout",
    "llama_param_specs",
    "paper_table",
    "switch_cost",
]
