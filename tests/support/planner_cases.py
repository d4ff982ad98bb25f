"""Planner cases whose outputs are pinned byte for byte (tests/placement/test_planner_golden.py).

Issue 44 made the per-layer planner (materialize, calibrate, dispatch, the balanced quotas)
fast at E = 256, D = 1,024 on the condition that its plans stay byte-identical to the ones
it made before. `digests()` runs every case and hashes what it returns; the digests of the
planner as it was before that work are in tests/data/planner_golden.json, written by

    PYTHONPATH=tests python -m support.planner_cases --write

Cases span one node and several, fewer devices than experts and more, t <= m and t > m,
m = 0, loads with cold (zero) experts, calibration with and without the all-to-all priced,
with a per-instance cost and a reduce, priced as the runtime prices it (the sparse all-gather's
stages, flat and hierarchical, and the plan's link bytes), and drifting-trace replays through
FSSDPPolicy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from megatron_patches.placement import Topology, fssdp, synthetic_trace
from megatron_patches.placement.accounting import dispatch_bytes, imbalance, sparse_all_gather_seconds
from megatron_patches.placement.links import transfer_seconds
from megatron_patches.placement.baselines import ByteModel
from megatron_patches.placement.policies import ReplayConfig, make_policy, replay
from megatron_patches.placement.types import DispatchPlan, ShardLayout

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "planner_golden.json"

SIZES = [  # (experts, nodes, devices per node)
    (8, 1, 4),
    (16, 2, 4),
    (64, 4, 8),
    (16, 4, 16),  # more devices than experts
    (256, 16, 8),
]
TM = [(8, 4), (4, 4), (2, 0), (16, 2), (3, 1)]
LARGE = (256, 128, 8)  # the benchmark's scale (E = 256, D = 1,024), at its t and m only
LARGE_TM = [(8, 4), (4, 4)]


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(np.ascontiguousarray(part).tobytes() if isinstance(part, np.ndarray) else repr(part).encode())
    return h.hexdigest()[:16]


def _plan_digest(plan: DispatchPlan) -> str:
    keys, sums = plan._canonical()
    return _digest(keys, sums)


def _a2a_seconds(plan: DispatchPlan) -> float:
    """A deterministic stand-in for the simulator's all-to-all price: the busiest sender's or
    receiver's remote tokens at 1 us each."""
    traffic_SD = plan.traffic_SD()
    np.fill_diagonal(traffic_SD, 0)
    return float(max(traffic_SD.sum(axis=0).max(), traffic_SD.sum(axis=1).max())) * 1e-6


def _sources(rng, experts: int, devices: int, exponent: float, cold: int) -> np.ndarray:
    weights = (np.arange(experts) + 1.0) ** -exponent
    weights = weights[rng.permutation(experts)]
    weights[rng.choice(experts, size=cold, replace=False)] = 0.0
    return np.stack([rng.multinomial(2048, weights / weights.sum()) for _ in range(devices)])


def layer_cases():
    """(name, shard, source_DE, actual_DE, t, m, topology) for every size x (t, m) x skew."""
    for experts, nodes, per_node in [*SIZES, LARGE]:
        topology = Topology(nodes, per_node, 300e9, 12.5e9)
        D = topology.num_devices
        for exponent in (0.8, 1.4):
            for t, m in LARGE_TM if (experts, nodes, per_node) == LARGE else TM:
                seed = (experts * 7919 + D * 31 + t * 17 + m) * 10 + int(exponent * 10)
                rng = np.random.default_rng(seed)
                source_DE = _sources(rng, experts, D, exponent, cold=experts // 8)
                actual_DE = source_DE.copy()
                order = np.argsort(source_DE.sum(axis=0), kind="stable")
                actual_DE[:, order[0]] = source_DE[:, order[-2]]  # a cold expert spikes after the gate
                shard = ShardLayout.even(experts, D) if seed % 2 else ShardLayout(rng.integers(0, D, experts), D)
                yield f"E{experts}-D{D}-z{exponent}-t{t}-m{m}", shard, source_DE, actual_DE, t, m, topology


def _runtime_cost(topology: Topology, algorithm: str) -> fssdp.FSSDPCostModel:
    """The cost model as the fssdp runtime builds it (`FSSDPTuning.cost_model`): each candidate's
    gather by the sparse all-gather's stages with `algorithm`, its all-to-all from the dispatch
    plan's link bytes (4 x, 1,536 bytes per token)."""
    return fssdp.FSSDPCostModel(
        seconds_per_token=1.4e-7, expert_bytes=4718592.0, seconds_per_instance=3e-5, reduce_ratio=1.0,
        reduce_hidden_s=1e-4,
        gather_seconds=lambda shard, placement: sparse_all_gather_seconds(shard, placement, 4718592.0, topology,
                                                                          algorithm),
        dispatch_seconds=lambda plan: 4.0 * transfer_seconds(dispatch_bytes(plan, topology, 1536), topology),
    )


COSTS = {
    "compute": fssdp.FSSDPCostModel(seconds_per_token=1.4e-7, expert_bytes=4718592.0),
    "a2a": fssdp.FSSDPCostModel(seconds_per_token=1.4e-7, expert_bytes=4718592.0, latency_s=2e-5,
                                seconds_per_instance=3e-5, reduce_ratio=1.0, reduce_hidden_s=1e-4,
                                dispatch_seconds=_a2a_seconds),
}


def layer_digests() -> dict[str, tuple[str, float]]:
    """Per case: (digest, imbalance of the plan's device loads)."""
    out = {}
    for name, shard, source_DE, actual_DE, t, m, topology in layer_cases():
        predicted_E = source_DE.sum(axis=0).astype(np.float64)
        placement = fssdp.materialize(shard, predicted_E, t, m, topology)
        plan = fssdp.dispatch(placement, source_DE, topology)
        quota_ED = fssdp.balanced_quotas(placement.holds_ED(), actual_DE.sum(axis=0))
        out[name] = (_digest(placement.counts_ED, _plan_digest(plan), quota_ED), imbalance(plan.device_loads_D()))
        reserve = fssdp.materialize(shard, predicted_E, t, max(m - 1, 0), topology)
        remaining_D = m - reserve.extra_copies_D(shard)
        costs = {**COSTS, "rt-hier": _runtime_cost(topology, "hierarchical"),
                 "rt-flat": _runtime_cost(topology, "flat")}
        for cost_name, cost in costs.items():
            calibrated, gathered = fssdp.calibrate(reserve, shard, actual_DE.sum(axis=0), remaining_D, topology,
                                                   cost, actual_DE)
            plan = fssdp.dispatch(calibrated, actual_DE, topology)
            out[f"{name}-cal-{cost_name}"] = (_digest(calibrated.counts_ED, gathered, _plan_digest(plan)),
                                              imbalance(plan.device_loads_D()))
    return out


def replay_digests() -> dict[str, tuple[str, float]]:
    topology = Topology(4, 8, 300e9, 12.5e9)
    bytes_ = ByteModel.from_expert_bytes(2 * 768 * 1536 * 2)
    out = {}
    for drift, calibrate in ((0.2, True), (1.0, True), (0.2, False)):
        trace = synthetic_trace(iterations=20, layers=2, experts=64, tokens=65536, zipf=1.2, drift=drift,
                                spike_prob=0.05, layer_variation=0.5, ranks=32, seed=1)
        config = ReplayConfig(topology, bytes_, overlap_degree=8, memory_capacity=4, calibrate=calibrate)
        result = replay(make_policy("fssdp", config, 2, 64), trace.loads, trace.source_loads)
        out[f"replay-drift{drift}-cal{calibrate}"] = (_digest(result.imbalance_IL), float(result.imbalance_IL.mean()))
    return out


def digests() -> dict[str, tuple[str, float]]:
    return {**layer_digests(), **replay_digests()}


def compare(golden: dict, found: dict) -> tuple[list[str], list[str]]:
    """(cases whose plan changed and balances at least as well, cases whose plan changed and
    balances worse) against the pinned ones; imbalance compared to 1e-9."""
    changed = sorted(name for name in golden if found[name][0] != golden[name][0])
    worse = [name for name in changed if found[name][1] > golden[name][1] + 1e-9]
    return [name for name in changed if name not in worse], worse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the digests to {GOLDEN}")
    args = parser.parse_args(argv)
    found = digests()
    if args.write:
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(found)} digests to {GOLDEN}")
        return 0
    golden = json.loads(GOLDEN.read_text())
    better, worse = compare(golden, found)
    print(f"{len(golden) - len(better) - len(worse)} of {len(golden)} cases byte-identical")
    for name in better + worse:
        print(f"  {name}: imbalance {golden[name][1]:.4f} -> {found[name][1]:.4f}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
