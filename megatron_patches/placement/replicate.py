"""Adaptive per-iteration expert replication planning (replicate mode, DESIGN 4.6).

G ranks each have s expert slots. Every iteration each expert class gets a number of
instances proportional to last iteration's popularity (at least one), the instances are laid
out over the slots so that every rank expects about the same tokens, tokens are spread over the
instances under a capacity, and each rank fetches its gradient slice of every expert from a
deterministic holder. This module
computes all of that as plain arrays; the runtime (`megatron_patches/replicate/`) moves the
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement import kernels
from megatron_patches.placement.types import (
    DispatchPlan,
    InstancePlacement,
    PlacementError,
    check_int,
    check_loads,
)

__all__ = [
    "TokenSpread",
    "assign_slots",
    "popularity_slots",
    "instance_capacity",
    "replica_counts",
    "slot_placement",
    "spread_tokens",
]


def replica_counts(popularity_E, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """Instances per expert class for G ranks x s slots (DESIGN 4.6 steps 1-2).

    1. goal_e = p_e / sum(p) * G*s; count_e = floor(max(goal_e, 1)); diff = count - goal.
    2. While sum(count) > G*s: among experts with count > 1, i = argmax(diff);
       count_i -= 1; diff_i -= 1.
       While sum(count) < G*s: i = argmin(diff); count_i += 1; diff_i += 1.
    argmax / argmin break ties towards the lower expert id.

    Reading of step 2: DESIGN writes "i = argmax(diff); if count_i > 1 then count_i -= 1".
    Taken literally with diff_i unchanged when count_i == 1, the loop would pick the same
    expert forever; decrementing diff_i anyway only makes it skip that expert after some
    idle rounds. Restricting argmax to experts with count > 1 yields the same counts without
    idle rounds.

    Termination: requires E <= G*s (raised otherwise: every class needs a slot). The first
    loop lowers sum(count) by one per pass and always has a candidate, because sum(count) >
    G*s >= E forces some count > 1. The second loop raises sum(count) by one per pass. Since
    floor(max(goal, 1)) differs from goal by less than 1 per expert, each loop runs fewer
    than E passes.

    If every popularity is zero (no tokens seen yet), the classes are treated as equally
    popular.

    Args:
        popularity_E: tokens per expert class last iteration, >= 0 (int or float) [E].
        num_ranks: G.
        slots_per_rank: s.
    Returns:
        int64 [E], each >= 1, summing to G*s.
    """
    G = check_int(num_ranks, "num_ranks", 1)
    s = check_int(slots_per_rank, "slots_per_rank", 1)
    p = np.asarray(popularity_E, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise PlacementError(f"popularity_E must be a non-empty 1-D array, got shape {p.shape}")
    bad = np.flatnonzero(~np.isfinite(p) | (p < 0))
    if bad.size:
        raise PlacementError(f"popularity_E[{int(bad[0])}] = {p[bad[0]]!r}; popularity must be finite and >= 0")
    E = p.size
    total_slots = G * s
    if E > total_slots:
        raise PlacementError(
            f"{E} expert classes do not fit in {G} ranks x {s} slots = {total_slots}; every class needs >= 1 slot"
        )
    if p.sum() == 0:
        p = np.ones(E)
    total = p.sum()
    goal = p / total * total_slots
    count = np.floor(np.maximum(goal, 1.0)).astype(np.int64)
    # diff scaled by sum(p) > 0, count * sum(p) - p * G*s: the same order as count - goal, and
    # exact for integer popularity (token counts), so equal shares tie exactly and the tie goes to
    # the lower expert id; count - goal would round 4 - 86/399*21 and 2 - 48/399*21 differently
    diff = count * total - p * total_slots
    excess = int(count.sum()) - total_slots
    for _ in range(max(excess, 0)):
        i = int(np.argmax(np.where(count > 1, diff, -np.inf)))
        count[i] -= 1
        diff[i] -= total
    for _ in range(max(-excess, 0)):
        i = int(np.argmin(diff))
        count[i] += 1
        diff[i] += total
    return count


def assign_slots(counts_E, popularity_E, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """Balanced slot assignment (DESIGN 4.6 step 3); int64 [G, s] of expert ids, every rank's
    row ascending.

    An instance of expert e expects w_e = p_e / count_e tokens. Instances are placed in
    descending order of w (ties: the lower expert id; an expert's instances one after the
    other), each on the rank with the least expected tokens so far among those with a free
    slot (ties: the lower rank): longest-processing-time-first scheduling. A rank may hold the
    same expert in several slots, and an expert's holders need not be consecutive ranks.

    The paper's rule filled the slots contiguously (expert 0's instances first, rank by rank),
    which sends every hot expert's instances to whole ranks of their own and stacks the
    single instances of several warm experts on one rank. On the drifting trace of
    docs/benchmarks.md ("Replicate's slot layout": 4 x 8 ranks, E = 64, s = 4) the balanced
    layout lowers the imbalance from 1.24 / 1.45 (mean / p95) to 1.12 / 1.21 at capacity factor
    1, and the dropless mean from 2.01 to 1.59 (p95 3.56 to 4.01), with the same counts; the
    gradient and weight paths move more bytes (a rank's slots hold more distinct experts).

    With fewer experts than ranks (E < G: more than s instances per expert on average) the
    contiguous fill is kept: there an expert's instances fill whole ranks of their own, and
    spreading them balanced almost nothing (128 x 8 ranks, E = 256: 1.056 against 1.049) for
    3.4x the gradient and weight bytes, nearly all between nodes.

    Args:
        counts_E: instances per expert (`replica_counts`), each >= 1, summing to G*s [E].
        popularity_E: tokens per expert the counts were made from, >= 0 [E]; all zero is
            treated as equal popularity, as `replica_counts` does.
        num_ranks: G.
        slots_per_rank: s.
    """
    G = check_int(num_ranks, "num_ranks", 1)
    s = check_int(slots_per_rank, "slots_per_rank", 1)
    counts_E = check_loads(counts_E, "counts_E", 1)
    zero = np.flatnonzero(counts_E == 0)
    if zero.size:
        raise PlacementError(f"expert {int(zero[0])} has 0 instances; every expert class needs >= 1")
    if int(counts_E.sum()) != G * s:
        raise PlacementError(f"instance counts sum to {int(counts_E.sum())}, but there are {G} x {s} = {G * s} slots")
    p = np.asarray(popularity_E, dtype=np.float64)
    if p.shape != counts_E.shape or not np.all(np.isfinite(p) & (p >= 0)):
        raise PlacementError(f"popularity_E must be {counts_E.size} finite values >= 0, got {p!r}")
    if counts_E.size < G:
        return np.repeat(np.arange(counts_E.size, dtype=np.int64), counts_E).reshape(G, s)
    if p.sum() == 0:
        p = np.ones_like(p)
    weight_E = p / counts_E
    order_E = np.argsort(-weight_E, kind="stable")
    return kernels.balanced_slots(order_E, counts_E, weight_E, G, s)


def popularity_slots(popularity_E, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """The slot choice of DESIGN 4.6 (steps 1-3) for one layer; int64 [G, s] of expert ids.

    Replica counts proportional to the popularity (`replica_counts`), laid out balanced over
    the ranks (`assign_slots`); equal popularities give static replication, each expert's
    instances on distinct ranks where the counts allow. The one rule shared by the runtime
    (replicate/runtime.py: the initial layout and every re-placement) and the simulator's
    replicate policy.
    """
    counts_E = replica_counts(popularity_E, num_ranks, slots_per_rank)
    return assign_slots(counts_E, popularity_E, num_ranks, slots_per_rank)


def slot_placement(slot_expert_RS, num_experts: int) -> InstancePlacement:
    """The InstancePlacement of a slot assignment: counts_ED[e, r] = slots of rank r holding e."""
    slots = np.asarray(slot_expert_RS, dtype=np.int64)
    if slots.ndim != 2:
        raise PlacementError(f"slot_expert_RS must be [ranks, slots], got shape {slots.shape}")
    E = check_int(num_experts, "num_experts", 1)
    bad = np.argwhere((slots < 0) | (slots >= E))
    if bad.size:
        r, j = (int(i) for i in bad[0])
        raise PlacementError(f"slot {j} of rank {r} holds expert {int(slots[r, j])}, not in [0, {E})")
    G = slots.shape[0]
    flat = slots * G + np.arange(G, dtype=np.int64)[:, None]
    return InstancePlacement(np.bincount(flat.ravel(), minlength=E * G).reshape(E, G))


def instance_capacity(capacity_factor: float, tokens_per_batch: int, num_ranks: int, slots_per_rank: int) -> int:
    """Tokens one instance may process: ceil(capacity_factor * tokens_per_batch / (G*s)).

    Rounded up as in GShard / DeepSpeed, so capacity factor 1.0 with perfectly balanced
    loads drops nothing.
    """
    G = check_int(num_ranks, "num_ranks", 1)
    s = check_int(slots_per_rank, "slots_per_rank", 1)
    if not np.isfinite(capacity_factor) or capacity_factor <= 0:
        raise PlacementError(f"capacity_factor must be finite and > 0, got {capacity_factor!r}")
    check_int(tokens_per_batch, "tokens_per_batch")
    # round the product first so e.g. 1.1 * 1000 / 100 = 11.000000000000002 does not become 12
    return int(np.ceil(round(capacity_factor * tokens_per_batch / (G * s), 9)))


@dataclass(frozen=True, eq=False)
class TokenSpread:
    """Outcome of spreading one layer's tokens over replicated instances under a capacity."""

    processed_ED: np.ndarray
    """Tokens processed per (expert, rank), summed over the rank's instances; int64 [E, R]."""
    dropped_E: np.ndarray
    """Tokens routed to each expert but dropped for lack of capacity; int64 [E]."""
    capacity: int
    """Tokens one instance may process."""
    plan: DispatchPlan
    """Where the tokens were sent (steps 1-2): the local ones and the shares of the remote
    instances, before the receivers cap them (`accounting.apply_capacity` of it gives
    processed_ED). Tokens dropped at the source because their expert has no instance on another
    rank are not in it."""
    kept_K: np.ndarray
    """Tokens of each `plan` entry that are processed; int64 [K] <= plan.tokens_K. A receiver
    serves its local tokens first, then remote arrivals in ascending source order, so every
    source can tell from the counts alone which of its tokens will be dropped (and drop them
    before sending). Summed per (expert, destination) it is processed_ED."""

    @property
    def processed(self) -> int:
        """Total tokens processed."""
        return int(self.processed_ED.sum())

    @property
    def dropped(self) -> int:
        """Total tokens dropped."""
        return int(self.dropped_E.sum())

    @property
    def survival(self) -> float:
        """Tokens processed / tokens routed (DESIGN 5); 1.0 when nothing was routed."""
        routed = self.processed + self.dropped
        return 1.0 if routed == 0 else self.processed / routed


def spread_tokens(
    placement: InstancePlacement,
    source_loads_RE,
    capacity_factor: float,
    slots_per_rank: int,
    tokens_per_batch: int | None = None,
) -> TokenSpread:
    """Spread each rank's tokens over the instances of their expert, dropping over capacity.

    Rule (deterministic, per layer):
    1. Local first: tokens on rank r for expert e go to r's own instances of e, up to
       capacity * (instances of e on r).
    2. The rest of (r, e) is split evenly over the instances of e on the *other* ranks,
       counted with multiplicity (instance list ordered by rank; n tokens over k instances give
       n // k each and one more to the instances at positions (r + i) mod k, i < n mod k). If
       e has no instance elsewhere, the rest is dropped.
    3. An instance processes its local tokens first, then remote arrivals up to its
       capacity; the excess is dropped.
    The transfers of steps 1-2 are returned too (`TokenSpread.plan`), for the all-to-all bytes.
    capacity = `instance_capacity(capacity_factor, tokens_per_batch, R, s)`; tokens_per_batch
    defaults to all tokens routed in the layer (sum of source_loads_RE).

    Args:
        placement: instances per (expert, rank), e.g. `slot_placement(assign_slots(...))`.
        source_loads_RE: tokens on each rank routed to each expert; int [R, E].
        capacity_factor: > 0.
        slots_per_rank: s, used for the capacity formula.
        tokens_per_batch: tokens in the batch for the capacity formula.
    """
    loads_RE = check_loads(source_loads_RE, "source_loads_RE", 2)
    counts_ED = placement.counts_ED
    E, R = counts_ED.shape
    if loads_RE.shape != (R, E):
        raise PlacementError(f"source_loads_RE must have shape ({R}, {E}), got {loads_RE.shape}")
    if tokens_per_batch is None:
        tokens_per_batch = int(loads_RE.sum())
    cap = instance_capacity(capacity_factor, tokens_per_batch, R, slots_per_rank)
    processed_ED, dropped_E, entries = kernels.spread_replicated(loads_RE, counts_ED.astype(np.int64), cap)
    source_K, expert_K, dest_K, tokens_K, kept_K = entries  # valid by construction
    plan = DispatchPlan.trusted(source_K, expert_K, dest_K, tokens_K, R, E, R)
    kept_K.setflags(write=False)
    return TokenSpread(processed_ED, dropped_E, cap, plan, kept_K)
