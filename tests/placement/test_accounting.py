"""Tests of accounting (DESIGN 3, 5): metrics and byte formulas against brute-force counting."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.placement import (
    CommBytes,
    DispatchPlan,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    Topology,
    allreduce_equivalent_bytes,
    apply_capacity,
    device_loads,
    dispatch,
    dispatch_bytes,
    extra_memory_bytes,
    imbalance,
    materialize,
    rearrangement_bytes,
    sparse_all_gather_bytes,
    sparse_reduce_scatter_bytes,
    survival,
)

FAST = settings(max_examples=80, deadline=None)


@st.composite
def placement_cases(draw):
    """A topology, a shard layout and a placement containing it (random extra copies)."""
    topo = Topology(draw(st.integers(1, 3)), draw(st.integers(1, 4)), 100.0, 10.0)
    D = topo.num_devices
    E = draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shard = ShardLayout(rng.integers(0, D, size=E), D)
    copies = rng.random((E, D)) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    placement = InstancePlacement(shard.holds_ED() | copies)
    chunk = draw(st.sampled_from(["scalar", "per-expert"]))
    chunk_bytes = 1000 if chunk == "scalar" else rng.integers(1, 5000, size=E)
    return topo, shard, placement, chunk_bytes


def brute_force_bytes(transfers, topo):
    """transfers: list of (src, dst, bytes). Counts per device and link class in plain loops."""
    D = topo.num_devices
    out = {k: [0] * D for k in ("sent_intra", "sent_inter", "recv_intra", "recv_inter")}
    for src, dst, nbytes in transfers:
        if src == dst:
            continue
        kind = "intra" if topo.node_of[src] == topo.node_of[dst] else "inter"
        out["sent_" + kind][src] += nbytes
        out["recv_" + kind][dst] += nbytes
    return out


def assert_bytes_equal(comm: CommBytes, expected):
    assert comm.sent_intra_D.tolist() == expected["sent_intra"]
    assert comm.sent_inter_D.tolist() == expected["sent_inter"]
    assert comm.recv_intra_D.tolist() == expected["recv_intra"]
    assert comm.recv_inter_D.tolist() == expected["recv_inter"]


# ---------------------------------------------------------------------------- loads, imbalance, survival


def test_imbalance_and_survival_definitions():
    assert imbalance([4, 4, 4]) == 1.0
    assert imbalance([6, 0, 0]) == 3.0
    assert imbalance([3, 1]) == 1.5
    assert imbalance([0, 0, 0]) == 1.0  # no tokens: balanced by definition
    with pytest.raises(PlacementError, match="finite and >= 0"):
        imbalance([1, -1])
    assert survival(75, 100) == 0.75
    assert survival(0, 0) == 1.0
    with pytest.raises(PlacementError, match="processed <= routed"):
        survival(5, 3)


def test_device_loads_and_capacity_worked_example():
    # 2 devices; expert 0 on both, expert 1 on device 1 with two instances
    placement = InstancePlacement([[1, 1], [0, 2]])
    plan = DispatchPlan.from_dense([[[5, 1], [0, 4]], [[0, 3], [0, 2]]])
    assert device_loads(plan).tolist() == [5, 10]
    processed, dropped = apply_capacity(plan, placement, capacity=3)
    # expert 0: device 0 gets 5 (cap 3), device 1 gets 4 (cap 3); expert 1: 6 on device 1 (cap 6)
    assert processed.tolist() == [[3, 3], [0, 6]]
    assert dropped.tolist() == [3, 0]


# ---------------------------------------------------------------------------- sparse collectives


def test_sparse_collective_bytes_worked_example():
    # 2 nodes x 2 devices; expert 0 owned by device 0 and copied to 1 (intra) and 2 (inter);
    # expert 1 owned by device 3, no copies. 10 bytes per chunk.
    topo = Topology(2, 2, 100.0, 10.0)
    shard = ShardLayout([0, 3], 4)
    placement = InstancePlacement([[1, 1, 1, 0], [0, 0, 0, 1]])
    gather = sparse_all_gather_bytes(shard, placement, 10, topo)
    assert gather.sent_intra_D.tolist() == [10, 0, 0, 0]
    assert gather.sent_inter_D.tolist() == [10, 0, 0, 0]
    assert gather.recv_intra_D.tolist() == [0, 10, 0, 0]
    assert gather.recv_inter_D.tolist() == [0, 0, 10, 0]
    reduce = sparse_reduce_scatter_bytes(placement, shard, 10, topo)
    assert reduce.recv_D.tolist() == [20, 0, 0, 0] and reduce.sent_D.tolist() == [0, 10, 10, 0]
    # r_0 = 3, r_1 = 1: 2 * (3 - 1) * 10 = 40 = spAG + spRS
    assert allreduce_equivalent_bytes(placement, 10) == 40 == gather.total + reduce.total
    assert (gather.intra, gather.inter) == (10, 10)


@FAST
@given(case=placement_cases())
def test_sparse_collective_bytes_match_per_chunk_counting(case):
    topo, shard, placement, chunk_bytes = case
    size = np.broadcast_to(chunk_bytes, (shard.num_experts,))
    gather_transfers = []
    for e in range(shard.num_experts):  # chunk by chunk: owner -> every other holder
        for d in range(topo.num_devices):
            if placement.counts_ED[e, d] > 0 and d != shard.owner_E[e]:
                gather_transfers.append((int(shard.owner_E[e]), d, int(size[e])))
    gather = sparse_all_gather_bytes(shard, placement, chunk_bytes, topo)
    assert_bytes_equal(gather, brute_force_bytes(gather_transfers, topo))
    reduce = sparse_reduce_scatter_bytes(placement, shard, chunk_bytes, topo)
    assert_bytes_equal(reduce, brute_force_bytes([(d, s, b) for s, d, b in gather_transfers], topo))
    assert gather.total + reduce.total == allreduce_equivalent_bytes(placement, chunk_bytes)
    assert gather.sent_D.sum() == gather.recv_D.sum()


def test_sparse_all_gather_requires_placement_to_contain_shard():
    topo = Topology(1, 2, 1.0, 1.0)
    with pytest.raises(PlacementError, match="expert 0 is not held by its owner device 1"):
        sparse_all_gather_bytes(ShardLayout([1], 2), InstancePlacement([[1, 0]]), 10, topo)


# ---------------------------------------------------------------------------- dispatch bytes, memory


@FAST
@given(case=placement_cases(), seed=st.integers(0, 2**32 - 1))
def test_dispatch_bytes_match_per_token_counting(case, seed):
    topo, shard, placement, _ = case
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 20, size=(topo.num_devices, shard.num_experts))
    plan = dispatch(placement, loads, topo)
    dense = plan.to_dense()
    transfers = [
        (s, d, 6 * int(dense[s, e, d]))
        for s in range(topo.num_devices)
        for e in range(shard.num_experts)
        for d in range(topo.num_devices)
    ]
    comm = dispatch_bytes(plan, topo, bytes_per_token=6)
    assert_bytes_equal(comm, brute_force_bytes(transfers, topo))
    combine = comm.reversed()
    assert combine.recv_D.tolist() == comm.sent_D.tolist()
    assert (comm + combine).total == 2 * comm.total


def test_dispatch_bytes_of_node_local_plan_are_intra_only():
    topo = Topology(2, 2, 100.0, 10.0)
    shard = ShardLayout.even(4, 4)
    placement = materialize(shard, [10, 10, 10, 10], 4, 4, topo)  # everything everywhere
    comm = dispatch_bytes(dispatch(placement, np.full((4, 4), 7), topo), topo, 2.0)
    assert comm.total == 0  # all tokens stay on their device


@FAST
@given(case=placement_cases())
def test_extra_memory_matches_counting(case):
    topo, shard, placement, chunk_bytes = case
    size = np.broadcast_to(chunk_bytes, (shard.num_experts,))
    expected = [0] * topo.num_devices
    for e in range(shard.num_experts):
        for d in range(topo.num_devices):
            if placement.counts_ED[e, d] > 0 and d != shard.owner_E[e]:
                expected[d] += int(size[e])
    assert extra_memory_bytes(placement, shard, chunk_bytes).tolist() == expected


@FAST
@given(L=st.integers(1, 3), E=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_rearrangement_bytes_match_counting(L, E, seed):
    topo = Topology(2, 2, 100.0, 10.0)
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 4, size=(L, E))
    new = np.where(rng.random((L, E)) < 0.5, old, rng.integers(0, 4, size=(L, E)))
    transfers = [(int(old[l, e]), int(new[l, e]), 16) for l in range(L) for e in range(E)]
    assert_bytes_equal(rearrangement_bytes(old, new, 16, topo), brute_force_bytes(transfers, topo))
    assert rearrangement_bytes(old, old, 16, topo).total == 0
    with pytest.raises(PlacementError, match="names device 4"):
        rearrangement_bytes(old, np.full_like(old, 4), 16, topo)
