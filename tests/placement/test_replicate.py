"""Tests of replicate-mode planning (DESIGN 4.6): counts, the balanced slot layout, capacity."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.placement import (
    InstancePlacement,
    PlacementError,
    apply_capacity,
    assign_slots,
    instance_capacity,
    replica_counts,
    slot_placement,
    spread_tokens,
)
from megatron_patches.placement.replicate import popularity_slots

FAST = settings(max_examples=80, deadline=None)


def literal_replica_counts(p, G, s):
    """DESIGN 4.6 steps 1-2 read literally: diff_i -= 1 even when count_i == 1 (reading B), in
    exact arithmetic (the cases' popularity is integer): equal shares tie, and ties go to the lower id."""
    p = np.asarray(p, dtype=float)
    if p.sum() == 0:
        p = np.ones_like(p)
    goal = p / p.sum() * G * s
    count = np.floor(np.maximum(goal, 1)).astype(int)
    diff = [Fraction(int(c)) - Fraction(int(x)) * G * s / int(p.sum()) for c, x in zip(count, p)]  # exact
    steps = 0
    while count.sum() > G * s:
        i = int(np.argmax(diff))
        if count[i] > 1:
            count[i] -= 1
        diff[i] -= 1
        steps += 1
        assert steps < 100000
    while count.sum() < G * s:
        i = int(np.argmin(diff))
        count[i] += 1
        diff[i] += 1
    return count


@st.composite
def popularity_cases(draw):
    G = draw(st.integers(1, 8))
    s = draw(st.integers(1, 4))
    E = draw(st.integers(1, G * s))
    kind = draw(st.sampled_from(["random", "zero", "one-hot", "skewed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "zero":
        p = np.zeros(E)
    elif kind == "one-hot":
        p = np.zeros(E)
        p[rng.integers(E)] = 1000
    elif kind == "skewed":
        p = rng.multinomial(5000, rng.permutation(1 / np.arange(1, E + 1) ** 2) / np.sum(1 / np.arange(1, E + 1) ** 2))
    else:
        p = rng.integers(0, 100, size=E)
    return p, G, s


# ---------------------------------------------------------------------------- counts


def test_replica_counts_worked_example():
    # 4 ranks x 2 slots = 8; p = [10, 0, 5, 85]: goals 0.8, 0, 0.4, 6.8 -> counts 1, 1, 1, 6
    # (sum 9 > 8); only expert 3 has count > 1, so it drops to 5.
    assert replica_counts([10, 0, 5, 85], 4, 2).tolist() == [1, 1, 1, 5]
    # goals 2.4, 3.6, 2.0 -> floors 2, 3, 2 (sum 7 < 8); diffs -0.4, -0.6, 0 -> expert 1 +1
    assert replica_counts([24, 36, 20], 4, 2).tolist() == [2, 4, 2]


@FAST
@given(case=popularity_cases())
def test_replica_counts_invariants_and_literal_reading(case):
    p, G, s = case
    counts = replica_counts(p, G, s)
    assert counts.sum() == G * s
    assert counts.min() >= 1
    goal = (p / p.sum() if p.sum() else np.full(p.size, 1 / p.size)) * G * s
    # never more than the rounded-up share; fewer is possible: the one instance every class is
    # owed comes out of the popular ones (p = [0, 0, 1000] on 3 slots gives [1, 1, 1])
    assert np.all(counts <= np.maximum(np.ceil(goal - 1e-9), 1))
    assert np.array_equal(counts, literal_replica_counts(p, G, s))


def test_replica_counts_errors():
    with pytest.raises(PlacementError, match="5 expert classes do not fit in 2 ranks x 2 slots = 4"):
        replica_counts([1, 1, 1, 1, 1], 2, 2)
    with pytest.raises(PlacementError, match=r"popularity_E\[1\]"):
        replica_counts([1, -1], 2, 2)
    assert replica_counts([0, 0, 0, 0], 2, 2).tolist() == [1, 1, 1, 1]  # E == G*s


# ---------------------------------------------------------------------------- slots


def reference_slots(counts, p, G, s):
    """DESIGN 4.6 step 3 written out: instances by descending p_e / count_e (ties: lower id), each
    to the rank with the least expected tokens among those with a free slot (ties: lower rank);
    with fewer experts than ranks, expert 0's instances first, rank by rank (contiguous)."""
    if len(counts) < G:
        flat = [e for e in range(len(counts)) for _ in range(counts[e])]
        return [flat[r * s:(r + 1) * s] for r in range(G)]
    p = np.asarray(p, dtype=float)
    if p.sum() == 0:
        p = np.ones_like(p)
    weight = [p[e] / counts[e] for e in range(len(counts))]
    load, rows = [0.0] * G, [[] for _ in range(G)]
    for e in sorted(range(len(counts)), key=lambda e: (-weight[e], e)):
        for _ in range(counts[e]):
            r = min((r for r in range(G) if len(rows[r]) < s), key=lambda r: (load[r], r))
            rows[r].append(e)
            load[r] += weight[e]
    return [sorted(row) for row in rows]


def test_assign_slots_worked_example():
    # every instance expects one token's worth (1 / 1 and 5 / 5): experts 0-2 take a rank each,
    # expert 3's five instances fill rank 3 and then the least-loaded ranks, lowest first
    slots = assign_slots([1, 1, 1, 5], [1, 1, 1, 5], 4, 2)
    assert slots.tolist() == [[0, 3], [1, 3], [2, 3], [3, 3]]
    placement = slot_placement(slots, 4)
    assert placement.counts_ED.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 2]]
    # equal popularity: each expert's instances on distinct ranks (the paper's contiguous layout
    # put both of expert e's on rank e // 2, leaving no replica anywhere)
    assert popularity_slots(np.ones(8), 4, 4).tolist() == [[0, 2, 4, 6], [0, 2, 4, 6], [1, 3, 5, 7], [1, 3, 5, 7]]
    # fewer experts than ranks: contiguous, each expert's instances on whole ranks of their own
    # (expert 0, three times as popular, gets 6 of the 8 slots)
    assert popularity_slots([3, 1], 4, 2).tolist() == [[0, 0], [0, 0], [0, 0], [1, 1]]


@FAST
@given(case=popularity_cases())
def test_slots_are_balanced_and_full(case):
    p, G, s = case
    counts = replica_counts(p, G, s)
    slots = assign_slots(counts, p, G, s)
    assert slots.shape == (G, s)
    assert np.all(np.diff(slots, axis=1) >= 0)  # every rank's row ascending
    assert slots.tolist() == reference_slots(counts, p, G, s)
    placement = slot_placement(slots, p.size)
    assert np.array_equal(placement.instances_E(), counts)
    placement.check_slot_limit(s)


def test_assign_slots_errors():
    with pytest.raises(PlacementError, match="sum to 7, but there are 4 x 2 = 8 slots"):
        assign_slots([2, 5], [2, 5], 4, 2)
    with pytest.raises(PlacementError, match="expert 1 has 0 instances"):
        assign_slots([8, 0], [8, 0], 4, 2)
    with pytest.raises(PlacementError, match="popularity_E must be 2 finite values >= 0"):
        assign_slots([4, 4], [1, -1], 4, 2)
    with pytest.raises(PlacementError, match="popularity_E must be 2 finite values >= 0"):
        assign_slots([4, 4], [1, 1, 1], 4, 2)
    with pytest.raises(PlacementError, match="slot 1 of rank 0 holds expert 3"):
        slot_placement([[0, 3]], 2)


# ---------------------------------------------------------------------------- capacity and spreading


def test_instance_capacity():
    assert instance_capacity(1.0, 1000, 4, 2) == 125
    assert instance_capacity(1.1, 1000, 10, 10) == 11  # 11.000000000000002 is not rounded up
    assert instance_capacity(1.0, 1001, 4, 2) == 126
    with pytest.raises(PlacementError, match="capacity_factor"):
        instance_capacity(0.0, 10, 1, 1)


def brute_force_spread(counts_ED, loads_RE, cap):
    """The documented spreading rule, token by token, instance by instance."""
    E, R = counts_ED.shape
    # instance list per expert: (rank) entries with multiplicity, ranks ascending
    inst = {e: [r for r in range(R) for _ in range(counts_ED[e, r])] for e in range(E)}
    local = np.zeros((E, R), dtype=int)
    arrivals = np.zeros((E, R), dtype=int)
    dropped = np.zeros(E, dtype=int)
    for r in range(R):
        for e in range(E):
            n = int(loads_RE[r, e])
            take = min(n, cap * counts_ED[e, r])
            local[e, r] += take
            rest = n - take
            remote = [x for x in inst[e] if x != r]
            if not remote:
                dropped[e] += rest
                continue
            k = len(remote)
            for j in range(rest):
                if j < k * (rest // k):
                    arrivals[e, remote[j % k]] += 1
                else:
                    arrivals[e, remote[(r + j - k * (rest // k)) % k]] += 1
    room = cap * counts_ED - local
    remote_done = np.minimum(arrivals, room)
    dropped += (arrivals - remote_done).sum(axis=1)
    return local + remote_done, dropped


@FAST
@given(case=popularity_cases(), cf=st.sampled_from([0.5, 1.0, 1.3, 100.0]), seed=st.integers(0, 2**32 - 1))
def test_spread_tokens_matches_brute_force(case, cf, seed):
    p, G, s = case
    placement = slot_placement(popularity_slots(p, G, s), p.size)
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 30, size=(G, p.size))
    spread = spread_tokens(placement, loads, cf, s)
    processed, dropped = brute_force_spread(placement.counts_ED, loads, spread.capacity)
    assert np.array_equal(spread.processed_ED, processed)
    assert np.array_equal(spread.dropped_E, dropped)
    assert np.array_equal(spread.processed_ED.sum(axis=1) + spread.dropped_E, loads.sum(axis=0))
    assert np.all(spread.processed_ED <= spread.capacity * placement.counts_ED)
    if cf == 100.0:
        assert spread.dropped == 0 and spread.survival == 1.0


def test_spread_tokens_worked_example():
    # 4 ranks x 2 slots, counts [1, 1, 1, 5] (see test_assign_slots_worked_example); 95 tokens
    # -> capacity ceil(95 / 8) = 12 per instance. Expert 3 has 5 instances (60 tokens of room: one
    # on each of ranks 0-2, two on rank 3) for 80 tokens: each rank keeps its own up to its room,
    # 20 dropped. Expert 0 (10 tokens, one instance on rank 0) fits.
    placement = slot_placement(assign_slots([1, 1, 1, 5], [1, 1, 1, 5], 4, 2), 4)
    loads = np.array([[3, 0, 1, 20], [2, 0, 2, 20], [3, 0, 1, 20], [2, 0, 1, 20]])
    spread = spread_tokens(placement, loads, 1.0, 2)
    assert spread.capacity == 12
    assert spread.processed_ED[0].tolist() == [10, 0, 0, 0]
    assert spread.processed_ED[3].tolist() == [12, 12, 12, 24]
    assert spread.dropped_E.tolist() == [0, 0, 0, 20]
    assert spread.survival == pytest.approx(75 / 95)


def test_replication_drops_fewer_tokens_than_static_ep_under_skew():
    # the claim of DESIGN 1 (2): adaptive replicas at the same capacity factor keep more tokens
    rng = np.random.default_rng(1)
    G, s, E = 8, 4, 16
    w = 1 / np.arange(1, E + 1) ** 1.2
    loads = rng.multinomial(2048, rng.permutation(w) / w.sum(), size=G)
    adaptive = slot_placement(popularity_slots(loads.sum(axis=0), G, s), E)
    static = slot_placement(popularity_slots(np.ones(E), G, s), E)
    assert spread_tokens(adaptive, loads, 1.0, s).survival > spread_tokens(static, loads, 1.0, s).survival + 0.1


@FAST
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4), st.floats(0.3, 2.0), st.integers(0, 2**32 - 1))
def test_spread_tokens_plan_matches_its_counts(E, R, s, cf, seed):
    # the transfers spread_tokens returns, capped at the receivers, are its processed counts
    rng = np.random.default_rng(seed)
    if E > R * s:
        E = R * s
    slots = np.sort(np.concatenate((np.arange(E), rng.integers(0, E, R * s - E))))
    counts = np.zeros((E, R), dtype=np.int64)
    np.add.at(counts, (slots, np.repeat(np.arange(R), s)), 1)
    placement = InstancePlacement(counts)
    src = rng.integers(0, 30, (R, E))
    spread = spread_tokens(placement, src, cf, s)
    assert ((spread.plan.tokens_K == 0) | (placement.counts_ED[spread.plan.expert_K, spread.plan.dest_K] > 0)).all()
    processed, dropped_arrival = apply_capacity(spread.plan, placement, spread.capacity)
    assert np.array_equal(processed, spread.processed_ED)
    # the kept part of every transfer: at most what was sent, summing to the processed counts,
    # with each receiver's remote room filled by the lowest sources first
    plan, kept = spread.plan, spread.kept_K
    assert ((0 <= kept) & (kept <= plan.tokens_K)).all()
    kept_ED = np.zeros_like(processed)
    np.add.at(kept_ED, (plan.expert_K, plan.dest_K), kept)
    assert np.array_equal(kept_ED, spread.processed_ED)
    for k in np.flatnonzero(kept < plan.tokens_K):
        same = (plan.expert_K == plan.expert_K[k]) & (plan.dest_K == plan.dest_K[k]) & (plan.source_K != plan.dest_K)
        assert (kept[same & (plan.source_K > plan.source_K[k])] == 0).all()
    dropped_at_source = src.sum() - spread.plan.routed_SE().sum()
    assert dropped_arrival.sum() + dropped_at_source == spread.dropped
    # what is not sent was routed to an expert with no instance on another rank
    unsent_RE = src - spread.plan.routed_SE()
    r, e = np.nonzero(unsent_RE)
    assert (placement.counts_ED[e].sum(axis=1) == placement.counts_ED[e, r]).all()
