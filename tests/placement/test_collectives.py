"""Where each copy comes from in the sparse collectives (placement/collectives.py), and the byte
formulas that read it: flat (every copy from the owner) and node-aware (one copy per remote
node from the owner, the rest from that node's relay)."""

import numpy as np
import pytest

from megatron_patches.placement import InstancePlacement, PlacementError, ShardLayout, Topology, sparse_all_gather_bytes
from megatron_patches.placement.collectives import copy_sources_ED


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
    source = copy_sources_ED(shard, placement, topology, "hierarchical")
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
        flat = copy_sources_ED(shard, placement, topology, "flat")
        relay = copy_sources_ED(shard, placement, topology, "hierarchical")
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
        remote_nodes = sum(len(set(node_D[holds_ED[e]]) - {node_D[shard.owner_E[e]]}) for e in range(shard.num_experts))
        assert b_relay.inter == remote_nodes * 4
        if nodes == 1:
            assert np.array_equal(flat, relay)


def test_unknown_algorithm_is_named():
    shard, placement, topology = random_case(np.random.default_rng(0), 2, 2)
    with pytest.raises(PlacementError, match="unknown sparse-collective algorithm 'tree'; valid: hierarchical, flat"):
        copy_sources_ED(shard, placement, topology, "tree")
