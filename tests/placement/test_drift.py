"""FSSDP's placement under drifting expert loads (issue 17, item 3), replayed on synthetic
traces of 4 nodes x 8 devices, 64 experts, t = 8, m = 4 (the issue's setting), with the
runtime's defaults: the adaptive load predictor and the relief calibration with slots reserved
for it (on by default; --no-fssdp-calibrate turns it off).

Traces vary the Zipf skew (1.0, 1.4), how fast popularity moves (0.05 and 0.2 positions per
iteration: the hot spot moves every 20 and every 5 iterations; each move turns the coldest
expert into a rising one) and one-iteration spikes (none, 5%). EP leaves them at a mean
imbalance of 4-6.6 (p95 8-14). Measured (80 iterations, docs/benchmarks.md "Drift"): calibrated
FSSDP 1.02-1.09 mean, p95 1.07-1.22; uncalibrated with the adaptive predictor 1.04-1.26 / 1.15-2.9,
with DESIGN's plain 5-iteration mean 1.08-1.77 / 1.38-4.1.

Faster drift (a whole position per iteration: the hottest expert was the coldest one iteration
before) is not predictable from the loads; calibration then does the work: Zipf 1.2 with 5%
spikes, seeds 0-5, 60 iterations: 1.45-1.85 mean, p95 1.76-2.25 (EP 6.3-12.1, FasterMoE's
shadowing 2.33-2.44 / 2.81-3.11). That misses the issue's 1.15 / 1.6 target; it is reported in
the closing note and asserted only as the improvement it is.
"""

import numpy as np
import pytest

from megatron_patches.placement import Topology, synthetic_trace
from megatron_patches.placement.baselines import ByteModel
from megatron_patches.placement.policies import ReplayConfig, make_policy, replay

TOPOLOGY = Topology(4, 8, 300e9, 12.5e9)  # NVLink inside a node, 100 Gbps between nodes
BYTES = ByteModel.from_expert_bytes(2 * 768 * 1536 * 2)  # GPT-MoE-S expert, bf16
LAYERS, EXPERTS, ITERATIONS, WARMUP = 4, 64, 60, 5


def imbalance(trace, policy: str, **knobs) -> tuple[float, float]:
    """Mean and p95 imbalance of a replay after the first WARMUP iterations (no history yet)."""
    config = ReplayConfig(TOPOLOGY, BYTES, overlap_degree=8, memory_capacity=4, **knobs)
    result = replay(make_policy(policy, config, LAYERS, EXPERTS), trace.loads, trace.source_loads)
    x = result.imbalance_IL[WARMUP:].ravel()
    return float(x.mean()), float(np.percentile(x, 95))


def drifting(zipf: float, drift: float, spikes: float, seed: int = 0):
    return synthetic_trace(iterations=ITERATIONS, layers=LAYERS, experts=EXPERTS, tokens=65536, zipf=zipf,
                           drift=drift, spike_prob=spikes, layer_variation=0.5, ranks=32, seed=seed)


@pytest.mark.parametrize("zipf,drift,spikes", [(1.0, 0.2, 0.05), (1.4, 0.2, 0.0), (1.4, 0.05, 0.05), (1.2, 0.2, 0.05)])
def test_calibrated_fssdp_holds_balance_on_drifting_loads(zipf, drift, spikes):
    trace = drifting(zipf, drift, spikes, seed=int(10 * zipf + 100 * drift))
    ep_mean, _ = imbalance(trace, "ep")
    assert ep_mean > 4.0  # the traces are badly skewed for a static layout
    mean, p95 = imbalance(trace, "fssdp")  # the default: calibrated
    assert mean <= 1.15 and p95 <= 1.6, (mean, p95)
    # the adaptive predictor alone already beats DESIGN's 5-iteration mean on drift
    adaptive, _ = imbalance(trace, "fssdp", calibrate=False)
    plain, _ = imbalance(trace, "fssdp", calibrate=False, load_predictor="mean")
    assert adaptive < plain
    assert mean < adaptive


def test_fast_drift_is_left_to_calibration():
    """Popularity moving a position per iteration: the prediction is useless (FSSDP without
    calibration stays near EP); calibration with its reserved slots takes most of it back, and
    balances better than FasterMoE's shadowing (measured on seed 3: EP 8.99, uncalibrated 8.67,
    calibrated 1.60, FasterMoE 2.44)."""
    trace = drifting(1.2, 1.0, 0.05, seed=3)
    ep_mean, _ = imbalance(trace, "ep")
    uncalibrated, _ = imbalance(trace, "fssdp", calibrate=False)
    mean, _ = imbalance(trace, "fssdp")
    fastermoe, _ = imbalance(trace, "fastermoe")
    assert uncalibrated > 0.9 * ep_mean
    assert mean < 0.25 * uncalibrated and mean < fastermoe, (mean, uncalibrated, fastermoe)
