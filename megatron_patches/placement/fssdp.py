"""FSSDP planning (DESIGN 4.2-4.4): materialization, calibration, heterogeneous sharding, dispatch.

FSSDP keeps exactly one owner per expert (the shard layout) and, every iteration and layer,
materializes extra copies of the experts predicted to be busy so that their tokens can be
processed on several devices. This module decides

- how many copies may be fetched while attention runs (`overlap_degree`, t) and how many fit
  in memory (`memory_capacity`, m);
- which experts get copies on which devices (`materialize`, DESIGN 4.2) and whether one more
  gather after the gate pays off (`calibrate`, 4.2 step 4);
- who owns which expert of every layer (`heterogeneous_shard`, 4.3; `even_shard`);
- where each source device sends the tokens of each expert (`dispatch`, 4.4).

All functions are pure and deterministic: every rank computes the same plan from the same
(all-reduced) loads. Ties are always broken towards the lower expert / node / device id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement.types import (
    DispatchPlan,
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
    "calibrate",
    "dispatch",
    "even_shard",
    "gather_bandwidth",
    "heterogeneous_shard",
    "materialize",
    "memory_capacity",
    "overlap_degree",
    "proportional_copies",
    "shard_slots_D",
]


def _check_weights(weights, name: str, size: int | None = None) -> np.ndarray:
    """Non-negative finite float loads (predictions may be fractional); float64 1-D."""
    arr = np.asarray(weights, dtype=np.float64)
    if arr.ndim != 1:
        raise PlacementError(f"{name} must be 1-D (one load per expert), got shape {arr.shape}")
    if size is not None and arr.size != size:
        raise PlacementError(f"{name} has {arr.size} entries but the layer has {size} experts")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        raise PlacementError(f"{name}[{int(bad[0])}] = {arr[bad[0]]!r}; loads must be finite and >= 0")
    return arr


def _descending(weights: np.ndarray) -> np.ndarray:
    """Indices by descending weight, ties towards the lower index."""
    return np.argsort(-weights, kind="stable")


# ----------------------------------------------------------------------------------------
# t and m
# ----------------------------------------------------------------------------------------


def gather_bandwidth(topology: Topology) -> float:
    """Bandwidth (bytes/s) that bounds how fast copies arrive during attention.

    DESIGN 4.2 uses the inter-node bandwidth when inter-node links are much slower than
    intra-node ones, else the uniform device bandwidth. A spAG that spans nodes is limited by
    its slowest link class either way, so with more than one node this is
    min(intra, inter); on one node it is the intra-node bandwidth.
    """
    if topology.nodes == 1:
        return topology.intra_node_bw
    return min(topology.intra_node_bw, topology.inter_node_bw)


def overlap_degree(t_non_moe_s: float, bandwidth: float, expert_bytes: float, num_experts: int) -> int:
    """t = floor(T_nonMoE * bw / expert_bytes), clamped to [0, num_experts] (DESIGN 4.2).

    t is how many expert copies a device can receive while the non-MoE computation that
    precedes the MoE layer runs, so their gather is hidden.

    Args:
        t_non_moe_s: time of the non-MoE part of a layer (attention etc.), seconds, >= 0.
        bandwidth: bytes/s available to the gather (see `gather_bandwidth`), > 0.
        expert_bytes: bytes of one expert's parameters, > 0.
        num_experts: E; t never exceeds it.
    """
    for name, value, positive in (
        ("t_non_moe_s", t_non_moe_s, False),
        ("bandwidth", bandwidth, True),
        ("expert_bytes", expert_bytes, True),
    ):
        if not np.isfinite(value) or value < 0 or (positive and value == 0):
            raise PlacementError(f"overlap_degree: {name} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")
    num_experts = check_int(num_experts, "overlap_degree: num_experts", 1)
    # a relative epsilon so that e.g. 0.3 s * 10 B/s / 1 B = 2.9999999999999996 counts as 3
    t = int(np.floor(t_non_moe_s * bandwidth / expert_bytes * (1 + 1e-12)))
    return min(t, num_experts)


def memory_capacity(free_bytes, expert_bytes: float):
    """m = floor(free_bytes / expert_bytes): extra expert copies that fit in free memory.

    `free_bytes` may be a number (-> int) or an array per device (-> int64 array). Negative
    free memory (already over budget) gives 0 copies.
    """
    if not np.isfinite(expert_bytes) or expert_bytes <= 0:
        raise PlacementError(f"memory_capacity: expert_bytes must be finite and > 0, got {expert_bytes!r}")
    free = np.asarray(free_bytes, dtype=np.float64)
    if not np.all(np.isfinite(free)):
        raise PlacementError(f"memory_capacity: free_bytes must be finite, got {free_bytes!r}")
    m = np.floor(np.maximum(free, 0.0) / expert_bytes).astype(np.int64)
    return int(m) if m.ndim == 0 else m


# ----------------------------------------------------------------------------------------
# Sparse materialization (4.2)
# ----------------------------------------------------------------------------------------


def proportional_copies(weights, total: int, cap) -> np.ndarray:
    """Split `total` copies over experts in proportion to `weights`, each at most `cap`.

    Largest-remainder rounding: every expert first gets floor(goal), then the copies left over
    go one each to the largest fractional parts (ties: heavier expert, then lower index).
    An expert whose goal reaches its cap is fixed at the cap and the copies it cannot take
    are re-split over the others (water-filling), so slots are not wasted on a capped expert.
    Experts with weight 0 get nothing; the result sums to min(total, sum of caps of experts
    with positive weight). Terminates: each pass either fixes >= 1 expert at its cap or ends.

    Args:
        weights: float [K], >= 0.
        total: copies to hand out, >= 0.
        cap: int or int [K], >= 0, most copies per expert.
    Returns:
        int64 [K] copies per expert.
    """
    weights = _check_weights(weights, "weights")
    total = check_int(total, "total")
    cap_K = np.broadcast_to(np.asarray(cap, dtype=np.int64), weights.shape).copy()
    if np.any(cap_K < 0):
        raise PlacementError(f"cap must be >= 0, got {cap!r}")
    copies = np.zeros(weights.size, dtype=np.int64)
    active = (weights > 0) & (cap_K > 0)
    remaining = total
    while remaining > 0 and active.any():
        w_active = weights[active].sum()
        goal = np.zeros(weights.size)
        goal[active] = weights[active] * (remaining / w_active)
        capped = active & (goal >= cap_K)
        if capped.any():
            copies[capped] = cap_K[capped]
            remaining -= int(cap_K[capped].sum())
            active &= ~capped
            continue
        base = np.floor(goal).astype(np.int64)
        leftover = remaining - int(base.sum())
        frac = goal - base
        # order active experts by (larger fraction, larger weight, lower index)
        idx = np.flatnonzero(active)
        order = idx[np.lexsort((idx, -weights[idx], -frac[idx]))]
        base[order[:leftover]] += 1
        copies += base
        remaining = 0
    return copies


def _place_copies(holds_ED: np.ndarray, free_D: np.ndarray, experts, copies, topology: Topology) -> None:
    """Place copies of `experts` (in the given order) onto devices; updates holds_ED and free_D.

    DESIGN 4.2 step 3: node by node, preferring nodes that do not yet hold the expert and
    have more free slots, then devices within the node with more free slots. Implemented as a
    round robin over nodes (one vectorised sort per expert instead of a loop per copy): a
    node's eligible devices (free slot, no copy of the expert yet) are ranked by (more free
    slots, lower id), giving each a round number 0, 1, 2, ...; a node that already holds the
    expert starts at round 1. Copies go to devices by (round, more free slots on the node,
    lower node id). So the first copies land on distinct nodes that lack the expert, the
    fullest nodes first, and a node gets a second copy only when every node has one. An
    expert gets fewer copies than asked when fewer eligible devices remain.
    """
    N, P = topology.nodes, topology.devices_per_node
    node_of = topology.node_of
    for e, c in zip(experts, copies):
        if c <= 0:
            continue
        eligible = np.flatnonzero((free_D > 0) & ~holds_ED[e])
        if eligible.size <= c:
            chosen = eligible
        else:
            free_el = free_D[eligible]
            node_el = node_of[eligible]
            fmax = int(free_el.max())
            # sort eligible devices by (node, more free, lower id): eligible is ascending by id
            by_node = np.argsort(node_el * (fmax + 1) + (fmax - free_el), kind="stable")
            dev = eligible[by_node]
            node = node_el[by_node]
            group_start = np.searchsorted(node, node, side="left")
            rank_in_node = np.arange(dev.size) - group_start
            node_holds_N = holds_ED[e].reshape(N, P).any(axis=1)
            node_free_N = np.bincount(node, weights=free_D[dev], minlength=N).astype(np.int64)
            nfmax = int(node_free_N.max())
            rounds = rank_in_node + node_holds_N[node]
            key = (rounds * (nfmax + 1) + (nfmax - node_free_N[node])) * N + node
            chosen = dev[np.argsort(key, kind="stable")[:c]]
        holds_ED[e, chosen] = True
        free_D[chosen] -= 1


def _check_layer_inputs(shard: ShardLayout, topology: Topology, loads, name: str) -> np.ndarray:
    if shard.num_devices != topology.num_devices:
        raise PlacementError(
            f"shard layout spans {shard.num_devices} devices but the topology has {topology.num_devices}"
        )
    return _check_weights(loads, name, shard.num_experts)


def materialize(
    shard: ShardLayout, predicted_loads_E, t: int, m: int, topology: Topology
) -> InstancePlacement:
    """Sparse materialization of one layer (DESIGN 4.2 steps 1-3).

    Args:
        shard: the owners P of the layer's experts.
        predicted_loads_E: predicted tokens per expert, float or int [E], >= 0.
        t: overlap degree (copies a device can receive during attention), >= 0.
        m: memory capacity (extra copies that fit on a device), >= 0.
        topology: the devices; must match shard.num_devices.
    Returns:
        P' ⊇ P with every device holding at most m extra copies (after m <- min(m, t)).

    Steps: t <- min(t, E); m <- min(m, t). If t <= m, the top-t experts by predicted load are
    materialized on every device. Otherwise the D*m slots are split over the top-t experts in
    proportion to their loads (`proportional_copies`, at most D-1 extra copies each) and
    placed by `_place_copies`. Ties in load go to the lower expert id.
    """
    loads_E = _check_layer_inputs(shard, topology, predicted_loads_E, "predicted_loads_E")
    t = min(check_int(t, "overlap degree t"), shard.num_experts)
    m = min(check_int(m, "memory capacity m"), t)
    D = shard.num_devices
    holds_ED = shard.holds_ED().astype(bool)
    top = _descending(loads_E)[:t]
    if t <= m:
        holds_ED[top, :] = True
    elif m > 0:
        copies = proportional_copies(loads_E[top], D * m, D - 1)
        free_D = np.full(D, m, dtype=np.int64)
        _place_copies(holds_ED, free_D, top, copies, topology)
    return InstancePlacement(holds_ED.astype(np.int64))


# ----------------------------------------------------------------------------------------
# Calibration (4.2 step 4)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationCost:
    """Cost model that decides whether the calibration gather pays off.

    MoE time of a layer is modelled as (max device load) * seconds_per_token: the slowest
    device decides when the combine all-to-all can finish. The extra gather is on the
    critical path; its time is the busiest device's transfer time (the larger of what it
    receives and what it sends, each link at its topology bandwidth) plus a fixed latency.
    """

    seconds_per_token: float
    """Expert compute time of one routed token on one device, seconds (fwd, or fwd+bwd if the copy
    also serves the backward)."""
    expert_bytes: float
    """Bytes of one expert's parameters (what one extra copy moves)."""
    latency_s: float = 0.0
    """Fixed cost of launching one more sparse all-gather, seconds."""

    def __post_init__(self) -> None:
        for name in ("seconds_per_token", "expert_bytes", "latency_s"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise PlacementError(f"CalibrationCost.{name} must be finite and >= 0, got {value!r}")


def _even_split_loads_D(holds_ED: np.ndarray, loads_E: np.ndarray) -> np.ndarray:
    """Device loads if each expert's tokens were split evenly over its holders; float [D]."""
    replicas_E = holds_ED.sum(axis=1)
    share_E = np.divide(loads_E, replicas_E, out=np.zeros_like(loads_E), where=replicas_E > 0)
    return share_E @ holds_ED


def _gather_seconds(new_ED: np.ndarray, owner_E: np.ndarray, topology: Topology, expert_bytes: float) -> float:
    """Transfer time of gathering the new copies new_ED from their owners (busiest device)."""
    e_idx, d_idx = np.nonzero(new_ED)
    if e_idx.size == 0:
        return 0.0
    src = owner_E[e_idx]
    bw = np.where(topology.same_node(src, d_idx), topology.intra_node_bw, topology.inter_node_bw)
    seconds = expert_bytes / bw
    D = topology.num_devices
    recv_D = np.bincount(d_idx, weights=seconds, minlength=D)
    send_D = np.bincount(src, weights=seconds, minlength=D)
    return float(max(recv_D.max(), send_D.max()))


def calibrate(
    current: InstancePlacement,
    shard: ShardLayout,
    actual_loads_E,
    remaining_m,
    topology: Topology,
    cost: CalibrationCost,
) -> tuple[InstancePlacement, bool]:
    """Calibration after the gate (DESIGN 4.2 step 4), as a pure function.

    Reruns the materialization with the actual loads and the memory still free, only adding
    copies to the current placement (copies already gathered cost nothing to keep). The target
    is instances proportional to the actual loads: with R = current instances + free slots,
    expert e should have goal_e = R * load_e / sum(load); the free slots are split over the
    deficits max(goal_e - replicas_e, 0) by `proportional_copies` (each expert at most on every
    device) and placed by the same node-aware rule as `materialize`, heaviest expert first.

    Decision: with MoE time = max device load * seconds_per_token, where device loads are
    estimated by splitting each expert's tokens evenly over its holders, the saving is
    (before - after) * seconds_per_token. The gather cost is `_gather_seconds` + latency.
    The extra gather is done only if the saving is strictly larger.

    Args:
        current: placement materialized from the prediction (must contain `shard`).
        shard: owners of the layer's experts.
        actual_loads_E: tokens per expert measured after the gate, int or float [E], >= 0.
        remaining_m: extra copies that still fit per device, int or int [D], >= 0.
        topology: the devices.
        cost: the cost model.
    Returns:
        (placement, do_extra_gather): the calibrated placement and True if it pays off, else
        (current, False).
    """
    loads_E = _check_layer_inputs(shard, topology, actual_loads_E, "actual_loads_E")
    current.require_contains(shard)
    D = topology.num_devices
    free_D = np.broadcast_to(np.asarray(remaining_m, dtype=np.int64), (D,)).copy()
    if np.any(free_D < 0):
        d = int(np.flatnonzero(free_D < 0)[0])
        raise PlacementError(f"remaining memory capacity of device {d} is {int(free_D[d])}; it must be >= 0")
    holds_ED = current.holds_ED().copy()
    total_load = loads_E.sum()
    if total_load == 0 or free_D.sum() == 0:
        return current, False
    replicas_E = holds_ED.sum(axis=1)
    goal_E = (replicas_E.sum() + free_D.sum()) * loads_E / total_load
    deficit_E = np.maximum(goal_E - replicas_E, 0.0)
    copies_E = proportional_copies(deficit_E, int(free_D.sum()), D - replicas_E)
    order = _descending(loads_E)
    _place_copies(holds_ED, free_D, order, copies_E[order], topology)
    new_ED = holds_ED & ~current.holds_ED()
    if not new_ED.any():
        return current, False
    saved = (_even_split_loads_D(current.holds_ED(), loads_E).max() - _even_split_loads_D(holds_ED, loads_E).max())
    saved_s = saved * cost.seconds_per_token
    gather_s = _gather_seconds(new_ED, shard.owner_E, topology, cost.expert_bytes) + cost.latency_s
    if saved_s > gather_s:
        return InstancePlacement(current.counts_ED + new_ED.astype(np.int64)), True
    return current, False


# ----------------------------------------------------------------------------------------
# Sharding (4.3)
# ----------------------------------------------------------------------------------------


def even_shard(num_layers: int, num_experts: int, num_devices: int) -> ModelShardLayout:
    """Homogeneous sharding: every layer split into contiguous expert blocks (EP's layout)."""
    return ModelShardLayout.even(num_layers, num_experts, num_devices)


def shard_slots_D(num_layers: int, num_experts: int, num_devices: int) -> np.ndarray:
    """Owned-expert slots per device for heterogeneous sharding; int64 [D].

    S = L*E/D per device when divisible. Otherwise the first (L*E mod D) devices get
    floor(L*E/D) + 1 and the rest floor(L*E/D), so memory differs by at most one expert.
    """
    total = num_layers * num_experts
    slots = np.full(num_devices, total // num_devices, dtype=np.int64)
    slots[: total % num_devices] += 1
    return slots


def heterogeneous_shard(loads_LE, t: int, topology: Topology) -> ModelShardLayout:
    """Heterogeneous, memory-balanced sharding of all MoE layers at once (DESIGN 4.3).

    1. Per layer, J = the top-t experts by load (they get materialized widely anyway), J' = rest.
    2. Device d gets `shard_slots_D` slots (S = L*E/D when divisible).
    3. J' first: layers by descending maximum expert load (ties: lower layer), experts by
       descending load (ties: lower id); each goes to the least-loaded node (load = sum of
       this layer's experts already owned there; ties: fewer free slots, then lower id) among
       nodes with a free slot, then to the least-loaded device of that node (same tie rule).
    4. J fills the remaining slots: layers in index order, experts by descending load; each
       goes to the device owning the fewest experts of that layer, ties: more free slots,
       then lower id. ("Arbitrarily" in DESIGN; spreading J keeps the owners that broadcast
       these copies every iteration from piling up on one device.)

    Args:
        loads_LE: tokens per expert per layer, int or float [L, E], >= 0.
        t: overlap degree.
        topology: the devices.
    """
    loads_LE = np.asarray(loads_LE, dtype=np.float64)
    if loads_LE.ndim != 2 or loads_LE.size == 0:
        raise PlacementError(f"loads_LE must be a non-empty [layers, experts] array, got shape {loads_LE.shape}")
    for l in range(loads_LE.shape[0]):
        _check_weights(loads_LE[l], f"loads_LE[{l}]")
    L, E = loads_LE.shape
    t = min(check_int(t, "overlap degree t"), E)
    N, P, D = topology.nodes, topology.devices_per_node, topology.num_devices
    free_D = shard_slots_D(L, E, D)
    node_free_N = free_D.reshape(N, P).sum(axis=1)
    owners_LE = np.full((L, E), -1, dtype=np.int64)
    order_LE = np.argsort(-loads_LE, axis=1, kind="stable")  # experts by descending load, per layer
    layer_order = np.argsort(-loads_LE.max(axis=1), kind="stable")
    for l in layer_order:
        node_load_N = np.zeros(N)
        dev_load_D = np.zeros(D)
        for e in order_LE[l, t:]:
            cand = np.flatnonzero(node_free_N > 0)
            lc = node_load_N[cand]
            cand = cand[lc == lc.min()]
            n = int(cand[np.argmin(node_free_N[cand])])
            devs = np.arange(n * P, (n + 1) * P)
            devs = devs[free_D[devs] > 0]
            ld = dev_load_D[devs]
            devs = devs[ld == ld.min()]
            d = int(devs[np.argmin(free_D[devs])])
            owners_LE[l, e] = d
            free_D[d] -= 1
            node_free_N[n] -= 1
            node_load_N[n] += loads_LE[l, e]
            dev_load_D[d] += loads_LE[l, e]
    if t > 0:
        for l in range(L):
            owned_D = np.bincount(owners_LE[l][owners_LE[l] >= 0], minlength=D)
            for e in order_LE[l, :t]:
                cand = np.flatnonzero(free_D > 0)
                oc = owned_D[cand]
                cand = cand[oc == oc.min()]
                d = int(cand[np.argmax(free_D[cand])])
                owners_LE[l, e] = d
                free_D[d] -= 1
                owned_D[d] += 1
    return ModelShardLayout(owners_LE, D)


# ----------------------------------------------------------------------------------------
# Topology-aware dispatch (4.4)
# ----------------------------------------------------------------------------------------


def dispatch(placement: InstancePlacement, source_loads_DE, topology: Topology) -> DispatchPlan:
    """Topology-aware token dispatch of one layer (DESIGN 4.4).

    Tokens on source device s routed to expert e go to s itself if s holds e; else they are
    split evenly over the devices on s's node that hold e; else evenly over all holders of e.
    "Evenly": n tokens over k holders (ascending device id h_0..h_{k-1}) give every holder
    n // k tokens and one more to the n mod k holders h_{(s+i) mod k}, i < n mod k. Rotating the
    remainder by the source id keeps the remainders of different sources from all landing on
    the lowest-id holder.

    Args:
        placement: instances of the layer's experts (multiplicity is ignored: a device with two
            instances of an expert counts once, since it processes them in one batch).
        source_loads_DE: tokens per (source device, expert), int [D, E], >= 0.
        topology: the devices; D must match the placement.
    Returns:
        A DispatchPlan with one entry per (source, expert) that needs no split (possibly with 0
        tokens) plus one entry per (source, expert, holder) share of the split pairs.
    """
    loads_SE = check_loads(source_loads_DE, "source_loads_DE", 2)
    E, D = placement.num_experts, placement.num_devices
    if topology.num_devices != D:
        raise PlacementError(f"placement spans {D} devices but the topology has {topology.num_devices}")
    if loads_SE.shape != (D, E):
        raise PlacementError(f"source_loads_DE must have shape ({D}, {E}) (sources are the devices), got {loads_SE.shape}")
    N = topology.nodes
    node_of = topology.node_of
    holds_ED = placement.counts_ED > 0
    holds_SE = np.ascontiguousarray(holds_ED.T)
    replicas_E = holds_ED.sum(axis=1)
    first_holder_E = np.argmax(holds_ED, axis=1)

    # Direct pairs need no splitting: s holds e (local), or e has a single holder. They get one
    # entry per (source, expert) in grid order, possibly with 0 tokens, which is cheaper at
    # D = 1024 than searching for the non-zero pairs.
    split_SE = ~holds_SE & (replicas_E > 1)[None, :] & (loads_SE > 0)

    # Split pairs: tokens go evenly over the holders on the source's node, else over all.
    remote = np.flatnonzero(split_SE)  # flat (source, expert) indices
    rs, re_ = np.divmod(remote, E)
    rn = loads_SE.ravel()[remote]
    # holder lists in CSR form: flat (expert, device) pairs, expert-major, devices ascending,
    # so the holders of e on node n are one contiguous run and all holders of e are one too
    hold_e, hold_dev = np.nonzero(holds_ED)
    k_EN = np.bincount(hold_e * N + node_of[hold_dev], minlength=E * N)
    start_EN = np.cumsum(k_EN) - k_EN
    group = re_ * N + node_of[rs]
    k = k_EN[group]
    base = start_EN[group]
    off_node = np.flatnonzero(k == 0)  # no copy on the source's node: all holders of e
    k[off_node] = replicas_E[re_[off_node]]
    base[off_node] = start_EN[re_[off_node] * N]
    pair, pos, share = even_shares(rn, k, rs % k)

    G = D * E
    K = G + pair.size
    devices = np.arange(D, dtype=np.int64)
    source_K = np.empty(K, dtype=np.int64)
    expert_K = np.empty(K, dtype=np.int64)
    dest_K = np.empty(K, dtype=np.int64)
    tokens_K = np.empty(K, dtype=np.int64)
    source_K[:G] = np.repeat(devices, E)
    expert_K[:G].reshape(D, E)[:] = np.arange(E, dtype=np.int64)
    grid_dest = dest_K[:G].reshape(D, E)
    grid_dest[:] = first_holder_E
    np.copyto(grid_dest, devices[:, None], where=holds_SE)
    grid_tokens = tokens_K[:G].reshape(D, E)
    grid_tokens[:] = loads_SE
    np.copyto(grid_tokens, 0, where=split_SE)
    source_K[G:] = rs[pair]
    expert_K[G:] = re_[pair]
    dest_K[G:] = hold_dev[base[pair] + pos]
    tokens_K[G:] = share
    # valid by construction (tests check every plan with DispatchPlan.check), so skip the
    # O(K) re-validation that would dominate the cost at D = 1024
    return DispatchPlan.trusted(source_K, expert_K, dest_K, tokens_K, D, E, D)
