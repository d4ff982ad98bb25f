"""Tests of the placement vocabulary (types.py) and the load tracker (loads.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.placement import (
    DispatchPlan,
    ElementShardLayout,
    InstancePlacement,
    LoadTracker,
    ModelShardLayout,
    PlacementError,
    ShardLayout,
    Topology,
    check_loads,
    check_source_loads,
)

FAST = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------------------- Topology


def test_topology_numbers_devices_node_major():
    topo = Topology(nodes=3, devices_per_node=2, intra_node_bw=100.0, inter_node_bw=10.0)
    assert topo.num_devices == 6
    assert topo.node_of.tolist() == [0, 0, 1, 1, 2, 2]
    assert topo.devices_on_node(1).tolist() == [2, 3]
    assert topo.same_node(2, 3) and not topo.same_node(1, 2)
    assert topo.same_node(np.array([0, 4]), np.array([1, 3])).tolist() == [True, False]
    assert topo.bandwidth(0, 1) == 100.0 and topo.bandwidth(0, 5) == 10.0
    assert topo.device_types == ("gpu",) * 6
    assert topo.same_node_DD()[0].tolist() == [True, True, False, False, False, False]


def test_topology_device_types_and_errors():
    topo = Topology(1, 2, 1.0, 1.0, device_types=("A100", "V100"))
    assert topo.device_types == ("A100", "V100")
    with pytest.raises(PlacementError, match="one type per device"):
        Topology(1, 2, 1.0, 1.0, device_types=("A100",))
    with pytest.raises(PlacementError, match="Topology.nodes must be an integer >= 1, got 0"):
        Topology(0, 2, 1.0, 1.0)
    with pytest.raises(PlacementError, match="inter_node_bw"):
        Topology(1, 2, 1.0, -5.0)
    with pytest.raises(PlacementError, match="node 2 is not a node id"):
        Topology(2, 2, 1.0, 1.0).devices_on_node(2)
    with pytest.raises(PlacementError, match="device 4 is not a device id"):
        Topology(2, 2, 1.0, 1.0).check_device(4)


# ---------------------------------------------------------------------------- loads


def test_check_loads_copies_what_someone_may_still_write():
    """check_loads returns a read-only int64 array: a copy of anything writable (or viewing a
    writable array), so writing the input later cannot change a plan made from it; an array that
    is already read-only int64 all the way down (its own result: the runtime checks a layer's
    gathered loads once, then calibration and dispatch read them) is taken as it is."""
    writable = np.array([[1, 2], [3, 4]], dtype=np.int64)
    checked = check_loads(writable, ndim=2)
    assert checked is not writable and not checked.flags.writeable
    writable[0, 0] = 99
    assert checked[0, 0] == 1
    assert check_loads(checked, ndim=2) is checked
    assert check_loads(checked[1:], ndim=2).base is checked  # a read-only view of it: no copy either
    view = writable.view()
    view.setflags(write=False)  # read-only, but its base is not
    assert check_loads(view, ndim=2) is not view
    small = np.array([1, 2], dtype=np.int32)
    small.setflags(write=False)
    assert check_loads(small).dtype == np.int64  # another dtype is converted


def test_check_source_loads_sums_as_numpy_does_on_either_path():
    """check_source_loads gives the checked loads with their sums by expert (axis 0) and by
    source (axis 1): the same from the compiled pass an already checked array takes and from
    numpy's on anything else, and the same error naming a negative entry on both."""
    rng = np.random.default_rng(0)
    writable = rng.integers(0, 1000, (16, 8))
    frozen = check_loads(writable, ndim=2)
    for loads in (writable, frozen, writable.astype(np.int32), writable.tolist()):
        arr, by_expert, by_source = check_source_loads(loads)
        np.testing.assert_array_equal(arr, writable)
        np.testing.assert_array_equal(by_expert, writable.sum(axis=0))
        np.testing.assert_array_equal(by_source, writable.sum(axis=1))
    assert check_source_loads(frozen)[0] is frozen
    negative = writable.copy()
    negative[3, 5] = -2
    negative.setflags(write=False)
    message = r"source_loads_DE must be non-negative token counts, got -2 at index \(3, 5\)"
    with pytest.raises(PlacementError, match=message):
        check_source_loads(negative)
    with pytest.raises(PlacementError, match="2 dimension"):
        check_source_loads([1, 2])


def test_check_loads_rejects_bad_values_with_their_position():
    assert check_loads([1.0, 2.0]).dtype == np.int64
    with pytest.raises(PlacementError, match=r"got -3 at index \(1,\)"):
        check_loads([1, -3])
    with pytest.raises(PlacementError, match="whole numbers"):
        check_loads([1.5])
    with pytest.raises(PlacementError, match="2 dimension"):
        check_loads([1, 2], ndim=2)


# ---------------------------------------------------------------------------- ShardLayout


@FAST
@given(E=st.integers(1, 40), D=st.integers(1, 16))
def test_even_shard_is_contiguous_and_balanced(E, D):
    shard = ShardLayout.even(E, D)
    counts = shard.counts_D()
    assert counts.sum() == E
    assert counts.max() - counts.min() <= 1
    assert np.all(np.diff(shard.owner_E) >= 0)  # contiguous blocks, ascending devices
    for d in range(D):
        assert shard.experts_of(d).tolist() == np.flatnonzero(shard.owner_E == d).tolist()
    assert np.array_equal(shard.holds_ED().sum(axis=0), counts)
    assert np.array_equal(shard.holds_ED().sum(axis=1), np.ones(E))


def test_shard_layout_names_bad_owner_and_is_immutable():
    with pytest.raises(PlacementError, match="expert 2 is owned by device 5"):
        ShardLayout([0, 1, 5], num_devices=3)
    shard = ShardLayout([0, 1, 1], 3)
    with pytest.raises(ValueError):
        shard.owner_E[0] = 2
    assert shard == ShardLayout(np.array([0, 1, 1]), 3)
    assert shard != ShardLayout([0, 1, 2], 3)


def test_model_shard_layout_counts():
    layout = ModelShardLayout([[0, 0, 1], [1, 2, 2]], 3)
    assert layout.counts_LD().tolist() == [[2, 1, 0], [0, 1, 2]]
    assert layout.counts_D().tolist() == [2, 2, 2]
    assert layout.layer(1) == ShardLayout([1, 2, 2], 3)
    with pytest.raises(PlacementError, match="layer 1 expert 0 is owned by device 3"):
        ModelShardLayout([[0, 0], [3, 0]], 3)
    even = ModelShardLayout.even(2, 5, 2)
    assert even.owners_LE.tolist() == [[0, 0, 0, 1, 1]] * 2


# ---------------------------------------------------------------------------- ElementShardLayout


@FAST
@given(N=st.integers(0, 60), D=st.integers(1, 12))
def test_element_shard_layout_partitions_every_element_once(N, D):
    layout = ElementShardLayout(N, D)
    sizes = layout.sizes_D()
    assert sizes.sum() == N and sizes.max() - sizes.min() <= 1
    offsets = layout.offsets()
    assert offsets[0] == 0 and offsets[-1] == N and len(offsets) == D + 1
    owner = np.full(N, -1)
    for r in range(D):
        start, end = layout.bounds(r)
        assert (start, end) == (offsets[r], offsets[r + 1])
        assert np.all(owner[start:end] == -1)
        owner[start:end] = r
    assert np.all(owner >= 0)
    for i in range(N):
        assert layout.owner_of(i) == owner[i]


def test_element_shard_layout_worked_example():
    # 10 elements over 4 ranks: np.array_split sizes 3, 3, 2, 2
    layout = ElementShardLayout(10, 4)
    assert [layout.bounds(r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    # fewer elements than ranks: trailing ranks get empty slices, not missing ones
    assert [ElementShardLayout(2, 4).bounds(r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


# ---------------------------------------------------------------------------- InstancePlacement


def test_instance_placement_requires_every_expert_and_names_it():
    with pytest.raises(PlacementError, match="expert 1 has no instance"):
        InstancePlacement([[1, 0], [0, 0], [0, 1]])
    with pytest.raises(PlacementError, match="expert 0 has -1 instances on device 1"):
        InstancePlacement([[1, -1]])


def test_instance_placement_queries():
    placement = InstancePlacement([[1, 2, 0], [0, 0, 1]])
    assert placement.holders(0).tolist() == [0, 1]
    assert placement.replicas_E().tolist() == [2, 1]
    assert placement.instances_E().tolist() == [3, 1]
    assert placement.slots_used_D().tolist() == [1, 2, 1]
    shard = ShardLayout([0, 2], 3)
    assert placement.contains(shard)
    assert placement.extra_copies_D(shard).tolist() == [0, 1, 0]
    assert not placement.contains(ShardLayout([2, 2], 3))
    with pytest.raises(PlacementError, match="expert 0 is not held by its owner device 2"):
        placement.require_contains(ShardLayout([2, 2], 3))
    with pytest.raises(PlacementError, match="device 1 holds 2 expert instances but has only 1 slots"):
        placement.check_slot_limit(1)
    placement.check_slot_limit([1, 2, 1])
    with pytest.raises(PlacementError, match="device 1 holds 1 extra expert copies but its memory capacity is 0"):
        placement.check_extra_limit(shard, 0)
    with pytest.raises(PlacementError, match="shard layout has E=1"):
        placement.contains(ShardLayout([0], 3))


# ---------------------------------------------------------------------------- DispatchPlan


@FAST
@given(st.integers(0, 2**32 - 1))
def test_dispatch_plan_dense_roundtrip_and_aggregates(seed):
    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 3, size=(3, 4, 5)) * (rng.random((3, 4, 5)) < 0.5)
    plan = DispatchPlan.from_dense(dense)
    assert np.array_equal(plan.to_dense(), dense)
    assert np.array_equal(plan.routed_SE(), dense.sum(axis=2))
    assert np.array_equal(plan.received_ED(), dense.sum(axis=0))
    assert np.array_equal(plan.device_loads_D(), dense.sum(axis=(0, 1)))
    assert np.array_equal(plan.traffic_SD(), dense.sum(axis=1))


def test_dispatch_plan_equality_ignores_entry_order_and_splits():
    a = DispatchPlan([0, 1], [0, 0], [1, 0], [5, 2], 2, 1, 2)
    b = DispatchPlan([1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0], [2, 3, 2, 0], 2, 1, 2)
    assert a == b
    assert a != DispatchPlan([0, 1], [0, 0], [1, 0], [5, 3], 2, 1, 2)
    trusted = DispatchPlan.trusted(*(np.array(x, dtype=np.int64) for x in ([0, 1], [0, 0], [1, 0], [5, 2])), 2, 1, 2)
    assert trusted == a and not trusted.tokens_K.flags.writeable


def test_dispatch_plan_validation_names_the_problem():
    with pytest.raises(PlacementError, match=r"dest_K\[1\] = 7 is not in \[0, 2\)"):
        DispatchPlan([0, 0], [0, 0], [0, 7], [1, 1], 1, 1, 2)
    with pytest.raises(PlacementError, match="equal lengths"):
        DispatchPlan([0], [0, 0], [0, 0], [1, 1], 1, 1, 2)
    placement = InstancePlacement([[1, 0], [0, 1]])
    loads = np.array([[3, 1], [0, 2]])
    good = DispatchPlan.from_dense([[[3, 0], [0, 1]], [[0, 0], [0, 2]]])
    good.check(placement, loads)
    stray = DispatchPlan.from_dense([[[2, 1], [0, 1]], [[0, 0], [0, 2]]])
    with pytest.raises(PlacementError, match=r"1 tokens of expert 0 from source 0 go to device 1, which holds no instance"):
        stray.check(placement, loads)
    short = DispatchPlan.from_dense([[[3, 0], [0, 1]], [[0, 0], [0, 1]]])
    with pytest.raises(PlacementError, match="source 1 routes 2 tokens to expert 1 but the plan dispatches 1"):
        short.check(placement, loads)


# ---------------------------------------------------------------------------- LoadTracker


def test_load_tracker_worked_example():
    tracker = LoadTracker(num_layers=1, num_experts=3, window=2)
    assert tracker.predict().tolist() == [[1.0, 1.0, 1.0]]  # uniform before any observation
    tracker.observe([[4, 0, 2]])
    assert tracker.predict().tolist() == [[4.0, 0.0, 2.0]]
    tracker.observe([[0, 2, 2]])
    assert tracker.predict().tolist() == [[2.0, 1.0, 2.0]]
    tracker.observe([[6, 6, 6]])  # the first observation leaves the window
    assert tracker.predict().tolist() == [[3.0, 4.0, 4.0]]
    assert tracker.num_observed == 3


@FAST
@given(
    window=st.integers(1, 6),
    history=st.lists(st.lists(st.integers(0, 1000), min_size=4, max_size=4), min_size=0, max_size=12),
)
def test_load_tracker_is_mean_of_last_window(window, history):
    tracker = LoadTracker(num_layers=2, num_experts=2, window=window)
    for row in history:
        tracker.observe(np.array(row).reshape(2, 2))
    if history:
        expected = np.mean(np.array(history[-window:]).reshape(-1, 2, 2), axis=0)
    else:
        expected = np.ones((2, 2))
    assert np.allclose(tracker.predict(), expected)
    restored = LoadTracker(num_layers=2, num_experts=2, window=window)
    restored.load_state_dict(tracker.state_dict())
    assert np.allclose(restored.predict(), expected)
    assert restored.num_observed == len(history)


def test_load_tracker_window_one_mimics_previous_iteration_and_validates():
    tracker = LoadTracker(1, 2, window=1)
    tracker.observe([[5, 1]])
    tracker.observe([[2, 9]])
    assert tracker.predict().tolist() == [[2.0, 9.0]]
    with pytest.raises(PlacementError, match=r"shape \(2,\), expected \(1, 2\)|2 dimension"):
        tracker.observe([2, 9])
    with pytest.raises(PlacementError, match="non-negative"):
        tracker.observe([[-1, 0]])
    with pytest.raises(PlacementError, match="LoadTracker window must be an integer >= 1, got 0"):
        LoadTracker(1, 2, window=0)


def test_adaptive_load_tracker_worked_example():
    """Loads alternating between [1, 0] and [0, 1] (window 5, candidates 1, 2, 4, 5): the last
    iteration predicts the other one (misplacing every token), two or four average to [.5, .5]
    (half), five to [.6, .4] or [.4, .6]; 2 and 4 tie and the larger wins. A steady ramp is
    followed by the shortest window."""
    tracker = LoadTracker(1, 2, window=5, adaptive=True)
    assert tracker.candidate_windows() == [1, 2, 4, 5]
    assert tracker.misprediction().tolist() == [0.0]  # nothing to back-test yet
    for i in range(12):
        tracker.observe([[1 - i % 2, i % 2]])
    assert tracker.chosen_windows().tolist() == [4]
    assert tracker.misprediction() == pytest.approx([0.5])
    assert tracker.predict().tolist() == [[0.5, 0.5]]
    ramp = LoadTracker(1, 2, window=4, adaptive=True)
    for i in range(8):
        ramp.observe([[10 * i, 100 - 10 * i]])
    assert ramp.chosen_windows().tolist() == [1]
    assert ramp.predict().tolist() == [[70.0, 30.0]]
    fixed = LoadTracker(1, 2, window=5)
    for i in range(12):
        fixed.observe([[1 - i % 2, i % 2]])
    assert fixed.chosen_windows().tolist() == [5]
    assert fixed.misprediction() == pytest.approx([0.6])  # five alternating: 3 to 2 the wrong way


@FAST
@given(
    window=st.integers(1, 6),
    history=st.lists(st.lists(st.integers(0, 1000), min_size=4, max_size=4), min_size=0, max_size=14),
)
def test_adaptive_load_tracker_invariants(window, history):
    """Each layer predicts the mean of its chosen window's last iterations; window 1 is the plain
    mean; the misprediction is a share; a checkpoint round trip predicts the same."""
    adaptive = LoadTracker(num_layers=2, num_experts=2, window=window, adaptive=True)
    plain = LoadTracker(num_layers=2, num_experts=2, window=window)
    for row in history:
        adaptive.observe(np.array(row).reshape(2, 2))
        plain.observe(np.array(row).reshape(2, 2))
    chosen = adaptive.chosen_windows()
    assert set(chosen.tolist()) <= set(adaptive.candidate_windows())
    if history:
        loads = np.array(history).reshape(-1, 2, 2)
        expected = np.stack([loads[-w:, l].mean(axis=0) for l, w in enumerate(chosen.tolist())])
        assert np.allclose(adaptive.predict(), expected)
        assert np.allclose(plain.predict(), loads[-window:].mean(axis=0))  # 2 x window kept, window used
    if window == 1:
        assert np.allclose(adaptive.predict(), plain.predict())
    assert np.all((adaptive.misprediction() >= 0) & (adaptive.misprediction() <= 1 + 1e-12))
    restored = LoadTracker(num_layers=2, num_experts=2, window=window, adaptive=True)
    restored.load_state_dict(adaptive.state_dict())
    assert np.allclose(restored.predict(), adaptive.predict())
    assert np.allclose(restored.misprediction(), adaptive.misprediction())
