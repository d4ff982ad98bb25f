"""FSSDP planning (DESIGN 4.2-4.4): materialization, calibration, heterogeneous sharding, dispatch.

FSSDP keeps exactly one owner per expert (the shard layout) and, every iteration and layer,
materializes extra copies of the experts predicted to be busy so that their tokens can be
processed on several devices. This module decides

- how many copies may be fetched while attention runs (`overlap_degree`, t), how many are
  worth fetching (`choose_overlap_degree`: t by cost) and how many fit in memory
  (`memory_capacity`, m);
- which experts get copies on which devices (`materialize`, DESIGN 4.2) and whether one more
  gather after the gate pays off (`calibrate`, 4.2 step 4);
- who owns which expert of every layer (`heterogeneous_shard`, 4.3; `even_shard`) and how
  well a layout can be balanced at best (`shard_imbalance_bound`);
- where each source device sends the tokens of each expert (`dispatch`, 4.4), with the
  tokens of a replicated expert split to even out device loads (`balanced_quotas`).

Where DESIGN leaves a choice open (which device gets a copy, where a top-t expert is
owned, how many tokens each holder takes) the choice is load-aware; the docstrings say where
this departs from DESIGN's literal text and what was measured.

All functions are pure and deterministic: every rank computes the same plan from the same
(all-reduced) loads. Ties left after the documented rules go to the lower expert / node / device id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
)

__all__ = [
    "CalibrationCost",
    "OverlapChoice",
    "balanced_quotas",
    "calibrate",
    "calibration_gather",
    "choose_overlap_degree",
    "dispatch",
    "even_shard",
    "gather_bandwidth",
    "heterogeneous_shard",
    "materialize",
    "memory_capacity",
    "overlap_candidates",
    "overlap_degree",
    "overlap_prices",
    "proportional_copies",
    "ReshardDecision",
    "decide_reshard",
    "reshard_due",
    "shard_imbalance_bound",
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


def _largest_first(x: np.ndarray):
    """Yields the indices of `_descending(x)` in order, the first from one argmax (callers that
    usually stop at the first skip the sort)."""
    yield int(x.argmax())
    yield from _descending(x).tolist()[1:]


# ----------------------------------------------------------------------------------------
# t and m
# ----------------------------------------------------------------------------------------


def gather_bandwidth(topology: Topology, algorithm: str = "flat") -> float:
    """Bandwidth (bytes/s) at which a device receives copies during attention, for t.

    DESIGN 4.2 uses the inter-node bandwidth when inter-node links are much slower than
    intra-node ones, else the uniform device bandwidth. With the flat collectives (every copy
    from its owner) a spAG that spans nodes is limited by its slowest link class, so with more
    than one node this is min(intra, inter); on one node it is the intra-node bandwidth.

    With the node-aware ("hierarchical") collectives an expert crosses into a node once, at one
    of its G devices (the relays take turns), and the relay forwards it inside the node. For t
    experts on every device of a node, a device receives t / G of them over its inter-node link
    and the other (G - 1) t / G from its node-mates, stage after stage:
    bw = 1 / (1 / (G inter) + (G - 1) / (G intra)).

    `inter_node_bw` must be what a device gets while every device of its node uses the network
    at once, as the runtime's probe measures it (`FSSDPRuntime._probe_bandwidths`): with one
    100 Gbps NIC per node of G = 8 devices, 1.56 GB/s, so G x inter is the NIC's 12.5 GB/s and,
    with 300 GB/s inside the node, bw = 12.1 GB/s (flat: 1.56, so t is 7.7x larger). Given the
    NIC rate of one pair alone (12.5 GB/s), the formula would claim 77 GB/s through a 12.5 GB/s
    NIC: the simulator passes the probe's figures (`sim.costs.Hardware.probed_topology`; it did
    not before 2026-11-27, which overstated its t 6x on cluster A). One bandwidth for both
    classes gives that bandwidth: t is unchanged.
    """
    if topology.nodes == 1:
        return topology.intra_node_bw
    if algorithm == "flat":
        return min(topology.intra_node_bw, topology.inter_node_bw)
    if algorithm != "hierarchical":
        raise PlacementError(f"gather_bandwidth: algorithm must be 'flat' or 'hierarchical', got {algorithm!r}")
    G = topology.devices_per_node
    return 1.0 / (1.0 / (G * topology.inter_node_bw) + (G - 1) / (G * topology.intra_node_bw))


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


def memory_capacity_after_activations(free_bytes: float, activation_peak_bytes: float, margin: float,
                                      layers_alive: int, copy_bytes: float) -> int:
    """m from measured memory: free - activation peak x (1 + margin), per layer whose copies
    are alive at once, over the bytes of one copy (weights and its gradient); >= 0.

    The activation peak is what one iteration without copies added on top of the memory held
    before it (activations, their gradients, the all-to-all buffers, the optimizer step's
    temporaries); the copies must leave room for it, and the margin for the iterations whose
    routing makes it larger.
    """
    for name, value in (("free_bytes", free_bytes), ("activation_peak_bytes", activation_peak_bytes),
                        ("margin", margin), ("copy_bytes", copy_bytes)):
        if not np.isfinite(value) or value < 0:
            raise PlacementError(f"memory_capacity_after_activations: {name} must be finite and >= 0, got {value!r}")
    layers_alive = check_int(layers_alive, "layers_alive", 1)
    budget = free_bytes - activation_peak_bytes * (1.0 + margin)
    return memory_capacity(budget / layers_alive, copy_bytes)


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
    with positive weight).

    The capped experts are found without iterating: fixing experts at their caps only raises
    the copies per unit weight (remaining / remaining weight) for the rest, so they are the
    first k in ascending cap / weight order, k the first position whose expert stays below
    its cap when the k before it are capped.

    Args:
        weights: float [K], >= 0.
        total: copies to hand out, >= 0.
        cap: int or int [K], >= 0, most copies per expert.
    Returns:
        int64 [K] copies per expert.
    """
    weights = _check_weights(weights, "weights")
    total = check_int(total, "total")
    cap_K = np.broadcast_to(np.asarray(cap, dtype=np.int64), weights.shape)
    if np.any(cap_K < 0):
        raise PlacementError(f"cap must be >= 0, got {cap!r}")
    return _proportional_copies(weights, total, cap_K)


def _proportional_copies(weights: np.ndarray, total: int, cap_K: np.ndarray) -> np.ndarray:
    """`proportional_copies` of validated inputs (float [K] >= 0, int >= 0, int [K] >= 0)."""
    copies = np.zeros(weights.size, dtype=np.int64)
    active = np.flatnonzero((weights > 0) & (cap_K > 0))
    if total == 0 or active.size == 0:
        return copies
    w, c = weights[active], cap_K[active]
    by_ratio = np.argsort(c / w, kind="stable")
    w_sorted, c_sorted = w[by_ratio], c[by_ratio]
    capped_before = np.cumsum(c_sorted) - c_sorted  # caps of the experts before position k
    weight_from = w_sorted[::-1].cumsum()[::-1]  # weight of the experts from position k on
    stays = w_sorted * ((total - capped_before) / weight_from) < c_sorted
    k = int(stays.argmax()) if stays.any() else w.size
    copies[active[by_ratio[:k]]] = c_sorted[:k]
    remaining = total - int(c_sorted[:k].sum())
    free = active[by_ratio[k:]]
    if free.size and remaining > 0:
        goal = weights[free] * (remaining / weights[free].sum())
        base = np.floor(goal).astype(np.int64)
        # the copies left over go to (larger fraction, larger weight, lower index)
        order = np.lexsort((free, -weights[free], -(goal - base)))
        base[order[: remaining - int(base.sum())]] += 1
        copies[free] = base
    return copies


def _copy_candidates(eligible: np.ndarray, load_D: np.ndarray, holds_D: np.ndarray, topology: Topology) -> np.ndarray:
    """Eligible devices in the order copies of one expert should go to them (DESIGN 4.2 step 3).

    Node by node, preferring nodes that do not hold the expert yet: a round robin over nodes in
    which a node's devices are ranked by (predicted load, id), giving each a round number
    0, 1, 2, ...; a node that already holds the expert starts at round 1. Devices are ordered
    by (round, predicted load, id), so the first copies land on distinct nodes that lack the
    expert, a node gets a second copy only when every node has one, and within a round the
    least-loaded devices come first.

    DESIGN ranks by "more free slots" where this ranks by predicted load: free-slot order puts
    copies on devices whose owned experts already exceed the mean load (docs/benchmarks.md,
    "Copy placement").
    """
    node = topology.node_of[eligible]
    load = load_D[eligible]
    by_node = np.lexsort((load, node))  # stable, and eligible is ascending: ties keep id order
    node_sorted = node[by_node]
    rounds = np.empty(eligible.size, dtype=np.int64)
    rounds[by_node] = np.arange(eligible.size) - np.searchsorted(node_sorted, node_sorted)  # rank within node
    rounds += holds_D.reshape(topology.nodes, topology.devices_per_node).any(axis=1)[node]
    return eligible[np.lexsort((load, rounds))]


def _place_copies(
    holds_ED: np.ndarray, free_D: np.ndarray, load_D: np.ndarray, experts, budgets, loads_E: np.ndarray, topology
) -> None:
    """Give each of `experts` (in the given order) up to its budget of copies; updates the arrays.

    `load_D` is the predicted device load (float [D]) so far; each expert's load is added to it
    split evenly over the expert's holders once its copies are placed, so later experts see
    where earlier ones went. For expert e with r current holders and load f, the candidates
    are `_copy_candidates` (free slot, no copy of e yet) cut to the budget, and e takes the
    first j of them for the j in [0, budget] minimizing

        max(load of its current holders, load of the first j candidates) + f / (r + j),

    the predicted load of its busiest holder; ties go to fewer copies. An expert therefore
    stops short of its budget when the next candidate is already so loaded that another copy
    would only move the peak there.

    Deviation from DESIGN 4.2 step 3, which fills every budgeted copy: with all D*m slots
    filled, every device takes exactly m copies however the copies are ordered, including a
    device whose owned experts alone exceed the mean load. Stopping early balances better with
    an even-split dispatch and moves fewer spAG / spRS bytes with the balanced one
    (docs/benchmarks.md, "Copy placement").
    """
    for e, budget, f in zip(experts.tolist(), budgets.tolist(), loads_E[experts].tolist()):
        holds_D = holds_ED[e]
        r = int(np.count_nonzero(holds_D))
        j = 0
        if budget > 0 and f > 0:
            eligible = np.flatnonzero((free_D > 0) > holds_D)  # a free slot and no copy yet
            if eligible.size:
                cand = _copy_candidates(eligible, load_D, holds_D, topology)[:budget]
                # busiest holder's predicted load with the first j >= 1 candidates, vs j = 0
                holders_peak = float(load_D[holds_D].max())
                peak_J = np.maximum(np.maximum.accumulate(load_D[cand]), holders_peak)
                value_J = peak_J + f / np.arange(r + 1, r + 1 + cand.size)
                j = int(value_J.argmin()) + 1
                if holders_peak + f / r <= value_J[j - 1]:
                    j = 0
                holds_D[cand[:j]] = True
                free_D[cand[:j]] -= 1
        load_D[holds_D] += f / (r + j)


def calibration_reserve(m: int, misprediction: float) -> int:
    """Copy slots per device that materialization leaves free for calibration: m x the share of
    tokens the predictor recently misplaced, to the nearest slot (halves up), at most m
    (`LoadTracker.misprediction`).

    Calibration can only add copies where memory is left, and the copies the prediction did not
    foresee are the ones it needs. Reserving the misplaced share costs the pre-gate plan little,
    since it already lacks that share's experts, and lets the unforeseen hot expert get its
    copies. Measured (docs/benchmarks.md, "Drift"; 4 x 8 devices, E = 64, t = 8, m = 4): with
    popularity moving one position every iteration (a misplaced share of 0.18: one slot) the
    calibrated imbalance falls from 1.87-2.01 to 1.42-1.46 (Zipf 1.2). Rounding up instead (a
    slot for any misplaced share) helped drift a little more (1.05 -> 1.04, 1.45 -> 1.33) but
    cost the stationary and the recorded training trace, where calibration's gathers do not pay
    and the reserved slot only takes a hidden pre-gate copy away (tiny_ep4_austen, 2 x 2
    devices, m = 2: 1.007 -> 1.032).
    """
    check_int(m, "memory capacity m")
    if not 0.0 <= misprediction <= 1.0:
        raise PlacementError(f"misprediction must be a share of tokens in [0, 1], got {misprediction!r}")
    return min(m, int(np.floor(m * misprediction + 0.5)))


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
    proportion to their loads (`proportional_copies`, at most D-1 extra copies each); these
    are budgets, and `_place_copies` places them heaviest expert first on the least-loaded
    devices, node by node, stopping early where a copy would not lower the peak. The
    predicted device load starts from the experts outside the top-t, which stay on their
    owners. Ties in load go to the lower expert id.

    Replica counts stay proportional to the copies DESIGN asks for, not to instances
    (copies + the owner's one): counting the owner's instance hardly changes the imbalance and
    adds spAG / spRS bytes, because the budgets are upper bounds that the heavy experts do not
    use up (docs/benchmarks.md, "Copy budgets").
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
        budgets = _proportional_copies(loads_E[top], D * m, np.full(t, D - 1))
        rest_E = loads_E.copy()
        rest_E[top] = 0.0
        load_D = np.bincount(shard.owner_E, weights=rest_E, minlength=D)
        _place_copies(holds_ED, np.full(D, m, dtype=np.int64), load_D, top, budgets, loads_E, topology)
    return InstancePlacement(holds_ED.astype(np.int64))


# ----------------------------------------------------------------------------------------
# Balanced token split (used by dispatch 4.4 and calibration 4.2 step 4)
# ----------------------------------------------------------------------------------------


def _fill(load_H: list, tokens: int) -> list:
    """Water-fill `tokens` over holders with integer loads load_H; integer quotas, same order.

    The least-loaded holders are raised to a common level: with the loads sorted ascending
    (s_0 <= s_1 <= ..., ties by position), the first j+1 holders are filled, j the smallest
    index with tokens + s_0 + ... + s_j <= (j+1) * s_{j+1}. Each filled holder gets
    floor(level) - load, and the level's remainder goes one token each to the first filled
    holders in that order. Integer arithmetic, so the quotas sum to `tokens` exactly.

    Plain Python on lists: the fills run one after another, and at the holder counts that
    occur (tens to a thousand) this beats numpy's per-call overhead at the small end (4 vs 9 us
    for 16 holders) and costs 0.12 ms at 1024.
    """
    order = sorted(range(len(load_H)), key=load_H.__getitem__)
    last = len(order) - 1
    total = tokens
    for j, h in enumerate(order):
        total += load_H[h]
        if j == last or total <= load_H[order[j + 1]] * (j + 1):
            break
    level, rem = divmod(total, j + 1)
    quota = [0] * len(load_H)
    for i in range(j + 1):
        h = order[i]
        quota[h] = level - load_H[h] + (i < rem)
    return quota


_QUOTA_MEMO: dict[bytes, np.ndarray] = {}
"""The last few `_replicated_quotas` results, keyed by their inputs' bytes."""
_QUOTA_MEMO_SIZE = 4


def _replicated_quotas(holds_ED: np.ndarray, tokens_E: np.ndarray, load_D: np.ndarray, rep: np.ndarray) -> np.ndarray:
    """`balanced_quotas` of the replicated experts `rep`; int64 [len(rep), D], read-only.

    `load_D` (int [D]) holds the tokens of the single-holder experts. The quotas are a pure
    function of the inputs, and the per-iteration planner asks for the same ones twice:
    `calibrate` prices its winning candidate with the quotas that `dispatch` then routes by
    (E = 64, D = 32: 0.1 ms of the planner's 1 ms per layer; tools/bench_planners.py). So the last
    `_QUOTA_MEMO_SIZE` results are kept, keyed by the inputs' bytes (a few us to build).
    """
    key = b"|".join(
        np.ascontiguousarray(x, dtype=dtype).tobytes()
        for x, dtype in ((rep, np.int64), (holds_ED[rep], bool), (tokens_E[rep], np.int64), (load_D, np.int64))
    )
    quota_RD = _QUOTA_MEMO.get(key)
    if quota_RD is None:
        quota_RD = _sweep_quotas(holds_ED, tokens_E, load_D, rep)
        quota_RD.setflags(write=False)
        if len(_QUOTA_MEMO) >= _QUOTA_MEMO_SIZE:
            del _QUOTA_MEMO[next(iter(_QUOTA_MEMO))]
        _QUOTA_MEMO[key] = quota_RD
    return quota_RD


def clear_quota_memo() -> None:
    """Forgets the memoized quotas (`_replicated_quotas`): benchmarks call it before each timed
    call, so that repeating one call does not time a memo hit."""
    _QUOTA_MEMO.clear()


def _sweep_quotas(holds_ED: np.ndarray, tokens_E: np.ndarray, load_D: np.ndarray, rep: np.ndarray) -> np.ndarray:
    """`_replicated_quotas` without the memo: water-fills (`_fill`) the replicated experts
    heaviest first, then sweeps once more. The second sweep is skipped when the first already
    reaches the lower bound on the peak, max(busiest device with single-holder experts only,
    ceil(total / D)): it cannot lower the peak then."""
    rows_P, devices_P = np.nonzero(holds_ED[rep])  # (replicated expert, holder) pairs, row-major
    ends = np.cumsum(np.bincount(rows_P, minlength=rep.size)).tolist()
    devices = devices_P.tolist()
    holders = [devices[start:end] for start, end in zip([0, *ends], ends)]
    tokens_R = tokens_E[rep].tolist()
    load = load_D.tolist()
    D = len(load)
    bound = max(max(load), -(-(sum(load) + sum(tokens_R)) // D))
    quotas = [[0] * len(h) for h in holders]
    order = sorted(range(rep.size), key=lambda r: -tokens_R[r])  # heaviest first, ties: lower id
    for sweep in range(2):
        if sweep and max(load) <= bound:
            break
        for r in order:
            h, q = holders[r], quotas[r]
            load_H = [load[d] - x for d, x in zip(h, q)]
            q = quotas[r] = _fill(load_H, tokens_R[r])
            for d, base, x in zip(h, load_H, q):
                load[d] = base + x
    quota_RD = np.zeros((rep.size, holds_ED.shape[1]), dtype=np.int64)
    quota_RD[rows_P, devices_P] = [x for q in quotas for x in q]
    return quota_RD


def balanced_quotas(holds_ED, tokens_E) -> np.ndarray:
    """Tokens each holder of each expert should process so that device loads even out; int64 [E, D].

    An expert with one holder sends it everything. The tokens of a replicated expert are
    water-filled over its holders (`_fill`): the least-loaded holders, counting what they
    already process for other experts, are topped up to a common level. Replicated experts go
    heaviest first (ties: lower id), and a second sweep refills each of them with the others'
    quotas fixed, which undoes most of the first sweep's order effects (unless the first
    already reached the lower bound on the peak; docs/benchmarks.md, "Balanced quotas").

    Args:
        holds_ED: which device holds which expert, bool or int [E, D]; every expert >= 1 holder.
        tokens_E: tokens routed to each expert, int [E], >= 0.
    Returns:
        quota_ED with quota_ED[e, d] > 0 only where d holds e and rows summing to tokens_E.
    """
    holds_ED = np.asarray(holds_ED) > 0
    tokens_E = check_loads(tokens_E, "tokens_E", 1)
    if holds_ED.ndim != 2 or tokens_E.size != holds_ED.shape[0]:
        raise PlacementError(
            f"tokens_E has {tokens_E.size} entries but holds_ED has shape {holds_ED.shape}; need [E, D] and [E]"
        )
    replicas_E = holds_ED.sum(axis=1)
    missing = np.flatnonzero(replicas_E == 0)
    if missing.size:
        raise PlacementError(f"expert {int(missing[0])} has no holder; its tokens have nowhere to go")
    quota_ED = holds_ED * tokens_E[:, None]  # single holders take everything
    rep = np.flatnonzero(replicas_E > 1)
    quota_ED[rep] = 0
    quota_ED[rep] = _replicated_quotas(holds_ED, tokens_E, quota_ED.sum(axis=0), rep)
    return quota_ED


# ----------------------------------------------------------------------------------------
# Calibration (4.2 step 4)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationCost:
    """FSSDP's cost model: whether calibration's gather pays off, and which t (`choose_overlap_degree`).

    MoE time of a layer is modelled as (max device load) * seconds_per_token: the slowest
    device decides when the combine all-to-all can finish; with per-source loads and
    `dispatch_seconds`, plus the all-to-all of the dispatch plan (`layer_seconds`). A gather
    costs what the work running beside it does not hide (`exposed_seconds`); its time is the
    busiest device's transfer time (the larger of what it receives and what it sends, each link
    at its topology bandwidth) plus a fixed latency, or `gather_seconds` when given.
    """

    seconds_per_token: float
    """Expert compute time of one routed token on one device, seconds (fwd, or fwd+bwd if the copy
    also serves the backward)."""
    expert_bytes: float
    """Bytes of one expert's parameters (what one extra copy moves)."""
    latency_s: float = 0.0
    """Fixed cost of launching one more sparse all-gather, seconds."""
    gather_seconds: Callable[[ShardLayout, InstancePlacement], float] | None = None
    """Time of spAG(shard -> placement) when given (the simulator passes its own link model and
    collective algorithm, so that calibration decides on the times it is priced at); None: the
    busiest device's transfers over the topology's point-to-point bandwidths, plus `latency_s`."""
    seconds_per_instance: float = 0.0
    """Fixed expert time of one instance that gets tokens on a device, seconds (forward and
    backward: kernel launches, the GEMMs' small-batch inefficiency, streaming the weights): a copy
    splits an expert's tokens but adds one of these, so on small batches copies stop paying."""
    reduce_ratio: float = 0.0
    """Bytes of a copy's gradient over its weights' (spRS moves gradients back the way spAG moved
    weights): the extra copies' reduce takes this many times their gather. 0: not priced."""
    reduce_hidden_s: float = 0.0
    """Backward time outside the MoE blocks that the copies' reduce hides behind (the layer's
    attention backward); with the MoE backward (`exposed_seconds`) only what exceeds it is priced."""
    dispatch_seconds: Callable[[DispatchPlan], float] | None = None
    """All-to-all time of a dispatch plan (dispatch and combine, forward and backward), when given
    with the per-source loads: copies near the tokens shorten it, so calibration counts it
    (FasterMoE's cost model does); None: the MoE time is the expert compute alone."""

    def __post_init__(self) -> None:
        for name in ("seconds_per_token", "expert_bytes", "latency_s", "seconds_per_instance", "reduce_ratio",
                     "reduce_hidden_s"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise PlacementError(f"CalibrationCost.{name} must be finite and >= 0, got {value!r}")

    def spag_seconds(self, shard: ShardLayout, placement: InstancePlacement, topology: Topology) -> float:
        """Time of spAG(shard -> placement): `gather_seconds`, or the busiest device's transfers
        over the topology's point-to-point bandwidths plus `latency_s` (0 without copies)."""
        if self.gather_seconds is not None:
            return float(self.gather_seconds(shard, placement))
        return self._copies_seconds(placement.holds_ED() & ~shard.holds_ED().astype(bool), shard, topology)

    def extra_gather_seconds(self, shard: ShardLayout, current: InstancePlacement, holds_ED: np.ndarray,
                             topology: Topology) -> float:
        """Time of gathering the copies in `holds_ED` that `current` lacks (on the critical path).
        `current` contains `shard`, so without `gather_seconds` the new copies are holds_ED minus
        current's holdings, priced without building calibration's gather placement (calibrate
        prices up to a few candidates per layer per iteration)."""
        if self.gather_seconds is not None:
            return self.spag_seconds(shard, calibration_gather(shard, current, holds_ED), topology)
        return self._copies_seconds((np.asarray(holds_ED) > 0) & ~current.holds_ED(), shard, topology)

    def _copies_seconds(self, new_ED: np.ndarray, shard: ShardLayout, topology: Topology) -> float:
        """The point-to-point model's gather of the copies new_ED (bool [E, D]) from their owners:
        the busiest device's transfers plus `latency_s`, 0 without copies."""
        if not new_ED.any():
            return 0.0
        return _gather_seconds(new_ED, shard.owner_E, topology, self.expert_bytes) + self.latency_s

    def layer_seconds(self, holds_ED, tokens_E: np.ndarray, source_loads_DE: np.ndarray | None,
                      topology: Topology) -> tuple[float, float]:
        """(expert compute, all-to-all) of one layer on the placement `holds_ED`: the busiest
        device's tokens x seconds_per_token + its instances with tokens x seconds_per_instance,
        with device loads as `dispatch` makes them, and the dispatch plan's all-to-all. Without
        per-source loads or `dispatch_seconds`, the loads of `balanced_quotas` and no all-to-all."""
        holds_ED = np.asarray(holds_ED) > 0
        if source_loads_DE is None or self.dispatch_seconds is None:
            quota_ED = balanced_quotas(holds_ED, tokens_E)
            return self.compute_seconds(quota_ED.sum(axis=0), (quota_ED > 0).sum(axis=0)), 0.0
        plan = dispatch(InstancePlacement(holds_ED.astype(np.int64)), source_loads_DE, topology)
        D = holds_ED.shape[1]
        busy = np.unique(plan.expert_K[plan.tokens_K > 0] * D + plan.dest_K[plan.tokens_K > 0])
        instances_D = np.bincount(busy % D, minlength=D)
        return self.compute_seconds(plan.device_loads_D(), instances_D), float(self.dispatch_seconds(plan))

    def compute_seconds(self, tokens_D: np.ndarray, instances_D: np.ndarray) -> float:
        """The busiest device's expert time, from tokens and instances with tokens per device."""
        return float((tokens_D * self.seconds_per_token + instances_D * self.seconds_per_instance).max())

    def exposed_seconds(self, gather_s: float, gather_hidden_s: float, compute_s: float, a2a_s: float) -> float:
        """What a gather of `gather_s` costs beyond the work that runs beside it.

        The gather past `gather_hidden_s` (0 for calibration's gather after the gate, which is on
        the critical path; the non-MoE forward for the spAG launched before the attention), plus
        its gradients' reduce (`reduce_ratio` x the gather) past the backward that runs while it
        is in flight: spRS(l) starts when layer l's MoE backward is done and is waited for when
        layer l-1's is (`FSSDPRuntime.drain`), so the attention backward (`reduce_hidden_s`) and
        one MoE backward hide it, modelled as this layer's: 2/3 of its expert compute (forward
        + backward = 3 forwards) and half its all-to-all (two of its four)."""
        return max(0.0, gather_s - gather_hidden_s) + self.exposed_reduce_seconds(gather_s, compute_s, a2a_s)

    def least_exposed_seconds(self, gather_s: float, best_s: float) -> float:
        """A lower bound of `exposed_seconds(gather_s, 0, c, a)` for any placement that can beat
        `best_s` (c + a < best_s, so the MoE backward hides at most 2/3 of best_s): lets
        calibration skip a candidate before pricing its dispatch."""
        return gather_s + max(0.0, self.reduce_ratio * gather_s - self.reduce_hidden_s - MOE_BACKWARD_SHARE * best_s)

    def exposed_reduce_seconds(self, gather_s: float, compute_s: float, a2a_s: float) -> float:
        """The reduce part of `exposed_seconds`."""
        backward_s = self.reduce_hidden_s + MOE_BACKWARD_SHARE * compute_s + 0.5 * a2a_s
        return max(0.0, self.reduce_ratio * gather_s - backward_s)


BACKWARD_OVER_FORWARD = 2.0
"""A GEMM layer's backward time over its forward time: two GEMMs (the input's and the weights'
gradients) per forward GEMM. The one figure the runtime's cost model (`FSSDPRuntime`), this
module's windows and the simulator's compute model (`sim.costs.ComputeModel.BACKWARD`) use."""
MOE_BACKWARD_SHARE = BACKWARD_OVER_FORWARD / (1.0 + BACKWARD_OVER_FORWARD)
"""Share of an expert's forward + backward compute that is its backward (2/3)."""


def calibration_gather(shard: ShardLayout, current: InstancePlacement, holds_ED) -> InstancePlacement:
    """What calibration's extra spAG fills: the owners plus the copies in `holds_ED` (bool or int
    [E, D]) that `current` lacks."""
    return InstancePlacement((shard.holds_ED() > 0) | ((np.asarray(holds_ED) > 0) & ~current.holds_ED()))


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
    source_loads_DE=None,
) -> tuple[InstancePlacement, bool]:
    """Calibration after the gate (DESIGN 4.2 step 4), as a pure function.

    With the actual loads and the memory still free, considers adding copies to the current
    placement (copies already gathered cost nothing to keep) and keeps the cheapest choice,
    which may be adding none. Candidates:

    - relief (`_relief_candidate`): copies added one at a time where the busiest device needs
      them, each to the device where it is cheapest (load plus transfer), cut at the cheapest
      prefix. This is DESIGN's step 4 ("rerun with the actual loads and the remaining memory")
      made marginal: DESIGN re-splits the free slots in proportion to the actual loads, which
      gathers copies for every expert off its proportion, while what pays is the copy or two
      that takes the peak off the one expert the prediction missed (a load spike). Measured on
      drifting traces (4 x 8 devices, E = 64, t = 8, m = 4; docs/benchmarks.md, "Drift"): the
      proportional re-split never won over relief and cost 0.3 ms per layer to price;
    - FasterMoE's shadowing, for every k: the k experts with the most tokens copied to every
      device that has a free slot (its policy space, so calibration can choose what it would).

    Price of a candidate: MoE time = max device load * seconds_per_token, with device loads as
    `dispatch` will make them (`balanced_quotas` of the actual loads), plus the extra gather's
    time (`CalibrationCost.extra_gather_seconds`), which is on the critical path, and the part
    of their gradients' reduction that the backward does not hide (`CalibrationCost.
    exposed_seconds`). With the per-source loads and `cost.dispatch_seconds`, the plan is
    `dispatch`'s itself and its all-to-all time is added (`CalibrationCost.layer_seconds`). The
    current placement costs its MoE time alone. A candidate is taken only when strictly
    cheaper; ties go to the earlier candidate (relief, then fewer shadows). A candidate whose
    least exposed gather and reduce (`CalibrationCost.least_exposed_seconds`), added to the best
    balance any placement can reach (ceil(total / D) tokens on the busiest device), cost no less
    than the best so far is not priced further.

    Args:
        current: placement materialized from the prediction (must contain `shard`).
        shard: owners of the layer's experts.
        actual_loads_E: tokens per expert measured after the gate, int [E], >= 0.
        remaining_m: extra copies that still fit per device, int or int [D], >= 0.
        topology: the devices.
        cost: the cost model.
        source_loads_DE: tokens per (source device, expert), int [D, E] summing to actual_loads_E,
            or None (then the all-to-all is not priced).
    Returns:
        (placement, do_extra_gather): the calibrated placement and True if it pays off, else
        (current, False).
    """
    if shard.num_devices != topology.num_devices:
        raise PlacementError(
            f"shard layout spans {shard.num_devices} devices but the topology has {topology.num_devices}"
        )
    tokens_E = check_loads(actual_loads_E, "actual_loads_E", 1)
    if tokens_E.size != shard.num_experts:
        raise PlacementError(
            f"actual_loads_E has {tokens_E.size} entries but the layer has {shard.num_experts} experts"
        )
    current.require_contains(shard)
    D = topology.num_devices
    free_D = np.broadcast_to(np.asarray(remaining_m, dtype=np.int64), (D,)).copy()
    if np.any(free_D < 0):
        d = int(np.flatnonzero(free_D < 0)[0])
        raise PlacementError(f"remaining memory capacity of device {d} is {int(free_D[d])}; it must be >= 0")
    total = int(tokens_E.sum())
    if total == 0 or free_D.sum() == 0:
        return current, False
    held_ED = current.holds_ED()
    with_a2a = source_loads_DE is not None and cost.dispatch_seconds is not None
    if with_a2a:
        source_loads_DE = check_loads(source_loads_DE, "source_loads_DE", 2)
        if not np.array_equal(source_loads_DE.sum(axis=0), tokens_E):
            raise PlacementError("source_loads_DE must sum over sources to actual_loads_E")

    quota_ED = balanced_quotas(held_ED, tokens_E)
    if with_a2a:
        best_s = sum(cost.layer_seconds(held_ED, tokens_E, source_loads_DE, topology))
    else:
        best_s = cost.compute_seconds(quota_ED.sum(axis=0), (quota_ED > 0).sum(axis=0))
    best = None
    floor_s = np.ceil(total / D) * cost.seconds_per_token  # no placement computes faster
    candidates = (
        _relief_candidate(held_ED, quota_ED, shard.owner_E, tokens_E, free_D, topology, cost),
        *_shadow_candidates(held_ED, tokens_E, free_D),
    )
    for holds_ED in candidates:
        if not (holds_ED & ~held_ED).any():
            continue
        gather_s = cost.extra_gather_seconds(shard, current, holds_ED, topology)
        if floor_s + cost.least_exposed_seconds(gather_s, best_s) >= best_s:
            continue  # its copies cost more than any balance could save
        compute_s, a2a_s = cost.layer_seconds(holds_ED, tokens_E, source_loads_DE, topology)
        seconds = compute_s + a2a_s + cost.exposed_seconds(gather_s, 0.0, compute_s, a2a_s)
        if seconds < best_s:
            best_s, best = seconds, holds_ED
    if best is None:
        return current, False
    return InstancePlacement(current.counts_ED + (best & ~held_ED).astype(np.int64)), True


def _relief_candidate(held_ED: np.ndarray, quota_ED: np.ndarray, owner_E: np.ndarray, tokens_E: np.ndarray,
                      free_D: np.ndarray, topology: Topology, cost: CalibrationCost) -> np.ndarray:
    """Copies that relieve the busiest device one at a time, as few as pay (`calibrate`).

    A load spike the prediction missed (an expert that was cold last iteration) overloads its
    few holders; what fixes it is a copy or two of that expert, near its owner, not a re-split
    of every expert's copies in proportion to the loads (DESIGN's step 4) or a copy on every
    device (the shadow candidates), whose gathers cost more than the spike. Greedy: take the
    busiest device (device loads as `balanced_quotas` makes them), its expert with the largest
    quota that can still get a copy, and copy it to the device where its transfer time from the
    owner plus that device's load is least (a same-node device first when loads are alike);
    refill that expert's tokens over its holders (`_fill`) and repeat while the peak falls.
    Each prefix of the chain is priced like `calibrate` prices a candidate, with the
    point-to-point gather model (busiest sender or receiver); the cheapest prefix is returned
    (possibly none of the copies: then `held_ED` itself).
    """
    D = held_ED.shape[1]
    holds_ED = held_ED.copy()
    free_D = free_D.copy()
    has_free_D = free_D > 0
    open_slots = int(has_free_D.sum())  # devices with a free slot
    quota_ED = quota_ED.copy()  # `balanced_quotas(held_ED, tokens_E)`, refilled expert by expert below
    load_D = quota_ED.sum(axis=0)
    floor = -(-int(tokens_E.sum()) // D)  # no placement gets the peak below this
    spt = cost.seconds_per_token
    copy_s_DD = cost.expert_bytes / np.where(topology.same_node_DD(), topology.intra_node_bw, topology.inter_node_bw)
    send_D = np.zeros(D)
    recv_D = np.zeros(D)
    gather_s = 0.0  # busiest sender or receiver so far
    instances_D = (quota_ED > 0).sum(axis=0)
    d = int(load_D.argmax())
    best_s, best_n, chain = cost.compute_seconds(load_D, instances_D), 0, []
    while open_slots:
        peak = int(load_D[d])
        if peak <= floor:
            break
        picked = None
        for e in _largest_first(quota_ED[:, d]):
            if quota_ED[e, d] == 0:
                break
            targets = np.flatnonzero(~holds_ED[e] & has_free_D & (load_D < peak - 1))
            if targets.size:
                src = int(owner_E[e])
                price = load_D[targets] * spt + copy_s_DD[src, targets]
                picked = e, int(targets[price.argmin()]), src
                break
        if picked is None:
            break
        e, target, src = picked
        holds_ED[e, target] = True
        free_D[target] -= 1
        if free_D[target] == 0:
            has_free_D[target] = False
            open_slots -= 1
        send_D[src] += copy_s_DD[src, target]
        recv_D[target] += copy_s_DD[src, target]
        gather_s = max(gather_s, send_D[src], recv_D[target])
        chain_gather_s = gather_s + cost.latency_s
        if floor * spt + cost.least_exposed_seconds(chain_gather_s, best_s) >= best_s:
            break  # the gather only grows along the chain: no longer prefix can be cheaper
        chain.append((e, target))
        holders = np.flatnonzero(holds_ED[e])
        old_H = quota_ED[e, holders]
        base_H = load_D[holders] - old_H
        new = _fill(base_H.tolist(), int(tokens_E[e]))
        quota_ED[e, holders] = new
        load_D[holders] = base_H + new
        instances_D[holders] += [(x > 0) - (y > 0) for x, y in zip(new, old_H.tolist())]
        d = int(load_D.argmax())
        compute_s = cost.compute_seconds(load_D, instances_D)
        seconds = compute_s + cost.exposed_seconds(chain_gather_s, 0.0, compute_s, 0.0)
        if seconds < best_s:
            best_s, best_n = seconds, len(chain)
    out = held_ED.copy()
    for e, target in chain[:best_n]:
        out[e, target] = True
    return out


def _shadow_candidates(held_ED: np.ndarray, tokens_E: np.ndarray, free_D: np.ndarray):
    """FasterMoE's choices: the top-k experts by tokens on every device with a free slot, k = 1, 2, ...
    (while some device still has a slot); yields bool [E, D] holdings. Only experts with more
    tokens than a device's fair share (total / D) are shadowed: a lighter one cannot by itself make
    a device the busiest, and pricing every prefix (E of them) costs a balanced split each."""
    holds_ED = held_ED.copy()
    free_D = free_D.copy()
    share = tokens_E.sum() / held_ED.shape[1]
    for e in _descending(tokens_E.astype(np.float64)):
        if tokens_E[e] <= share or not free_D.any():
            return
        new_D = ~holds_ED[e] & (free_D > 0)
        if not new_D.any():
            continue
        holds_ED[e] |= new_D
        free_D -= new_D
        yield holds_ED.copy()


# ----------------------------------------------------------------------------------------
# t by cost
# ----------------------------------------------------------------------------------------


def overlap_candidates(hidden_t: int, num_experts: int) -> list[int]:
    """The t `choose_overlap_degree` prices, ascending: 0 (EP), the powers of two below E, E, and
    `hidden_t` (DESIGN 4.2's, every copy hidden) among them."""
    hidden_t = min(check_int(hidden_t, "hidden_t"), num_experts)
    out, t = {0, hidden_t, num_experts}, 1
    while t < num_experts:
        out.add(t)
        t *= 2
    return sorted(out)


@dataclass(frozen=True)
class OverlapChoice:
    """`choose_overlap_degree`'s answer and the prices it compared."""

    t: int
    """The chosen overlap degree: the cheapest candidate (ties: the smaller)."""
    hidden_t: int
    """DESIGN 4.2's t, floor(T_nonMoE x bw / expert bytes): what attention hides (one of the
    candidates)."""
    candidates: tuple[int, ...]
    """The t priced (`overlap_candidates`)."""
    prices_T4: np.ndarray
    """Seconds per candidate, summed over the layers: expert compute, all-to-all, exposed gather
    (spAG beyond the non-MoE forward, calibration's), reduce beyond the backward; float [T, 4]."""

    def table(self) -> str:
        """One line per candidate, in ms, for logs."""
        rows = []
        for t, (compute, a2a, gather, reduce) in zip(self.candidates, self.prices_T4 * 1e3):
            mark = " <-" if t == self.t else ""
            rows.append(f"t={t}: {compute + a2a + gather + reduce:.2f} ms (experts {compute:.2f}, all-to-all "
                        f"{a2a:.2f}, exposed gather {gather:.2f}, exposed reduce {reduce:.2f}){mark}")
        return "; ".join(rows)


def overlap_prices(shards: list[ShardLayout], source_loads_LDE, candidates: list[int], m: int, topology: Topology,
                   cost: CalibrationCost, t_non_moe_s: float, calibrated: bool = False) -> np.ndarray:
    """Price of each candidate t over the layers `shards` with the per-source loads
    `source_loads_LDE` (int [L, D, E]); float [T, 4] (`OverlapChoice.prices_T4`).

    A layer's placement is `materialize`'s for those loads (its prediction, when the loads repeat)
    with t and m, then, with `calibrated` (the run calibrates after the gate), what `calibrate`
    adds to it in the memory left: with t = 0 calibration alone may do better than copies
    gathered before the gate. Its price is `CalibrationCost.layer_seconds` (the busiest
    device's expert time, the dispatch plan's all-to-all), the spAG launched as the layer starts
    beyond the non-MoE forward `t_non_moe_s`, calibration's gather (on the critical path), and
    the spRS of every copy beyond the backward that hides it
    (`CalibrationCost.exposed_reduce_seconds`).
    """
    source_loads_LDE = check_loads(source_loads_LDE, "source_loads_LDE", 3)
    if source_loads_LDE.shape[0] != len(shards):
        raise PlacementError(
            f"source_loads_LDE has {source_loads_LDE.shape[0]} layers but {len(shards)} shard layouts were given"
        )
    prices_T4 = np.zeros((len(candidates), 4))
    for shard, sources_DE in zip(shards, source_loads_LDE):
        tokens_E = sources_DE.sum(axis=0)
        for i, t in enumerate(candidates):
            placement = materialize(shard, tokens_E, t, m, topology)
            gather_s = reduced_s = cost.spag_seconds(shard, placement, topology)  # spRS reduces what spAG gathered
            exposed_s = max(0.0, gather_s - t_non_moe_s)
            if calibrated:
                remaining_D = np.maximum(m - placement.extra_copies_D(shard), 0)
                final, extra = calibrate(placement, shard, tokens_E, remaining_D, topology, cost, sources_DE)
                if extra:
                    exposed_s += cost.extra_gather_seconds(shard, placement, final.holds_ED(), topology)
                    placement = final
                    reduced_s = cost.spag_seconds(shard, placement, topology)  # ... and calibration's copies
            compute_s, a2a_s = cost.layer_seconds(placement.holds_ED(), tokens_E, sources_DE, topology)
            reduce_s = cost.exposed_reduce_seconds(reduced_s, compute_s, a2a_s)
            prices_T4[i] += (compute_s, a2a_s, exposed_s, reduce_s)
    return prices_T4


def choose_overlap_degree(candidates: list[int], prices_T4: np.ndarray, hidden_t: int) -> OverlapChoice:
    """t by cost: the candidate whose predicted time is least (ties: the smaller t, fewer copies).

    DESIGN 4.2's t gathers what attention hides. That throws away copies whose gather is exposed
    but which save more than it in expert compute and all-to-all (on nodes behind one NIC the
    all-to-all dominates, and a copy near the tokens keeps them off the network; where attention
    is short the hidden t is 0 and FSSDP degenerates to EP), and it takes hidden copies that do
    not pay (each instance has a fixed cost, so on small batches splitting an expert over more
    devices is slower; the spRS of many copies outlasts the backward). Measured in the simulator
    (tests/sim/test_sim_fssdp_calibration.py, README "Every run config, simulated"). `prices_T4`
    comes from `overlap_prices`, summed over the job's layers (the runtime all-reduces it over
    pipeline stages, so every rank takes the same t)."""
    prices_T4 = np.asarray(prices_T4, dtype=np.float64)
    if prices_T4.shape != (len(candidates), 4) or not np.all(np.isfinite(prices_T4)):
        raise PlacementError(f"prices_T4 must be finite with shape ({len(candidates)}, 4), got {prices_T4.shape}")
    total_T = prices_T4.sum(axis=1)
    best = min(range(len(candidates)), key=lambda i: (total_T[i], candidates[i]))
    return OverlapChoice(int(candidates[best]), int(hidden_t), tuple(int(t) for t in candidates), prices_T4)


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


def _least_loaded(load: np.ndarray, free: np.ndarray, preferred: int) -> int:
    """Index with a free slot and the least load; ties: fewer free slots, then `preferred`, then lower index."""
    cand = np.flatnonzero(free > 0)
    lc = load[cand]
    cand = cand[lc == lc.min()]
    if cand.size > 1:
        fc = free[cand]
        cand = cand[fc == fc.min()]
        if cand.size > 1 and preferred in cand:
            return preferred
    return int(cand[0])


def _check_loads_LE(loads_LE) -> np.ndarray:
    loads_LE = np.asarray(loads_LE, dtype=np.float64)
    if loads_LE.ndim != 2 or loads_LE.size == 0:
        raise PlacementError(f"loads_LE must be a non-empty [layers, experts] array, got shape {loads_LE.shape}")
    for l in range(loads_LE.shape[0]):
        _check_weights(loads_LE[l], f"loads_LE[{l}]")
    return loads_LE


def heterogeneous_shard(loads_LE, topology: Topology, current: ModelShardLayout | None = None) -> ModelShardLayout:
    """Heterogeneous, memory-balanced sharding of all MoE layers at once (DESIGN 4.3).

    1. Device d gets `shard_slots_D` slots (S = L*E/D when divisible), so memory stays
       balanced while a device may own anywhere from 0 to E experts of one layer.
    2. Layers go by descending maximum expert load (ties: lower layer); within a layer,
       experts by descending load (ties: lower id). Each goes to the least-loaded node (load =
       this layer's experts already owned there) among nodes with a free slot, then to the
       least-loaded device of that node with a free slot. Ties, for nodes and for devices:
       fewer free slots, then the node / device of the expert's owner in `current`, then the
       lower id. (Fewer free slots first: a heavy expert ends up alone, so it should take the
       place that has few slots left and leave many slots to the light experts that share.)

    Deviation from DESIGN, which places the top-t experts of a layer (J) only after the rest
    (J') of every layer, "arbitrarily" into the slots left over. Here J goes through the same
    greedy at its full load, so (being the heaviest) first; the overlap degree t therefore
    does not enter. The reason: between two re-shards the loads drift, and a J expert that
    falls out of the top-t is served by its owner alone. The slots J' leaves over sit on the
    devices that own few J' experts, i.e. heavy ones, so such an expert lands next to a heavy
    J' expert (docs/benchmarks.md, "Heterogeneous sharding order").

    Ties towards `current` keep an expert in place when the greedy has no reason to move it;
    with continuous loads such ties are rare, so the policy also adopts a new layout only
    when it lowers `shard_imbalance_bound` (see `policies.FSSDPPolicy`).

    Args:
        loads_LE: predicted tokens per expert per layer, int or float [L, E], >= 0.
        topology: the devices.
        current: the layout in use (same L, E, D), for tie-breaking; None for none.
    """
    loads_LE = _check_loads_LE(loads_LE)
    L, E = loads_LE.shape
    N, P, D = topology.nodes, topology.devices_per_node, topology.num_devices
    if current is not None and (current.owners_LE.shape != (L, E) or current.num_devices != D):
        raise PlacementError(
            f"current layout has {current.num_layers} layers x {current.num_experts} experts over "
            f"{current.num_devices} devices; expected {L} x {E} over {D}"
        )
    free_D = shard_slots_D(L, E, D)
    node_free_N = free_D.reshape(N, P).sum(axis=1)
    owners_LE = np.full((L, E), -1, dtype=np.int64)
    previous_LE = current.owners_LE if current is not None else np.full((L, E), -1, dtype=np.int64)
    order_LE = np.argsort(-loads_LE, axis=1, kind="stable")
    for l in np.argsort(-loads_LE.max(axis=1), kind="stable"):
        node_load_N = np.zeros(N)
        dev_load_D = np.zeros(D)
        for e in order_LE[l]:
            prev = int(previous_LE[l, e])
            n = _least_loaded(node_load_N, node_free_N, prev // P if prev >= 0 else -1)
            first = n * P
            d = first + _least_loaded(
                dev_load_D[first : first + P], free_D[first : first + P], prev - first if prev >= 0 else -1
            )
            owners_LE[l, e] = d
            free_D[d] -= 1
            node_free_N[n] -= 1
            node_load_N[n] += loads_LE[l, e]
            dev_load_D[d] += loads_LE[l, e]
    return ModelShardLayout(owners_LE, D)


def shard_imbalance_bound(layout: ModelShardLayout, loads_LE, t: int) -> np.ndarray:
    """Lowest imbalance materialization + dispatch can reach with these owners; float [L].

    `materialize` copies only the top-t experts of a layer; every other expert is processed
    by its owner alone. So in layer l no dispatch can bring the busiest device below the
    load of the non-top-t experts it owns, and none below the mean: the bound is
    max(1, max_d (non-top-t load owned by d) / (total load / D)), 1 for a layer without load.
    `dispatch`'s balanced split reaches it within 0.002 on average on the issue-3 trace when
    the loads are the actual ones, which makes it a good predictor of a layout's imbalance.

    Args:
        layout: owners of every layer's experts.
        loads_LE: tokens per expert per layer, int or float [L, E], >= 0.
        t: overlap degree (the top-t of each layer by these loads are the copied experts).
    """
    loads_LE = _check_loads_LE(loads_LE)
    L, E = loads_LE.shape
    if layout.owners_LE.shape != (L, E):
        raise PlacementError(
            f"layout has {layout.num_layers} x {layout.num_experts} experts, loads have shape {(L, E)}"
        )
    t = min(check_int(t, "overlap degree t"), E)
    D = layout.num_devices
    single_LE = loads_LE.copy()
    np.put_along_axis(single_LE, np.argsort(-loads_LE, axis=1, kind="stable")[:, :t], 0.0, axis=1)
    flat = (np.arange(L)[:, None] * D + layout.owners_LE).ravel()
    peak_L = np.bincount(flat, weights=single_LE.ravel(), minlength=L * D).reshape(L, D).max(axis=1)
    mean_L = loads_LE.sum(axis=1) / D
    return np.where(mean_L > 0, np.maximum(1.0, peak_L / np.where(mean_L > 0, mean_L, 1.0)), 1.0)


def reshard_due(completed_iterations: int, interval: int) -> bool:
    """Whether a re-shard decision is taken before the next iteration: after every `interval`
    completed iterations (interval 0 = never), never before the first."""
    return interval > 0 and completed_iterations > 0 and completed_iterations % interval == 0


@dataclass(frozen=True)
class ReshardDecision:
    """The re-shard rule's verdict on one proposal (DESIGN 4.3)."""

    proposed: ModelShardLayout
    """`heterogeneous_shard` of the predicted loads, ties towards the current owners."""
    adopt: bool
    """True when the proposal lowers the mean imbalance bound and moves at least one expert."""
    moved: int
    """Experts whose owner differs between the current layout and the proposal."""
    bound_before: float
    """Mean over layers of `shard_imbalance_bound` of the current layout."""
    bound_proposed: float
    """The same for the proposal."""


def decide_reshard(current: ModelShardLayout, loads_LE, topology: Topology, t: int) -> ReshardDecision:
    """The one re-shard rule, shared by the runtime (fssdp/runtime.py) and the simulator
    (policies.FSSDPPolicy): propose the heterogeneous sharding of the predicted loads and adopt
    it only if it lowers the predicted imbalance, the mean over layers of
    `shard_imbalance_bound`. DESIGN re-shards whenever the plan changed; the greedy's plan
    changes with any reordering of nearly equal loads, so that would move nearly every expert
    each time (docs/benchmarks.md, "Re-shard adoption", has the measurements)."""
    proposed = heterogeneous_shard(loads_LE, topology, current=current)
    before = float(shard_imbalance_bound(current, loads_LE, t).mean())
    after = float(shard_imbalance_bound(proposed, loads_LE, t).mean())
    moved = int((proposed.owners_LE != current.owners_LE).sum())
    return ReshardDecision(proposed, adopt=after < before and moved > 0, moved=moved, bound_before=before, bound_proposed=after)


# ----------------------------------------------------------------------------------------
# Topology-aware dispatch (4.4)
# ----------------------------------------------------------------------------------------


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
    holds_ED = placement.counts_ED > 0
    replicas_E = holds_ED.sum(axis=1)
    rep = np.flatnonzero(replicas_E > 1)
    first_holder_E = np.argmax(holds_ED, axis=1)
    tokens_E = loads_SE.sum(axis=0)
    pieces = []  # (flat (r, source), flat (r, destination), tokens) of the replicated experts rep[r]
    if rep.size:
        R = rep.size
        single = replicas_E == 1
        load_D = np.bincount(first_holder_E[single], weights=tokens_E[single], minlength=D).astype(np.int64)
        quota_RD = _replicated_quotas(holds_ED, tokens_E, load_D, rep)
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

    # every expert gets one entry per source in grid order (the replicated ones with 0 tokens,
    # their tokens are in the pieces), which at D = 1024 is cheaper than finding non-zero pairs
    G = D * E
    K = G + sum(p[2].size for p in pieces)
    source_K = np.empty(K, dtype=np.int64)
    expert_K = np.empty(K, dtype=np.int64)
    dest_K = np.empty(K, dtype=np.int64)
    tokens_K = np.empty(K, dtype=np.int64)
    source_K[:G].reshape(D, E)[:] = np.arange(D, dtype=np.int64)[:, None]
    expert_K[:G].reshape(D, E)[:] = np.arange(E, dtype=np.int64)
    dest_K[:G].reshape(D, E)[:] = first_holder_E
    grid_tokens = tokens_K[:G].reshape(D, E)
    grid_tokens[:] = loads_SE
    grid_tokens[:, rep] = 0
    if pieces:
        from_P, to_P, n_P = (np.concatenate(column) for column in zip(*pieces))
        r_P, source_K[G:] = np.divmod(from_P, D)
        expert_K[G:] = rep[r_P]
        dest_K[G:] = to_P % D
        tokens_K[G:] = n_P
    # valid by construction (tests check every plan with DispatchPlan.check), so skip the
    # O(K) re-validation that would dominate the cost at D = 1024
    return DispatchPlan.trusted(source_K, expert_K, dest_K, tokens_K, D, E, D)
