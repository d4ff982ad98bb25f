"""Pure, deterministic planning for load-adaptive MoE expert placement (numpy only).

Types (topology, shard layouts, instance placements, dispatch plans) and the planning
algorithms of DESIGN.md section 4. No torch, no Megatron: the same inputs give the same
plan on every rank, so ranks never need to broadcast a plan.
"""

from megatron_patches.placement.types import (
    DispatchPlan,
    ElementShardLayout,
    InstancePlacement,
    ModelShardLayout,
    PlacementError,
    ShardLayout,
    Topology,
    check_loads,
)

__all__ = [
    "DispatchPlan",
    "ElementShardLayout",
    "InstancePlacement",
    "ModelShardLayout",
    "PlacementError",
    "ShardLayout",
    "Topology",
    "check_loads",
]
