"""Synthetic expert-load traces with controllable skew, drift, spikes and per-layer variation.

Used by `tools/make_trace.py`, the tests and the simulator when no recorded trace is at hand.
The model, per layer l and iteration i:

- popularity follows a Zipf law over popularity positions: weight(k) = (k + 1) ** -a_l for
  position k = 0..E-1, a_l = zipf * (1 + layer_variation * u_l), u_l uniform in [-1, 1];
- each layer has its own random assignment of experts to positions (which experts are hot
  differs between layers);
- drift: the assignment rotates by `drift` positions per iteration, interpolated linearly
  between neighbouring positions, so hot experts cool down smoothly and others heat up
  (drift 0.05 moves the hot spot by one expert every 20 iterations);
- spikes: with probability `spike_prob` per (iteration, layer) one random expert's weight is
  multiplied by `spike_factor` for that iteration only;
- swings: every (layer, expert) weight is multiplied by exp(x), where x follows a stationary
  Gaussian AR(1) process over iterations: x_0 ~ N(0, swing^2) and
  x_{i+1} = swing_corr * x_i + swing * sqrt(1 - swing_corr^2) * N(0, 1). So an expert's
  popularity wanders randomly around its Zipf position, by a factor exp(swing) at one standard
  deviation, and x over k iterations differs by N(0, 2 swing^2 (1 - swing_corr^k)): the fast
  per-iteration popularity changes measured in training (swing 0 draws nothing, so traces of
  earlier versions are reproduced bit for bit);
- top-k: a token picks k distinct experts, so an expert receives at most 1/k of a layer's
  routed tokens; shares above 1/k are capped there and the excess spread over the others in
  proportion (water-filling; with k = 1, or no share above 1/k, nothing changes);
- tokens: `tokens` routed tokens per layer and iteration (tokens per batch x top-k), drawn
  multinomially from the normalised weights. With `ranks`, each rank gets an equal share of
  the tokens and its own slightly perturbed distribution (multiplicative log-normal noise
  of standard deviation `source_noise`), and `loads` is the sum over ranks.

Everything is drawn from one numpy Generator seeded with `seed`, so a trace is reproducible.
"""

from __future__ import annotations

import numpy as np

from megatron_patches.placement.trace import Trace
from megatron_patches.placement.types import PlacementError, check_int

__all__ = ["PAPERS_ROUTING", "cap_shares", "describe_routing", "popularity_weights", "synthetic_trace"]

PAPERS_ROUTING = {"zipf": 1.0, "drift": 0.05, "layer_variation": 0.5, "swing": 0.75, "swing_corr": 0.8}
"""The routing dynamics the MoE training papers report, as generator parameters (the simulator's
synthetic trace; `tools/make_trace.py --papers-routing`). Each is set from a routing statistic,
never from a system's published speed:
- swing 0.75 with correlation 0.8: SYMI (Skiadopoulos et al., NSDI'26, arXiv 2504.19925) reports
  an expert's popularity within one layer changing 16x within 3 iterations (16 experts, top-1,
  GPT-Small). On that setup (16 GPUs x 4 x 512 tokens, 12 layers, 60 iterations, seed 0) these
  values give a median layer's largest 3-iteration swing of 14.7x (trace_statistics per layer);
  the correlation keeps the neighbouring-iteration locality the papers' predictors rely on (Hecate
  predicts from a 5-iteration window, SYMI from the previous iteration);
- layer_variation 0.5 (the Zipf exponent from 0.5x to 1.5x per layer): Hecate (arXiv 2502.02581,
  Figure 11) measures "significant variations in degrees of load imbalance across layers" of
  GPT-MoE-S, per-layer speedups over EP from 2.8x to 18.8x; on that setup the default 0.2 keeps
  the layers' mean hottest share within 1.5x of each other, 0.5 spreads it 2.1x;
- Zipf 1.0 and drift 0.05 stay the generator's defaults: no paper we could read publishes the
  hottest expert's share during training, so the skew is not tuned to anything."""


def describe_routing(routing: dict) -> str:
    """Generator parameters as the tools print them, e.g. "zipf 1.0, layer variation 0.5"."""
    return ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in routing.items())


def _check(name: str, value, low: float) -> None:
    if not np.isfinite(value) or value < low:
        raise PlacementError(f"{name} must be >= {low}, got {value!r}")


def popularity_weights(
    iterations: int,
    layers: int,
    experts: int,
    zipf: float,
    drift: float,
    spike_prob: float,
    spike_factor: float,
    layer_variation: float,
    rng: np.random.Generator,
    swing: float = 0.0,
    swing_corr: float = 0.9,
) -> np.ndarray:
    """Normalised routing probabilities; float64 [iterations, layers, experts], rows sum to 1."""
    exponent_L = zipf * (1 + layer_variation * rng.uniform(-1.0, 1.0, size=layers))  # [L]
    exponent_L = np.maximum(exponent_L, 0.0)
    position_LE = np.stack([rng.permutation(experts) for _ in range(layers)]).astype(np.float64)  # [L, E]
    # fractional Zipf position of every expert at every iteration, cyclic over E positions
    shift_I = drift * np.arange(iterations, dtype=np.float64)  # [I]
    pos_ILE = (position_LE[None, :, :] + shift_I[:, None, None]) % experts
    lo = np.floor(pos_ILE).astype(np.int64)
    frac = pos_ILE - lo
    hi = (lo + 1) % experts
    ranks_K = np.arange(experts, dtype=np.float64) + 1.0
    zipf_LK = ranks_K[None, :] ** -exponent_L[:, None]  # [L, E] weight of position k in layer l
    layer_idx = np.arange(layers)[None, :, None]
    w = (1 - frac) * zipf_LK[layer_idx, lo] + frac * zipf_LK[layer_idx, hi]  # [I, L, E]
    if spike_prob > 0:
        spiked_IL = rng.random((iterations, layers)) < spike_prob
        spike_expert_IL = rng.integers(0, experts, size=(iterations, layers))
        i, l = np.nonzero(spiked_IL)
        w[i, l, spike_expert_IL[i, l]] *= spike_factor
    if swing > 0:
        # stationary AR(1) in log space, one independent process per (layer, expert)
        innovation_ILE = rng.standard_normal((iterations, layers, experts))
        x_ILE = np.empty_like(innovation_ILE)
        x_ILE[0] = swing * innovation_ILE[0]
        step = swing * np.sqrt(1.0 - swing_corr**2)
        for i in range(1, iterations):
            x_ILE[i] = swing_corr * x_ILE[i - 1] + step * innovation_ILE[i]
        # shift by the row max before exp: the same weights after normalisation, no overflow
        w = w * np.exp(x_ILE - x_ILE.max(axis=2, keepdims=True))
    return w / w.sum(axis=2, keepdims=True)


def cap_shares(p_ILE: np.ndarray, cap: float) -> np.ndarray:
    """Rows of `p_ILE` (probabilities over the last axis) with no entry above `cap`: capped
    entries set to `cap`, the rest scaled up to fill the row (repeated until none exceeds it);
    rows already within the cap are returned unchanged. Needs cap * E >= 1."""
    p = np.array(p_ILE, dtype=np.float64).reshape(-1, np.shape(p_ILE)[-1])  # [rows, E], a copy
    for index in np.nonzero(p.max(axis=1) > cap)[0]:
        row = p[index]
        capped = np.zeros(row.shape, dtype=bool)
        while True:
            capped |= row > cap
            free = ~capped
            row[capped] = cap
            rest = row[free].sum()
            if rest <= 0:
                break
            row[free] *= (1.0 - cap * capped.sum()) / rest
            if not np.any(row[free] > cap * (1 + 1e-12)):
                break
    return p.reshape(np.shape(p_ILE))


def synthetic_trace(
    iterations: int = 200,
    layers: int = 12,
    experts: int = 64,
    tokens: int = 65536,
    zipf: float = 1.0,
    drift: float = 0.05,
    spike_prob: float = 0.0,
    spike_factor: float = 5.0,
    layer_variation: float = 0.2,
    swing: float = 0.0,
    swing_corr: float = 0.9,
    ranks: int | None = None,
    source_noise: float = 0.1,
    seed: int = 0,
    topk: int = 1,
    **metadata,
) -> Trace:
    """Generate a synthetic Trace (see the module docstring for the model).

    Args:
        iterations, layers, experts: trace shape, each >= 1.
        tokens: routed tokens per layer and iteration (batch tokens x top-k), >= 0.
        zipf: Zipf exponent a >= 0 (0 = uniform popularity; 1-2 = strongly skewed).
        drift: popularity positions moved per iteration, >= 0.
        spike_prob: chance of a one-iteration spike per (iteration, layer), in [0, 1].
        spike_factor: weight multiplier of a spiked expert, >= 1.
        layer_variation: relative spread of the Zipf exponent across layers, in [0, 1].
        swing: standard deviation of an expert's log-popularity around its Zipf weight, >= 0.
        swing_corr: correlation of that log-popularity between consecutive iterations, in [0, 1).
        ranks: if given, also produce source_loads split over this many ranks.
        source_noise: std-dev of the log-normal per-rank perturbation, >= 0.
        seed: seed of the numpy Generator.
        topk: experts per token, >= 1, <= experts: no expert gets more than 1/topk of the tokens.
        metadata: extra JSON-serialisable metadata stored with the trace (e.g. model).
    """
    for name, value in (("iterations", iterations), ("layers", layers), ("experts", experts)):
        check_int(value, name, 1)
    check_int(tokens, "tokens")
    _check("zipf", zipf, 0.0)
    _check("drift", drift, 0.0)
    _check("spike_factor", spike_factor, 1.0)
    _check("source_noise", source_noise, 0.0)
    if not 0.0 <= spike_prob <= 1.0:
        raise PlacementError(f"spike_prob must be in [0, 1], got {spike_prob!r}")
    _check("swing", swing, 0.0)
    if not 0.0 <= swing_corr < 1.0:
        raise PlacementError(f"swing_corr must be in [0, 1), got {swing_corr!r}")
    if not 0.0 <= layer_variation <= 1.0:
        raise PlacementError(f"layer_variation must be in [0, 1], got {layer_variation!r}")
    if ranks is not None:
        check_int(ranks, "ranks", 1)
    check_int(topk, "topk", 1)
    if topk > experts:
        raise PlacementError(f"topk must be <= experts ({experts}): a token picks distinct experts, got {topk}")
    rng = np.random.default_rng(seed)
    p_ILE = popularity_weights(
        iterations, layers, experts, zipf, drift, spike_prob, spike_factor, layer_variation, rng, swing, swing_corr
    )
    if topk > 1:
        p_ILE = cap_shares(p_ILE, 1.0 / topk)
    meta = {
        "generator": "synthetic",
        "tokens": int(tokens),
        "zipf": float(zipf),
        "drift": float(drift),
        "spike_prob": float(spike_prob),
        "spike_factor": float(spike_factor),
        "layer_variation": float(layer_variation),
        "swing": float(swing),
        "swing_corr": float(swing_corr),
        "source_noise": float(source_noise),
        "seed": int(seed),
        **({"topk": int(topk)} if topk > 1 else {}),
        **metadata,
    }
    if ranks is None:
        loads = rng.multinomial(tokens, p_ILE).astype(np.int64)
        return Trace(loads, None, meta)
    meta["ranks"] = int(ranks)
    noise = rng.lognormal(0.0, source_noise, size=(iterations, layers, ranks, experts))
    p_ILRE = p_ILE[:, :, None, :] * noise
    p_ILRE /= p_ILRE.sum(axis=3, keepdims=True)
    # equal shares of the tokens per rank; the first (tokens mod ranks) ranks get one more
    share_R = np.full(ranks, tokens // ranks, dtype=np.int64)
    share_R[: tokens % ranks] += 1
    source = rng.multinomial(np.broadcast_to(share_R, (iterations, layers, ranks)), p_ILRE).astype(np.int64)
    return Trace(source.sum(axis=2), source, meta)
