"""Tests of the process-group helpers (`comm/groups.py`) on real gloo process groups.

In-process (one rank): argument errors and the ring model. Multi-rank: one spawned driver forks 4
ranks; each all-reduces through `all_reduce_recorded` in the world and in two groups of two, and
the bytes recorded per member are compared with the simulator's ring model in the test process.
"""


import numpy as np
import pytest
import torch
import torch.distributed as dist

from support.mp import run_forked, run_ranks, single_rank_group

from megatron_patches.comm import TrafficCounter
from megatron_patches.comm.groups import all_reduce_recorded, ring_allreduce_numel
from megatron_patches.placement import InstancePlacement, Topology, ring_allreduce_bytes

WORLD = 4
NUMEL = 24
"""All-reduce buffer length: divisible by 2, 3 and 4, so the ring model's per-member bytes are
integers and equal the simulator's float formula."""


def topology(devices: int = WORLD) -> Topology:
    """Two nodes, so both link classes carry traffic."""
    return Topology(nodes=2, devices_per_node=devices // 2, intra_node_bw=1e11, inter_node_bw=1e10)


# ---------------------------------------------------------------------------- in the ranks


def rank_checks() -> dict:
    me = dist.get_rank()
    counter = TrafficCounter()
    t = torch.full((NUMEL,), float(2**me))
    all_reduce_recorded(t, dist.group.WORLD, kind="world", traffic=counter, topology=topology())
    assert torch.equal(t, torch.full((NUMEL,), float(2**WORLD - 1)))
    # two groups of two (every process enters new_group for both, in the same order)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[me // 2]
    t = torch.tensor([float(2**me)])
    all_reduce_recorded(t, mine, kind="pairs", traffic=counter)
    assert t.item() == sum(2**r for r in dist.get_process_group_ranks(mine))
    return {"world": counter.get("world").as_dict(), "pairs": counter.get("pairs").as_dict()}


def drive() -> list[dict]:
    return run_forked(WORLD, rank_checks, timeout=240)


# ---------------------------------------------------------------------------- tests


@pytest.mark.multirank
def test_recorded_all_reduce_sums_and_counts_the_ring_bytes():
    per_rank = run_ranks(1, __file__, "drive", timeout=300, gloo=False)[0]
    # the world's ring bytes per rank equal the simulator's model (float formula, exact here)
    expected = ring_allreduce_bytes(InstancePlacement(np.ones((1, WORLD), dtype=np.int64)), NUMEL * 4, topology())
    keys = ("sent_intra", "sent_inter", "recv_intra", "recv_inter")
    measured = [[r["world"][k] for r in per_rank] for k in keys]
    assert measured == [a.tolist() for a in (expected.sent_intra_D, expected.sent_inter_D, expected.recv_intra_D,
                                             expected.recv_inter_D)]
    assert sum(measured[0]) + sum(measured[1]) == 2 * (WORLD - 1) * NUMEL * 4
    # Two-rank groups reducing one float32: each member sends 2 * 1 - c_1 - c_0 = 1 element and
    # receives one (default topology: one node)
    assert [r["pairs"] for r in per_rank] == [{"sent_intra": 4, "sent_inter": 0, "recv_intra": 4, "recv_inter": 0}] * 4


def test_ring_model():
    assert ring_allreduce_numel(10, 1).tolist() == [0]
    # chunks of 10 over 4: [3, 3, 2, 2]; member i skips chunks i+1 and i+2
    assert ring_allreduce_numel(10, 4).tolist() == [20 - 3 - 2, 20 - 2 - 2, 20 - 2 - 3, 20 - 3 - 3]
    for numel, m in ((0, 3), (1, 5), (7, 2), (100, 7)):
        assert ring_allreduce_numel(numel, m).sum() == 2 * (m - 1) * numel
    with pytest.raises(ValueError, match="needs >= 1 member, got 0"):
        ring_allreduce_numel(4, 0)


def test_single_rank_world_and_argument_errors():
    with single_rank_group():
        counter = TrafficCounter()
        t = torch.arange(3.0)
        all_reduce_recorded(t, dist.group.WORLD, kind="x", traffic=counter)
        assert torch.equal(t, torch.arange(3.0)) and counter.get("x").as_dict()["sent_intra"] == 0
        with pytest.raises(ValueError, match="needs a contiguous tensor"):
            all_reduce_recorded(torch.zeros(4, 2).T, dist.group.WORLD, kind="x")
        with pytest.raises(ValueError, match="the topology has 4 devices but the group 1 ranks"):
            all_reduce_recorded(torch.zeros(2), dist.group.WORLD, kind="x", topology=topology())
