"""Zebra planning, part 5: Asym-EA that follows the loads (--zebra-replan-interval, issue 19).

Gather and squeeze (``asym_ea``) sizes the offload from the profile alone, as if every expert got
the same number of tokens. Routed loads are skewed and drift, so the expert rank that holds the hot
experts sets every layer's E task. Every K iterations the training loop hands the loads it
measured over those K iterations to ``replan``, which

1. weighs every expert by its share of its layer's tokens: ``relative_loads`` (1.0 = the mean, the
   load the profile was measured at), and prices an expert's work as its weight times the profiled
   per-expert time of the GPU it lives on (tau_E on an expert GPU, tau_A on an attention GPU: the
   package docstring). A rank's E task is the sum over the experts it holds, and a role's E task
   is its slowest rank's (the all-to-all after it waits for every rank);
2. for a per-layer chunk count o, chooses *which* experts move (``layer_owners``): every expert
   rank gives its o*n2 heaviest experts (each rank's kept load is then as small as o allows, so
   the slowest one is too), and the moved experts, heaviest first, go to the least loaded
   attention rank that still has room for one (o*n1 each), longest-processing-time first;
3. searches the chunk counts by steepest descent from the current plan's counts and from gather
   and squeeze's, each step changing one layer's count by one, or moving one chunk from one layer
   to another (the only steps left when the total sits at a memory bound), within the same memory
   bounds as Asym-EA (n_min, n_max) and the per-layer cap; the cost of a candidate is the makespan
   of the zig-zag task graph (``cost.role_durations``), the model the tests brute-force
   gather-and-squeeze with;
4. adopts the best plan only when its predicted gain over the current owners, counted over the K
   iterations until the next re-plan, exceeds the time to move the experts: every moved expert's
   weights and Adam state (``move_bytes_per_expert``) cross the link between its old and new
   rank, and the busiest rank's sent or received bytes over ``link_bytes_per_s`` are the move's
   time (sends and receives overlap: full-duplex links).

The loads are the world's (every ZP group runs the same plan, so its load is the sum over groups),
read from Megatron's routers by the shared loop and identical on every rank; everything here is
deterministic numpy, so every rank reaches the same decision (the engine checks that they did
before it moves anything).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement.zebra.asym_ea import (
    AsymEAPlan,
    _memory_chunk_bounds,
    asym_ea,
    expert_owners,
    max_chunks_per_layer,
)
from megatron_patches.placement.zebra.cost import makespan, role_durations
from megatron_patches.placement.zebra.profile import ZebraProfile, chunk_sizes

__all__ = ["ReplanDecision", "layer_owners", "move_seconds", "predicted_time", "relative_loads", "replan"]


def relative_loads(loads_LE: np.ndarray) -> np.ndarray:
    """Each expert's tokens over its layer's mean, float64 [L, n]; a layer that routed nothing
    counts every expert as 1.0 (the profile's load)."""
    loads_LE = np.asarray(loads_LE, dtype=np.float64)
    if loads_LE.ndim != 2 or (loads_LE < 0).any():
        raise ValueError(f"loads must be non-negative token counts [layers, experts], got shape {loads_LE.shape}")
    mean_L1 = loads_LE.mean(axis=1, keepdims=True)
    return np.where(mean_L1 > 0, loads_LE / np.where(mean_L1 > 0, mean_L1, 1.0), 1.0)


def layer_owners(profile: ZebraProfile, chunks: int, weights_E: np.ndarray) -> np.ndarray:
    """Owners (ZP-group-local ranks, int64 [n]) of one layer's experts when it offloads ``chunks``:
    every expert rank gives its chunks*n2 heaviest experts (ties: the lower id), which go, heaviest
    first, to the attention rank with the least weight so far that holds fewer than chunks*n1
    (ties: the lower rank)."""
    shape = profile.shape
    m, per_rank = shape.attention_ranks, shape.experts_per_expert_rank
    n1, n2 = chunk_sizes(shape)
    owners_E = m + np.arange(shape.num_experts, dtype=np.int64) // per_rank
    give = chunks * n2
    if give == 0:
        return owners_E
    moved = []
    for r in range(shape.expert_ranks):
        block = np.arange(r * per_rank, (r + 1) * per_rank)
        heaviest = block[np.lexsort((block, -weights_E[block]))][:give]
        moved.extend(int(e) for e in heaviest)
    moved.sort(key=lambda e: (-weights_E[e], e))
    held_A, load_A = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.float64)
    for e in moved:
        open_A = np.flatnonzero(held_A < chunks * n1)
        a = int(open_A[np.argmin(load_A[open_A])])  # argmin: the first (lowest rank) on ties
        owners_E[e] = a
        held_A[a] += 1
        load_A[a] += weights_E[e]
    return owners_E


def _layer_times(profile: ZebraProfile, owners_E: np.ndarray, weights_E: np.ndarray) -> tuple[float, float]:
    """One layer's E task (s) on its slowest expert rank and on its slowest attention rank."""
    shape = profile.shape
    m, per_rank = shape.attention_ranks, shape.experts_per_expert_rank
    load_G = np.bincount(owners_E, weights=weights_E, minlength=m + shape.expert_ranks)
    return float(load_G[m:].max()) * profile.t_exp_E / per_rank, float(load_G[:m].max()) * profile.t_exp_A / per_rank


def predicted_time(profile: ZebraProfile, owners_LE: np.ndarray, weights_LE: np.ndarray, num_microbatches: int) -> float:
    """Makespan in s of one iteration under an owner table [L, n] and relative loads [L, n]."""
    expert_L, attention_L = zip(*(_layer_times(profile, o, w) for o, w in zip(owners_LE, weights_LE)))
    offloads_L = [int((owners_E < profile.shape.attention_ranks).any()) for owners_E in owners_LE]
    return makespan(profile.shape.num_layers, num_microbatches, offloads_L,
                    role_durations(profile, expert_L, attention_L))


def move_seconds(old_LE: np.ndarray, new_LE: np.ndarray, group_size: int, bytes_per_expert: int,
                 link_bytes_per_s: float) -> tuple[int, int, float]:
    """(experts that change owner, the busiest rank's bytes sent or received, its time in s) when one
    ZP group goes from owner table ``old_LE`` to ``new_LE`` (every ZP group moves at once, alike)."""
    changed = old_LE != new_LE
    sent_G = np.bincount(old_LE[changed], minlength=group_size) * bytes_per_expert
    received_G = np.bincount(new_LE[changed], minlength=group_size) * bytes_per_expert
    busiest = int(max(sent_G.max(), received_G.max()))
    return int(changed.sum()), busiest, busiest / link_bytes_per_s


@dataclass(frozen=True)
class ReplanDecision:
    """What ``replan`` decided, with the figures behind it (the training log prints them)."""

    plan: AsymEAPlan
    """The plan to run from now on: the best one found when adopted, else the current one."""
    adopted: bool
    """Whether the owners change."""
    current_s: float
    """Predicted iteration time of the current owners under the measured loads."""
    best_s: float
    """Predicted iteration time of the best plan found."""
    moved_experts: int
    """Experts per ZP group whose owner the best plan changes."""
    move_bytes: int
    """The busiest rank's bytes sent or received to move them."""
    move_s: float
    """Predicted time of the move (move_bytes over the link)."""
    horizon: int
    """Iterations the gain is counted over (until the next re-plan)."""
    evaluated: int
    """Candidate plans priced by the search."""

    @property
    def gain_s(self) -> float:
        """Predicted time saved over the horizon."""
        return (self.current_s - self.best_s) * self.horizon

    def summary(self) -> str:
        verdict = "adopted" if self.adopted else "kept the current plan"
        return (f"predicted {self.current_s * 1e3:.3f} -> {self.best_s * 1e3:.3f} ms per iteration "
                f"(chunks {list(self.plan.offload_chunks_L) if self.adopted else 'unchanged'}), "
                f"gain {self.gain_s * 1e3:.3f} ms over {self.horizon} iterations vs moving "
                f"{self.moved_experts} experts ({self.move_bytes} B on the busiest rank, "
                f"{self.move_s * 1e3:.3f} ms): {verdict} ({self.evaluated} plans priced)")


def replan(profile: ZebraProfile, current: AsymEAPlan, loads_LE: np.ndarray, num_microbatches: int, *,
           horizon: int, bytes_per_expert: int, link_bytes_per_s: float) -> ReplanDecision:
    """Re-plan Asym-EA for measured loads [L, n] (see the module docstring)."""
    shape = profile.shape
    if current.shape != shape:
        raise ValueError(f"the current plan is for {current.shape}, the profile for {shape}")
    if np.shape(loads_LE) != (shape.num_layers, shape.num_experts):
        raise ValueError(f"loads have shape {np.shape(loads_LE)}, expected ({shape.num_layers}, {shape.num_experts})")
    if horizon < 1 or bytes_per_expert < 0 or not link_bytes_per_s > 0:
        raise ValueError(f"horizon={horizon} (>= 1), bytes_per_expert={bytes_per_expert} (>= 0), "
                         f"link_bytes_per_s={link_bytes_per_s} (> 0) are required")
    weights_LE = relative_loads(loads_LE)
    n1, n2 = chunk_sizes(shape)
    need, cap = _memory_chunk_bounds(profile)
    per_layer_cap = max_chunks_per_layer(shape)
    # a layer's owners and role times depend on its own count only: computed once per (layer, count)
    owners_LOE = [[layer_owners(profile, o, w) for o in range(per_layer_cap + 1)] for w in weights_LE]
    # (expert-rank, attention-rank) E task of each layer at each count
    times_LO = [[_layer_times(profile, owners, w) for owners in layer] for layer, w in zip(owners_LOE, weights_LE)]
    prices: dict[tuple[int, ...], float] = {}

    def price(chunks_L: tuple[int, ...]) -> float:
        if chunks_L not in prices:
            expert_L = [times_LO[l][o][0] for l, o in enumerate(chunks_L)]
            attention_L = [times_LO[l][o][1] for l, o in enumerate(chunks_L)]
            prices[chunks_L] = makespan(shape.num_layers, num_microbatches, chunks_L,
                                        role_durations(profile, expert_L, attention_L))
        return prices[chunks_L]

    def singles(chunks_L: tuple[int, ...]):
        total = sum(chunks_L)
        for l, o in enumerate(chunks_L):
            for step in (1, -1):
                if 0 <= o + step <= per_layer_cap and need <= total + step <= cap:
                    yield chunks_L[:l] + (o + step,) + chunks_L[l + 1 :]

    def transfers(chunks_L: tuple[int, ...]):
        for l, o in enumerate(chunks_L):
            for k, other in enumerate(chunks_L):
                if k != l and o < per_layer_cap and other > 0:
                    moved = list(chunks_L)
                    moved[l], moved[k] = o + 1, other - 1
                    yield tuple(moved)

    def balance() -> tuple[int, ...]:
        """Chunk counts from a stream-sum view of the pipeline: with R micro-batches in flight the
        attention ranks' compute stream carries sum_l (T_A^attn + E_A,l) and the expert ranks'
        sum_l E_E,l per micro-batch. Add, one at a time, the chunk that lowers the larger of the two
        most (every one needed to reach n_min, then only while it helps)."""
        chunks_L = [0] * shape.num_layers
        attention = sum(profile.t_attn_A + times_LO[l][0][1] for l in range(shape.num_layers))
        expert = sum(times_LO[l][0][0] for l in range(shape.num_layers))
        while sum(chunks_L) < cap:
            options = []
            for l, o in enumerate(chunks_L):
                if o < per_layer_cap:
                    a = attention + times_LO[l][o + 1][1] - times_LO[l][o][1]
                    e = expert + times_LO[l][o + 1][0] - times_LO[l][o][0]
                    options.append((max(a, e), l, a, e))
            if not options:
                break
            peak, l, a, e = min(options)
            if sum(chunks_L) >= need and peak >= max(attention, expert):
                break
            chunks_L[l] += 1
            attention, expert = a, e
        return tuple(chunks_L)

    def descend(chunks_L: tuple[int, ...]) -> tuple[int, ...]:
        """First-improvement one-layer steps, then (the total at a memory bound, where one-layer
        steps cannot go on) one-chunk transfers between layers, on the exact makespan, within a
        budget of priced plans (a makespan costs ~7 ms at L = 32, R = 8 in Python)."""
        while len(prices) < budget:
            better = next((c for c in singles(chunks_L) if len(prices) < budget and price(c) < price(chunks_L)), None)
            if better is None and sum(chunks_L) in (need, cap):
                better = next((c for c in transfers(chunks_L) if len(prices) < budget and price(c) < price(chunks_L)),
                              None)
            if better is None:
                return chunks_L
            chunks_L = better
        return chunks_L

    budget = 4 * shape.num_layers + 8
    starts = sorted({balance(), tuple(current.offload_chunks_L), tuple(asym_ea(profile).offload_chunks_L)},
                    key=lambda c: (price(c), c))
    best_chunks = descend(starts[0])
    best_s = price(best_chunks)
    best_owners = np.stack([owners_LOE[l][o] for l, o in enumerate(best_chunks)])
    current_owners = np.stack([expert_owners(current, l) for l in range(shape.num_layers)])
    current_s = predicted_time(profile, current_owners, weights_LE, num_microbatches)
    moved, move_bytes, move_s = move_seconds(current_owners, best_owners, shape.attention_ranks + shape.expert_ranks,
                                             bytes_per_expert, link_bytes_per_s)
    adopted = moved > 0 and (current_s - best_s) * horizon > move_s
    plan = AsymEAPlan(shape=shape, offload_chunks_L=best_chunks, n1=n1, n2=n2,
                      owners_LE=tuple(tuple(int(o) for o in row) for row in best_owners)) if adopted else current
    return ReplanDecision(plan=plan, adopted=adopted, current_s=current_s, best_s=best_s, moved_experts=moved,
                          move_bytes=move_bytes, move_s=move_s, horizon=horizon, evaluated=len(prices))
