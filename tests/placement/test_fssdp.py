"""Tests of FSSDP planning: t and m, materialization, calibration, sharding, dispatch (DESIGN 4.2-4.4)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.placement import (
    CalibrationCost,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    Topology,
    calibrate,
    dispatch,
    even_shard,
    gather_bandwidth,
    heterogeneous_shard,
    imbalance,
    materialize,
    memory_capacity,
    overlap_degree,
    proportional_copies,
    shard_slots_D,
)

FAST = settings(max_examples=80, deadline=None)


@st.composite
def topologies(draw):
    return Topology(draw(st.integers(1, 4)), draw(st.integers(1, 4)), 100.0, draw(st.sampled_from([1.0, 100.0])))


@st.composite
def loads_of(draw, size, high=1000):
    """Loads with the degenerate patterns mixed in: all zero, one hot expert, random."""
    kind = draw(st.sampled_from(["random", "zero", "one-hot", "skewed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "zero":
        return np.zeros(size, dtype=np.int64)
    if kind == "one-hot":
        out = np.zeros(size, dtype=np.int64)
        out[rng.integers(size)] = high
        return out
    if kind == "skewed":
        w = 1.0 / np.arange(1, size + 1) ** 1.5
        return rng.multinomial(high, rng.permutation(w) / w.sum()).astype(np.int64)
    return rng.integers(0, high, size=size)


@st.composite
def layer_cases(draw):
    topo = draw(topologies())
    E = draw(st.integers(1, 12))
    shard = ShardLayout(draw(st.lists(st.integers(0, topo.num_devices - 1), min_size=E, max_size=E)), topo.num_devices)
    loads = draw(loads_of(E))
    return topo, shard, loads


# ---------------------------------------------------------------------------- t and m


def test_overlap_degree_worked_examples():
    # 0.3 s of attention at 10 B/s moves 3 experts of 1 B (despite 0.3*10 = 2.9999999999999996)
    assert overlap_degree(0.3, 10.0, 1.0, num_experts=8) == 3
    # GPT-MoE-S expert (2 * 768 * 1536 params, bf16 = 4.72 MB) over 12.5 GB/s in 2 ms: 5 experts
    assert overlap_degree(2e-3, 12.5e9, 2 * 768 * 1536 * 2, num_experts=64) == 5
    assert overlap_degree(10.0, 1e9, 1.0, num_experts=64) == 64  # clamped to E
    assert overlap_degree(0.0, 1e9, 1.0, num_experts=64) == 0
    with pytest.raises(PlacementError, match="bandwidth must be finite and > 0"):
        overlap_degree(1.0, 0.0, 1.0, 4)


def test_memory_capacity_and_bandwidth_choice():
    assert memory_capacity(10.5e6, 1e6) == 10
    assert memory_capacity(-5.0, 1e6) == 0
    assert memory_capacity(np.array([3e6, 0.9e6]), 1e6).tolist() == [3, 0]
    with pytest.raises(PlacementError, match="expert_bytes"):
        memory_capacity(1.0, 0)
    assert gather_bandwidth(Topology(1, 8, 300e9, 12.5e9)) == 300e9
    assert gather_bandwidth(Topology(4, 8, 300e9, 12.5e9)) == 12.5e9


# ---------------------------------------------------------------------------- proportional copies


def test_proportional_copies_worked_example_with_cap_and_water_filling():
    # 16 slots over loads [100, 50, 30, 20, 5, 5]: expert 0's goal 7.6 exceeds cap 7, so it is
    # fixed at 7 and 9 slots are re-split over [50, 30, 20, 5, 5] (sum 110): goals 4.09, 2.45,
    # 1.64, 0.41, 0.41 -> floors 4, 2, 1, 0, 0 and the 2 leftovers go to fractions .64 and .45.
    assert proportional_copies([100, 50, 30, 20, 5, 5], 16, 7).tolist() == [7, 4, 3, 2, 0, 0]
    assert proportional_copies([0, 0], 5, 3).tolist() == [0, 0]
    assert proportional_copies([1, 1, 1], 2, 3).tolist() == [1, 1, 0]  # ties -> lower index


@FAST
@given(
    weights=st.lists(st.integers(0, 100), min_size=1, max_size=12),
    total=st.integers(0, 60),
    cap=st.integers(0, 8),
)
def test_proportional_copies_invariants(weights, total, cap):
    w = np.array(weights, dtype=float)
    copies = proportional_copies(w, total, cap)
    assert np.all(copies >= 0) and np.all(copies <= cap)
    assert np.all(copies[w == 0] == 0)
    assert copies.sum() == min(total, cap * int((w > 0).sum()))
    order = np.argsort(-w, kind="stable")
    assert np.all(np.diff(copies[order]) <= 0)  # heavier expert never gets fewer copies


# ---------------------------------------------------------------------------- materialize


def test_materialize_worked_example_memory_binds():
    # 2 nodes x 2 devices, expert e owned by device e; t = 3, m = 1 -> 4 slots over the top 3
    # (loads 8, 4, 2): goals 2.29, 1.14, 0.57 -> copies [2, 1, 1].
    # expert 0 (owner 0, node 0): round 0 = node 1 (lacks it) -> device 2; round 1: node 1 has
    #   more eligible free slots (2) than node 0 (1) -> device 3.
    # expert 1 (owner 1): only device 0 still has a free slot and lacks it.
    # expert 2 (owner 2): only device 1 has a free slot.
    topo = Topology(2, 2, 100.0, 1.0)
    shard = ShardLayout([0, 1, 2, 3], 4)
    placement = materialize(shard, [8, 4, 2, 1], t=3, m=1, topology=topo)
    assert placement.counts_ED.tolist() == [[1, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
    assert placement.extra_copies_D(shard).tolist() == [1, 1, 1, 1]


def test_materialize_worked_example_memory_free():
    # t <= m: the top-t experts go everywhere; ties in load go to the lower expert id
    topo = Topology(1, 3, 1.0, 1.0)
    shard = ShardLayout([0, 1, 2, 2], 3)
    placement = materialize(shard, [5, 9, 5, 1], t=2, m=4, topology=topo)
    assert placement.counts_ED.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]


@FAST
@given(case=layer_cases(), t=st.integers(0, 14), m=st.integers(0, 14))
def test_materialize_invariants(case, t, m):
    topo, shard, loads = case
    placement = materialize(shard, loads, t, m, topo)
    E, D = shard.num_experts, topo.num_devices
    t_eff = min(t, E)
    m_eff = min(m, t_eff)
    placement.require_contains(shard)
    placement.check_extra_limit(shard, m_eff)
    assert placement.counts_ED.max() == 1
    top = np.argsort(-loads, kind="stable")[:t_eff]
    others = np.setdiff1d(np.arange(E), top)
    assert np.all(placement.replicas_E()[others] == 1)  # only the top-t get copies
    if t_eff <= m_eff:
        assert np.all(placement.replicas_E()[top] == D)
    else:
        extra_E = placement.replicas_E() - 1
        target = proportional_copies(loads[top].astype(float), D * m_eff, D - 1)
        assert np.all(extra_E[top] <= target)
        assert extra_E.sum() <= D * m_eff
    assert placement == materialize(shard, loads, t, m, topo)  # deterministic


@FAST
@given(case=layer_cases())
def test_materialize_degenerate_inputs_keep_the_shard(case):
    topo, shard, loads = case
    base = InstancePlacement.from_shard(shard)
    assert materialize(shard, loads, 0, 5, topo) == base
    assert materialize(shard, loads, 5, 0, topo) == base
    single = Topology(1, 1, 1.0, 1.0)
    one = ShardLayout(np.zeros(shard.num_experts, dtype=int), 1)
    assert materialize(one, loads, 5, 5, single) == InstancePlacement.from_shard(one)


def test_materialize_spreads_copies_over_nodes_first():
    # one hot expert on device 0; m = 1 with t = 2 leaves 8 slots for its 7 possible copies;
    # the first three copies must land on the three other nodes
    topo = Topology(4, 2, 100.0, 1.0)
    shard = ShardLayout.even(8, 8)
    loads = np.array([1000, 0, 0, 0, 0, 0, 0, 0])
    placement = materialize(shard, loads, t=2, m=1, topology=topo)
    assert placement.replicas_E()[0] == 8
    topo3 = Topology(4, 2, 100.0, 1.0)
    placement3 = materialize(shard, [30, 10, 0, 0, 0, 0, 0, 0], t=2, m=1, topology=topo3)
    holders0 = placement3.holders(0)
    assert len(set(topo3.node_of[holders0].tolist())) == 4  # 6 copies of expert 0 reach all nodes


def test_materialize_rejects_mismatched_inputs():
    topo = Topology(1, 2, 1.0, 1.0)
    with pytest.raises(PlacementError, match="spans 3 devices but the topology has 2"):
        materialize(ShardLayout([0, 1], 3), [1, 1], 1, 1, topo)
    with pytest.raises(PlacementError, match="has 3 entries but the layer has 2 experts"):
        materialize(ShardLayout([0, 1], 2), [1, 1, 1], 1, 1, topo)
    with pytest.raises(PlacementError, match=r"predicted_loads_E\[1\]"):
        materialize(ShardLayout([0, 1], 2), [1, -1], 1, 1, topo)
    with pytest.raises(PlacementError, match="memory capacity m must be an integer >= 0, got -1"):
        materialize(ShardLayout([0, 1], 2), [1, 1], 1, -1, topo)


# ---------------------------------------------------------------------------- calibration


def test_calibrate_worked_example():
    # 1 node x 4 devices, expert e on device e, no copies yet; expert 0 turns out to get 800
    # tokens, the others 100. Estimated max device load 800. With one free slot per device,
    # the free slots go to expert 0 (R = 4 + 4 = 8 instances, goal 6.4, deficit 5.4, capped at
    # 3 copies): it sits on all 4 devices -> max load 200 + 100 = 300, saving 500 tokens.
    topo = Topology(1, 4, 1e9, 1e9)
    shard = ShardLayout([0, 1, 2, 3], 4)
    current = InstancePlacement.from_shard(shard)
    loads = [800, 100, 100, 100]
    # gather: device 0 sends 3 copies of 1 MB at 1 GB/s = 3 ms; saving 500 tokens * 10 us = 5 ms
    placement, extra = calibrate(current, shard, loads, 1, topo, CalibrationCost(1e-5, 1e6))
    assert extra
    assert placement.holders(0).tolist() == [0, 1, 2, 3]
    assert placement.replicas_E()[1:].tolist() == [1, 1, 1]
    # 5 us per token: saving 2.5 ms < 3 ms gather -> keep the current placement
    placement, extra = calibrate(current, shard, loads, 1, topo, CalibrationCost(5e-6, 1e6))
    assert not extra and placement == current
    # with a latency of 2.1 ms the 5 ms saving no longer beats 3 ms + 2.1 ms
    assert not calibrate(current, shard, loads, 1, topo, CalibrationCost(1e-5, 1e6, latency_s=2.1e-3))[1]


@FAST
@given(case=layer_cases(), t=st.integers(0, 6), m=st.integers(0, 6), free=st.integers(0, 4),
       spt=st.sampled_from([0.0, 1e-6, 1.0]))
def test_calibrate_invariants(case, t, m, free, spt):
    topo, shard, predicted = case
    rng = np.random.default_rng(int(predicted.sum()))
    actual = rng.permutation(predicted)
    current = materialize(shard, predicted, t, m, topo)
    placement, extra = calibrate(current, shard, actual, free, topo, CalibrationCost(spt, 1.0))
    added = placement.holds_ED() & ~current.holds_ED()
    assert np.all(placement.holds_ED() >= current.holds_ED())  # only adds copies
    assert np.all(added.sum(axis=0) <= free)  # within the remaining memory
    assert extra == bool(added.any())
    if spt == 0.0:
        assert not extra  # nothing to save, never worth a gather


# ---------------------------------------------------------------------------- sharding


def test_shard_slots_rule_when_not_divisible():
    assert shard_slots_D(2, 3, 4).tolist() == [2, 2, 1, 1]
    assert shard_slots_D(61, 256, 1024).tolist() == [16] * 256 + [15] * 768
    assert even_shard(2, 4, 2).owners_LE.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]


def test_heterogeneous_shard_worked_example():
    # 1 node x 2 devices, 2 layers x 3 experts, t = 0: 3 slots per device.
    # layer 0 first (max 6): e0 -> dev 0 (tie), e1 -> dev 1 (less loaded), e2 -> dev 1 (5 < 6).
    # layer 1 (loads reset): e0 ties on load -> fewer free slots -> dev 1 (1 left);
    # e1 -> dev 0 (load 0 < 1); e2 -> dev 0, the only device with a free slot.
    layout = heterogeneous_shard([[6, 5, 4], [1, 1, 1]], 0, Topology(1, 2, 1.0, 1.0))
    assert layout.owners_LE.tolist() == [[0, 1, 1], [1, 0, 0]]


def test_heterogeneous_shard_picks_least_loaded_node_then_device():
    # 2 nodes x 2 devices, one layer of 4 experts, t = 0: one slot per device.
    # e0 (40) -> node 0 (tie), dev 0; e1 (30) -> node 1, dev 2; e2 (20) -> node 1 (30 < 40), dev 3;
    # e3 (10) -> node 0 (40 < 50), dev 1.
    layout = heterogeneous_shard([[40, 30, 20, 10]], 0, Topology(2, 2, 1.0, 1.0))
    assert layout.owners_LE.tolist() == [[0, 2, 3, 1]]


def test_heterogeneous_shard_spreads_top_t_over_devices():
    # t = 2: the top-2 experts of each layer are placed last, each on the device owning the
    # fewest experts of that layer
    layout = heterogeneous_shard([[9, 8, 1, 1], [9, 8, 1, 1]], 2, Topology(1, 2, 1.0, 1.0))
    for layer in range(2):
        assert sorted(layout.owners_LE[layer, :2].tolist()) == [0, 1]


@FAST
@given(topo=topologies(), L=st.integers(1, 4), E=st.integers(1, 10), t=st.integers(0, 12),
       seed=st.integers(0, 2**32 - 1))
def test_heterogeneous_shard_is_memory_balanced(topo, L, E, t, seed):
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 100, size=(L, E)) * (rng.random((L, E)) < 0.7)
    layout = heterogeneous_shard(loads, t, topo)
    assert layout.owners_LE.shape == (L, E)
    assert np.array_equal(layout.counts_D(), shard_slots_D(L, E, topo.num_devices))
    assert layout == heterogeneous_shard(loads, t, topo)


def test_heterogeneous_shard_balances_a_skewed_layer_better_than_even():
    rng = np.random.default_rng(3)
    w = 1.0 / np.arange(1, 17) ** 1.2
    loads = np.stack([rng.multinomial(10000, rng.permutation(w) / w.sum()) for _ in range(4)])
    topo = Topology(2, 4, 1.0, 1.0)
    het = heterogeneous_shard(loads, 0, topo)
    even = even_shard(4, 16, 8)

    def worst(layout):
        return max(imbalance(np.bincount(layout.owners_LE[l], weights=loads[l], minlength=8)) for l in range(4))

    assert worst(het) < worst(even)


# ---------------------------------------------------------------------------- dispatch


def brute_force_dispatch(placement, loads_SE, topo):
    """The DESIGN 4.4 rule token by token, with the documented remainder rotation."""
    S, E = loads_SE.shape
    out = np.zeros((S, E, topo.num_devices), dtype=np.int64)
    for s in range(S):
        for e in range(E):
            n = int(loads_SE[s, e])
            holders = placement.holders(e).tolist()
            if s in holders:
                out[s, e, s] += n
                continue
            near = [d for d in holders if topo.node_of[d] == topo.node_of[s]]
            targets = near or holders
            k = len(targets)
            for token in range(n):
                # token i of n: the first k * (n // k) go round robin; the rest start at s mod k
                if token < k * (n // k):
                    out[s, e, targets[token % k]] += 1
                else:
                    out[s, e, targets[(s + token - k * (n // k)) % k]] += 1
    return out


@st.composite
def dispatch_cases(draw):
    topo, shard, _ = draw(layer_cases())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    extra = rng.random((shard.num_experts, topo.num_devices)) < draw(st.sampled_from([0.0, 0.2, 0.6]))
    placement = InstancePlacement(shard.holds_ED() | extra)
    loads = np.stack([draw(loads_of(shard.num_experts, high=40)) for _ in range(topo.num_devices)])
    return topo, placement, loads


@FAST
@given(case=dispatch_cases())
def test_dispatch_matches_brute_force_and_checks(case):
    topo, placement, loads = case
    plan = dispatch(placement, loads, topo)
    plan.check(placement, loads)
    assert np.array_equal(plan.to_dense(), brute_force_dispatch(placement, loads, topo))


@FAST
@given(case=dispatch_cases())
def test_dispatch_locality_and_evenness(case):
    topo, placement, loads = case
    dense = dispatch(placement, loads, topo).to_dense()
    holds = placement.holds_ED()
    for s in range(topo.num_devices):
        for e in range(placement.num_experts):
            row = dense[s, e]
            if holds[e, s]:
                assert row[s] == loads[s, e]  # local first: nothing leaves
                continue
            node_holders = [d for d in placement.holders(e) if topo.same_node(d, s)]
            targets = node_holders or placement.holders(e).tolist()
            assert row[np.setdiff1d(np.arange(topo.num_devices), targets)].sum() == 0
            shares = row[targets]
            assert shares.max() - shares.min() <= 1  # split evenly, not picked


def test_dispatch_worked_example():
    # 2 nodes x 2 devices. Expert 0 on devices 0 and 1 (node 0), expert 1 on device 3 only.
    topo = Topology(2, 2, 100.0, 1.0)
    placement = InstancePlacement([[1, 1, 0, 0], [0, 0, 0, 1]])
    loads = np.array([[4, 1], [0, 0], [5, 2], [3, 6]])
    dense = dispatch(placement, loads, topo).to_dense()
    assert dense[0, 0].tolist() == [4, 0, 0, 0]  # local
    assert dense[0, 1].tolist() == [0, 0, 0, 1]  # only holder, across nodes
    # source 2 (node 1) has no copy of expert 0 on its node: 5 tokens over holders [0, 1],
    # 2 each and the odd one to holder (2 + 0) mod 2 = device 0
    assert dense[2, 0].tolist() == [3, 2, 0, 0]
    # source 3: 3 tokens over [0, 1]: remainder to holder (3 mod 2) = device 1
    assert dense[3, 0].tolist() == [1, 2, 0, 0]
    assert dense[2, 1].tolist() == [0, 0, 0, 2]  # same node as the holder
    assert dense[3, 1].tolist() == [0, 0, 0, 6]


def test_dispatch_zero_tokens_and_validation():
    topo = Topology(1, 2, 1.0, 1.0)
    placement = InstancePlacement([[1, 0]])
    plan = dispatch(placement, np.zeros((2, 1), dtype=int), topo)
    assert plan.tokens_K.sum() == 0 and plan.device_loads_D().tolist() == [0, 0]
    with pytest.raises(PlacementError, match=r"source_loads_DE must have shape \(2, 1\)"):
        dispatch(placement, np.zeros((1, 1), dtype=int), topo)


def test_fssdp_beats_ep_on_a_skewed_layer():
    # the point of it all: heterogeneous sharding + top-t materialization + topology-aware
    # dispatch on a Zipf(1.2) layer of 64 experts over 4 nodes x 8 devices
    rng = np.random.default_rng(0)
    topo = Topology(4, 8, 100.0, 10.0)
    E = 64
    w = 1.0 / np.arange(1, E + 1) ** 1.2
    source = rng.multinomial(8192, rng.permutation(w) / w.sum(), size=topo.num_devices)
    loads = source.sum(axis=0)
    even = ShardLayout.even(E, topo.num_devices)
    ep = imbalance(dispatch(InstancePlacement.from_shard(even), source, topo).device_loads_D())
    shard = heterogeneous_shard(loads[None, :], 16, topo).layer(0)
    fssdp = imbalance(dispatch(materialize(shard, loads, 16, 16, topo), source, topo).device_loads_D())
    assert ep > 3
    assert fssdp < 1.2
