"""Pure, deterministic planning for load-adaptive MoE expert placement (numpy only).

Types (topology, shard layouts, instance placements, dispatch plans) and the planning
algorithms of DESIGN.md section 4. No torch, no Megatron: the same inputs give the same
plan on every rank, so ranks never need to broadcast a plan.

Modules: `types` (the vocabulary), `loads` (prediction), `fssdp` (materialization,
calibration, sharding, dispatch), `replicate` (replica counts, slots, gradient sources,
token spreading), `accounting` (metrics and bytes), `trace` / `synthetic` (load traces).
"""

from megatron_patches.placement.accounting import (
    CommBytes,
    allreduce_equivalent_bytes,
    apply_capacity,
    device_loads,
    dispatch_bytes,
    extra_memory_bytes,
    imbalance,
    rearrangement_bytes,
    sparse_all_gather_bytes,
    sparse_reduce_scatter_bytes,
    survival,
)
from megatron_patches.placement.fssdp import (
    CalibrationCost,
    calibrate,
    dispatch,
    even_shard,
    gather_bandwidth,
    heterogeneous_shard,
    materialize,
    memory_capacity,
    overlap_degree,
    proportional_copies,
    shard_slots_D,
)
from megatron_patches.placement.loads import LoadTracker
from megatron_patches.placement.replicate import (
    TokenSpread,
    assign_slots,
    contiguous_rank_groups,
    expert_rank_ranges,
    gradient_source,
    gradient_source_table,
    instance_capacity,
    replica_counts,
    slot_placement,
    spread_tokens,
)
from megatron_patches.placement.synthetic import synthetic_trace
from megatron_patches.placement.trace import Trace, TraceError, read_trace, write_trace
from megatron_patches.placement.types import (
    DispatchPlan,
    ElementShardLayout,
    InstancePlacement,
    ModelShardLayout,
    PlacementError,
    ShardLayout,
    Topology,
    check_int,
    check_loads,
    even_shares,
)

__all__ = [
    "CalibrationCost",
    "CommBytes",
    "DispatchPlan",
    "ElementShardLayout",
    "InstancePlacement",
    "LoadTracker",
    "ModelShardLayout",
    "PlacementError",
    "ShardLayout",
    "TokenSpread",
    "Topology",
    "Trace",
    "TraceError",
    "allreduce_equivalent_bytes",
    "apply_capacity",
    "assign_slots",
    "calibrate",
    "check_int",
    "check_loads",
    "contiguous_rank_groups",
    "device_loads",
    "dispatch",
    "dispatch_bytes",
    "even_shard",
    "even_shares",
    "expert_rank_ranges",
    "extra_memory_bytes",
    "gather_bandwidth",
    "gradient_source",
    "gradient_source_table",
    "heterogeneous_shard",
    "imbalance",
    "instance_capacity",
    "materialize",
    "memory_capacity",
    "overlap_degree",
    "proportional_copies",
    "read_trace",
    "rearrangement_bytes",
    "replica_counts",
    "shard_slots_D",
    "slot_placement",
    "sparse_all_gather_bytes",
    "sparse_reduce_scatter_bytes",
    "spread_tokens",
    "survival",
    "synthetic_trace",
    "write_trace",
]
