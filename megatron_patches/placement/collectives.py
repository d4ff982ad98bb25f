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
  (`ring_pays`). The relays still send it N - 1 times out of the owner's node, the ring once out
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

__all__ = ["ALGORITHMS", "CopySources", "copy_sources", "copy_stage_bytes", "relay_sources_ED", "ring_pays"]

ALGORITHMS = ("hierarchical", "flat")
"""The sparse-collective algorithms; the first is the default."""


@dataclass(frozen=True, eq=False)
class CopySources:
    """Who sends every copy of spAG(shard -> placement), in which stage.

    The runtime runs three stages one after the other (`comm.relay`): the owners' point-to-point
    sends, the ring broadcasts, the relays' sends inside their nodes (which forward what the first
    stage brought). A time model adds their times (`stages_ED`, `stage_bytes`)."""

    source_ED: np.ndarray
    """source_ED[e, d]: the device that sends expert e's copy to device d; -1 where d holds no copy
    of e or owns it (nothing to receive). For a ring expert, d's predecessor on the ring. int64 [E, D]."""
    ring_E: np.ndarray
    """Experts broadcast along the ring of all devices; bool [E]."""
    owner_E: np.ndarray
    """The experts' owners (P0); int64 [E]."""

    def stages_ED(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The transfers of each stage in the runtime's order, as bool [E, D] masks of the
        (expert, receiving device) pairs: the owners' point-to-point sends, the ring broadcasts,
        the relays' sends."""
        receives_ED = self.source_ED >= 0
        ring_ED = receives_ED & self.ring_E[:, None]
        from_owner_ED = receives_ED & ~ring_ED & (self.source_ED == self.owner_E[:, None])
        return from_owner_ED, ring_ED, receives_ED & ~ring_ED & ~from_owner_ED

    def stage_bytes(self, chunk_bytes, topology: Topology) -> tuple[CommBytes, CommBytes, CommBytes]:
        """The bytes of each stage (`stages_ED`) for chunks of `chunk_bytes` (a number or float [E])."""
        size_E = np.ascontiguousarray(np.broadcast_to(np.asarray(chunk_bytes, dtype=np.float64), self.ring_E.shape))
        by_stage = kernels.stage_bytes(self.source_ED, self.ring_E, self.owner_E, size_E, topology.node_of)
        return tuple(CommBytes(*rows) for rows in by_stage)


def ring_pays(relayed: CopySources, ringed: CopySources, topology: Topology) -> bool:
    """Whether the ring broadcasts of `ringed` beat the relays of `relayed` (the same copies) in
    `placement.links.transfer_seconds`' model, the stages one after the other. Chunks are of equal
    size, so the comparison needs no byte count."""

    def seconds(sources: CopySources) -> float:
        return sum(transfer_seconds(stage, topology) for stage in sources.stage_bytes(1.0, topology))

    return seconds(ringed) < seconds(relayed)


def copy_sources(shard: ShardLayout, placement: InstancePlacement, topology: Topology, algorithm: str) -> CopySources:
    """Who sends every copy in spAG(shard, placement) (see the module docstring).

    Args:
        shard: P0, the owners (a partition).
        placement: P1 ⊇ P0, who holds a copy.
        topology: the devices' nodes (node-major).
        algorithm: "hierarchical" or "flat".
    """
    relayed = CopySources(relay_sources_ED(shard, placement, topology, algorithm),
                          np.zeros(shard.num_experts, dtype=bool), shard.owner_E)
    everywhere_E = placement.held_ED().all(axis=1)
    D = topology.num_devices
    if algorithm == "flat" or D < 3 or not everywhere_E.any():
        return relayed  # with 2 devices a ring is one point-to-point copy
    source_ED = relayed.source_ED.copy()
    # the ring 0 -> 1 -> ... -> D-1 -> 0 started at the owner: d receives from d - 1
    source_ED[everywhere_E] = (np.arange(D) - 1) % D
    source_ED[everywhere_E, shard.owner_E[everywhere_E]] = -1
    ringed = CopySources(source_ED, everywhere_E, shard.owner_E)
    return ringed if ring_pays(relayed, ringed, topology) else relayed


def copy_stage_bytes(shard: ShardLayout, placement: InstancePlacement, topology: Topology, algorithm: str,
                     chunk_bytes) -> tuple[CommBytes, CommBytes, CommBytes]:
    """`copy_sources(...).stage_bytes(chunk_bytes, topology)` without the [E, D] source table:
    the same choice of senders (and of the ring, by `ring_pays`' rule) and the same bytes, from
    the holders' lists (`kernels.holder_lists`). The planners price candidate placements by
    their gathers' bytes several times per layer and iteration; at E = 256, D = 1,024 building
    and reading the source table took 0.7 ms of each pricing."""
    if algorithm not in ALGORITHMS:
        raise PlacementError(f"unknown sparse-collective algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    placement.require_contains(shard)
    if topology.num_devices != placement.num_devices:
        raise PlacementError(
            f"placement spans {placement.num_devices} devices but the topology has {topology.num_devices}")
    held_ED = placement.held_ED()
    ptr, dev = kernels.holder_lists(np.ascontiguousarray(held_ED))  # read as bytes: C order
    owner_E = shard.owner_E.astype(np.int64)
    D, P = topology.num_devices, topology.devices_per_node
    relays = algorithm == "hierarchical" and topology.nodes > 1
    size_E = np.ascontiguousarray(np.broadcast_to(np.asarray(chunk_bytes, dtype=np.float64), owner_E.shape))
    no_ring_E = np.zeros(owner_E.size, dtype=bool)
    everywhere_E = np.diff(ptr) == D
    ring_E = no_ring_E
    if algorithm != "flat" and D >= 3 and everywhere_E.any():
        ones_E = np.ones(owner_E.size)

        def seconds(ring):
            unit = kernels.copy_stage_bytes(ptr, dev, owner_E, P, relays, ring, ones_E, topology.node_of)
            return sum(transfer_seconds(CommBytes(*rows), topology) for rows in unit)

        if seconds(everywhere_E) < seconds(no_ring_E):
            ring_E = everywhere_E
    by_stage = kernels.copy_stage_bytes(ptr, dev, owner_E, P, relays, ring_E, size_E, topology.node_of)
    return tuple(CommBytes(*rows) for rows in by_stage)


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
    if algorithm not in ALGORITHMS:
        raise PlacementError(f"unknown sparse-collective algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    placement.require_contains(shard)
    if topology.num_devices != placement.num_devices:
        raise PlacementError(f"placement spans {placement.num_devices} devices but the topology has {topology.num_devices}")
    relays = algorithm == "hierarchical" and topology.nodes > 1
    return kernels.relay_sources(placement.held_ED(), shard.owner_E.astype(np.int64), topology.devices_per_node, relays)
