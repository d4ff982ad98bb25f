"""Where each copy comes from in the sparse collectives (placement/collectives.py), and the byte
formulas that read it: flat (every copy from the owner) and node-aware (one copy per remote
node from the owner, the rest from that node's relay; experts every device holds by ring
broadcast when the ring is faster)."""

import numpy as np
import pytest

from megatron_patches.placement import InstancePlacement, PlacementError, ShardLayout, Topology, sparse_all_gather_bytes
from megatron_patches.placement.accounting import CommBytes, gather_stage_bytes, sparse_all_gather_seconds, transfer_seconds
from megatron_patches.placement.collectives import copy_sources, copy_stage_bytes, relay_sources_ED


def random_case(rng, nodes: int, per_node: int):
    D = nodes * per_node
    E = int(rng.integers(1, 3 * D))
    owner_E = rng.integers(0, D, E)
    counts_ED = (rng.random((E, D)) < rng.choice([0.2, 0.6, 1.0])).astype(np.int64)
    counts_ED[np.arange(E), owner_E] = 1
    topology = Topology(nodes, per_node, 1e11, 1e10)
    return ShardLayout(owner_E, D), InstancePlacement(counts_ED), topology


def test_every_copy_everywhere_crosses_each_node_boundary_once():
    """2 nodes x 4 devices, 8 experts held everywhere: flat sends each expert to the 4 devices
    of the other node (32 crossings), node-aware once per expert (8), relayed inside the node."""
    topology = Topology(2, 4, 1e11, 1e10)
    shard = ShardLayout(np.arange(8), 8)
    placement = InstancePlacement(np.ones((8, 8), dtype=np.int64))
    flat = sparse_all_gather_bytes(shard, placement, 100, topology, "flat")
    node_aware = sparse_all_gather_bytes(shard, placement, 100, topology, "hierarchical")
    assert (flat.inter, flat.intra) == (32 * 100, 24 * 100)
    assert (node_aware.inter, node_aware.intra) == (8 * 100, 48 * 100)
    assert flat.total == node_aware.total  # the same 56 copies
    sources = copy_sources(shard, placement, topology, "hierarchical")
    # every expert is held everywhere, but their owners are spread: each node's NIC sends its
    # 4 experts once either way, and a ring would cross back into the owner's node: relays
    assert not sources.ring_E.any()
    source = sources.source_ED
    # expert 0 (owner 0, node 0): node 1's relay is holder 0 mod 4 = device 4, which feeds 5, 6, 7
    assert source[0].tolist() == [-1, 0, 0, 0, 0, 4, 4, 4]
    # expert 5 (owner 5, node 1): node 0's relay is holder 5 mod 4 = device 1
    assert source[5].tolist() == [1, 5, 1, 1, 5, -1, 5, 5]


@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 2), (2, 4), (4, 2), (3, 3)])
def test_sources_are_owners_or_one_relay_per_remote_node(nodes, per_node):
    rng = np.random.default_rng(nodes * 10 + per_node)
    for _ in range(40):
        shard, placement, topology = random_case(rng, nodes, per_node)
        holds_ED = placement.holds_ED().astype(bool)
        flat = copy_sources(shard, placement, topology, "flat").source_ED
        relay = relay_sources_ED(shard, placement, topology, "hierarchical")
        receives_ED = holds_ED.copy()
        receives_ED[np.arange(shard.num_experts), shard.owner_E] = False
        for source in (flat, relay):
            assert np.array_equal(source >= 0, receives_ED)  # every copy outside P0 filled once
        assert np.array_equal(flat[receives_ED], np.broadcast_to(shard.owner_E[:, None], flat.shape)[receives_ED])
        node_D = np.arange(topology.num_devices) // per_node
        for e, d in zip(*np.nonzero(receives_ED)):
            s, owner = relay[e, d], shard.owner_E[e]
            if node_D[d] == node_D[owner]:
                assert s == owner
            else:
                assert s == owner or (node_D[s] == node_D[d] and relay[e, s] == owner)
        for e in range(shard.num_experts):
            crossings = [node_D[d] for d in np.flatnonzero(relay[e] == shard.owner_E[e]) if node_D[d] != node_D[shard.owner_E[e]]]
            assert len(crossings) == len(set(crossings))  # at most one per remote node
        b_flat = sparse_all_gather_bytes(shard, placement, 4, topology, "flat")
        b_relay = sparse_all_gather_bytes(shard, placement, 4, topology, "hierarchical")
        assert b_relay.total == b_flat.total and b_relay.inter <= b_flat.inter
        # one crossing per remote node; a ring expert (held everywhere) crosses each node boundary
        # the ring 0 -> 1 -> ... -> D-1 -> 0 takes from its owner on, i.e. once more when the
        # owner is not its node's first device (the ring comes back into the owner's node)
        ring_E = copy_sources(shard, placement, topology, "hierarchical").ring_E
        remote_nodes = sum(len(set(node_D[holds_ED[e]]) - {node_D[shard.owner_E[e]]}) for e in np.flatnonzero(~ring_E))
        back_in = sum(shard.owner_E[e] % per_node != 0 for e in np.flatnonzero(ring_E)) if nodes > 1 else 0
        assert b_relay.inter == (remote_nodes + int(ring_E.sum()) * (nodes - 1) + back_in) * 4
        if nodes == 1:
            assert np.array_equal(flat, relay)


def test_unknown_algorithm_is_named():
    shard, placement, topology = random_case(np.random.default_rng(0), 2, 2)
    with pytest.raises(PlacementError, match="unknown sparse-collective algorithm 'tree'; valid: hierarchical, flat"):
        copy_sources(shard, placement, topology, "tree")


def test_a_hot_expert_everywhere_goes_around_the_ring():
    """4 nodes x 2 devices (one NIC each), expert 0 held everywhere, owned by device 2: the relays
    send it out of node 1 three times (stage 1) and forward it inside the three other nodes
    (stage 2); the ring 2 -> 3 -> 4 -> 5 -> 6 -> 7 -> 0 -> 1 sends one copy out of each node, so
    the busiest device sends one copy over the network, not three. Expert 1 (two holders) keeps
    its point-to-point copy."""
    topology = Topology(4, 2, 1e11, 1e10)
    shard = ShardLayout([2, 5], 8)
    counts = np.zeros((2, 8), dtype=np.int64)
    counts[0] = 1
    counts[1, [5, 0]] = 1
    placement = InstancePlacement(counts)
    sources = copy_sources(shard, placement, topology, "hierarchical")
    assert sources.ring_E.tolist() == [True, False]
    assert sources.source_ED[0].tolist() == [7, 0, -1, 2, 3, 4, 5, 6]  # each device's ring predecessor
    assert sources.source_ED[1].tolist() == [5, -1, -1, -1, -1, -1, -1, -1]
    relayed = relay_sources_ED(shard, placement, topology, "hierarchical")
    assert relayed[0].tolist() == [2, 0, -1, 2, 2, 4, 2, 6]  # one copy out of node 1 per other node
    owners, ring, relays = gather_stage_bytes(shard, placement, 10, topology)
    assert (owners.inter, owners.intra, ring.inter, ring.intra, relays.total) == (10, 0, 30, 40, 0)
    assert ring.sent_inter_D.tolist() == [0, 0, 0, 10, 0, 10, 0, 10]  # the last of each node (not 1: the ring ends)
    assert ring.recv_D.tolist() == [10, 10, 0, 10, 10, 10, 10, 10]
    # chunks of 1e10 B at 1e10 B/s between nodes: stage 1 (expert 1) 1 s, ring 1 s; the relays
    # would take 3 s (device 2 sends three copies) + 0.1 s inside the nodes, flat 6 s
    assert sparse_all_gather_seconds(shard, placement, 1e10, topology, "hierarchical") == pytest.approx(2.0)
    assert sparse_all_gather_seconds(shard, placement, 1e10, topology, "flat") == pytest.approx(6.0)


def _seconds(source_ED, stages_ED, topology) -> float:
    """Stages one after the other, each priced by accounting.transfer_seconds."""
    total = 0.0
    for mask_ED in stages_ED:
        e, d = np.nonzero(mask_ED)
        total += transfer_seconds(CommBytes.from_transfers(source_ED[e, d], d, 1.0, topology), topology)
    return total


@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 4), (4, 2), (3, 3)])
def test_ring_is_taken_for_all_experts_everywhere_exactly_when_faster(nodes, per_node):
    rng = np.random.default_rng(7 * nodes + per_node)
    D = nodes * per_node
    topology = Topology(nodes, per_node, 1e11, 1e10)
    taken = kept = 0
    for _ in range(60):
        shard, placement, _ = random_case(rng, nodes, per_node)
        placement = InstancePlacement(placement.counts_ED + np.outer(rng.random(shard.num_experts) < 0.2, np.ones(D, np.int64)))
        everywhere_E = placement.holds_ED().all(axis=1)
        sources = copy_sources(shard, placement, topology, "hierarchical")
        ring_E = sources.ring_E
        relayed_ED = relay_sources_ED(shard, placement, topology, "hierarchical")
        assert np.array_equal(sources.source_ED[~ring_E], relayed_ED[~ring_E])
        predecessor_D = (np.arange(D) - 1) % D
        for e in np.flatnonzero(ring_E):
            assert np.array_equal(np.delete(sources.source_ED[e], shard.owner_E[e]), np.delete(predecessor_D, shard.owner_E[e]))
            assert sources.source_ED[e, shard.owner_E[e]] == -1
        if not everywhere_E.any():
            assert not ring_E.any()
            continue
        # the alternative, priced independently: relays only (stage 1 from the owners, stage 2 the
        # rest) against the ring for every expert everywhere (owners, ring, relays)
        receives_ED = relayed_ED >= 0
        from_owner_ED = relayed_ED == shard.owner_E[:, None]
        relays_s = _seconds(relayed_ED, (receives_ED & from_owner_ED, receives_ED & ~from_owner_ED), topology)
        ring_ED = np.where(everywhere_E[:, None], predecessor_D[None, :], relayed_ED)
        ring_ED[everywhere_E, shard.owner_E[everywhere_E]] = -1
        rows_ED = everywhere_E[:, None] & (ring_ED >= 0)
        ring_s = _seconds(ring_ED, (receives_ED & from_owner_ED & ~rows_ED, rows_ED,
                                    receives_ED & ~from_owner_ED & ~everywhere_E[:, None]), topology)
        assert np.array_equal(ring_E, everywhere_E if ring_s < relays_s else np.zeros_like(everywhere_E))
        assert sparse_all_gather_seconds(shard, placement, 1.0, topology, "hierarchical") == pytest.approx(min(ring_s, relays_s))
        taken += bool(ring_E.any())
        kept += not ring_E.any()
    assert taken and kept  # both choices occur


def _table_stage_bytes(sources, chunk, topology):
    """The bytes of each stage (owners' sends, ring broadcasts, relays' sends) of the transfers
    a source table names, one point-to-point transfer per (expert, receiving device)."""
    e, d = np.nonzero(sources.source_ED >= 0)
    source = sources.source_ED[e, d]
    size = np.broadcast_to(np.asarray(chunk, dtype=np.float64), sources.ring_E.shape)[e]
    ring = sources.ring_E[e]
    from_owner = ~ring & (source == sources.owner_E[e])
    return tuple(CommBytes.from_transfers(source[k], d[k], size[k], topology)
                 for k in (from_owner, ring, ~ring & ~from_owner))


@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 4), (4, 2), (3, 3), (2, 8), (3, 12)])
def test_stage_bytes_from_holder_lists_are_the_source_tables(nodes, per_node):
    """`copy_stage_bytes` (what the planners price gathers by) gives the bytes of the senders
    `copy_sources` names (what the runtime sends by), stage by stage, flat and hierarchical,
    with the ring taken or not, for chunks of one size and of a size per expert; devices per
    node that are and are not a multiple of 8 (the holder lists skip 8 devices at a time)."""
    rng = np.random.default_rng(nodes * 100 + per_node)
    rings = 0
    for i in range(60):
        shard, placement, topology = random_case(rng, nodes, per_node)
        if i % 3 == 0:  # a few hot experts on one owner everywhere: where the ring pays
            counts_ED = placement.counts_ED.copy()
            hot = rng.choice(shard.num_experts, size=min(3, shard.num_experts), replace=False)
            counts_ED[hot] = 1
            owner_E = shard.owner_E.copy()
            owner_E[hot] = owner_E[hot[0]]
            shard, placement = ShardLayout(owner_E, topology.num_devices), InstancePlacement(counts_ED)
        for algorithm in ("flat", "hierarchical"):
            for chunk in (4718592.0, rng.integers(1, 10**6, shard.num_experts).astype(np.float64)):
                sources = copy_sources(shard, placement, topology, algorithm)
                rings += int(sources.ring_E.any())
                expected = _table_stage_bytes(sources, chunk, topology)
                found = copy_stage_bytes(shard, placement, topology, algorithm, chunk)
                for a, b in zip(expected, found):
                    for field in ("sent_intra_D", "sent_inter_D", "recv_intra_D", "recv_inter_D"):
                        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert rings > 0  # the ring was chosen in some cases
