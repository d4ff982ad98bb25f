"""Tests of SparseAllGather / SparseReduceScatter on real gloo process groups.

In-process (one rank): the argument and buffer errors, and a world of one. Multi-rank
(`slow`): one spawned driver process per world size (2, 4, 8) forks the ranks after its
imports; every rank runs all cases of that world size against dense references (an
all_reduce of the full buffer; an all_gather summed in ascending rank order for the
documented summation order) and returns its byte counters, which the test compares with
placement.accounting's formulas.
"""

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist


from support.mp import run_forked, run_ranks, single_rank_group

from megatron_patches.comm import RelayAllGather, RelayReduceScatter, SparseAllGather, SparseReduceScatter, TrafficCounter
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
from megatron_patches.placement.collectives import copy_sources

RANDOM_CASES = {2: 6, 4: 5, 8: 2}
"""Random whole-chunk cases per world size (8 ranks on 2 cores are slow: keep that one small)."""
SLOW_SENDER_S = 1.5
"""How long ranks other than 0 wait before launching, in the asynchrony check."""
OWNER_LACKS_COPY = "chunk 1 is owned by device 1 in P0 but P1 holds no copy of it on device 1;"
"""The error for a P1 without the owner's copy (chunk 1, device 1) in the error checks."""


def topology(world_size: int) -> Topology:
    """Two nodes, so both link classes carry traffic."""
    return Topology(nodes=2, devices_per_node=world_size // 2, intra_node_bw=1e11, inter_node_bw=1e10)


def make_cases(world_size: int, seed: int = 0) -> list[dict]:
    """The cases of one world size, identical on every rank and in the test process.

    Each case: name, kind ("shard" = whole chunks, "element" = slices), owner_E (shard),
    counts_ED (P1), N (chunk elements), seed (data).
    """
    D = world_size
    rng = np.random.default_rng(seed + D)
    cases = []

    def add(name, kind, owner_E, counts_ED, N):
        counts = np.asarray(counts_ED).tolist()
        cases.append(dict(name=name, kind=kind, owner_E=owner_E, counts_ED=counts, N=int(N), seed=len(cases)))

    def holds(owner_E):
        return ShardLayout(owner_E, D).holds_ED()

    E = 2 * D + 1
    owner = [D - 1] + rng.integers(0, D, E - 1).tolist()  # rank 0 never owns all: it has chunks to receive
    add("no copies", "shard", owner, holds(owner), rng.integers(1, 40))
    add("every chunk everywhere", "shard", owner, np.ones((E, D)), rng.integers(1, 40))
    add("one device owns all, no copies", "shard", [D - 1] * E, holds([D - 1] * E), rng.integers(1, 40))
    add("one device owns all, everywhere", "shard", [0] * E, np.ones((E, D)), rng.integers(1, 40))
    add("one chunk", "shard", [D - 1], [[1] * D], rng.integers(1, 40))
    for i in range(RANDOM_CASES[D]):
        E = int(rng.integers(1, 3 * D + 1))
        owner = rng.integers(0, D, E).tolist()
        copies = (rng.random((E, D)) < rng.choice([0.2, 0.5])) * rng.integers(1, 3, (E, D))  # some multiplicity
        add(f"random {i}", "shard", owner, holds(owner) + copies, rng.integers(1, 40))
    for name, N in (("slices", rng.integers(D, 40)), ("slices, fewer elements than ranks", D - 1 or 1)):
        E = int(rng.integers(1, 2 * D + 1))
        counts = (rng.random((E, D)) < 0.4) * rng.integers(1, 3, (E, D))
        counts[np.arange(E), rng.integers(0, D, E)] += 1
        add(name, "element", None, counts, N)
    return cases


def build(case: dict, world_size: int):
    """(P0, P1) of a case."""
    placement = InstancePlacement(case["counts_ED"])
    if case["kind"] == "shard":
        return ShardLayout(case["owner_E"], world_size), placement
    return ElementShardLayout(case["N"], world_size), placement


def chunk_data(case: dict, E: int) -> torch.Tensor:
    """The full logical buffer [E, N] of a case (float32, the same on every rank)."""
    return torch.from_numpy(np.random.default_rng(case["seed"]).standard_normal((E, case["N"]))).float()


def owned_part(collective, full_EN: torch.Tensor) -> torch.Tensor:
    """This rank's owned buffer cut from a full buffer: its chunks' rows, its columns."""
    plan = collective.plan
    return full_EN[torch.from_numpy(plan.owned_chunks.copy()), plan.start : plan.stop].contiguous()


# ---------------------------------------------------------------------------- multi-rank checks (run in the ranks)


def run_case(case: dict, group, world_size: int) -> dict:
    """One case on this rank: spAG and spRS against dense references; returns the byte counters."""
    owners, placement = build(case, world_size)
    E, N = placement.num_experts, case["N"]
    rank = dist.get_rank(group)
    topo = topology(world_size)
    gather_bytes, reduce_bytes = TrafficCounter(), TrafficCounter()
    gather = SparseAllGather(owners, placement, group, N, topology=topo, traffic=gather_bytes)
    reduce = SparseReduceScatter(placement, owners, group, N, topology=topo, traffic=reduce_bytes)
    held_idx = torch.from_numpy(gather.held_chunks.copy())
    owned_idx = torch.from_numpy(gather.owned_chunks.copy())
    columns = slice(gather.plan.start, gather.plan.stop)

    # Gather: dense reference = all_reduce of the full buffer where each rank fills what it owns.
    W = chunk_data(case, E)
    owned = owned_part(gather, W)
    dense = torch.zeros(E, N)
    dense[owned_idx, columns] = owned
    dist.all_reduce(dense, group=group)
    assert torch.equal(dense, W), case["name"]  # the owners tile the buffer exactly once
    held = gather(owned).wait()
    assert held.shape == (held_idx.numel(), N)
    assert torch.equal(held, dense[held_idx]), f"{case['name']}: rank {rank} held chunks differ"

    # Reduce: random per-rank copies' gradients; reference = all_reduce of the dense buffers.
    grads = torch.from_numpy(np.random.default_rng([case["seed"], rank]).standard_normal(held.shape)).float()
    out = reduce(grads).wait()
    full = torch.zeros(E, N)
    full[held_idx] = grads
    summed = full.clone()
    dist.all_reduce(summed, group=group)
    torch.testing.assert_close(out, summed[owned_idx, columns], rtol=1e-5, atol=1e-5)
    # The documented order: ascending device, bit for bit (adding a non-holder's zeros is exact).
    everyone = [torch.zeros(E, N) for _ in range(world_size)]
    dist.all_gather(everyone, full, group=group)
    ordered = torch.zeros(E, N)
    for part in everyone:
        ordered += part
    assert torch.equal(out, ordered[owned_idx, columns]), f"{case['name']}: rank {rank} sum order differs"
    counters = {"spag": gather_bytes.get("spag").as_dict(), "sprs": reduce_bytes.get("sprs").as_dict()}
    if case["kind"] == "shard":
        # node-aware: the same held copies and sums (each remote node's copies summed at its relay first)
        relay_bytes = TrafficCounter()
        relay_gather = RelayAllGather(owners, placement, group, N, topology=topo, traffic=relay_bytes, kind="relay_spag")
        relay_reduce = RelayReduceScatter(placement, owners, group, N, topology=topo, traffic=relay_bytes, kind="relay_sprs")
        assert np.array_equal(relay_gather.held_chunks, gather.held_chunks)
        assert torch.equal(relay_gather(owned).wait(), held), f"{case['name']}: rank {rank} relayed copies differ"
        torch.testing.assert_close(relay_reduce(grads).wait(), out, rtol=1e-6, atol=1e-6)
        counters.update({kind: relay_bytes.get(kind).as_dict() for kind in ("relay_spag", "relay_sprs")})
    return counters


def check_in_flight(cases: list[dict], group, world_size: int) -> None:
    """Three collectives in flight at once on different buffers, waited for in reverse order."""
    rank = dist.get_rank(group)
    a_case = next(c for c in cases if c["name"] == "every chunk everywhere")
    b_case = next(c for c in cases if c["kind"] == "element")
    c_case = next(c for c in cases if c["name"].startswith("random"))
    gathers = []
    for case in (a_case, b_case):
        owners, placement = build(case, world_size)
        gathers.append((SparseAllGather(owners, placement, group, case["N"], traffic=TrafficCounter()), case))
    owners, placement = build(c_case, world_size)
    reduce = SparseReduceScatter(placement, owners, group, c_case["N"], traffic=TrafficCounter())
    # a node-aware gather too: its second stage is posted in wait() on gloo, after the others' launches
    owners_d, placement_d = build(a_case, world_size)
    gd = RelayAllGather(owners_d, placement_d, group, a_case["N"], topology=topology(world_size), traffic=TrafficCounter())

    (ga, a), (gb, b) = gathers
    Wa = chunk_data(a, len(a["counts_ED"]))
    Wb = chunk_data(b, len(b["counts_ED"]))
    out_a = torch.full(ga.plan.held_shape, float("nan"))
    if rank != 0:
        time.sleep(SLOW_SENDER_S)  # rank 0's chunks from other ranks cannot have arrived at its launch
    start = time.monotonic()
    handle_a = ga(owned_part(ga, Wa), out=out_a)
    launch_s = time.monotonic() - start
    handle_b = gb(owned_part(gb, Wb))
    grads = torch.ones(reduce.plan.held_shape)
    handle_c = reduce(grads)
    handle_d = gd(owned_part(gd, Wa))
    if rank == 0:
        # Launching returned without waiting for the late peers, and received rows are only
        # unpacked by wait(): the data is not valid before it.
        assert launch_s < SLOW_SENDER_S * 2 / 3, f"launch blocked for {launch_s:.2f} s"
        remote = np.setdiff1d(np.arange(ga.plan.held_shape[0]), ga.plan.local_held_rows)
        assert remote.size and torch.isnan(out_a[torch.from_numpy(remote)]).all()
    assert torch.equal(handle_d.wait(), Wa[torch.from_numpy(gd.held_chunks.copy())])
    summed = handle_c.wait()
    replicas = torch.from_numpy(InstancePlacement(c_case["counts_ED"]).replicas_E()[reduce.owned_chunks]).float()
    assert torch.equal(summed, replicas[:, None].expand_as(summed)), "each owner sums one 1.0 per distinct holder"
    assert torch.equal(handle_b.wait(), Wb[torch.from_numpy(gb.held_chunks.copy())])
    result_a = handle_a.wait()
    assert result_a is out_a and handle_a.wait() is result_a
    assert torch.equal(result_a, Wa[torch.from_numpy(ga.held_chunks.copy())])


def rank_checks(world_size: int) -> list[dict]:
    """Everything one rank checks at one world size; returns its byte counters per case."""
    group = dist.new_group(list(range(world_size)))  # explicit, not the default group
    cases = make_cases(world_size)
    counters = [run_case(case, group, world_size) for case in cases]
    check_in_flight(cases, group, world_size)
    return counters


def drive(world_size: int) -> list[list[dict]]:
    """In a fresh process: fork the ranks after the imports (one import for all ranks)."""
    return run_forked(world_size, rank_checks, timeout=240, args=(world_size,))


# ---------------------------------------------------------------------------- tests


def as_lists(comm) -> list[list[int]]:
    """A CommBytes as [sent_intra_D, sent_inter_D, recv_intra_D, recv_inter_D] lists."""
    return [arr.tolist() for arr in (comm.sent_intra_D, comm.sent_inter_D, comm.recv_intra_D, comm.recv_inter_D)]


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_sparse_collectives_on_gloo_ranks(world_size):
    per_rank = run_ranks(1, __file__, "drive", timeout=300, args=(world_size,), gloo=False)[0]
    cases = make_cases(world_size)
    assert all(len(counters) == len(cases) for counters in per_rank)
    topo = topology(world_size)
    keys = ("sent_intra", "sent_inter", "recv_intra", "recv_inter")
    moved = relay_saved = rings = 0
    for i, case in enumerate(cases):
        owners, placement = build(case, world_size)
        chunk_bytes = case["N"] * 4  # float32

        def measured(kind):
            return [[per_rank[r][i][kind][key] for r in range(world_size)] for key in keys]

        spag, sprs = measured("spag"), measured("sprs")
        if case["kind"] == "shard":
            assert spag == as_lists(sparse_all_gather_bytes(owners, placement, chunk_bytes, topo)), case["name"]
            assert sprs == as_lists(sparse_reduce_scatter_bytes(placement, owners, chunk_bytes, topo)), case["name"]
            total = sum(map(sum, spag[:2])) + sum(map(sum, sprs[:2]))
            assert total == allreduce_equivalent_bytes(placement, chunk_bytes), case["name"]
            relay_spag, relay_sprs = measured("relay_spag"), measured("relay_sprs")
            hierarchical = sparse_all_gather_bytes(owners, placement, chunk_bytes, topo, "hierarchical")
            assert relay_spag == as_lists(hierarchical), case["name"]
            assert relay_sprs == as_lists(hierarchical.reversed()), case["name"]
            # the same copies, never more bytes in total, and no more across the node boundary
            assert sum(map(sum, relay_spag[:2])) == sum(map(sum, spag[:2])), case["name"]
            assert sum(relay_spag[1]) <= sum(spag[1]), case["name"]
            relay_saved += sum(spag[1]) - sum(relay_spag[1])
            rings += bool(copy_sources(owners, placement, topo, "hierarchical").ring_E.any())
        else:
            # Every holder of a chunk receives every other rank's slice of it, and the reduce returns them.
            size_D = owners.sizes_D() * 4
            expected = np.zeros((4, world_size), dtype=np.int64)
            for c, d in zip(*np.nonzero(placement.holds_ED())):
                for r in np.flatnonzero(np.arange(world_size) != d):
                    link = 0 if topo.same_node(r, d) else 1
                    expected[link, r] += size_D[r]
                    expected[2 + link, d] += size_D[r]
            assert spag == expected.tolist(), case["name"]
            assert sprs == expected[[2, 3, 0, 1]].tolist(), case["name"]
        moved += sum(map(sum, spag[:2]))
    assert moved > 0
    if world_size >= 4:  # two ranks per node: a chunk held on both of a remote node's ranks crosses once
        assert relay_saved > 0
        # chunks everywhere on one owner go by ring broadcast / reduce (dist.broadcast, dist.reduce)
        assert rings >= 2


def test_single_rank_world_and_argument_errors():
    shard = ShardLayout([0, 1, 1], 2)
    placement = InstancePlacement([[1, 1], [0, 1], [1, 1]])
    with single_rank_group():
        world = dist.group.WORLD
        # P0 / P1 errors name the chunk and the device, before anything touches the group.
        lacking = InstancePlacement([[1, 0], [1, 0], [0, 1]])
        with pytest.raises(PlacementError, match=OWNER_LACKS_COPY):
            SparseAllGather(shard, lacking, world, 4)
        with pytest.raises(PlacementError, match=r"chunk 0 is on devices \[0, 1\] in P0"):
            SparseReduceScatter(placement, InstancePlacement([[1, 1], [0, 1], [0, 1]]), world, 4)
        with pytest.raises(PlacementError, match="must be an InstancePlacement, got ShardLayout"):
            SparseAllGather(shard, shard, world, 4)
        with pytest.raises(ValueError, match="pass the process group explicitly"):
            SparseAllGather(shard, placement, None, 4)
        with pytest.raises(ValueError, match="spans 2 devices but the process group has 1 ranks"):
            SparseAllGather(shard, placement, world, 4)
        one = ShardLayout([0, 0], 1)
        with pytest.raises(ValueError, match="the topology has 2 devices but the process group 1 ranks"):
            SparseAllGather(one, InstancePlacement.from_shard(one), world, 4, topology=Topology.single_node(2))

        # A world of one: the gather copies locally, the reduce returns the one copy, no bytes move.
        counter = TrafficCounter()
        gather = SparseAllGather(one, InstancePlacement([[2], [1]]), world, 3, traffic=counter)
        with pytest.raises(ValueError, match=r"rank 0: owned must have shape \(2, 3\) \(one row per chunk \[0, 1\]\)"):
            gather(torch.zeros(3, 3))
        with pytest.raises(ValueError, match="out \\(held buffer\\) must have dtype torch.float32"):
            gather(torch.zeros(2, 3), out=torch.zeros(2, 3, dtype=torch.float64))
        W = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(gather(W).wait(), W)
        reduce = SparseReduceScatter(InstancePlacement([[1], [1]]), one, world, 3, traffic=counter)
        with pytest.raises(ValueError, match=r"held must have shape \(2, 3\)"):
            reduce(torch.zeros(2, 4))
        out = torch.full((2, 3), 7.0)
        assert reduce(W, out=out).wait() is out and torch.equal(out, W)
        assert counter.snapshot() == {
            "spag": {"sent_intra": 0, "sent_inter": 0, "recv_intra": 0, "recv_inter": 0},
            "sprs": {"sent_intra": 0, "sent_inter": 0, "recv_intra": 0, "recv_inter": 0},
        }
