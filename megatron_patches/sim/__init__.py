"""Trace-driven performance simulator (DESIGN 6): iteration time of every system on any described cluster.

Modules: `costs` (compute, communication and memory cost model), `events` (event-driven
streams, vectorised over iterations), `scenario` (the shared inputs: workload, hardware, the
trace scaled to the simulated batch), `systems` (EP, FSSDP variants, replicate, static,
FasterMoE, SmartMoE, FlexMoE: the placement engine's own planners, scheduled per layer),
`zebra` (zebra parallelism on heterogeneous pools, on the placement engine's zebra schedule),
precision (fp32 / fp16 / bf16) and activation recompute (none / selective / full) in `costs`,
`report` (table, JSON, plots). The command line is tools/simulate.py.
"""

from megatron_patches.sim.costs import (
    PRECISIONS,
    RECOMPUTE,
    CommModel,
    ComputeModel,
    Hardware,
    KernelEfficiency,
    LinkParameters,
    MemoryModel,
    MemoryNeed,
    Precision,
    SimError,
    Workload,
    select_devices,
)
from megatron_patches.sim.events import CATEGORIES, Event, Timeline
from megatron_patches.sim.report import BREAKDOWN_PARTS, SystemResult, format_table, plot, summarize, write_json
from megatron_patches.sim.scenario import Scenario, SimOptions, build_scenario, scale_counts
from megatron_patches.sim.systems import SYSTEMS, SystemSpec, replay_config, resolve_systems, simulate

__all__ = [
    "BREAKDOWN_PARTS",
    "CATEGORIES",
    "CommModel",
    "ComputeModel",
    "Event",
    "Hardware",
    "KernelEfficiency",
    "LinkParameters",
    "MemoryModel",
    "MemoryNeed",
    "PRECISIONS",
    "Precision",
    "RECOMPUTE",
    "SYSTEMS",
    "Scenario",
    "SimError",
    "SimOptions",
    "SystemResult",
    "SystemSpec",
    "Timeline",
    "Workload",
    "build_scenario",
    "format_table",
    "plot",
    "replay_config",
    "resolve_systems",
    "scale_counts",
    "select_devices",
    "simulate",
    "summarize",
    "write_json",
]
