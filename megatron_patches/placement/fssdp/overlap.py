"""t by cost: the overlap degree whose priced iteration is cheapest (`overlap_prices`,
`choose_overlap_degree`) among the candidates (`overlap_candidates`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement.fssdp.calibrate import FSSDPCostModel, calibrate
from megatron_patches.placement.fssdp.materialize import materialize
from megatron_patches.placement.types import (
    PlacementError,
    ShardLayout,
    Topology,
    check_int,
    check_loads,
)


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
                   cost: FSSDPCostModel, t_non_moe_s: float, calibrated: bool = False) -> np.ndarray:
    """Price of each candidate t over the layers `shards` with the per-source loads
    `source_loads_LDE` (int [L, D, E]); float [T, 4] (`OverlapChoice.prices_T4`).

    A layer's placement is `materialize`'s for those loads (its prediction, when the loads repeat)
    with t and m, then, with `calibrated` (the run calibrates after the gate), what `calibrate`
    adds to it in the memory left: with t = 0 calibration alone may do better than copies
    gathered before the gate. Its price is `FSSDPCostModel.layer_seconds` (the busiest
    device's expert time, the dispatch plan's all-to-all), the spAG launched as the layer starts
    beyond the non-MoE forward `t_non_moe_s`, calibration's gather (on the critical path), and
    the spRS of every copy beyond the backward that hides it
    (`FSSDPCostModel.exposed_reduce_seconds`).
    """
    source_loads_LDE = check_loads(source_loads_LDE, "source_loads_LDE", 3)
    if source_loads_LDE.shape[0] != len(shards):
        raise PlacementError(
            f"source_loads_LDE has {source_loads_LDE.shape[0]} layers but {len(shards)} shard layouts were given"
        )
    prices_T4 = np.zeros((len(candidates), 4))
    for shard, sources_DE in zip(shards, source_loads_LDE):
        tokens_E, sent_S = sources_DE.sum(axis=0), sources_DE.sum(axis=1)
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
            compute_s, a2a_s = cost.layer_seconds(placement.held_ED(), tokens_E, sources_DE, topology, sent_S)
            reduce_s = cost.exposed_reduce_seconds(reduced_s, compute_s)
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
    (tests/sim/test_sim_fssdp_calibration.py, docs/tools.md, "Every run config, simulated"). `prices_T4`
    comes from `overlap_prices`, summed over the job's layers (the runtime all-reduces it over
    pipeline stages, so every rank takes the same t)."""
    prices_T4 = np.asarray(prices_T4, dtype=np.float64)
    if prices_T4.shape != (len(candidates), 4) or not np.all(np.isfinite(prices_T4)):
        raise PlacementError(f"prices_T4 must be finite with shape ({len(candidates)}, 4), got {prices_T4.shape}")
    total_T = prices_T4.sum(axis=1)
    best = min(range(len(candidates)), key=lambda i: (total_T[i], candidates[i]))
    return OverlapChoice(int(candidates[best]), int(hidden_t), tuple(int(t) for t in candidates), prices_T4)
