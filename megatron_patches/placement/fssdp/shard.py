"""Sharding (DESIGN 4.3): who owns which expert of every layer (`heterogeneous_shard`,
`even_shard`), how well a layout balances at best (`shard_imbalance_bound`) and when to re-shard
(`decide_reshard`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement.fssdp.inputs import check_weights
from megatron_patches.placement.types import (
    ModelShardLayout,
    PlacementError,
    Topology,
    check_int,
)


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
        check_weights(loads_LE[l], f"loads_LE[{l}]")
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


def overlap_due(completed_iterations: int, interval: int) -> bool:
    """Whether auto t is chosen again before the next iteration: at every re-shard check
    (`reshard_due`) and, while the router's loads still move fast, after 1, 4, 16, 64, ...
    completed iterations below the interval (with interval 0, for ever at that pace).

    A t is priced on one iteration's loads and holds until the next choice. Chosen only after the
    first iteration and then at re-shard checks (every 100 by default), an early, skewed iteration
    decided for a long run: in case 22 of tests/sim/test_sim_fssdp_calibration.py the hottest
    expert's tokens fall from 6,875 to 4,111 over 8 iterations; t = 1 priced on the first
    (0.56 ms cheaper than t = 0 with calibration) gathered that expert to every device on every
    iteration after, while calibration at t = 0 takes 1-2 copies from the fourth on, so FSSDP ran
    at 1.131x EP on a shared 25 Gb/s NIC (t chosen again at iteration 4: 1.017x). Powers of 4, not
    of 2: a choice prices every candidate t on every layer, seconds of host time at scale
    (Qwen3-30B-A3B on 256 GPUs, calibrated: about 12 s in the simulator), so 3 more choices in
    the first 100 iterations rather than 6."""
    if completed_iterations <= 0:
        return False
    if reshard_due(completed_iterations, interval):
        return True
    below = interval <= 0 or completed_iterations < interval
    power_of_two = completed_iterations & (completed_iterations - 1) == 0
    return below and power_of_two and (completed_iterations.bit_length() - 1) % 2 == 0


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
