"""Calibration (DESIGN 4.2 step 4): one more gather after the gate when it pays off
(`calibrate`), priced by FSSDP's cost model (`FSSDPCostModel`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_patches.placement import kernels
from megatron_patches.placement.fssdp.dispatch import plan_dispatch
from megatron_patches.placement.fssdp.inputs import descending, holdings
from megatron_patches.placement.fssdp.quotas import balanced_quotas, replicated_quotas, split_holders
from megatron_patches.placement.types import (
    DispatchPlan,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    Topology,
    check_loads,
    check_source_loads,
)


@dataclass(frozen=True)
class FSSDPCostModel:
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
                raise PlacementError(f"FSSDPCostModel.{name} must be finite and >= 0, got {value!r}")

    def spag_seconds(self, shard: ShardLayout, placement: InstancePlacement, topology: Topology) -> float:
        """Time of spAG(shard -> placement): `gather_seconds`, or the busiest device's transfers
        over the topology's point-to-point bandwidths plus `latency_s` (0 without copies)."""
        if self.gather_seconds is not None:
            return float(self.gather_seconds(shard, placement))
        return self._copies_seconds(placement.held_ED(), shard.holds_ED(bool), shard, topology)

    def extra_gather_seconds(self, shard: ShardLayout, current: InstancePlacement, holds_ED: np.ndarray,
                             topology: Topology) -> float:
        """Time of gathering the copies in `holds_ED` that `current` lacks (on the critical path).
        `current` contains `shard`, so without `gather_seconds` the new copies are holds_ED minus
        current's holdings, priced without building calibration's gather placement (calibrate
        prices up to a few candidates per layer per iteration)."""
        if self.gather_seconds is not None:
            return self.spag_seconds(shard, calibration_gather(shard, current, holds_ED), topology)
        return self._copies_seconds(holdings(holds_ED), current.held_ED(), shard, topology)

    def _copies_seconds(self, holds_ED: np.ndarray, have_ED: np.ndarray, shard: ShardLayout,
                        topology: Topology) -> float:
        """The point-to-point model's gather of the copies in holds_ED that have_ED lacks (bool
        [E, D] each) from their owners: the busiest device's transfers (its receives or its sends,
        each copy's `expert_bytes` over the intra- or inter-node bandwidth) plus `latency_s`, 0
        without copies."""
        seconds = kernels.copies_seconds(holds_ED, have_ED, shard.owner_E.astype(np.int64), topology.node_of,
                                         self.expert_bytes / topology.intra_node_bw,
                                         self.expert_bytes / topology.inter_node_bw)
        return 0.0 if seconds < 0 else float(seconds) + self.latency_s

    def layer_seconds(self, holds_ED, tokens_E: np.ndarray, source_loads_DE: np.ndarray | None,
                      topology: Topology, sent_S: np.ndarray | None = None) -> tuple[float, float]:
        """(expert compute, all-to-all) of one layer on the placement `holds_ED`: the busiest
        device's tokens x seconds_per_token + its instances with tokens x seconds_per_instance,
        with device loads as `dispatch` makes them, and the dispatch plan's all-to-all. Without
        per-source loads or `dispatch_seconds`, the loads of `balanced_quotas` and no all-to-all.
        The per-source loads are checked ones (`check_loads`, int64 [D, E]) summing over sources to
        `tokens_E`; `sent_S`, their row sums, when the caller prices several placements on them."""
        holds_ED = holdings(holds_ED)
        if source_loads_DE is None or self.dispatch_seconds is None:
            return self.compute_seconds(*quota_loads(holds_ED, tokens_E)), 0.0
        plan = plan_dispatch(holds_ED, source_loads_DE, tokens_E, topology, sent_S)
        return self.compute_seconds(plan.device_loads_D(), plan.instances_with_tokens_D()), float(
            self.dispatch_seconds(plan))

    def compute_seconds(self, tokens_D: np.ndarray, instances_D: np.ndarray) -> float:
        """The busiest device's expert time, from tokens and instances with tokens per device."""
        return float(kernels.compute_seconds(np.asarray(tokens_D), np.asarray(instances_D), self.seconds_per_token,
                                             self.seconds_per_instance))

    def exposed_seconds(self, gather_s: float, gather_hidden_s: float, compute_s: float) -> float:
        """What a gather of `gather_s` costs beyond the work that runs beside it.

        The gather past `gather_hidden_s` (0 for calibration's gather after the gate, which is on
        the critical path; the non-MoE forward for the spAG launched before the attention), plus
        its gradients' reduce (`reduce_ratio` x the gather) past the backward that runs while it
        is in flight: spRS(l) starts when layer l's MoE backward is done and is waited for when
        layer l-1's is (`FSSDPRuntime.drain`), so the attention backward (`reduce_hidden_s`) and
        one MoE backward's compute hide it, modelled as this layer's: 2/3 of its expert compute
        (forward + backward = 3 forwards). The backward's all-to-alls hide none of it: they move
        over the same links (until 2026-11-29 half the all-to-all was counted as hiding it; the
        simulator then began to share the NIC and showed the reduce delaying the all-to-all,
        docs/benchmarks.md "NIC sharing")."""
        return kernels.exposed_seconds(gather_s, gather_hidden_s, compute_s, self.reduce_ratio,
                                       self.reduce_hidden_s, MOE_BACKWARD_SHARE)

    def least_exposed_seconds(self, gather_s: float, best_s: float) -> float:
        """A lower bound of `exposed_seconds(gather_s, 0, c, a)` for any placement that can beat
        `best_s` (c + a < best_s, so the MoE backward hides at most 2/3 of best_s): lets
        calibration skip a candidate before pricing its dispatch."""
        return kernels.least_exposed_seconds(gather_s, best_s, self.reduce_ratio, self.reduce_hidden_s,
                                             MOE_BACKWARD_SHARE)

    def exposed_reduce_seconds(self, gather_s: float, compute_s: float) -> float:
        """The reduce part of `exposed_seconds`."""
        return kernels.exposed_reduce_seconds(gather_s, compute_s, self.reduce_ratio, self.reduce_hidden_s,
                                              MOE_BACKWARD_SHARE)


BACKWARD_OVER_FORWARD = 2.0
"""A GEMM layer's backward time over its forward time: two GEMMs (the input's and the weights'
gradients) per forward GEMM. The one figure the runtime's cost model (`FSSDPRuntime`), this
module's windows and the simulator's compute model (`sim.costs.ComputeModel.BACKWARD`) use."""
MOE_BACKWARD_SHARE = BACKWARD_OVER_FORWARD / (1.0 + BACKWARD_OVER_FORWARD)
"""Share of an expert's forward + backward compute that is its backward (2/3)."""


def calibration_gather(shard: ShardLayout, current: InstancePlacement, holds_ED) -> InstancePlacement:
    """What calibration's extra spAG fills: the owners plus the copies in `holds_ED` (bool or int
    [E, D]) that `current` lacks."""
    gather_ED = ~current.held_ED()
    gather_ED &= holdings(holds_ED)
    gather_ED[np.arange(shard.num_experts), shard.owner_E] = True
    return InstancePlacement.trusted(gather_ED)


def quota_loads(holds_ED: np.ndarray, tokens_E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, instances with tokens) per device under `balanced_quotas(holds_ED, tokens_E)`,
    without its [E, D] matrix: the single-holder experts counted per holder, the replicated
    ones from their quotas (`replicated_quotas`); int64 [D] each."""
    holders = split_holders(holds_ED, tokens_E)
    if np.any(holders.holder_E < 0):
        balanced_quotas(holds_ED, tokens_E)  # raises, naming the expert without a holder
    load_D, instances_D = holders.load_D, holders.busy_D
    if holders.rep.size:
        quota_RD = replicated_quotas(holders, tokens_E)
        load_D = load_D + quota_RD.sum(axis=0)
        instances_D = instances_D + (quota_RD > 0).sum(axis=0)
    return load_D, instances_D


def calibrate(
    current: InstancePlacement,
    shard: ShardLayout,
    actual_loads_E,
    remaining_m,
    topology: Topology,
    cost: FSSDPCostModel,
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
      With more than `EXACT_SHADOWS` of them (many experts over a device's share and many free
      slots: 128 experts on 256 GPUs with 31 free slots have about 31), k is searched
      (`_search_shadows`) instead of every k priced.

    Price of a candidate: MoE time = max device load * seconds_per_token, with device loads as
    `dispatch` will make them (`balanced_quotas` of the actual loads), plus the extra gather's
    time (`FSSDPCostModel.extra_gather_seconds`), which is on the critical path, and the part
    of their gradients' reduction that the backward does not hide (`FSSDPCostModel.
    exposed_seconds`). With the per-source loads and `cost.dispatch_seconds`, the plan is
    `dispatch`'s itself and its all-to-all time is added (`FSSDPCostModel.layer_seconds`). The
    current placement costs its MoE time alone. A candidate is taken only when strictly
    cheaper; ties go to the earlier candidate (relief, then fewer shadows). A candidate whose
    least exposed gather and reduce (`FSSDPCostModel.least_exposed_seconds`), added to the best
    balance any placement can reach (ceil(total / D) tokens on the busiest device), cost more
    than the best so far (or as much, and it comes later) is not priced further.

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
    held_ED = current.held_ED()
    with_a2a = source_loads_DE is not None and cost.dispatch_seconds is not None
    sent_S = None
    if with_a2a:
        source_loads_DE, by_expert_E, sent_S = check_source_loads(source_loads_DE, "source_loads_DE")
        if not np.array_equal(by_expert_E, tokens_E):
            raise PlacementError("source_loads_DE must sum over sources to actual_loads_E")

    quota_ED = balanced_quotas(held_ED, tokens_E)
    if with_a2a:
        best_s = sum(cost.layer_seconds(held_ED, tokens_E, source_loads_DE, topology, sent_S))
    else:
        best_s = cost.compute_seconds(quota_ED.sum(axis=0), (quota_ED > 0).sum(axis=0))
    floor_s = np.ceil(total / D) * cost.seconds_per_token  # no placement computes faster
    chosen = [best_s, -1, None]  # price, index (-1: the current placement; 0: relief; k: k shadows), holdings

    def consider(index: int, holds_ED: np.ndarray) -> float:
        """Prices candidate `index` and takes it when its (price, index) is below the chosen one's;
        returns its price, inf where it cannot be taken (no new copy, or too dear to price)."""
        if not (holds_ED & ~held_ED).any():
            return np.inf
        gather_s = cost.extra_gather_seconds(shard, current, holds_ED, topology)
        least_s = floor_s + cost.least_exposed_seconds(gather_s, chosen[0])
        if (least_s, index) > (chosen[0], chosen[1]):
            return np.inf  # its copies cost more than any balance could save
        compute_s, a2a_s = cost.layer_seconds(holds_ED, tokens_E, source_loads_DE, topology, sent_S)
        seconds = compute_s + a2a_s + cost.exposed_seconds(gather_s, 0.0, compute_s)
        if (seconds, index) < (chosen[0], chosen[1]):
            chosen[:] = seconds, index, holds_ED
        return seconds

    consider(0, _relief_candidate(held_ED, quota_ED, shard.owner_E, tokens_E, free_D, topology, cost))
    shadows = _shadow_steps(held_ED, tokens_E, free_D)

    def price_shadows(k: int) -> float:
        return consider(k, _with_shadows(held_ED, shadows[:k]))

    if len(shadows) <= EXACT_SHADOWS:
        for k in range(1, len(shadows) + 1):
            price_shadows(k)
    else:
        _search_shadows(len(shadows), price_shadows)
    if chosen[2] is None:
        return current, False
    return InstancePlacement.trusted(held_ED | chosen[2]), True


EXACT_SHADOWS = 12
"""Most shadow candidates (k = 1 .. K) that `calibrate` prices one by one; beyond, it searches k
(`_search_shadows`). Each price is a balanced split and a dispatch plan: at 128 experts on 256
GPUs with 31 free slots per device a calibration priced about 31 of them, 40 ms per layer.
Below 12 every k is priced (at the papers' scale, E = 64 on 32 GPUs, the simulator's calibrations
have 3.4 on average, at most 11, and a search there missed the cheapest k in 5% of them, by up to
18%; docs/benchmarks.md, "Calibration's shadows")."""


def _search_shadows(count: int, price) -> None:
    """Prices k shadows (`price(k)`: seconds, inf where not priced) for the k of 1 .. count on a
    grid of powers of two and `count`, then halves the gaps on either side of the cheapest k so
    far (ties: the smaller k) until it has priced its neighbours: about 2 log2(count) + 2 of them.
    The prices fall with k until the free slots run out, with a sawtooth near the bottom as each
    shadow takes the peak off one device: over 401 calibrations of Qwen3-30B-A3B on 256 H100s
    (31-33 shadows each) this priced 26% of the candidates and chose a dearer one in 3 of them
    (mean regret 0.02%, max 6.3%; docs/benchmarks.md, "Calibration's shadows")."""
    seen: dict[int, float] = {}
    k = 1
    while k < count:
        seen[k] = price(k)
        k *= 2
    seen[count] = price(count)
    while True:
        best = min(seen, key=lambda k: (seen[k], k))
        below = max((k for k in seen if k < best), default=0)
        above = min((k for k in seen if k > best), default=count + 1)
        fresh = [k for k in {(below + best) // 2, (best + above) // 2} if below < k < above and k not in seen]
        if not fresh:
            return
        for k in sorted(fresh):
            seen[k] = price(k)


def _relief_candidate(held_ED: np.ndarray, quota_ED: np.ndarray, owner_E: np.ndarray, tokens_E: np.ndarray,
                      free_D: np.ndarray, topology: Topology, cost: FSSDPCostModel) -> np.ndarray:
    """Copies that relieve the busiest device one at a time, as few as pay (`calibrate`).

    A load spike the prediction missed (an expert that was cold last iteration) overloads its
    few holders; what fixes it is a copy or two of that expert, near its owner, not a re-split
    of every expert's copies in proportion to the loads (DESIGN's step 4) or a copy on every
    device (the shadow candidates), whose gathers cost more than the spike. Greedy: take the
    busiest device (device loads as `balanced_quotas` makes them), its expert with the largest
    quota that can still get a copy, and copy it to the device where its transfer time from the
    owner plus that device's load is least (a same-node device first when loads are alike);
    refill that expert's tokens over its holders (`kernels.fill_sorted`) and repeat while the peak falls.
    Each prefix of the chain is priced like `calibrate` prices a candidate, with the
    point-to-point gather model (busiest sender or receiver); the cheapest prefix is returned
    (possibly none of the copies: then `held_ED` itself). `quota_ED` is overwritten.
    """
    expert_N, target_N = kernels.relief_chain(
        held_ED, quota_ED, owner_E.astype(np.int64), tokens_E, free_D, topology.node_of,
        cost.expert_bytes / topology.intra_node_bw, cost.expert_bytes / topology.inter_node_bw,
        cost.seconds_per_token, cost.seconds_per_instance, cost.latency_s, cost.reduce_ratio, cost.reduce_hidden_s,
        MOE_BACKWARD_SHARE)
    out = held_ED.copy()
    out[expert_N, target_N] = True
    return out


def _shadow_steps(held_ED: np.ndarray, tokens_E: np.ndarray, free_D: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """FasterMoE's choices, as steps: step k copies the k-th expert by tokens to every device with
    a free slot that lacks it, (expert, bool [D] of its new holders), while some device has a slot;
    k shadows are held_ED with the first k steps (`_with_shadows`). Only experts with more tokens
    than a device's fair share (total / D) are shadowed: a lighter one cannot by itself make a
    device the busiest, and pricing every prefix (E of them) costs a balanced split each. An
    expert that no device with a free slot lacks makes no step."""
    steps = []
    free_D = free_D.copy()
    share = tokens_E.sum() / held_ED.shape[1]
    for e in descending(tokens_E.astype(np.float64)):
        if tokens_E[e] <= share or not free_D.any():
            break
        new_D = ~held_ED[e] & (free_D > 0)
        if new_D.any():
            steps.append((int(e), new_D))
            free_D -= new_D
    return steps


def _with_shadows(held_ED: np.ndarray, steps: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """held_ED with the shadow steps `steps` taken (`_shadow_steps`); a new bool [E, D]."""
    holds_ED = held_ED.copy()
    for e, new_D in steps:
        holds_ED[e] |= new_D
    return holds_ED
