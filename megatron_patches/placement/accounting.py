"""Accounting of plans: loads, imbalance, token survival, bytes moved, extra memory (DESIGN 3, 5).

Pure functions shared by the tests, the tools (plan CLI, simulator) and the runtime, so that
a metric means the same thing everywhere:

- device load = tokens processed by the experts on a device in a layer;
  imbalance = max device load / mean device load (1.0 is the physical limit);
- token survival = tokens processed / tokens routed;
- bytes sent and received per device, split by link class (intra-node / inter-node), for
  token all-to-all, sparse all-gather / reduce-scatter and rearrangement, under the names of
  ``TRAFFIC_KINDS``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from megatron_patches.placement.collectives import copy_stage_bytes
from megatron_patches.placement.links import CommBytes, transfer_seconds
from megatron_patches.placement.types import (
    DispatchPlan,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    Topology,
    check_int,
    check_loads,
)

__all__ = [
    "TRAFFIC_KINDS",
    "CommBytes",
    "allreduce_equivalent_bytes",
    "apply_capacity",
    "device_loads",
    "dispatch_bytes",
    "extra_memory_bytes",
    "imbalance",
    "rearrangement_bytes",
    "gather_stage_bytes",
    "sparse_all_gather_bytes",
    "sparse_all_gather_seconds",
    "sparse_reduce_scatter_bytes",
    "survival",
    "transfer_seconds",
]

TRAFFIC_KINDS = {
    "all_to_all": "the token all-to-all of dispatch and combine (every mode; the simulator's name)",
    "a2a_dispatch": "zebra's dispatch all-to-all (tokens and probabilities, and their gradients)",
    "a2a_combine": "zebra's combine all-to-all (expert outputs, and their gradients)",
    "spag": "fssdp: the sparse all-gather of the iteration's expert copies, before the gate",
    "spag_calibrate": "fssdp: calibration's extra copies, gathered after the gate",
    "spag_remat": "fssdp with re-materialization: the copies gathered again for the backward",
    "sprs": "fssdp: the sparse reduce-scatter of the copies' gradients to the owners",
    "reshard": "fssdp: experts (weights and optimizer state) moved to new owners by a re-shard",
    "reshard_edp": "fssdp, distributed optimizer over several expert groups: a departing expert's optimizer "
                   "state made whole over the expert-data-parallel group first",
    "popularity": "replicate: the per-micro-batch all-reduce of the routed counts",
    "grad_allreduce": "the replicas' gradient all-reduce among an expert's holders (static replication, "
                      "FlexMoE, SmartMoE, FasterMoE's EP replicas)",
    "grad_reduce_scatter": "replicate: every holder of an expert sends each slice owner its slice of the "
                           "expert's gradient (a sparse reduce-scatter in the EP group)",
    "grad_edp": "replicate: the slices' gradient all-reduce across replicate groups (EDP > 1)",
    "weight_scatter": "replicate: the updated weights pushed from the slice owners into the next slots",
    "rearrange": "optimizer state moved with re-placed experts (FlexMoE and SmartMoE, replicate's periodic "
                 "baseline)",
    "shadow_broadcast": "FasterMoE: a shadowed expert's weights broadcast to every device",
    "shadow_reduce": "FasterMoE: the shadows' gradients reduced to the holder",
    "dense_grad_allreduce": "the dense parameters' data-parallel gradient all-reduce (simulator)",
}
"""One name per kind of traffic, shared by the runtime's byte counters and records, the policies'
traffic and the simulator's timeline labels (tests/placement/test_accounting.py checks that each
uses only these)."""


def device_loads(plan: DispatchPlan) -> np.ndarray:
    """Tokens processed per device after a dispatch plan; int64 [D]."""
    return plan.device_loads_D()


def imbalance(loads_D) -> float:
    """max device load / mean device load.

    All-zero loads (no tokens in the layer) count as perfectly balanced, 1.0: nobody waits
    for anybody, and it keeps averages over iterations finite.
    """
    loads = np.asarray(loads_D, dtype=np.float64)
    if loads.ndim != 1 or loads.size == 0:
        raise PlacementError(f"loads_D must be a non-empty 1-D array of device loads, got shape {loads.shape}")
    if np.any(loads < 0) or not np.all(np.isfinite(loads)):
        raise PlacementError("device loads must be finite and >= 0")
    mean = loads.mean()
    return 1.0 if mean == 0 else float(loads.max() / mean)


def survival(processed: int, routed: int) -> float:
    """Token survival = processed / routed; 1.0 when nothing was routed."""
    if processed < 0 or routed < 0 or processed > routed:
        raise PlacementError(f"need 0 <= processed <= routed, got processed={processed}, routed={routed}")
    return 1.0 if routed == 0 else processed / routed


def apply_capacity(plan: DispatchPlan, placement: InstancePlacement, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens processed and dropped when every instance may process at most `capacity` tokens.

    A device holding c instances of expert e processes up to c * capacity of the tokens the
    plan sends it for e; the rest is dropped (which tokens does not matter for counting).

    Returns:
        (processed_ED, dropped_E): int64 [E, D] and int64 [E].
    """
    capacity = check_int(capacity, "capacity")
    received_ED = plan.received_ED()
    if received_ED.shape != placement.counts_ED.shape:
        raise PlacementError(
            f"plan covers (E, D) = {received_ED.shape} but the placement has {placement.counts_ED.shape}"
        )
    processed_ED = np.minimum(received_ED, capacity * placement.counts_ED)
    return processed_ED, (received_ED - processed_ED).sum(axis=1)


def dispatch_bytes(plan: DispatchPlan, topology: Topology, bytes_per_token: float) -> CommBytes:
    """Bytes of the dispatch all-to-all of a plan (tokens kept on their source device are free).

    The combine all-to-all moves the same bytes back: `dispatch_bytes(...).reversed()`.
    Requires sources to be the topology's devices (S = D).
    """
    if plan.num_sources != topology.num_devices or plan.num_devices != topology.num_devices:
        raise PlacementError(
            f"plan has {plan.num_sources} sources and {plan.num_devices} devices; the topology has {topology.num_devices}"
        )
    if not np.isfinite(bytes_per_token) or bytes_per_token < 0:
        raise PlacementError(f"bytes_per_token must be finite and >= 0, got {bytes_per_token!r}")
    if not plan.by_owner_form:
        return CommBytes.from_transfers(plan.source_K, plan.dest_K, plan.tokens_K * bytes_per_token, topology)
    # float products, truncated, as from_transfers' per-entry bytes sum: exact for whole bytes per token
    return CommBytes(*((tokens * bytes_per_token).astype(np.int64) for tokens in plan.link_tokens(topology.node_of)))


def _chunk_bytes_E(chunk_bytes, num_experts: int) -> np.ndarray:
    arr = np.broadcast_to(np.asarray(chunk_bytes, dtype=np.float64), (num_experts,))
    if np.any(arr < 0) or not np.all(np.isfinite(arr)):
        raise PlacementError(f"chunk_bytes must be finite and >= 0 (one value or one per expert), got {chunk_bytes!r}")
    return arr


def sparse_all_gather_bytes(shard: ShardLayout, placement: InstancePlacement, chunk_bytes, topology: Topology,
                            algorithm: str = "flat") -> CommBytes:
    """Bytes of SparseAllGather(P0 = shard, P1 = placement) (DESIGN 3).

    Every (expert, device) pair in P1 but not in P0 receives the expert's chunk once from the
    device `placement.collectives.copy_sources` names: the owner (flat), or on another node than
    the owner's the node's relay for the expert (hierarchical: one copy per node crosses the
    network), or for an expert every device holds and broadcast along the ring, the device's ring
    predecessor. Nothing else moves. Multiplicity in P1 does not add bytes (one copy per device
    serves all its slots).

    Args:
        shard: P0, a partition of the experts (one owner each).
        placement: P1 ⊇ P0.
        chunk_bytes: bytes of one chunk: a number, or one per expert [E].
        topology: the devices.
        algorithm: "flat" or "hierarchical".
    """
    first, ring, relays = gather_stage_bytes(shard, placement, chunk_bytes, topology, algorithm)
    return first + ring + relays


def sparse_reduce_scatter_bytes(placement: InstancePlacement, shard: ShardLayout, chunk_bytes, topology: Topology,
                                algorithm: str = "flat") -> CommBytes:
    """Bytes of SparseReduceScatter(P0 = placement, P1 = shard): every copy's gradient goes back
    the way the copy came (a relay sends one sum for its node, a ring reduces back to the owner),
    so exactly the spAG transfers reversed."""
    return sparse_all_gather_bytes(shard, placement, chunk_bytes, topology, algorithm).reversed()


def gather_stage_bytes(shard: ShardLayout, placement: InstancePlacement, chunk_bytes, topology: Topology,
                       algorithm: str = "hierarchical") -> tuple[CommBytes, CommBytes, CommBytes]:
    """The spAG's stages apart, in the runtime's order (`CopySources`): (owners' point-to-point
    sends, ring broadcasts, relays' sends inside their nodes). They add up to `sparse_all_gather_bytes`;
    the runtime starts each after the one before (`comm.relay`), so a time model adds their times
    (a stage that moves nothing costs nothing). Flat has only the first."""
    return copy_stage_bytes(shard, placement, topology, algorithm, _chunk_bytes_E(chunk_bytes, placement.num_experts))


def sparse_all_gather_seconds(shard: ShardLayout, placement: InstancePlacement, chunk_bytes, topology: Topology,
                              algorithm: str, seconds: Callable[[CommBytes], float] | None = None) -> float:
    """Time of spAG(shard -> placement) as the runtime runs it: its stages (`gather_stage_bytes`) one
    after the other, a stage that moves nothing costing nothing. `seconds` prices one stage's
    transfers (the simulator passes its link model); None: `transfer_seconds` on the topology."""
    if seconds is None:
        seconds = lambda comm: transfer_seconds(comm, topology)  # noqa: E731
    return sum(seconds(stage) for stage in gather_stage_bytes(shard, placement, chunk_bytes, topology, algorithm))


def allreduce_equivalent_bytes(placement: InstancePlacement, chunk_bytes) -> int:
    """sum over experts of 2 * (r_e - 1) * size_e, r_e = distinct devices holding e (DESIGN 3).

    The bytes a replicated-expert system's gradient AllReduce moves in the large-group limit;
    equal to the total of one spAG plus one spRS for the same placement.
    """
    size_E = _chunk_bytes_E(chunk_bytes, placement.num_experts)
    return int(round(float(np.sum(2 * (placement.replicas_E() - 1) * size_E))))


def extra_memory_bytes(placement: InstancePlacement, shard: ShardLayout, expert_bytes) -> np.ndarray:
    """Memory per device for copies beyond the owned experts; int64 [D].

    `expert_bytes` is the size of one copy (a number or one per expert [E]); e.g. bf16
    weights only for FSSDP copies (gradients of a copy add as much again during backward).
    """
    placement.require_contains(shard)
    size_E = _chunk_bytes_E(expert_bytes, placement.num_experts)
    extra_ED = placement.holds_ED().copy()
    extra_ED[np.arange(shard.num_experts), shard.owner_E] = False
    return np.round(size_E @ extra_ED).astype(np.int64)


def rearrangement_bytes(old_owner, new_owner, bytes_per_expert, topology: Topology) -> CommBytes:
    """Bytes of moving ownership from `old_owner` to `new_owner` (re-sharding, swapping, relocating).

    Every expert whose owner changes sends `bytes_per_expert` from the old owner to the new
    one: weights plus optimizer state, e.g. 16 B per parameter under Adam mixed precision
    (DESIGN 1: 2 B weight + 2 B grad + 4 B master + 4 B m + 4 B v; what is counted is the
    caller's choice). Owners may be [E] (one layer) or [L, E] (all layers);
    bytes_per_expert is a number or broadcastable to that shape.
    """
    old = check_loads(old_owner, "old_owner")
    new = check_loads(new_owner, "new_owner")
    if old.shape != new.shape:
        raise PlacementError(f"old owners have shape {old.shape} but new owners {new.shape}")
    D = topology.num_devices
    for name, arr in (("old_owner", old), ("new_owner", new)):
        if arr.size and arr.max() >= D:
            raise PlacementError(f"{name} names device {int(arr.max())}, not in [0, {D})")
    size = np.broadcast_to(np.asarray(bytes_per_expert, dtype=np.float64), old.shape)
    moved = old != new
    return CommBytes.from_transfers(old[moved], new[moved], size[moved], topology)
