"""Topology-aware dispatch (DESIGN 4.4): where each source device sends the tokens of each
expert (`dispatch`)."""

from __future__ import annotations

import numpy as np

from megatron_patches.placement.fssdp.quotas import replicated_quotas
from megatron_patches.placement.types import (
    DispatchPlan,
    InstancePlacement,
    PlacementError,
    Topology,
    check_loads,
)


def _northwest(group_A: np.ndarray, supply_A: np.ndarray, group_B: np.ndarray, capacity_B: np.ndarray):
    """Match supplies to capacities group by group in list order (north-west corner rule).

    Within a group the supplies A (in the given order) are laid end to end on a line, and so
    are the capacities B; the first min(total supply, total capacity) units are matched where
    the two tilings overlap, so each supplier sends to a run of consecutive receivers. Both
    lists must be sorted by group (int64 arrays).

    Returns:
        (a_K, b_K, amount_K, rest_A, rest_B): indices into A and B and the units matched, one
        entry per overlapping piece (at most len(A) + len(B) of them), and what is left
        unmatched of every supply and every capacity.
    """
    groups = int(max(group_A[-1], group_B[-1])) + 1
    total_A = np.bincount(group_A, weights=supply_A, minlength=groups).astype(np.int64)
    total_B = np.bincount(group_B, weights=capacity_B, minlength=groups).astype(np.int64)
    matched_G = np.minimum(total_A, total_B)
    base_G = np.cumsum(matched_G) - matched_G

    def tiles(group, amount, total_G):
        """[lo, hi) of each item on the common line, clipped to its group's matched units."""
        start = np.cumsum(amount) - amount - (np.cumsum(total_G) - total_G)[group]  # offset inside the group
        base, matched = base_G[group], matched_G[group]
        return base + np.minimum(start, matched), base + np.minimum(start + amount, matched)

    lo_A, hi_A = tiles(group_A, supply_A, total_A)
    lo_B, hi_B = tiles(group_B, capacity_B, total_B)
    rest_A, rest_B = supply_A - (hi_A - lo_A), capacity_B - (hi_B - lo_B)
    # both tilings are sorted and gap-free: the B items overlapping A item a are those from the
    # first ending after lo_a to the last starting before hi_a
    keep_A = np.flatnonzero(hi_A > lo_A)
    keep_B = np.flatnonzero(hi_B > lo_B)
    lo_A, hi_A, lo_B, hi_B = lo_A[keep_A], hi_A[keep_A], lo_B[keep_B], hi_B[keep_B]
    first = np.searchsorted(hi_B, lo_A, side="right")
    count = np.searchsorted(lo_B, hi_A, side="left") - first
    a = np.repeat(np.arange(keep_A.size), count)
    b = first[a] + np.arange(a.size) - np.repeat(np.cumsum(count) - count, count)
    amount = np.minimum(hi_A[a], hi_B[b]) - np.maximum(lo_A[a], lo_B[b])
    return keep_A[a], keep_B[b], amount, rest_A, rest_B


def dispatch(placement: InstancePlacement, source_loads_DE, topology: Topology) -> DispatchPlan:
    """Topology-aware token dispatch of one layer (DESIGN 4.4), with a balanced split.

    Every holder h of expert e gets a quota q[e, h] of e's tokens (`balanced_quotas`: the
    tokens of a replicated expert are water-filled over its least-loaded holders). Tokens
    then travel as DESIGN orders it, each step limited by the quotas left: a source that
    holds e keeps up to its quota of its own tokens; the rest go to e's holders on the
    source's node; what those cannot take goes to e's holders on other nodes. Within a node
    (and then across nodes), sources in ascending id fill the holders' quotas in ascending id
    (`_northwest`). An expert with a single holder sends it everything.

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
    loads_SE = check_loads(source_loads_DE, "source_loads_DE", 2)
    E, D = placement.num_experts, placement.num_devices
    if topology.num_devices != D:
        raise PlacementError(f"placement spans {D} devices but the topology has {topology.num_devices}")
    if loads_SE.shape != (D, E):
        raise PlacementError(f"source_loads_DE must have shape ({D}, {E}) (sources are the devices), got {loads_SE.shape}")
    holds_ED = placement.holds_ED()
    replicas_E = holds_ED.sum(axis=1)
    rep = np.flatnonzero(replicas_E > 1)
    first_holder_E = np.argmax(holds_ED, axis=1)
    tokens_E = loads_SE.sum(axis=0)
    pieces = []  # (flat (r, source), flat (r, destination), tokens) of the replicated experts rep[r]
    if rep.size:
        R = rep.size
        single = replicas_E == 1
        load_D = np.bincount(first_holder_E[single], weights=tokens_E[single], minlength=D).astype(np.int64)
        quota_RD = replicated_quotas(holds_ED, tokens_E, load_D, rep)
        # pairs are flat (expert index r, device) = r * D + d, which is (r, node, device) order
        # because devices are numbered node-major, as _northwest needs
        tokens_RD = loads_SE[:, rep].T
        local_RD = np.minimum(tokens_RD, quota_RD)  # quota_RD is 0 where the source holds no copy
        f_L = np.flatnonzero(local_RD)
        pieces.append((f_L, f_L, local_RD.ravel()[f_L]))
        supply_RD = (tokens_RD - local_RD).ravel()
        capacity_RD = (quota_RD - local_RD).ravel()
        f_A = np.flatnonzero(supply_RD)
        f_B = np.flatnonzero(capacity_RD)
        if f_A.size:
            # within the source's node first (groups = (expert, node)) ...
            node_group = (np.arange(R)[:, None] * topology.nodes + topology.node_of[None, :]).ravel()
            a_K, b_K, n_K, rest_A, rest_B = _northwest(
                node_group[f_A], supply_RD[f_A], node_group[f_B], capacity_RD[f_B]
            )
            pieces.append((f_A[a_K], f_B[b_K], n_K))
            # ... then across nodes (groups = experts) for what the node's holders could not take
            left_A, left_B = np.flatnonzero(rest_A), np.flatnonzero(rest_B)
            if left_A.size:
                f_A, f_B = f_A[left_A], f_B[left_B]
                a_K, b_K, n_K, _, _ = _northwest(f_A // D, rest_A[left_A], f_B // D, rest_B[left_B])
                pieces.append((f_A[a_K], f_B[b_K], n_K))

    # the single-holder experts' tokens go to their holder from every source, kept as the
    # source loads themselves (`DispatchPlan.by_owner`): at D = 1024 writing them out as entries
    # would cost more than the rest of the plan
    if pieces:
        from_P, to_P, n_P = (np.concatenate(column) for column in zip(*pieces))
        r_P, source_P = np.divmod(from_P, D)
        piece_arrays = (source_P, rep[r_P], to_P % D, n_P.astype(np.int64))
    else:
        piece_arrays = tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
    return DispatchPlan.by_owner(loads_SE, first_holder_E, replicas_E == 1, tokens_E, piece_arrays, D)
