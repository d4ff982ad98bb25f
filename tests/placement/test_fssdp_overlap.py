"""FSSDP's t by cost (`fssdp.choose_overlap_degree`) and the cost model terms it prices: the
per-instance expert time and the reduce hidden by the MoE backward."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.placement import (
    FSSDPCostModel,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    Topology,
    calibrate,
)
from megatron_patches.placement.fssdp import (
    choose_overlap_degree,
    overlap_candidates,
    overlap_prices,
)

MS = 1e-3


def test_candidates_are_ep_the_powers_of_two_and_the_hidden_t():
    assert overlap_candidates(3, 16) == [0, 1, 2, 3, 4, 8, 16]
    assert overlap_candidates(0, 4) == [0, 1, 2, 4]
    assert overlap_candidates(4, 4) == [0, 1, 2, 4]
    assert overlap_candidates(9, 6) == [0, 1, 2, 4, 6]  # clamped to E


def two_devices(seconds_per_instance: float = 0.0) -> FSSDPCostModel:
    # 1 us per token copy, 1 ms per copy gathered (1 MB at 1 GB/s), no reduce priced
    return FSSDPCostModel(seconds_per_token=1e-6, expert_bytes=1e6, seconds_per_instance=seconds_per_instance)


def choose(cost: FSSDPCostModel, t_non_moe_s: float, hidden_t: int = 0):
    """One node of 2 devices, expert 0 on device 0 with 1500 tokens, expert 1 on device 1 with 500.
    t = 0: device 0 computes 1500 tokens + 1 instance. t = 1 (expert 0 on both): the split
    1000 / 500 + 500 puts 2 instances on device 1 and gathers one copy (1 ms)."""
    topo = Topology(1, 2, 1e9, 1e9)
    shards = [ShardLayout([0, 1], 2)]
    sources_LDE = np.array([[[750, 250], [750, 250]]])
    candidates = overlap_candidates(hidden_t, 2)
    return choose_overlap_degree(candidates, overlap_prices(shards, sources_LDE, candidates, 2, topo, cost, t_non_moe_s),
                                 hidden_t)


def test_a_copy_past_the_hidden_budget_is_taken_when_it_saves_more_than_its_exposed_gather():
    """Hidden t = 0 (DESIGN 4.2: nothing hides a gather). t = 1 costs 1 ms of compute + the
    gather's 1 ms beyond 0.5 ms of attention = 1.5 ms; t = 0 costs 1.5 ms of compute: a tie,
    which goes to the smaller t. With 0.8 ms of attention t = 1 costs 1.2 ms and is taken."""
    assert choose(two_devices(), t_non_moe_s=0.5 * MS).t == 0
    choice = choose(two_devices(), t_non_moe_s=0.8 * MS)
    assert choice.t == 1 and choice.hidden_t == 0
    np.testing.assert_allclose(choice.prices_T4.sum(axis=1), [1.5 * MS, 1.2 * MS, 1.2 * MS])
    np.testing.assert_allclose(choice.prices_T4[1], [1.0 * MS, 0.0, 0.2 * MS, 0.0])
    assert "t=1: 1.20 ms" in choice.table() and "<-" in choice.table().split(";")[1]


def test_the_per_instance_time_keeps_copies_that_split_small_batches_away():
    """The same layer with the gather hidden (1 ms of attention): t = 1 costs 1 + 2 s (device 1
    runs 2 instances), t = 0 costs 1.5 + s, so the copy pays only while s < 0.5 ms, even where
    the hidden t would take it."""
    assert choose(two_devices(0.4 * MS), t_non_moe_s=1 * MS, hidden_t=1).t == 1
    choice = choose(two_devices(0.6 * MS), t_non_moe_s=1 * MS, hidden_t=1)
    assert choice.t == 0 and choice.hidden_t == 1
    np.testing.assert_allclose(choice.prices_T4[:2, 0], [2.1 * MS, 2.2 * MS])


def test_layer_seconds_counts_instances_with_tokens_only():
    topo = Topology(1, 2, 1e9, 1e9)
    cost = FSSDPCostModel(seconds_per_token=1e-6, expert_bytes=1.0, seconds_per_instance=1 * MS)
    holds_ED = ShardLayout([0, 0, 1, 1], 2).holds_ED()
    # device 0: 20 tokens in 2 instances; device 1's experts get none
    assert cost.layer_seconds(holds_ED, np.array([10, 10, 0, 0]), None, topo) == (pytest.approx(2.02 * MS), 0.0)
    # the same through a dispatch plan (per-source loads and an all-to-all price)
    priced = FSSDPCostModel(seconds_per_token=1e-6, expert_bytes=1.0, seconds_per_instance=1 * MS,
                             dispatch_seconds=lambda plan: 5 * MS)
    compute, a2a = priced.layer_seconds(holds_ED, np.array([10, 10, 0, 0]), np.array([[5, 5, 0, 0], [5, 5, 0, 0]]), topo)
    assert (compute, a2a) == (pytest.approx(2.02 * MS), 5 * MS)


def test_the_reduce_hides_behind_attention_and_the_moe_backward():
    """spRS(l) runs from layer l's MoE backward to layer l-1's: the attention backward and 2/3 of
    the expert compute hide it (the backward's all-to-alls move over the same links: none)."""
    cost = FSSDPCostModel(seconds_per_token=1e-6, expert_bytes=1.0, reduce_ratio=2.0, reduce_hidden_s=1 * MS)
    # gather 3 ms, 1 ms hidden: 2 ms; reduce 6 ms against 1 + 2 ms: 3 ms
    assert cost.exposed_seconds(3 * MS, 1 * MS, 3 * MS) == pytest.approx(5 * MS)
    assert cost.exposed_reduce_seconds(3 * MS, 3 * MS) == pytest.approx(3 * MS)
    # gather 1 ms, all hidden; reduce 2 ms against 1 + 2 ms: none
    assert cost.exposed_seconds(1 * MS, 1 * MS, 3 * MS) == 0.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), nodes=st.sampled_from([1, 2]), per_node=st.sampled_from([2, 4]),
       experts_per=st.sampled_from([1, 2]), t_non_moe=st.floats(0, 5e-3), instance=st.floats(0, 1e-3))
def test_the_choice_is_the_cheapest_candidate_and_prices_are_sums_of_layers(seed, nodes, per_node, experts_per,
                                                                            t_non_moe, instance):
    rng = np.random.default_rng(seed)
    D = nodes * per_node
    E = D * experts_per
    topo = Topology(nodes, per_node, 50e9, 5e9)
    cost = FSSDPCostModel(seconds_per_token=2e-6, expert_bytes=4e6, seconds_per_instance=instance, reduce_ratio=2.0,
                           reduce_hidden_s=1e-3, dispatch_seconds=lambda plan: 1e-9 * plan.tokens_K.sum())
    shards = [ShardLayout(np.repeat(np.arange(D), experts_per), D) for _ in range(2)]
    sources_LDE = rng.poisson(rng.zipf(1.5, size=(2, 1, E)).clip(max=200) * 20, size=(2, D, E))
    hidden_t = int(rng.integers(0, E + 1))
    candidates = overlap_candidates(hidden_t, E)
    prices = overlap_prices(shards, sources_LDE, candidates, E, topo, cost, t_non_moe)
    choice = choose_overlap_degree(candidates, prices, hidden_t)
    total = prices.sum(axis=1)
    assert choice.t in candidates and hidden_t in candidates
    assert total[candidates.index(choice.t)] == total.min()
    assert all(t >= choice.t for t, p in zip(candidates, total) if p == total.min())  # ties: the smaller t
    assert np.all(prices >= 0)
    # t = 0 is EP: no gather, no reduce
    assert prices[0, 2] == prices[0, 3] == 0.0
    # layer by layer
    one = [overlap_prices(shards[k:k + 1], sources_LDE[k:k + 1], candidates, E, topo, cost, t_non_moe) for k in range(2)]
    np.testing.assert_allclose(prices, one[0] + one[1])


def test_choose_rejects_prices_of_the_wrong_shape():
    with pytest.raises(PlacementError, match=r"shape \(3, 4\)"):
        choose_overlap_degree([0, 1, 2], np.zeros((2, 4)), 0)


def test_calibration_counts_the_instances_a_copy_adds():
    """Expert 0 (100 tokens) on device 0, expert 1 (50) on device 1: a copy of expert 0 on device 1
    evens the tokens (75 each, 25 us saved) but gives device 1 a second instance of 1 ms:
    calibration keeps the placement as it is (and takes the copy when instances cost nothing)."""
    topo = Topology(1, 2, 1e12, 1e12)
    shard = ShardLayout([0, 1], 2)
    current = InstancePlacement.from_shard(shard)
    cheap = FSSDPCostModel(seconds_per_token=1e-6, expert_bytes=1.0)
    costly = FSSDPCostModel(seconds_per_token=1e-6, expert_bytes=1.0, seconds_per_instance=1 * MS)
    assert calibrate(current, shard, [100, 50], 1, topo, cheap)[1]
    assert not calibrate(current, shard, [100, 50], 1, topo, costly)[1]


def test_with_calibration_each_t_is_priced_with_the_copies_calibration_adds():
    """The two-device layer at 10 us per token: t = 0 alone costs 15 ms of compute; calibration
    would add expert 0's copy after the gate (10 ms + its 1 ms gather on the path), so with
    `calibrated` t = 0 costs 11 ms. Before the gate the same copy is 0.2 ms exposed (0.8 ms of
    attention): t = 1 costs 10.2 ms and is still the choice."""
    topo = Topology(1, 2, 1e9, 1e9)
    shards = [ShardLayout([0, 1], 2)]
    sources_LDE = np.array([[[750, 250], [750, 250]]])
    cost = FSSDPCostModel(seconds_per_token=1e-5, expert_bytes=1e6)
    candidates = overlap_candidates(0, 2)
    plain = overlap_prices(shards, sources_LDE, candidates, 2, topo, cost, 0.8 * MS)
    calibrated = overlap_prices(shards, sources_LDE, candidates, 2, topo, cost, 0.8 * MS, calibrated=True)
    np.testing.assert_allclose(plain[0], [15 * MS, 0, 0, 0])
    np.testing.assert_allclose(calibrated[0], [10 * MS, 0, 1 * MS, 0])
    np.testing.assert_allclose(calibrated[1], [10 * MS, 0, 0.2 * MS, 0])  # nothing left for calibration
    assert choose_overlap_degree(candidates, calibrated, 0).t == 1
