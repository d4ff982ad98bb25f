"""Topology-aware dispatch (DESIGN 4.4): where each source device sends the tokens of each
expert (`dispatch`)."""

from __future__ import annotations

import numpy as np

from megatron_patches.placement.fssdp.quotas import replicated_quotas, split_holders
from megatron_patches.placement.types import (
    DispatchPlan,
    InstancePlacement,
    PlacementError,
    Topology,
    check_source_loads,
)


def dispatch(placement: InstancePlacement, source_loads_DE, topology: Topology) -> DispatchPlan:
    """Topology-aware token dispatch of one layer (DESIGN 4.4), with a balanced split.

    Every holder h of expert e gets a quota q[e, h] of e's tokens (`balanced_quotas`: the
    tokens of a replicated expert are water-filled over its least-loaded holders). Tokens
    then travel as DESIGN orders it, each step limited by the quotas left: a source that
    holds e keeps up to its quota of its own tokens; the rest go to e's holders on the
    source's node; what those cannot take goes to e's holders on other nodes. Within a node
    (and then across nodes), sources in ascending id fill the holders' quotas in ascending id
    (the north-west corner rule, `kernels.route_replicated`). An expert with a single holder
    sends it everything.

    Deviation from DESIGN 4.4, which keeps every local token local and splits the rest
    evenly: a device that holds a copy but is already busy with its own experts then
    processes all its local tokens, and an even split ignores how loaded each holder is.
    The quotas balance much better at the price of some inter-node all-to-all bytes
    (docs/benchmarks.md, "Dispatch split"): the tokens beyond a node's quotas. Given the
    quotas the routing keeps that crossing to the minimum: the tokens
    expert e sends from node n to other nodes are exactly max(0, tokens of e on n - quotas of
    e on n).

    Args:
        placement: instances of the layer's experts (multiplicity is ignored: a device with two
            instances of an expert counts once, since it processes them in one batch).
        source_loads_DE: tokens per (source device, expert), int [D, E], >= 0.
        topology: the devices; D must match the placement.
    Returns:
        A DispatchPlan with one entry per (source, single-holder expert), possibly with 0
        tokens, plus the local, intra-node and inter-node pieces of the replicated experts.
    """
    loads_SE, tokens_E, sent_S = check_source_loads(source_loads_DE, "source_loads_DE")
    E, D = placement.num_experts, placement.num_devices
    if topology.num_devices != D:
        raise PlacementError(f"placement spans {D} devices but the topology has {topology.num_devices}")
    if loads_SE.shape != (D, E):
        raise PlacementError(f"source_loads_DE must have shape ({D}, {E}) (sources are the devices), got {loads_SE.shape}")
    return plan_dispatch(placement.held_ED(), loads_SE, tokens_E, topology, sent_S)


def plan_dispatch(held_ED: np.ndarray, loads_SE: np.ndarray, tokens_E: np.ndarray, topology: Topology,
                  sent_S: np.ndarray | None = None) -> DispatchPlan:
    """`dispatch` of checked inputs: holdings bool [E, D] (every expert held), the loads int64 [D, E]
    (read-only) and their column sums `tokens_E`, optionally their row sums `sent_S`. Calibration
    prices several candidate placements on one layer's loads; validating and summing the loads
    once instead of per candidate saves 0.3 ms of each at E = 256, D = 1,024."""
    D = held_ED.shape[1]
    holders = split_holders(held_ED, tokens_E)
    quota_RD = replicated_quotas(holders, tokens_E) if holders.rep.size else np.zeros((0, D), dtype=np.int64)
    # the plan keeps the loads and the quotas: the single-holder experts' tokens go to their
    # holder from every source, the replicated experts' are routed as above when asked
    # (`DispatchPlan.by_owner`): at D = 1024 writing every piece out would cost more than the
    # rest of the plan, and a rank needs only its own row
    node_start = np.searchsorted(topology.node_of, np.arange(topology.nodes + 1))
    return DispatchPlan.by_owner(loads_SE, holders.holder_E, holders.single_E, tokens_E, holders.rep, quota_RD,
                                 node_start.astype(np.int64), D, sent_S)
