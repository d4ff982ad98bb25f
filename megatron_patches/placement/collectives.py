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

SparseReduceScatter runs the same transfers reversed: holders on a remote node send their
gradients to the node's relay, which adds its own and sends one sum to the owner.

`copy_sources_ED` returns the choice as one table, which the byte formulas
(`placement.accounting.sparse_all_gather_bytes`), the runtime's transfer plans
(`comm.transfers.plan_relay_transfers`) and the simulator all read, so the three agree.
"""

from __future__ import annotations

import numpy as np

from megatron_patches.placement.types import InstancePlacement, PlacementError, ShardLayout, Topology

__all__ = ["ALGORITHMS", "copy_sources_ED"]

ALGORITHMS = ("hierarchical", "flat")
"""The sparse-collective algorithms; the first is the default."""


def copy_sources_ED(shard: ShardLayout, placement: InstancePlacement, topology: Topology, algorithm: str) -> np.ndarray:
    """source_ED[e, d]: the device that sends expert e's copy to device d in spAG(shard, placement).

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
    owner_E = shard.owner_E
    holds_ED = placement.holds_ED().astype(bool)
    receives_ED = holds_ED.copy()
    receives_ED[np.arange(owner_E.size), owner_E] = False
    source_ED = np.where(receives_ED, owner_E[:, None], -1).astype(np.int64)
    if algorithm == "flat" or topology.nodes == 1:
        return source_ED
    E, N, P = owner_E.size, topology.nodes, topology.devices_per_node
    receives_ENP = receives_ED.reshape(E, N, P)
    # (expert, node) pairs served by a relay: the node holds copies and is not the owner's
    relayed_EN = receives_ENP.any(axis=2) & (owner_E[:, None] // P != np.arange(N)[None, :])
    count_EN = np.maximum(receives_ENP.sum(axis=2), 1)
    position_ENP = np.cumsum(receives_ENP, axis=2) - 1  # a holder's place among its node's holders
    is_relay_ENP = receives_ENP & relayed_EN[:, :, None] & (position_ENP == (np.arange(E)[:, None] % count_EN)[:, :, None])
    relay_EN = np.argmax(is_relay_ENP, axis=2) + np.arange(N)[None, :] * P
    source_ENP = source_ED.reshape(E, N, P)
    source_ENP[receives_ENP & relayed_EN[:, :, None]] = np.broadcast_to(relay_EN[:, :, None], (E, N, P))[
        receives_ENP & relayed_EN[:, :, None]]
    source_ENP[is_relay_ENP] = np.broadcast_to(owner_E[:, None, None], (E, N, P))[is_relay_ENP]
    return source_ENP.reshape(E, N * P)
