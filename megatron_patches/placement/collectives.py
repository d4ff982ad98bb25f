"""Where every expert copy comes from in a sparse collective: flat or node-aware (hierarchical).

SparseAllGather(P0, P1) fills every copy in P1 that is not in P0 (DESIGN 3). Which device
sends it is the algorithm's choice:

- **flat**: every copy comes from the owner, point to point. An expert held by k devices of a
  remote node crosses that node's network link k times.
- **hierarchical** (node-aware): the copies on the owner's node come from the owner; on every
  other node that holds the expert, one holder (the node's *relay* for that expert) gets it
  from the owner, and the node's other holders get it from the relay. So each expert crosses
  into a node at most once, and the fan-out runs over the node's own links. The relay of
  expert e on a node is holder number e mod (its holders there), ascending, so the relaying of
  many experts spreads over the node's devices and every rank computes the same choice.
  An expert that **every device holds** (a hot expert copied everywhere: calibration's
  FasterMoE-style shadow, or t >= D copies) is instead broadcast along the ring of all devices
  (ascending ids, rotated to start at the owner: each device receives it from its predecessor
  and forwards it once; NCCL's pipelined ring broadcast), when that is faster than the relays
  (`ring_experts`). The relays still send it N - 1 times out of the owner's node, the ring once out
  of each node; with the experts every device holds spread evenly over their owners the relays
  are as fast or faster (each NIC sends its own experts' copies), with a few hot experts on few
  owners the ring is up to N - 1 times faster (docs/benchmarks.md, "Ring broadcast": without
  it FasterMoE's ring broadcast of the same shadows beat FSSDP on 2 of 30 simulated clusters;
  a ring whenever possible made 10 others slower).

SparseReduceScatter runs the same transfers reversed: holders on a remote node send their
gradients to the node's relay, which adds its own and sends one sum to the owner; a ring
broadcast becomes a ring reduce to the owner.

`copy_sources` returns the choice (`CopySources`: one source table plus the ring experts),
which the byte formulas (`placement.accounting.sparse_all_gather_bytes`), the runtime's
transfer plans (`comm.relay`) and the simulator all read, so the three agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement import kernels
from megatron_patches.placement.links import CommBytes, transfer_seconds
from megatron_patches.placement.types import InstancePlacement, PlacementError, ShardLayout, Topology

__all__ = ["ALGORITHMS", "CopySources", "copy_sources", "copy_stage_bytes", "relay_sources_ED", "ring_experts"]

ALGORITHMS = ("hierarchical", "flat")
"""The sparse-collective algorithms; the first is the default."""


@dataclass(frozen=True, eq=False)
class CopySources:
    """Who sends every copy of spAG(shard -> placement), in which stage.

    The runtime runs three stages one after the other (`comm.relay`): the owners' point-to-point
    sends, the ring broadcasts, the relays' sends inside their nodes (which forward what the first
    stage brought). A time model adds their times (`copy_stage_bytes`: each stage's bytes)."""

    source_ED: np.ndarray
    """source_ED[e, d]: the device that sends expert e's copy to device d; -1 where d holds no copy
    of e or owns it (nothing to receive). For a ring expert, d's predecessor on the ring. int64 [E, D]."""
    ring_E: np.ndarray
    """Experts broadcast along the ring of all devices; bool [E]."""
    owner_E: np.ndarray
    """The experts' owners (P0); int64 [E]."""


def ring_experts(ptr: np.ndarray, dev: np.ndarray, owner_E: np.ndarray, topology: Topology,
                 algorithm: str) -> np.ndarray:
    """The experts spAG broadcasts along the ring (bool [E]), from the holders in CSR form
    (`kernels.holder_lists`) and the owners (int64 [E]): those every device holds, when their ring
    beats their relays in `placement.links.transfer_seconds`' model, the stages one after the other
    (chunks of one size, so the comparison needs no byte count); none with flat collectives or
    fewer than 3 devices (with 2 a ring is one point-to-point copy)."""
    none_E = np.zeros(owner_E.size, dtype=bool)
    everywhere_E = np.diff(ptr) == topology.num_devices
    if algorithm == "flat" or topology.num_devices < 3 or not everywhere_E.any():
        return none_E
    ones_E = np.ones(owner_E.size)

    def seconds(ring_E: np.ndarray) -> float:
        stages = kernels.copy_stage_bytes(ptr, dev, owner_E, topology.devices_per_node, _relays(topology, algorithm),
                                          ring_E, ones_E, topology.node_of)
        return sum(transfer_seconds(CommBytes(*rows), topology) for rows in stages)

    return everywhere_E if seconds(everywhere_E) < seconds(none_E) else none_E


def copy_sources(shard: ShardLayout, placement: InstancePlacement, topology: Topology, algorithm: str) -> CopySources:
    """Who sends every copy in spAG(shard, placement) (see the module docstring).

    Args:
        shard: P0, the owners (a partition).
        placement: P1 ⊇ P0, who holds a copy.
        topology: the devices' nodes (node-major).
        algorithm: "hierarchical" or "flat".
    """
    source_ED = relay_sources_ED(shard, placement, topology, algorithm)
    ptr, dev = kernels.holder_lists(np.ascontiguousarray(placement.held_ED()))  # read as bytes: C order
    ring_E = ring_experts(ptr, dev, shard.owner_E.astype(np.int64), topology, algorithm)
    if ring_E.any():
        # the ring 0 -> 1 -> ... -> D-1 -> 0 started at the owner: d receives from d - 1
        source_ED[ring_E] = (np.arange(topology.num_devices) - 1) % topology.num_devices
        source_ED[ring_E, shard.owner_E[ring_E]] = -1
    return CopySources(source_ED, ring_E, shard.owner_E)


def copy_stage_bytes(shard: ShardLayout, placement: InstancePlacement, topology: Topology, algorithm: str,
                     chunk_bytes) -> tuple[CommBytes, CommBytes, CommBytes]:
    """The bytes of each stage of spAG(shard -> placement) (owners' sends, ring broadcasts, relays'
    sends) for chunks of `chunk_bytes` (a number or float [E]): the senders `copy_sources` names
    (the same relays and ring, `ring_experts`), from the holders' lists (`kernels.holder_lists`)
    without its [E, D] source table. The planners price candidate placements by their gathers'
    bytes several times per layer and iteration; at E = 256, D = 1,024 building and reading the
    source table took 0.7 ms of each pricing."""
    _check_gather(shard, placement, topology, algorithm)
    ptr, dev = kernels.holder_lists(np.ascontiguousarray(placement.held_ED()))  # read as bytes: C order
    owner_E = shard.owner_E.astype(np.int64)
    size_E = np.ascontiguousarray(np.broadcast_to(np.asarray(chunk_bytes, dtype=np.float64), owner_E.shape))
    by_stage = kernels.copy_stage_bytes(ptr, dev, owner_E, topology.devices_per_node, _relays(topology, algorithm),
                                        ring_experts(ptr, dev, owner_E, topology, algorithm), size_E, topology.node_of)
    return tuple(CommBytes(*rows) for rows in by_stage)


def _check_gather(shard: ShardLayout, placement: InstancePlacement, topology: Topology, algorithm: str) -> None:
    """Raises PlacementError unless `algorithm` is one of ALGORITHMS, `placement` contains `shard`
    and spans the topology's devices."""
    if algorithm not in ALGORITHMS:
        raise PlacementError(f"unknown sparse-collective algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    placement.require_contains(shard)
    if topology.num_devices != placement.num_devices:
        raise PlacementError(f"placement spans {placement.num_devices} devices but the topology has {topology.num_devices}")


def _relays(topology: Topology, algorithm: str) -> bool:
    """Whether copies for another node go through a relay there (hierarchical, more than one node)."""
    return algorithm == "hierarchical" and topology.nodes > 1


def relay_sources_ED(shard: ShardLayout, placement: InstancePlacement, topology: Topology, algorithm: str) -> np.ndarray:
    """source_ED[e, d]: the device that sends expert e's copy to device d point to point, from the
    owner or (hierarchical) a node's relay, without ring broadcasts (`copy_sources` adds them).

    -1 where d holds no copy of e or owns it (nothing to receive). int64 [E, D].

    Args:
        shard: P0, the owners (a partition).
        placement: P1 ⊇ P0, who holds a copy.
        topology: the devices' nodes (node-major).
        algorithm: "hierarchical" or "flat" (see the module docstring).
    """
    _check_gather(shard, placement, topology, algorithm)
    return kernels.relay_sources(placement.held_ED(), shard.owner_E.astype(np.int64), topology.devices_per_node,
                                 _relays(topology, algorithm))
