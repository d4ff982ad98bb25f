"""Tests of ContiguousGroups (pre-registered contiguous rank groups) on real gloo process groups.

In-process (one rank): argument errors and a world of one. Multi-rank (`slow`): one spawned
driver forks 4 ranks; each checks that every rank range the replicate scheduler produces is
registered, that an all-reduce in every range sums exactly its members, that a second layout of
two parents works, and that nothing creates a group after construction; the ring byte counts
are compared with the simulator's model in the test process.
"""


import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


from support.mp import run_forked, run_ranks, single_rank_group

from megatron_patches.comm import TrafficCounter
from megatron_patches.comm.groups import ContiguousGroups, ring_allreduce_numel
from megatron_patches.placement import (
    InstancePlacement,
    Topology,
    assign_slots,
    contiguous_rank_groups,
    expert_rank_ranges,
    replica_counts,
    ring_allreduce_bytes,
    slot_placement,
)

WORLD = 4
NUMEL = 24
"""All-reduce buffer length: divisible by 2, 3 and 4, so the ring model's per-member bytes are
integers and equal the simulator's float formula."""
POPULARITY_DRAWS = 400


def topology() -> Topology:
    """Two nodes of two ranks, so both link classes carry traffic."""
    return Topology(nodes=2, devices_per_node=2, intra_node_bw=1e11, inter_node_bw=1e10)


def scheduler_ranges(num_ranks: int, draws: int, seed: int = 0) -> set[tuple[int, int]]:
    """Every holder range of >= 2 ranks that replica_counts + assign_slots produce over random popularity."""
    rng = np.random.default_rng(seed)
    found = set()
    for _ in range(draws):
        s = int(rng.integers(1, 5))
        E = int(rng.integers(1, num_ranks * s + 1))
        popularity = rng.pareto(rng.choice([0.5, 1.5, 5.0]), E) * rng.integers(0, 2, E)  # skewed, some zeros
        placement = slot_placement(assign_slots(replica_counts(popularity, num_ranks, s), num_ranks, s), E)
        found |= {(int(a), int(b)) for a, b in expert_rank_ranges(placement) if b - a >= 2}
    return found


# ---------------------------------------------------------------------------- in the ranks


def rank_checks() -> dict:
    me = dist.get_rank()
    groups_before = distributed_c10d._world.group_count
    groups = ContiguousGroups([list(range(WORLD))])
    made = distributed_c10d._world.group_count - groups_before
    assert groups.ranges == tuple(contiguous_rank_groups(WORLD)) and groups.position == me
    mine = [r for r in groups.ranges if r[0] <= me < r[1]]
    for start, stop in mine:
        assert dist.get_process_group_ranks(groups.get(start, stop)) == list(range(start, stop))

    # Every range the scheduler produces is registered; this rank can use those it is in.
    produced = scheduler_ranges(WORLD, POPULARITY_DRAWS)
    assert produced <= set(groups.ranges), produced - set(groups.ranges)
    for start, stop in sorted(produced):
        if start <= me < stop:
            groups.get(start, stop)

    # An all-reduce in each range sums exactly its members (bit r = rank r), ranges in the same order everywhere.
    topo = topology()
    counter = TrafficCounter()
    for start, stop in groups.ranges:
        if start <= me < stop:
            t = torch.full((NUMEL,), float(2**me))
            work = groups.all_reduce(t, start, stop, kind="ar", traffic=counter, topology=topo, async_op=True)
            work.wait()
            assert torch.equal(t, torch.full((NUMEL,), float(sum(2**r for r in range(start, stop))))), (start, stop)
    t = torch.ones(3)
    assert groups.all_reduce(t, me, me + 1, kind="ar", traffic=counter) is None and torch.equal(t, torch.ones(3))
    for bad in ((me, me + 1), (0, WORLD + 1), (-1, 1)):
        try:
            groups.get(*bad)
        except ValueError as err:
            assert "no group was registered" in str(err)
        else:
            raise AssertionError(f"get{bad} did not raise")
    outside = next(r for r in groups.ranges if not r[0] <= me < r[1])
    try:
        groups.get(*outside)
    except ValueError as err:
        assert "is not a member" in str(err)
    else:
        raise AssertionError(f"get{outside} did not raise for a non-member")

    # Two parents of two ranks (e.g. one per tensor-parallel rank): each sees only its own range.
    pairs = ContiguousGroups([[0, 1], [2, 3]])
    assert pairs.ranks == ((0, 1) if me < 2 else (2, 3)) and pairs.ranges == ((0, 2),) and pairs.position == me % 2
    t = torch.tensor([float(2**me)])
    pairs.all_reduce(t, 0, 2, kind="pairs", traffic=counter)
    assert t.item() == sum(2**r for r in pairs.ranks)
    assert dist.get_process_group_ranks(pairs.get(0, 2)) == list(pairs.ranks)

    # Parents that leave a rank out fail on every rank alike, before any group is made (no rank hangs).
    try:
        ContiguousGroups([[0, 1], [3]])
    except ValueError as err:
        assert "global ranks [2] are in no parent" in str(err)
    else:
        raise AssertionError("parents without rank 2 did not raise")

    # new_group calls (counted by every process, member or not): 6 + the one range of each of the
    # two parents; looking groups up and reducing in them created none.
    assert distributed_c10d._world.group_count == groups_before + made + 2
    return {"made": made, "ar": counter.get("ar").as_dict(), "pairs": counter.get("pairs").as_dict()}


def drive() -> list[dict]:
    return run_forked(WORLD, rank_checks, timeout=240)


# ---------------------------------------------------------------------------- tests


@pytest.mark.multirank
def test_contiguous_groups_on_four_gloo_ranks():
    per_rank = run_ranks(1, __file__, "drive", timeout=300, gloo=False)[0]
    assert [r["made"] for r in per_rank] == [len(contiguous_rank_groups(WORLD))] * WORLD

    # The ring bytes of all six ranges, per rank, equal the simulator's model (float formula, exact here).
    topo = topology()
    expected = None
    for start, stop in contiguous_rank_groups(WORLD):
        counts_ED = np.zeros((1, WORLD), dtype=np.int64)
        counts_ED[0, start:stop] = 1
        one = ring_allreduce_bytes(InstancePlacement(counts_ED), NUMEL * 4, topo)
        expected = one if expected is None else expected + one
    keys = ("sent_intra", "sent_inter", "recv_intra", "recv_inter")
    measured = [[r["ar"][k] for r in per_rank] for k in keys]
    arrays = (expected.sent_intra_D, expected.sent_inter_D, expected.recv_intra_D, expected.recv_inter_D)
    assert measured == [a.tolist() for a in arrays]
    assert sum(measured[0]) + sum(measured[1]) == sum(2 * (b - a - 1) * NUMEL * 4 for a, b in contiguous_rank_groups(4))
    # Two-rank parents reducing one float32: the ring model has each member send 2 * 1 - c_1 - c_0 = 1
    # element and receive one (default topology: one node).
    assert [r["pairs"] for r in per_rank] == [{"sent_intra": 4, "sent_inter": 0, "recv_intra": 4, "recv_inter": 0}] * 4


def test_scheduler_reaches_every_registered_range():
    # Not only covered: the registry holds no range the scheduler could never use (for 4 and 6 ranks).
    for ranks in (4, 6):
        assert scheduler_ranges(ranks, 2 * POPULARITY_DRAWS) == set(contiguous_rank_groups(ranks))


def test_ring_model():
    assert ring_allreduce_numel(10, 1).tolist() == [0]
    # chunks of 10 over 4: [3, 3, 2, 2]; member i skips chunks i+1 and i+2
    assert ring_allreduce_numel(10, 4).tolist() == [20 - 3 - 2, 20 - 2 - 2, 20 - 2 - 3, 20 - 3 - 3]
    for numel, m in ((0, 3), (1, 5), (7, 2), (100, 7)):
        assert ring_allreduce_numel(numel, m).sum() == 2 * (m - 1) * numel
    with pytest.raises(ValueError, match="needs >= 1 member, got 0"):
        ring_allreduce_numel(4, 0)


def test_single_rank_world_and_argument_errors():
    with pytest.raises(RuntimeError, match="needs an initialised default process group"):
        ContiguousGroups([[0]])
    with single_rank_group():
        one = ContiguousGroups([[0]])
        assert one.ranges == () and one.size == 1 and one.position == 0
        t = torch.arange(3.0)
        assert one.all_reduce(t, 0, 1, kind="x", traffic=TrafficCounter()) is None and torch.equal(t, torch.arange(3.0))
        with pytest.raises(ValueError, match=r"no group was registered for positions \[0, 1\)"):
            one.get(0, 1)
        for parents, message in (
            ([], "parents must be a non-empty list of rank lists"),
            ("0", "parents must be a non-empty list of rank lists"),
            ([[]], r"parents\[0\] must be a non-empty list of global ranks"),
            ([[1]], r"parents\[0\] holds 1, which is not a global rank in \[0, 1\)"),
            ([[True]], r"parents\[0\] holds True"),
            ([[0, 0]], r"parents\[0\] = \[0, 0\] must list its ranks strictly ascending"),
            ([[0], [0]], r"global rank 0 is in parents\[0\] and parents\[1\]; parents must be disjoint"),
        ):
            with pytest.raises(ValueError, match=message):
                ContiguousGroups(parents)
