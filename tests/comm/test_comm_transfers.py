"""Tests of the pure parts of comm/: transfer plans, traffic counters, the CPU stream path.

The plans are checked without torch.distributed: every rank's plan is computed, the
messages are exchanged in numpy, and the result must be the gathered chunks / the summed
copies; the plans' bytes must equal placement.accounting's formulas.
"""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.comm import (
    CommStream,
    LinkBytes,
    Ownership,
    TrafficCounter,
    comm_stream,
    default_counter,
    plan_rank_transfers,
)
from megatron_patches.comm.transfers import _check_postconditions, plan_relay_transfers
from megatron_patches.placement.collectives import copy_sources
from megatron_patches.placement import (
    ElementShardLayout,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    Topology,
    allreduce_equivalent_bytes,
    sparse_all_gather_bytes,
    sparse_reduce_scatter_bytes,
)

FAST = settings(max_examples=60, deadline=None)
OWNER_LACKS_COPY = "chunk 1 is owned by device 1 in P0 but P1 holds no copy of it on device 1;"


@st.composite
def plan_cases(draw):
    """(topology, P0 layout, P1, N): whole-chunk or element-granular P0, random P1 ⊇ P0."""
    topo = Topology(draw(st.integers(1, 3)), draw(st.integers(1, 3)), 100.0, 10.0)
    D = topo.num_devices
    E = draw(st.integers(1, 8))
    N = draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shard = ShardLayout(rng.integers(0, D, size=E), D)
    p = draw(st.sampled_from([0.0, 0.3, 1.0]))
    counts = shard.holds_ED() + (rng.random((E, D)) < p) * rng.integers(1, 3, size=(E, D))
    kind = draw(st.sampled_from(["shard", "partition", "element"]))
    owners = {"shard": shard, "partition": InstancePlacement.from_shard(shard), "element": ElementShardLayout(N, D)}
    if kind == "element":  # slices need not be instances: any placement with >= 1 instance per chunk
        counts = (rng.random((E, D)) < max(p, 0.2)) * rng.integers(1, 3, size=(E, D))
        counts[np.arange(E), rng.integers(0, D, size=E)] += 1
    return topo, owners[kind], InstancePlacement(counts), N


def all_plans(owners, placement, N):
    own = Ownership.of(owners, placement.num_experts, N)
    return own, [plan_rank_transfers(own, placement, r) for r in range(placement.num_devices)]


def exchange_gather(plans, W_CN):
    """Run the gather in numpy from the plans; returns every rank's held buffer."""
    sent = {}
    for plan in plans:
        owned = W_CN[plan.owned_chunks, plan.start : plan.stop]
        for peer in plan.peers:
            if peer.owned_rows.size:
                sent[plan.rank, peer.peer] = owned[peer.owned_rows].ravel()
    held_all = []
    for plan in plans:
        held = np.full(plan.held_shape, np.nan)
        owned = W_CN[plan.owned_chunks, plan.start : plan.stop]
        held[plan.local_held_rows, plan.start : plan.stop] = owned[plan.local_owned_rows]
        for peer in plan.peers:
            if peer.held_rows.size:
                message = sent.pop((peer.peer, plan.rank))
                held[peer.held_rows, peer.peer_start : peer.peer_stop] = message.reshape(peer.held_rows.size, -1)
        held_all.append(held)
    assert not sent, f"messages nobody received: {sorted(sent)}"
    return held_all


def exchange_reduce(plans, grads):
    """Run the reduce in numpy: grads[r] is rank r's held buffer; returns owned sums per rank."""
    sent = {}
    for plan, held in zip(plans, grads):
        for peer in plan.peers:
            if peer.held_rows.size:
                sent[plan.rank, peer.peer] = held[peer.held_rows, peer.peer_start : peer.peer_stop].ravel()
    out_all = []
    for plan, held in zip(plans, grads):
        out = np.zeros(plan.owned_shape)
        parts = [(plan.rank, plan.local_owned_rows, held[plan.local_held_rows, plan.start : plan.stop])]
        for peer in plan.peers:
            if peer.owned_rows.size:
                message = sent.pop((peer.peer, plan.rank))
                parts.append((peer.peer, peer.owned_rows, message.reshape(peer.owned_rows.size, -1)))
        for _, rows, values in sorted(parts, key=lambda part: part[0]):
            np.add.at(out, rows, values)
        out_all.append(out)
    assert not sent, f"messages nobody received: {sorted(sent)}"
    return out_all


@FAST
@given(plan_cases())
def test_plans_gather_every_held_chunk_and_reduce_every_copy(case):
    topo, owners, placement, N = case
    own, plans = all_plans(owners, placement, N)
    E = placement.num_experts
    rng = np.random.default_rng(0)
    W_CN = rng.standard_normal((E, N))
    for plan, held in zip(plans, exchange_gather(plans, W_CN)):
        np.testing.assert_array_equal(held, W_CN[plan.held_chunks])
        np.testing.assert_array_equal(plan.held_chunks, np.flatnonzero(placement.holds_ED()[:, plan.rank]))
    grads = [rng.standard_normal(plan.held_shape) for plan in plans]
    dense_sum_CN = np.zeros((E, N))
    for plan, held in zip(plans, grads):
        dense_sum_CN[plan.held_chunks] += held
    for plan, out in zip(plans, exchange_reduce(plans, grads)):
        np.testing.assert_allclose(out, dense_sum_CN[plan.owned_chunks, plan.start : plan.stop], rtol=1e-12, atol=1e-12)


def link_rows(comm):
    """A CommBytes as rows [sent_intra_D, sent_inter_D, recv_intra_D, recv_inter_D]."""
    return [comm.sent_intra_D, comm.sent_inter_D, comm.recv_intra_D, comm.recv_inter_D]


def plan_bytes(plans, topo, element_size):
    """Per-device [sent_intra, sent_inter, recv_intra, recv_inter] of the gather, via TrafficCounter."""
    rows = []
    for plan in plans:
        counter = TrafficCounter()
        peer_P, send_P, recv_P = plan.gather_numel()
        counter.record("spag", plan.rank, topo, peer_P, send_P * element_size, recv_P * element_size)
        rows.append(list(counter.get("spag").as_dict().values()))
    return np.array(rows, dtype=np.int64).T


@FAST
@given(plan_cases())
def test_plan_bytes_equal_accounting_formulas(case):
    topo, owners, placement, N = case
    _, plans = all_plans(owners, placement, N)
    got = plan_bytes(plans, topo, 4)
    if isinstance(owners, ElementShardLayout):
        # Brute force: every holder d of c receives every other rank's slice of c.
        expected = np.zeros_like(got)
        size_D = owners.sizes_D() * 4
        for c, d in zip(*np.nonzero(placement.holds_ED())):
            for r in range(topo.num_devices):
                if r != d:
                    k = 0 if topo.same_node(r, d) else 1
                    expected[k, r] += size_D[r]
                    expected[2 + k, d] += size_D[r]
        np.testing.assert_array_equal(got, expected)
        return
    if isinstance(owners, InstancePlacement):
        owners = ShardLayout(np.argmax(owners.counts_ED, axis=1), topo.num_devices)
    gather = sparse_all_gather_bytes(owners, placement, N * 4, topo)
    np.testing.assert_array_equal(got, link_rows(gather))
    reduce = sparse_reduce_scatter_bytes(placement, owners, N * 4, topo)
    np.testing.assert_array_equal(got, link_rows(reduce.reversed()))
    # spAG + spRS together move the AllReduce-equivalent volume (DESIGN 3).
    assert 2 * int(got[:2].sum()) == allreduce_equivalent_bytes(placement, N * 4)


def test_worked_example_whole_chunks():
    # 3 chunks on 2 devices: device 0 owns chunk 0, device 1 owns chunks 1 and 2.
    # P1 adds a copy of chunk 0 on device 1 and of chunk 2 on device 0.
    shard = ShardLayout([0, 1, 1], 2)
    placement = InstancePlacement([[1, 1], [0, 1], [1, 1]])
    _, (p0, p1) = all_plans(shard, placement, 4)
    assert p0.owned_chunks.tolist() == [0] and p0.held_chunks.tolist() == [0, 2]
    assert p1.owned_chunks.tolist() == [1, 2] and p1.held_chunks.tolist() == [0, 1, 2]
    assert (p0.owned_shape, p0.held_shape, p1.owned_shape, p1.held_shape) == ((1, 4), (2, 4), (2, 4), (3, 4))
    (to1,), (to0,) = p0.peers, p1.peers
    # Device 0 sends chunk 0 (its owned row 0) and receives chunk 2 (its held row 1).
    assert to1.peer == 1 and to1.owned_rows.tolist() == [0] and to1.held_rows.tolist() == [1]
    # Device 1 sends chunk 2 (its owned row 1) and receives chunk 0 (its held row 0).
    assert to0.peer == 0 and to0.owned_rows.tolist() == [1] and to0.held_rows.tolist() == [0]
    assert p0.local_owned_rows.tolist() == [0] and p0.local_held_rows.tolist() == [0]
    assert p1.local_owned_rows.tolist() == [0, 1] and p1.local_held_rows.tolist() == [1, 2]
    assert [a.tolist() for a in p0.gather_numel()] == [[1], [4], [4]]


def test_worked_example_element_slices():
    # 5 elements over 2 ranks: rank 0 owns columns [0, 3), rank 1 owns [3, 5) of both chunks.
    # Chunk 0 is held by both ranks (twice on rank 1), chunk 1 only by rank 1.
    placement = InstancePlacement([[1, 2], [0, 1]])
    _, (p0, p1) = all_plans(ElementShardLayout(5, 2), placement, 5)
    assert (p0.start, p0.stop, p1.start, p1.stop) == (0, 3, 3, 5)
    assert p0.owned_shape == (2, 3) and p1.owned_shape == (2, 2)
    assert p0.held_chunks.tolist() == [0] and p1.held_chunks.tolist() == [0, 1]
    (to1,), (to0,) = p0.peers, p1.peers
    assert to1.owned_rows.tolist() == [0, 1] and to1.held_rows.tolist() == [0]  # rank 1 holds both chunks
    assert (to1.peer_start, to1.peer_stop) == (3, 5)
    assert to0.owned_rows.tolist() == [0] and to0.held_rows.tolist() == [0, 1]
    assert [a.tolist() for a in p0.gather_numel()] == [[1], [6], [2]]
    assert [a.tolist() for a in p1.gather_numel()] == [[0], [2], [6]]
    # Fewer elements than ranks: rank 2 owns an empty slice and takes part in no message.
    _, plans = all_plans(ElementShardLayout(2, 3), InstancePlacement([[1, 1, 1]]), 2)
    assert plans[2].owned_shape == (1, 0)
    assert all(peer.peer != 2 for plan in plans for peer in plan.peers if peer.held_rows.size)
    assert not any(peer.owned_rows.size for peer in plans[2].peers)


def test_errors_name_the_chunk_and_device():
    shard = ShardLayout([0, 1, 1], 2)
    with pytest.raises(PlacementError, match=OWNER_LACKS_COPY):
        plan_rank_transfers(Ownership.of(shard, 3, 4), InstancePlacement([[1, 0], [1, 0], [0, 1]]), 0)
    with pytest.raises(PlacementError, match=r"chunk 1 is on devices \[0, 1\] in P0; P0 must assign every chunk"):
        Ownership.of(InstancePlacement([[1, 0], [1, 1], [0, 1]]), 3, 4)
    with pytest.raises(PlacementError, match="chunk 2 has 2 instances on device 1 in P0"):
        Ownership.of(InstancePlacement([[1, 0], [0, 1], [0, 2]]), 3, 4)
    with pytest.raises(PlacementError, match="P0 covers 3 chunks but the buffer has 4"):
        Ownership.of(shard, 4, 4)
    with pytest.raises(PlacementError, match="slices chunks of 6 elements but the chunks have 4"):
        Ownership.of(ElementShardLayout(6, 2), 3, 4)
    with pytest.raises(PlacementError, match="P0 must be a ShardLayout.*got ndarray"):
        Ownership.of(np.array([0, 1, 1]), 3, 4)
    with pytest.raises(PlacementError, match="chunk_numel must be an integer >= 1"):
        Ownership.of(shard, 3, 0)
    with pytest.raises(PlacementError, match="P1 has 3 chunks x 3 devices but P0 has 3 chunks x 2 devices"):
        plan_rank_transfers(Ownership.of(shard, 3, 4), InstancePlacement(np.ones((3, 3))), 0)
    with pytest.raises(PlacementError, match=r"rank 2 is not a device of the placement, which has devices \[0, 2\)"):
        plan_rank_transfers(Ownership.of(shard, 3, 4), InstancePlacement.from_shard(shard), 2)


def test_postcondition_guard_rejects_a_plan_that_misses_a_message():
    shard = ShardLayout([0, 1, 1], 2)
    placement = InstancePlacement([[1, 1], [0, 1], [1, 1]])
    plan = plan_rank_transfers(Ownership.of(shard, 3, 4), placement, 0)
    _check_postconditions(plan, placement)
    with pytest.raises(RuntimeError, match="chunk 2 on device 0 would get 0 of 4 elements"):
        _check_postconditions(dataclasses.replace(plan, peers=()), placement)
    # Device 0 holds only its own chunk 0 (gather complete without peers), but device 1 holds a
    # copy too: without the peer, the reduce would miss that copy.
    copy_on_1 = InstancePlacement([[2, 1], [0, 1], [0, 1]])
    plan = plan_rank_transfers(Ownership.of(shard, 3, 4), copy_on_1, 0)
    with pytest.raises(RuntimeError, match="device 0 would sum 1 copies of chunk 0, which has 2"):
        _check_postconditions(dataclasses.replace(plan, peers=()), copy_on_1)


def test_traffic_counter_splits_links_and_kinds():
    topo = Topology(nodes=2, devices_per_node=2, intra_node_bw=1.0, inter_node_bw=1.0)
    counter = TrafficCounter()
    # Rank 1 (node 0) exchanges with rank 0 (node 0) and rank 3 (node 1).
    counter.record("spag", 1, topo, [0, 3], [10, 20], [1, 2])
    counter.record("spag", 1, topo, [3], [5], [0])
    counter.record("sprs", 1, topo, [0], [0], [7])
    assert counter.get("spag") == LinkBytes(sent_intra=10, sent_inter=25, recv_intra=1, recv_inter=2)
    assert counter.get("spag").sent == 35 and counter.get("spag").received == 3
    assert counter.snapshot() == {
        "spag": {"sent_intra": 10, "sent_inter": 25, "recv_intra": 1, "recv_inter": 2},
        "sprs": {"sent_intra": 0, "sent_inter": 0, "recv_intra": 7, "recv_inter": 0},
    }
    counter.get("spag").sent_intra += 99  # a copy: the counter is unchanged
    assert counter.get("spag").sent_intra == 10
    counter.reset()
    assert counter.snapshot() == {} and counter.get("spag") == LinkBytes()
    assert isinstance(default_counter(), TrafficCounter) and default_counter() is default_counter()


def test_cpu_stream_is_a_no_op_and_shared_per_device():
    stream = comm_stream(torch.device("cpu"))
    assert isinstance(stream, CommStream) and stream.cuda_stream is None
    assert comm_stream("cpu") is stream
    x = torch.zeros(3)
    with stream.launch(x):
        x += 1
    with stream.finish():
        x += 1
    assert x.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (2, 4), (4, 2)])
def test_relay_plans_agree_pairwise_and_relay_only_what_arrived(nodes, per_node):
    """Node-aware plans: what rank r sends p in a stage is, chunk for chunk and in order, what p
    expects from r in that stage; a relay's stage-2 rows are chunks it got from the owner in stage 1;
    every rank joins the same ring broadcasts, and their recorded numel is D - 1 copies each."""
    rng = np.random.default_rng(nodes + per_node)
    D = nodes * per_node
    topology = Topology(nodes, per_node, 1e11, 1e10)
    rings = 0
    for _ in range(20):
        E = int(rng.integers(1, 3 * D))
        owner_E = rng.integers(0, D, E)
        hot = rng.random(E) < 0.3  # experts everywhere, owned by one device: ring broadcasts
        owner_E[hot] = rng.integers(0, D)
        counts = (rng.random((E, D)) < 0.6).astype(np.int64)
        counts[np.arange(E), owner_E] = 1
        counts[hot] = 1
        shard, placement = ShardLayout(owner_E, D), InstancePlacement(counts)
        sources = copy_sources(shard, placement, topology, "hierarchical")
        plans = [plan_relay_transfers(shard, placement, sources, 7, r) for r in range(D)]
        rings += bool(sources.ring_E.any())
        for r, plan in enumerate(plans):
            # every rank joins the same broadcasts in the same order, rooted at the owners
            assert np.array_equal(plan.ring_chunks, np.flatnonzero(sources.ring_E))
            assert np.array_equal(plan.ring_roots, owner_E[plan.ring_chunks])
            assert np.array_equal(plan.held_chunks[plan.ring_held_rows], plan.ring_chunks)
            mine = plan.ring_owned_rows >= 0
            assert np.array_equal(plan.owned_chunks[plan.ring_owned_rows[mine]], plan.ring_chunks[plan.ring_roots == r])
        # the ring's recorded numel: D - 1 copies of each ring chunk, sent as received
        ring_numel = [plan.gather_numel() for plan in plans]
        stage_numel = sum(7 * m.send_rows.size for plan in plans for stage in plan.stages for m in stage)
        sent = sum(int(send.sum()) for _, send, _ in ring_numel)
        assert sent == sum(int(recv.sum()) for _, _, recv in ring_numel)
        assert sent - stage_numel == 7 * (D - 1) * int(sources.ring_E.sum())
        for stage in range(2):
            for r, plan in enumerate(plans):
                for message in plan.stages[stage]:
                    rows = plan.owned_chunks if stage == 0 else plan.held_chunks
                    sent = rows[message.send_rows]
                    back = next((m for m in plans[message.peer].stages[stage] if m.peer == r), None)
                    received = plans[message.peer].held_chunks[back.recv_rows] if back else np.array([], np.int64)
                    assert np.array_equal(sent, received)
                    if stage == 1:
                        got_first = {int(c) for m in plan.stages[0] for c in plan.held_chunks[m.recv_rows]}
                        assert set(sent.tolist()) <= got_first
    assert rings > 0
