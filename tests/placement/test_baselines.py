"""Tests of the baselines (DESIGN 4.9), their moved-bytes accounting and the policy replay.

Worked examples are traced by hand in the comments; random cases check invariants and
cross-check vectorised code against brute force.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.placement import (
    InstancePlacement,
    PlacementError,
    Topology,
    allreduce_equivalent_bytes,
    shard_imbalance_bound,
    spread_tokens,
    synthetic_trace,
)
from megatron_patches.placement.baselines import (
    ByteModel,
    EPLayout,
    ExpertMove,
    ShadowCostModel,
    deepspeed_dispatch,
    deepspeed_slot_counts,
    deepspeed_slots,
    ep_layout_moves,
    fastermoe_shadow,
    flexmoe_adjust,
    moved_bytes,
    smartmoe_swap,
    split_evenly,
    static_replication,
)
from megatron_patches.placement.policies import (
    POLICIES,
    ReplayConfig,
    ring_allreduce_bytes,
    even_source_loads,
    make_policy,
    replay,
)

FAST = settings(max_examples=60, deadline=None)
TWO_BY_TWO = Topology(nodes=2, devices_per_node=2, intra_node_bw=100e9, inter_node_bw=10e9)


# ---------------------------------------------------------------------------------------------
# byte model and moves


def test_byte_model_defaults_are_adam_mixed_precision():
    bm = ByteModel.from_expert_bytes(2 * 768 * 1536 * 2)  # GPT-MoE-S expert in bf16
    assert bm.params_per_expert == 2 * 768 * 1536
    assert bm.token_bytes == 2 * 768  # h = sqrt(params / 4) for d_ffn = 2 h
    assert bm.expert_weight_bytes == 2 * bm.params_per_expert
    assert bm.expert_grad_bytes == 2 * bm.params_per_expert
    assert bm.expert_optimizer_bytes == 12 * bm.params_per_expert  # fp32 master + m + v


def test_byte_model_is_configurable_and_validated():
    bm = ByteModel(params_per_expert=1000, weight_bytes_per_param=4, optimizer_bytes_per_param=8, token_bytes=64)
    assert (bm.expert_weight_bytes, bm.expert_optimizer_bytes, bm.token_bytes) == (4000, 8000, 64)
    assert ByteModel.from_expert_bytes(4000, weight_bytes_per_param=4.0, token_bytes=8).params_per_expert == 1000
    with pytest.raises(PlacementError, match="params_per_expert"):
        ByteModel(params_per_expert=0)
    with pytest.raises(PlacementError, match="optimizer_bytes_per_param"):
        ByteModel(params_per_expert=10, optimizer_bytes_per_param=-1)


def test_moved_bytes_splits_by_link_class_and_kind():
    bm = ByteModel(params_per_expert=100, token_bytes=2)
    moves = [ExpertMove(0, 0, 0, 1), ExpertMove(0, 1, 1, 2), ExpertMove(3, 5, 3, 0)]  # intra, inter, inter
    mb = moved_bytes(moves, TWO_BY_TWO, bm)
    assert (mb.param_intra, mb.param_inter) == (200, 400)
    assert (mb.optimizer_intra, mb.optimizer_inter) == (1200, 2400)
    assert mb.total == 3 * 100 * (2 + 12)
    weights_only = moved_bytes(moves, TWO_BY_TWO, bm, with_optimizer=False)
    assert weights_only.optimizer == 0 and weights_only.param == 600
    with pytest.raises(PlacementError, match="source == destination"):
        moved_bytes([ExpertMove(0, 2, 1, 1)], TWO_BY_TWO, bm)
    with pytest.raises(PlacementError, match="not a device id"):
        moved_bytes([ExpertMove(0, 2, 1, 9)], TWO_BY_TWO, bm)


# ---------------------------------------------------------------------------------------------
# EP


def test_ep_even_layout_and_dispatch_by_hand():
    ep = EPLayout.even(8, 4)
    assert ep.owner_E.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ep.placement().counts_ED.sum(axis=1).tolist() == [1] * 8
    src = np.zeros((4, 8), dtype=np.int64)
    src[:, 0] = 10  # every source sends 10 tokens to expert 0 (device 0)
    src[2, 7] = 3  # and source 2 sends 3 to expert 7 (device 3)
    plan = ep.dispatch(src)
    plan.check(ep.placement(), src)
    assert plan.device_loads_D().tolist() == [40, 0, 0, 3]


def test_ep_with_more_devices_than_experts_is_expert_data_parallel():
    ep = EPLayout.even(2, 4)  # 2 groups of 2 devices: expert 0 on devices 0 and 2, expert 1 on 1 and 3
    assert ep.group_size == 2 and ep.num_groups == 2
    assert ep.placement().counts_ED.tolist() == [[1, 0, 1, 0], [0, 1, 0, 1]]
    src = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
    dense = ep.dispatch(src).to_dense()
    # sources 0, 1 stay in group 0 (devices 0, 1); sources 2, 3 in group 1 (devices 2, 3)
    assert dense[3, 0].tolist() == [0, 0, 7, 0]
    assert dense[1, 1].tolist() == [0, 4, 0, 0]
    assert ep.dispatch(src).device_loads_D().tolist() == [1 + 3, 2 + 4, 5 + 7, 6 + 8]


def test_ep_refuses_incompatible_counts_and_uneven_groups():
    with pytest.raises(PlacementError, match="divide"):
        EPLayout.even(6, 4)
    with pytest.raises(PlacementError, match="must hold 2"):
        EPLayout(np.array([0, 0, 0, 1]), 2)
    with pytest.raises(PlacementError, match=r"expected \(D=4 sources, E=8 experts\)"):
        EPLayout.even(8, 4).dispatch(np.zeros((3, 8), dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# even split over holders


def test_split_evenly_by_hand():
    holds = np.array([[1, 1, 1], [0, 1, 0]], dtype=bool)
    src = np.array([[5, 1], [5, 0]])
    dense = split_evenly(src, holds).to_dense()
    # source 0: 5 over holders (0, 1, 2) -> 1 each + remainder 2 to positions 0, 1
    assert dense[0, 0].tolist() == [2, 2, 1]
    # source 1: remainder rotated to start at position 1
    assert dense[1, 0].tolist() == [1, 2, 2]
    assert dense[0, 1].tolist() == [0, 1, 0]


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_split_evenly_invariants(S, E, D, seed):
    rng = np.random.default_rng(seed)
    holds = rng.random((E, D)) < 0.5
    holds[np.arange(E), rng.integers(0, D, E)] = True
    src = rng.integers(0, 50, (S, E))
    plan = split_evenly(src, holds)
    plan.check(InstancePlacement(holds.astype(np.int64)), src)
    dense = plan.to_dense()
    for s, e in itertools.product(range(S), range(E)):
        share = dense[s, e, holds[e]]
        assert share.max() - share.min() <= 1


# ---------------------------------------------------------------------------------------------
# FasterMoE


def test_fastermoe_shadows_the_hot_expert_when_it_pays_by_hand():
    ep = EPLayout.even(2, 2)  # expert 0 on device 0, expert 1 on device 1
    src = np.array([[90, 0], [90, 10]])
    # no shadow: device loads (180, 10) -> 180; shadow e0: (90, 100) + 5 = 105;
    # shadow e0, e1: (90, 100) + 10 = 110
    cheap = ShadowCostModel(seconds_per_token=1.0, a2a_seconds_per_token=0.0, shadow_seconds=5.0)
    d = fastermoe_shadow(ep, src, cheap)
    assert d.shadowed_E.tolist() == [True, False]
    assert (d.estimated_seconds, d.ep_estimated_seconds) == (105.0, 180.0)
    assert d.placement.counts_ED.tolist() == [[1, 1], [0, 1]]
    assert d.dispatch.device_loads_D().tolist() == [90, 100]
    d.dispatch.check(d.placement, src)
    dear = ShadowCostModel(seconds_per_token=1.0, a2a_seconds_per_token=0.0, shadow_seconds=100.0)
    assert not fastermoe_shadow(ep, src, dear).shadowed_E.any()


def test_fastermoe_cost_model_from_hardware():
    bm = ByteModel(params_per_expert=1000, token_bytes=10)
    cost = ShadowCostModel.from_hardware(bm, TWO_BY_TWO, device_flops=1e6)
    assert cost.seconds_per_token == pytest.approx(6000 / 1e6)
    assert cost.a2a_seconds_per_token == pytest.approx(40 / 10e9)  # inter-node link, 4 crossings
    assert cost.shadow_seconds == pytest.approx(4000 / 10e9)  # weights + grads


@FAST
@given(st.sampled_from([(4, 2), (4, 4), (2, 4), (6, 3)]), st.integers(0, 2**32 - 1))
def test_fastermoe_picks_the_cheapest_prefix_brute_force(shape, seed):
    E, D = shape
    rng = np.random.default_rng(seed)
    ep = EPLayout.even(E, D)
    src = rng.integers(0, 100, (D, E)) * (rng.random(E) < 0.7)
    cost = ShadowCostModel(float(rng.uniform(0.1, 1)), float(rng.uniform(0, 1)), float(rng.uniform(0, 80)))
    order = np.argsort(-src.sum(axis=0), kind="stable")
    times = []
    for k in range(E + 1):
        shadowed = np.zeros(E, dtype=bool)
        shadowed[order[:k]] = True
        compute = np.zeros(D)
        inbound = np.zeros(D)
        for s, e in itertools.product(range(D), range(E)):
            dest = s if shadowed[e] else (s // ep.group_size) * ep.group_size + ep.owner_E[e]
            compute[dest] += src[s, e]
            inbound[dest] += src[s, e] if dest != s else 0
        times.append(
            cost.seconds_per_token * compute.max()
            + cost.a2a_seconds_per_token * inbound.max()
            + cost.shadow_seconds * k
        )
    d = fastermoe_shadow(ep, src, cost)
    best = int(np.argmin(times))
    assert d.shadowed_E.sum() == best
    assert d.estimated_seconds == pytest.approx(times[best])
    assert d.ep_estimated_seconds == pytest.approx(times[0])
    d.dispatch.check(d.placement, src)


# ---------------------------------------------------------------------------------------------
# SmartMoE


def test_smartmoe_swaps_by_hand():
    ep = EPLayout.even(8, 4)
    loads = np.array([10, 9, 8, 7, 1, 1, 1, 1.0])
    # device loads (19, 15, 2, 2). Swap 1: heaviest 0 with lightest 2 (gap 17), pairs move 9 or 8,
    # tie at |x - 8.5| -> first pair: experts 0 <-> 4 (x = 9) -> (10, 15, 11, 2).
    # Swap 2: device 1 with device 3 (gap 13): experts 2 <-> 6 (x = 7) -> (10, 8, 11, 9).
    # Then device 2 (11) has no pair with 0 < x < gap against 1 (gap 3), 3 (gap 2), 0 (gap 1).
    new, swaps = smartmoe_swap(ep, loads)
    assert swaps == 2
    assert new.owner_E.tolist() == [2, 0, 3, 1, 0, 2, 1, 3]
    assert np.bincount(new.owner_E, weights=loads).tolist() == [10, 8, 11, 9]
    moves = ep_layout_moves(ep, new, layer=3)
    assert sorted((m.expert, m.src, m.dst) for m in moves) == [(0, 0, 2), (2, 1, 3), (4, 2, 0), (6, 3, 1)]
    assert all(m.layer == 3 for m in moves)
    # on 2 nodes x 2 devices every one of these moves crosses nodes: 4 x (weights + optimizer)
    bm = ByteModel(params_per_expert=10, token_bytes=2)
    mb = moved_bytes(moves, TWO_BY_TWO, bm)
    assert (mb.param_intra, mb.param_inter, mb.optimizer_inter) == (0, 4 * 20, 4 * 120)
    assert smartmoe_swap(ep, loads, max_swaps=0)[0].owner_E.tolist() == ep.owner_E.tolist()


@FAST
@given(st.sampled_from([(8, 4), (12, 3), (6, 6), (4, 8)]), st.integers(0, 2**32 - 1))
def test_smartmoe_never_worsens_and_keeps_counts(shape, seed):
    E, D = shape
    rng = np.random.default_rng(seed)
    ep = EPLayout.even(E, D)
    loads = rng.pareto(1.0, E) * 10
    new, swaps = smartmoe_swap(ep, loads)
    before = np.bincount(ep.owner_E, weights=loads, minlength=ep.group_size)
    after = np.bincount(new.owner_E, weights=loads, minlength=ep.group_size)
    assert after.max() <= before.max() + 1e-9
    assert (after**2).sum() <= (before**2).sum() + 1e-9
    assert np.bincount(new.owner_E).tolist() == np.bincount(ep.owner_E).tolist()
    assert len(ep_layout_moves(ep, new, 0)) <= 2 * swaps * ep.num_groups


# ---------------------------------------------------------------------------------------------
# FlexMoE


def test_flexmoe_replicates_into_reserved_slots_by_hand():
    ep = EPLayout.even(8, 4)
    loads = np.array([10, 9, 8, 7, 1, 1, 1, 1.0])
    # device loads (19, 15, 2, 2), 1 free slot per device. Op 1: hottest device 0, its hottest
    # expert 0 -> least loaded device with a free slot, device 2: (14, 15, 7, 2).
    # Op 2: device 1's expert 2 -> device 3 (device 0 is lighter? no: 14 vs 2): (14, 11, 7, 6).
    # Op 3: device 0's expert 1 (9 > 5) -> only device 1 has a free slot -> (9.5, 15.5, ...): rejected.
    placement, moves = flexmoe_adjust(ep.placement(), loads, 3, TWO_BY_TWO)
    holders = [placement.holders(e).tolist() for e in range(8)]
    assert holders == [[0, 2], [0], [1, 3], [1], [2], [2], [3], [3]]
    # new replicas are copied from an existing holder (none on the target's node here)
    assert [(m.expert, m.src, m.dst) for m in moves] == [(0, 0, 2), (2, 1, 3)]
    # without reserved slots and without replicas there is nothing FlexMoE can do
    assert flexmoe_adjust(ep.placement(), loads, 2, TWO_BY_TWO)[1] == []


def test_flexmoe_drops_over_capacity_when_the_run_sets_one_by_hand():
    """2 devices, 2 experts, 1 reserved slot each (2 slots per device); every token goes to
    expert 0 (8 from each device, T = 16). At capacity factor 1 the layer's 16 tokens of
    capacity are shared by its instances: 8 each for EP's 2, 16 / 3 -> 6 each once expert 0 has
    a replica."""
    bm = ByteModel(params_per_expert=1000, token_bytes=8)
    src_LDE = np.array([[[8, 0], [8, 0]]])
    config = ReplayConfig(Topology.single_node(2), bm, memory_capacity=1, reshard_interval=2, skew_threshold=None,
                          capacity_factor=1.0, flexmoe_capacity=True)
    policy = make_policy("flexmoe", config, 1, 2)
    # iteration 0: EP's layout, expert 0 only on device 0: 8 processed, 8 dropped
    first = policy.plan(0, np.array([[16.0, 0.0]]), src_LDE).layers[0]
    assert first.processed_ED.tolist() == [[8, 0], [0, 0]]
    # iteration 2 (the interval): a replica of expert 0 in device 1's reserved slot receives
    # half of expert 0's tokens; 3 instances share 16 -> ceil(16 / 3) = 6 each
    second = policy.plan(2, np.array([[16.0, 0.0]]), src_LDE).layers[0]
    assert second.placement.holders(0).tolist() == [0, 1]
    assert second.processed_ED.tolist() == [[6, 6], [0, 0]]
    # without a capacity (the run sets none) FlexMoE is dropless, as its paper runs it
    dropless = make_policy("flexmoe", ReplayConfig(Topology.single_node(2), bm, memory_capacity=1, reshard_interval=2,
                                                   skew_threshold=None), 1, 2)
    assert dropless.plan(0, np.array([[16.0, 0.0]]), src_LDE).layers[0].processed_ED.tolist() == [[16, 0], [0, 0]]


def test_flexmoe_relocates_when_slots_are_full_by_hand():
    one_node = Topology.single_node(2)
    start = InstancePlacement(np.array([[1, 0], [0, 1], [1, 1]]))  # e0 {0}, e1 {1}, e2 {0, 1}
    loads = np.array([1, 10, 2.0])
    # per-replica loads (1, 10, 1): devices (2, 11). Hot expert 1 must go to device 0, which is
    # full: drop e2's replica there -> devices (1 + 5, 5 + 2) = (6, 7), accepted. Next: hot
    # expert 2 on device 1 needs device 0, whose only droppable replica is e1's -> (2, 11): rejected.
    placement, moves = flexmoe_adjust(start, loads, 2, one_node)
    assert placement.counts_ED.tolist() == [[1, 0], [1, 1], [0, 1]]
    assert [(m.expert, m.src, m.dst) for m in moves] == [(1, 1, 0)]


@FAST
@given(st.sampled_from([(8, 4, 1), (4, 4, 2), (2, 4, 1), (12, 6, 3)]), st.integers(0, 2**32 - 1))
def test_flexmoe_invariants(shape, seed):
    E, D, reserved = shape
    rng = np.random.default_rng(seed)
    topology = Topology(nodes=2, devices_per_node=D // 2, intra_node_bw=1e11, inter_node_bw=1e10)
    ep = EPLayout.even(E, D)
    slots = E // ep.group_size + reserved
    loads = rng.pareto(1.0, E) * 10
    before = ep.placement()
    placement, moves = flexmoe_adjust(before, loads, slots, topology)
    placement.check_slot_limit(slots)
    assert placement.counts_ED.max() == 1 and (placement.replicas_E() >= 1).all()

    def dev(p):
        h = p.holds_ED()
        return (loads / h.sum(axis=1)) @ h

    assert dev(placement).max() <= dev(before).max() + 1e-9
    # moves are exactly the new replicas, each copied from a device that held the expert before
    new_ED = placement.holds_ED() & ~before.holds_ED()
    assert sorted((m.expert, m.dst) for m in moves) == sorted(zip(*map(list, np.nonzero(new_ED))))
    for m in moves:
        assert before.counts_ED[m.expert, m.src] == 1


# ---------------------------------------------------------------------------------------------
# static replication


def test_static_replication_layout():
    p = static_replication(16, 16, 4)  # the replication paper's baseline: 4 instances per class
    assert p.instances_E().tolist() == [4] * 16
    assert p.slots_used_D().tolist() == [4] * 16
    # DeepSpeed's layout: expert-parallel groups of 4 consecutive ranks each hold all 16 classes,
    # so class e's replicas sit on ranks e // 4 + 4k, one per group, never two on one rank
    assert p.holds_ED().sum(axis=1).tolist() == [4] * 16
    assert [p.holders(e).tolist() for e in (0, 5, 15)] == [[0, 4, 8, 12], [1, 5, 9, 13], [3, 7, 11, 15]]
    # DeepSpeed lays out s | E with E/s | ranks only: 6 experts on 2 ranks take 3 or 6 slots
    assert deepspeed_slot_counts(6, 2) == [3, 6] and deepspeed_slot_counts(16, 16) == [1, 2, 4, 8, 16]
    assert static_replication(6, 2, 3).holders(4).tolist() == [1]
    with pytest.raises(PlacementError, match="cannot use 4 slots per rank.*valid s for 6 experts on 2 ranks: 3, 6"):
        static_replication(6, 2, 4)
    with pytest.raises(PlacementError, match="valid s for 9 experts on 2 ranks: 9$"):
        static_replication(9, 2, 4)
    # by default, the most slots within the budget; none within it is refused
    assert deepspeed_slots(6, 2, 5, chosen=False) == 3 and deepspeed_slots(16, 16, 7, chosen=False) == 4
    with pytest.raises(PlacementError, match="needs at least 3 slots per rank and the memory budget holds 2"):
        deepspeed_slots(6, 2, 2, chosen=False)


def test_deepspeed_dispatch_hand_case():
    """4 ranks x 2 slots, 4 experts: groups {0, 1} and {2, 3} (ranks 0 and 2 hold experts 0-1, ranks
    1 and 3 experts 2-3). 40 assignments per source at factor 1: C = ceil(40 / 4) = 10 rows per
    expert and source. A source keeps at most 10 per expert, whatever its group leaves unused, sends
    all 4 x 10 rows (padding included) within its group, and an instance computes 2 x 10."""
    src_SE = np.array([[25, 5, 5, 5], [10, 10, 10, 10], [0, 0, 0, 40], [4, 12, 12, 12]])
    spread = deepspeed_dispatch(src_SE, 2, 1.0)
    assert spread.capacity == 20
    assert spread.dropped_E.tolist() == [15, 2, 2, 32]
    assert spread.processed_ED.tolist() == [[20, 0, 4, 0], [15, 0, 10, 0], [0, 15, 0, 10], [0, 15, 0, 20]]
    plan = spread.plan
    assert plan.routed_SE().tolist() == [[10] * 4] * 4  # the fixed [E, C] buffer of every source
    assert plan.received_ED().tolist() == [[20, 0, 20, 0], [20, 0, 20, 0], [0, 20, 0, 20], [0, 20, 0, 20]]
    assert spread.kept_K.reshape(4, 4).tolist() == np.minimum(src_SE, 10).tolist()
    # 20 rows per source leave it (the group's other rank's two experts), never to another group
    off = plan.dest_K != plan.source_K
    assert np.bincount(plan.source_K[off], plan.tokens_K[off]).tolist() == [20] * 4
    assert (plan.source_K // 2 == plan.dest_K // 2).all()
    # the global spread of the same loads (capacity 20 per instance, overflow to the other group)
    # keeps more: expert 3's 67 tokens fill both its instances
    assert spread_tokens(static_replication(4, 4, 2), src_SE, 1.0, 2).processed_ED[3].sum() == 40
    # DeepSpeed's min_capacity: 4 assignments per source still give 4 rows
    assert deepspeed_dispatch(np.ones((4, 4), dtype=np.int64), 2, 1.0).capacity == 8


# ---------------------------------------------------------------------------------------------
# policy replay helpers


def test_even_source_loads():
    loads = np.array([[7, 0, 4]])
    src = even_source_loads(loads, 3)
    assert src.sum(axis=1).tolist() == loads.tolist()
    # 7 over 3 sources: 2 each + 1 to the device at expert 0's offset (device 0)
    assert src[0, :, 0].tolist() == [3, 2, 2]
    # 4 over 3: the extra goes to device 2 (expert 2's offset)
    assert src[0, :, 2].tolist() == [1, 1, 2]


@FAST
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def testring_allreduce_bytes_volume_is_the_allreduce_equivalent(E, D, seed):
    rng = np.random.default_rng(seed)
    holds = rng.random((E, D)) < 0.5
    holds[np.arange(E), rng.integers(0, D, E)] = True
    placement = InstancePlacement(holds.astype(np.int64))
    topology = Topology.single_node(D)
    comm = ring_allreduce_bytes(placement, 1000.0, topology)
    assert comm.total == pytest.approx(allreduce_equivalent_bytes(placement, 1000.0), abs=D * E)


# ---------------------------------------------------------------------------------------------
# replay of every policy


@pytest.fixture(scope="module")
def small_trace():
    return synthetic_trace(
        iterations=12,
        layers=2,
        experts=8,
        tokens=4000,
        zipf=1.2,
        drift=0.1,
        spike_prob=0.0,
        spike_factor=5.0,
        layer_variation=0.2,
        ranks=4,
        source_noise=0.1,
        seed=3,
    )


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_produces_consistent_plans(name, small_trace):
    bm = ByteModel(params_per_expert=1000, token_bytes=8)
    config = ReplayConfig(TWO_BY_TWO, bm, overlap_degree=2, memory_capacity=1, reshard_interval=4, capacity_factor=1.2)
    policy = make_policy(name, config, 2, 8)
    tracker_loads = small_trace.loads.astype(float)
    for i in range(small_trace.num_iterations):
        predicted = tracker_loads[max(0, i - 5) : i].mean(axis=0) if i else np.ones((2, 8))
        src = small_trace.source_loads[i]
        step = policy.plan(i, predicted, src)
        for l, lp in enumerate(step.layers):
            routed = src[l]
            sent = lp.dispatch.routed_SE()
            if name == "static":  # DeepSpeed's fixed buffers: the capacity's rows of every expert, padded
                assert (sent == lp.capacity // 4).all()  # 8 experts: s = 2 (3 in the budget), groups of 4 ranks
            else:
                assert (sent <= routed).all()
            if name in ("replicate", "static"):
                assert (lp.processed_ED <= lp.dispatch.received_ED()).all()
            else:
                lp.dispatch.check(lp.placement, routed)  # dropless: every token sent to a holder
                assert np.array_equal(lp.processed_ED, lp.dispatch.received_ED())
            assert ((lp.processed_ED > 0) <= lp.placement.holds_ED()).all()
        traffic = policy.traffic(step)
        assert "all_to_all" in traffic and all(c.total >= 0 for c in traffic.values())
        if name in ("ep", "static", "replicate", "fastermoe"):
            assert step.moves == ()
        if name in ("fssdp", "smartmoe") and i % 4 != 0:
            assert step.moves == ()


def test_replay_moved_bytes_match_the_moves(small_trace):
    bm = ByteModel(params_per_expert=1000, token_bytes=8)
    config = ReplayConfig(TWO_BY_TWO, bm, overlap_degree=2, memory_capacity=1, reshard_interval=4,
                          load_predictor="mean")
    policy = make_policy("smartmoe", config, 2, 8)
    moves = []
    for i in range(small_trace.num_iterations):
        predicted = small_trace.loads[max(0, i - 5) : i].mean(axis=0) if i else np.ones((2, 8))
        step = policy.plan(i, predicted, small_trace.source_loads[i])
        moves += step.moves
    result = replay(make_policy("smartmoe", config, 2, 8), small_trace.loads, small_trace.source_loads)
    # each moved expert carries 2 B/param of weights + 12 B/param of optimizer state
    assert result.rearrange.total == pytest.approx(len(moves) * 1000 * 14)
    assert result.rearrange.param == pytest.approx(len(moves) * 2000)
    assert result.traffic["rearrange"].sum() == pytest.approx(result.rearrange.total)


def test_replay_replicate_traffic_by_formula(small_trace):
    # replicate mode: weights of every expert are scattered from all D slice owners into every
    # distinct holder, i.e. per (expert, holder) W minus the holder's own slice
    bm = ByteModel(params_per_expert=1000, token_bytes=8)
    config = ReplayConfig(TWO_BY_TWO, bm, slots_per_rank=3)
    policy = make_policy("replicate", config, 2, 8)
    step = policy.plan(0, np.ones((2, 8)), small_trace.source_loads[0])
    expected = sum(lp.placement.replicas_E().sum() * 2 * (1000 - 250) for lp in step.layers)
    assert policy.traffic(step)["weight_scatter"].total == pytest.approx(expected)


def test_replay_fastermoe_broadcast_bytes(small_trace):
    bm = ByteModel(params_per_expert=1000, token_bytes=8)
    config = ReplayConfig(Topology.single_node(4), bm, device_flops=1e6)  # slow compute: shadowing pays
    policy = make_policy("fastermoe", config, 2, 8)
    step = policy.plan(0, np.ones((2, 8)), small_trace.source_loads[0])
    shadowed = sum(int(lp.shadowed_E.sum()) for lp in step.layers)
    assert shadowed > 0
    traffic = policy.traffic(step)
    assert traffic["shadow_broadcast"].total == shadowed * 3 * 2000  # owner -> the 3 other devices
    assert traffic["shadow_reduce"].total == shadowed * 3 * 2000


def test_replay_fssdp_beats_ep_on_a_skewed_trace():
    trace = synthetic_trace(
        iterations=30,
        layers=2,
        experts=16,
        tokens=20000,
        zipf=1.5,
        drift=0.02,
        spike_prob=0.0,
        spike_factor=5.0,
        layer_variation=0.1,
        ranks=8,
        source_noise=0.1,
        seed=0,
    )
    topology = Topology(nodes=2, devices_per_node=4, intra_node_bw=1e11, inter_node_bw=1e10)
    config = ReplayConfig(
        topology, ByteModel(params_per_expert=1000, token_bytes=8), overlap_degree=4, memory_capacity=2
    )
    ep = replay(make_policy("ep", config, 2, 16), trace.loads, trace.source_loads)
    fs = replay(make_policy("fssdp", config, 2, 16), trace.loads, trace.source_loads)
    assert ep.imbalance_IL.mean() > 2.5
    assert fs.imbalance_IL.mean() < 0.6 * ep.imbalance_IL.mean()
    assert (fs.survival_IL == 1).all() and fs.window == 5


def test_fssdp_policy_reshards_only_when_the_bound_drops():
    # constant loads: the even layout puts experts 2 and 3 of layer 0 (6 and 7 of layer 1), the
    # heaviest outside the top-2, on one device: 590 tokens against a mean of 382.5, bound 1.54.
    # The first re-shard (iteration 4) separates them (bound 1); the later ones find nothing better.
    loads_LE = np.array([[500, 400, 300, 290, 10, 10, 10, 10], [10, 10, 10, 10, 500, 400, 300, 290]])
    trace = np.repeat(loads_LE[None], 13, axis=0)
    bm = ByteModel(params_per_expert=1000, token_bytes=8)
    config = ReplayConfig(TWO_BY_TWO, bm, overlap_degree=2, memory_capacity=1, reshard_interval=4)
    policy = make_policy("fssdp", config, 2, 8)
    even = policy.shard
    result = replay(policy, trace)
    assert result.rearrange_events == 1
    assert shard_imbalance_bound(policy.shard, loads_LE, 2).mean() < shard_imbalance_bound(even, loads_LE, 2).mean()
    moved = int((policy.shard.owners_LE != even.owners_LE).sum())
    assert result.rearrange.total == pytest.approx(moved * 1000 * 14)
    # balanced loads: the even layout is already at the bound (1), so nothing is ever moved
    flat = replay(make_policy("fssdp", config, 2, 8), np.full((13, 2, 8), 100))
    assert flat.rearrange_events == 0 and flat.rearrange.total == 0


def test_make_policy_names_the_valid_ones():
    config = ReplayConfig(TWO_BY_TWO, ByteModel(params_per_expert=10))
    with pytest.raises(PlacementError, match="valid policies: ep, fssdp"):
        make_policy("deepspeed", config, 1, 4)
    with pytest.raises(PlacementError, match="slots-per-rank >= 3"):
        make_policy("replicate", ReplayConfig(TWO_BY_TWO, ByteModel(params_per_expert=10), slots_per_rank=2), 1, 9)
