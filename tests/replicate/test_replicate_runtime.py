"""Tests of replicate mode's runtime (megatron_patches.replicate) against a dense reference.

Multi-rank (`slow`): one spawned driver per world size (2, 4) forks the gloo ranks; each rank
runs every scenario of its world size for a few iterations against a dense single-process
reference that every rank computes for itself from the same seeds: the popularity all-reduce,
the gradient path (the sparse reduce-scatter: each owned slice = the dense sum over all
instances; integer-valued gradients make every summation order exact; no process group made), the Adam step (= torch.optim.Adam on the full
vectors, bit for bit), the push (every slot of the next placement = the reference-updated
expert) and the per-expert checkpoint form (whole experts to their owners and back). The
ranks return their byte counters per iteration and phase; the test process compares them with
the DESIGN 4.6 formulas, per rank and link class, and with the simulator's
(`ReplicatePolicy.traffic`).

In-process: the Adam slices alone, the slot buffer, argument errors and a world of one.
"""


import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


from support.mp import run_forked, run_ranks, single_rank_group

from megatron_patches.comm import TrafficCounter
from megatron_patches.comm.groups import ring_allreduce_numel
from megatron_patches.placement import (
    ByteModel,
    CommBytes,
    DispatchPlan,
    ElementShardLayout,
    LayerPlan,
    PlacementError,
    PolicyStep,
    ReplayConfig,
    ReplicatePolicy,
    ShardLayout,
    Topology,
    assign_slots,
    slot_placement,
)
from megatron_patches.mode.adam import AdamSettings
from megatron_patches.placement.replicate import popularity_slots
from megatron_patches.replicate.experts import STATE_NAMES, ReplicatedExperts
from megatron_patches.replicate.slices import ExpertSlices
from megatron_patches.replicate.slots import SlotWeights

ITERATIONS = 3
KINDS = ("popularity", "grad_reduce_scatter", "weight_scatter")
LINKS = ("sent_intra", "sent_inter", "recv_intra", "recv_inter")

SCENARIOS = {
    2: [
        dict(name="fp32", s=3, E=4, N=36, dtype="float32", offload=False, nodes=2, adam={}),
        dict(name="bf16 offload adamw", s=2, E=3, N=5, dtype="bfloat16", offload=True, nodes=1,
             adam=dict(weight_decay=0.1, decoupled_weight_decay=True)),
    ],
    4: [
        # N divisible by 2, 3 and 4: the simulator's float ring formula is exact, so it is compared too.
        dict(name="fp32, distinct-class placement", s=2, E=5, N=36, dtype="float32", offload=False, nodes=2,
             adam=dict(weight_decay=0.01), extra_counts=[1, 2, 2, 2, 1]),
        dict(name="bf16 offload adamw", s=3, E=7, N=7, dtype="bfloat16", offload=True, nodes=2,
             adam=dict(weight_decay=0.1, decoupled_weight_decay=True, betas=(0.8, 0.95))),
        dict(name="fewer elements than ranks", s=1, E=2, N=3, dtype="float32", offload=False, nodes=1, adam={}),
    ],
}  # fmt: skip
"""Per world size: s slots, E classes, N elements per expert, slot dtype, offload, nodes of the
topology, Adam options; `extra_counts` adds a placement in which no rank holds a class twice."""


def topology(case: dict, world_size: int) -> Topology:
    nodes = case["nodes"]
    return Topology(nodes=nodes, devices_per_node=world_size // nodes, intra_node_bw=1e11, inter_node_bw=1e10)


def placements(case: dict, world_size: int, seed: int) -> list[np.ndarray]:
    """ITERATIONS + 1 slot assignments: a dominant class first (several slots of one class on a
    rank), then random instance counts (every composition of G*s into E parts is possible)."""
    G, s, E = world_size, case["s"], case["E"]
    rng = np.random.default_rng(seed)
    popularity = np.ones(E)
    popularity[rng.integers(E)] = 100.0 * G * s
    out = [popularity_slots(popularity, G, s)]
    if "extra_counts" in case:
        out.append(assign_slots(case["extra_counts"], case["extra_counts"], G, s))
    while len(out) < ITERATIONS + 1:
        cuts = np.sort(rng.choice(np.arange(1, G * s), E - 1, replace=False))
        counts = np.diff(np.concatenate(([0], cuts, [G * s])))
        out.append(assign_slots(counts, counts, G, s))
    return out


# ---------------------------------------------------------------------------- in the ranks


def run_scenario(case: dict, index: int, world_size: int, parent: dist.ProcessGroup):
    """One scenario on this rank; returns its byte counters per iteration."""
    me = dist.get_rank(parent)
    G, s, E, N = world_size, case["s"], case["E"], case["N"]
    dtype = getattr(torch, case["dtype"])
    seed = 1000 * world_size + index
    slots_T = placements(case, world_size, seed)
    rng = np.random.default_rng(seed)
    W_EN = torch.from_numpy(rng.standard_normal((E, N))).float()
    cfg = AdamSettings(lr=1e-2, **case["adam"])
    reference = [torch.nn.Parameter(W_EN[e].clone()) for e in range(E)]
    ref_opt = torch.optim.Adam(
        reference,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        decoupled_weight_decay=cfg.decoupled_weight_decay,
    )
    counter = TrafficCounter()
    groups_before = distributed_c10d._world.group_count
    experts = ReplicatedExperts(
        W_EN,
        slots_T[0],
        parent,
        adam=cfg,
        slot_dtype=dtype,
        offload=case["offload"],
        topology=topology(case, world_size),
        traffic=counter,
    )
    sl = experts.slices
    assert sl.state_device == torch.device("cpu") and sl.offload == case["offload"]
    start, stop = sl.start, sl.stop
    assert (start, stop) == ElementShardLayout(N, G).bounds(me)
    assert torch.equal(experts.slots.slots_SN.detach(), W_EN[slots_T[0][me]].to(dtype)), "initial slots"
    # the layer runs in the group it is given: no communicator of its own, at any G (before
    # 2026-11-28 every layer needed the G (G - 1) / 2 contiguous-range groups)
    assert distributed_c10d._world.group_count == groups_before, "building the layer created a process group"
    groups_made = distributed_c10d._world.group_count
    per_iteration = []
    for t in range(ITERATIONS):
        counter.reset()
        counts_RE = rng.integers(0, 50, (G, E))
        got = experts.popularity(torch.from_numpy(counts_RE[me].copy()))
        assert got.tolist() == counts_RE.sum(axis=0).tolist(), "popularity all-reduce"

        # Integer-valued gradients in [-8, 8]: every sum is exact in fp32 and bf16, in any order.
        grads_RSN = rng.integers(-8, 9, (G, s, N)).astype(np.float32)
        dense_EN = np.zeros((E, N), dtype=np.float32)
        np.add.at(dense_EN, slots_T[t].ravel(), grads_RSN.reshape(G * s, N))
        grad_SN = torch.from_numpy(grads_RSN[me]).to(dtype)
        grad_En = experts.reduce_gradients(grad_SN)
        assert torch.equal(grad_SN, torch.from_numpy(grads_RSN[me]).to(dtype)), "the slot gradients were modified"
        assert grad_En.dtype == dtype and grad_En.shape == (E, stop - start)
        assert torch.equal(grad_En.float(), torch.from_numpy(dense_EN[:, start:stop])), f"iteration {t}: grad slices"

        lr = 1e-2 / (t + 1)  # a schedule: every step its own lr
        for e in range(E):
            reference[e].grad = torch.from_numpy(dense_EN[e].copy())
        ref_opt.param_groups[0]["lr"] = lr
        ref_opt.step()
        experts.step(grad_En, lr=lr)
        with torch.no_grad():
            ref_EN = torch.stack([p.detach() for p in reference])
            m_EN = torch.stack([ref_opt.state[p]["exp_avg"] for p in reference])
            v_EN = torch.stack([ref_opt.state[p]["exp_avg_sq"] for p in reference])
        # Adam is elementwise: the slices equal torch.optim.Adam on the full vectors bit for bit.
        assert torch.equal(sl.master_En, ref_EN[:, start:stop]), f"iteration {t}: master weights"
        assert torch.equal(sl.exp_avg_En, m_EN[:, start:stop]) and torch.equal(sl.exp_avg_sq_En, v_EN[:, start:stop])
        assert torch.equal(sl.step_count, ref_opt.state[reference[0]]["step"])

        experts.push(slots_T[t + 1])
        assert experts.slots.slot_expert_S.tolist() == slots_T[t + 1][me].tolist()
        expected = ref_EN[torch.from_numpy(slots_T[t + 1][me].copy())].to(dtype)
        assert torch.equal(experts.slots.slots_SN.detach(), expected), f"iteration {t}: slots of the next placement"
        per_iteration.append({kind: counter.get(kind).as_dict() for kind in KINDS})
    assert distributed_c10d._world.group_count == groups_made, "a process group was created during training"

    # Per-expert checkpoint form: whole experts on the ranks of an expert-granular layout (EP's
    # even one, where ranks own none when E < G, then random owners), and back.
    state_EN = {"weights": ref_EN, "exp_avg": m_EN, "exp_avg_sq": v_EN}
    for shard in (ShardLayout.even(E, G), ShardLayout(rng.integers(0, G, E), G)):
        mine_O = torch.from_numpy(shard.experts_of(me).copy())
        rows = experts.gather_to_owners(shard)
        assert rows["step"] == ITERATIONS
        for name in STATE_NAMES:
            assert torch.equal(rows[name], state_EN[name][mine_O]), f"gather_to_owners: {name}"
    shifted = {name: rows[name] + 1 for name in STATE_NAMES}
    experts.scatter_from_owners(shard, shifted, step=7)
    assert torch.equal(sl.master_En, ref_EN[:, start:stop] + 1)
    assert torch.equal(sl.exp_avg_En, m_EN[:, start:stop] + 1)
    assert torch.equal(sl.exp_avg_sq_En, v_EN[:, start:stop] + 1)
    assert sl.step_count.item() == 7
    expected = (ref_EN + 1)[torch.from_numpy(slots_T[-1][me].copy())].to(dtype)
    assert torch.equal(experts.slots.slots_SN.detach(), expected), "slots refilled from the loaded state"
    return per_iteration


def rank_checks(world_size: int) -> list:
    parent = dist.new_group(list(range(world_size)))
    return [run_scenario(case, i, world_size, parent) for i, case in enumerate(SCENARIOS[world_size])]


def drive(world_size: int) -> list:
    return run_forked(world_size, rank_checks, timeout=240, args=(world_size,))


# ---------------------------------------------------------------------------- expected bytes


def ring(members: np.ndarray, numel: int, element_size: int):
    """(src, dst, bytes) of a ring all-reduce over `members` (ascending), the ring model of comm.groups."""
    m = members.size
    return members, np.roll(members, -1), ring_allreduce_numel(numel, m) * element_size


def expected_bytes(slots_RS: np.ndarray, next_RS: np.ndarray, E: int, N: int, topo: Topology, dtype_size: int):
    """DESIGN 4.6's volumes of one iteration, as point-to-point transfers per phase."""
    G = slots_RS.shape[0]
    n_R = ElementShardLayout(N, G).sizes_D()
    placement = slot_placement(slots_RS, E)
    out = {"popularity": CommBytes.from_transfers(*ring(np.arange(G), E, 8), topo)}
    # every holder of a class sends each other rank its slice of the class's gradient
    _, holder_H = np.nonzero(placement.holds_ED())
    owners = np.tile(np.arange(G), holder_H.size)
    out["grad_reduce_scatter"] = CommBytes.from_transfers(np.repeat(holder_H, G), owners, n_R[owners] * dtype_size, topo)
    e_H, h_H = np.nonzero(slot_placement(next_RS, E).holds_ED())
    senders = np.tile(np.arange(G), h_H.size)
    out["weight_scatter"] = CommBytes.from_transfers(senders, np.repeat(h_H, G), n_R[senders] * dtype_size, topo)
    return out


def as_links(comm: CommBytes) -> list[list[int]]:
    return [a.tolist() for a in (comm.sent_intra_D, comm.sent_inter_D, comm.recv_intra_D, comm.recv_inter_D)]


# ---------------------------------------------------------------------------- tests


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_replicate_runtime_against_dense_reference(world_size):
    per_rank = run_ranks(1, __file__, "drive", timeout=300, args=(world_size,), gloo=False)[0]
    closed_form_checked = simulator_checked = 0
    for i, case in enumerate(SCENARIOS[world_size]):
        G, s, E, N = world_size, case["s"], case["E"], case["N"]
        size = torch.empty(0, dtype=getattr(torch, case["dtype"])).element_size()
        topo = topology(case, world_size)
        slots_T = placements(case, world_size, 1000 * world_size + i)
        for t in range(ITERATIONS):
            measured = {k: [[per_rank[r][i][t][k][link] for r in range(G)] for link in LINKS] for k in KINDS}
            expected = expected_bytes(slots_T[t], slots_T[t + 1], E, N, topo, size)
            for kind in KINDS:
                assert measured[kind] == as_links(expected[kind]), (case["name"], t, kind)
            assert sum(map(sum, measured["popularity"][:2])) == 2 * (G - 1) * E * 8

            # Totals in elements: gradients H_r (N - n_r) from each rank, weights H_r (N - n_r) to it.
            held_RE = slot_placement(slots_T[t], E).holds_ED().T
            next_RE = slot_placement(slots_T[t + 1], E).holds_ED().T
            n_R = ElementShardLayout(N, G).sizes_D()
            totals = {k: (sum(map(sum, measured[k][:2])), sum(map(sum, measured[k][2:]))) for k in KINDS}
            grads = int((held_RE.sum(axis=1) * (N - n_R)).sum()) * size
            assert totals["grad_reduce_scatter"] == (grads, grads)
            weights = int((next_RE.sum(axis=1) * (N - n_R)).sum()) * size
            assert totals["weight_scatter"] == (weights, weights)
            if (held_RE.sum(axis=1) == s).all():
                # No rank holds a class twice: static replication's volume, popularity-independent, and
                # N (s G - E) elements fewer than the holders' all-reduce and slice fetch moved before
                assert grads == s * N * (G - 1) * size
                assert grads == (2 * N * (s * G - E) + N * (E - s) - N * (s * G - E)) * size
                closed_form_checked += 1
            if (next_RE.sum(axis=1) == s).all():
                assert weights == s * N * (G - 1) * size
                closed_form_checked += 1

            if N % 12 == 0:
                # The simulator's formulas for the same placement are the measured bytes.
                policy = ReplicatePolicy(
                    ReplayConfig(topo, ByteModel(N, weight_bytes_per_param=size, grad_bytes_per_param=size),
                                 slots_per_rank=s),
                    num_layers=1,
                    num_experts=E,
                )  # fmt: skip
                idle = DispatchPlan.from_dense(np.zeros((G, E, G), dtype=np.int64))
                sim = policy.traffic(PolicyStep(t, (LayerPlan(slot_placement(slots_T[t], E), idle, np.zeros((E, G))),)))
                sim_next = policy.traffic(
                    PolicyStep(t, (LayerPlan(slot_placement(slots_T[t + 1], E), idle, np.zeros((E, G))),))
                )
                assert measured["grad_reduce_scatter"] == as_links(sim["grad_reduce_scatter"])
                assert "grad_allreduce" not in sim and "grad_fetch" not in sim
                assert measured["weight_scatter"] == as_links(sim_next["weight_scatter"])
                simulator_checked += 1
    assert simulator_checked > 0
    if world_size == 4:
        # the distinct-class placement is the next one of iteration 0 and the current one of iteration 1
        assert closed_form_checked >= 2


def test_adam_slices_equal_torch_adam_on_full_vectors():
    E, N, G = 3, 11, 4  # uneven slices: 3, 3, 3, 2 elements
    rng = np.random.default_rng(7)
    for options in (
        {},
        dict(weight_decay=0.05),
        dict(weight_decay=0.05, decoupled_weight_decay=True, betas=(0.5, 0.9), eps=1e-6),
    ):
        W_EN = torch.from_numpy(rng.standard_normal((E, N))).float()
        cfg = AdamSettings(lr=3e-3, **options)
        full = [torch.nn.Parameter(W_EN[e].clone()) for e in range(E)]
        opt = torch.optim.Adam(full, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                               decoupled_weight_decay=cfg.decoupled_weight_decay)  # fmt: skip
        # Odd ranks take the offload path (host state; on this CPU-only machine the same memory).
        slices = [ExpertSlices(W_EN, r, G, adam=cfg, device="cpu", offload=r % 2 == 1) for r in range(G)]
        assert [sl.shape for sl in slices] == [(E, 3), (E, 3), (E, 3), (E, 2)]
        for step in range(30):
            # gradients over six orders of magnitude, so the moments' rounding is exercised
            grad_EN = torch.from_numpy(rng.standard_normal((E, N)) * 10 ** rng.uniform(-4, 2)).float()
            lr = None if step % 3 else 1e-3 * (step + 1)  # the configured lr, or a scheduler's
            for e in range(E):
                full[e].grad = grad_EN[e].clone()
            opt.param_groups[0]["lr"] = cfg.lr if lr is None else lr
            opt.step()
            for sl in slices:
                sl.step(grad_EN[:, sl.start : sl.stop], lr)
        with torch.no_grad():
            ref_EN = torch.stack([p.detach() for p in full])
        for sl in slices:
            assert torch.equal(sl.master_En, ref_EN[:, sl.start : sl.stop]), options
            assert torch.equal(sl.weights(torch.bfloat16), ref_EN[:, sl.start : sl.stop].to(torch.bfloat16))
            assert sl.state_bytes() == 3 * 4 * E * (sl.stop - sl.start)
            assert sl.step_count.item() == 30


def test_adam_slices_with_decay_mask_equal_adamw_param_groups():
    # Megatron's optimizer: AdamW with weight decay on the weight matrices, none on the biases.
    # Each expert row is [weight (7 elements), bias (4)]; the slices must match bit for bit.
    E, N, G, W = 2, 11, 3, 7
    rng = np.random.default_rng(3)
    W_EN = torch.from_numpy(rng.standard_normal((E, N))).float()
    cfg = AdamSettings(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    weights = [torch.nn.Parameter(W_EN[e, :W].clone()) for e in range(E)]
    biases = [torch.nn.Parameter(W_EN[e, W:].clone()) for e in range(E)]
    opt = torch.optim.AdamW(
        [{"params": weights, "weight_decay": cfg.weight_decay}, {"params": biases, "weight_decay": 0.0}], lr=cfg.lr
    )
    mask_N = torch.arange(N) < W
    slices = [ExpertSlices(W_EN, r, G, adam=cfg, device="cpu", decay_mask_N=mask_N) for r in range(G)]
    for step in range(20):
        grad_EN = torch.from_numpy(rng.standard_normal((E, N))).float()
        lr = 1e-2 / (step + 1)
        for e in range(E):
            weights[e].grad, biases[e].grad = grad_EN[e, :W].clone(), grad_EN[e, W:].clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for sl in slices:
            sl.step(grad_EN[:, sl.start : sl.stop], lr)
    ref_EN = torch.cat([torch.stack([p.detach() for p in weights]), torch.stack([p.detach() for p in biases])], dim=1)
    for sl in slices:
        assert torch.equal(sl.master_En, ref_EN[:, sl.start : sl.stop])
    with pytest.raises(ValueError, match="decay_mask_N must be a bool"):
        ExpertSlices(W_EN, 0, G, adam=cfg, device="cpu", decay_mask_N=torch.ones(N))


def test_slot_weights_assignment_and_in_place_fill():
    slots = SlotWeights([[0, 0, 1, 2, 2, 2], [2, 2, 2, 2, 3, 3]], 0, 4, 2, dtype=torch.float32, device="cpu")
    assert slots.held_experts.tolist() == [0, 1, 2] and slots.held_row_S.tolist() == [0, 0, 1, 2, 2, 2]
    assert slots.placement.counts_ED.tolist() == [[2, 0], [1, 0], [3, 4], [0, 2]]
    assert slots.num_ranks == 2 and slots.slots_per_rank == 6 and slots.slots_SN.requires_grad
    with torch.no_grad():
        slots.slots_SN[:3] = torch.tensor([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5]])
    slots.fill_from_held()
    assert slots.slots_SN.tolist() == [[0.0, 0.5], [0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [2.0, 2.5], [2.0, 2.5]]

    with pytest.raises(PlacementError, match=r"rank 1's slots hold experts \[1, 2, 3, 3, 3, 2\], not in ascending"):
        slots.assign([[0, 0, 0, 0, 0, 1], [1, 2, 3, 3, 3, 2]])
    # an expert's holders need not be consecutive ranks (the balanced layout spreads them)
    spread = SlotWeights([[0], [1], [0]], 0, 2, 4, dtype=torch.float32, device="cpu")
    assert spread.placement.holders(0).tolist() == [0, 2]
    with pytest.raises(PlacementError, match=r"slot_expert_RS has shape \(2, 3\) but this rank's slots were built"):
        slots.assign([[0, 1, 2], [2, 3, 3]])
    with pytest.raises(PlacementError, match=r"slot 1 of rank 0 holds expert 4, not in \[0, 4\)"):
        slots.assign([[0, 4, 4, 4, 4, 4], [1, 2, 3, 3, 3, 3]])
    with pytest.raises(PlacementError, match=r"rank 2 is not in \[0, 2\)"):
        SlotWeights([[0], [1]], 2, 2, 4, dtype=torch.float32, device="cpu")
    assert slots.slot_expert_S.tolist() == [0, 0, 1, 2, 2, 2], "a rejected assignment leaves the old one"


def test_argument_errors():
    with pytest.raises(ValueError, match=r"AdamSettings.betas must be two numbers in \[0, 1\)"):
        AdamSettings(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="AdamSettings.lr must be finite and >= 0, got -1"):
        AdamSettings(lr=-1)
    with pytest.raises(ValueError, match=r"weights_EN must be a floating-point \[experts, elements\] tensor"):
        ExpertSlices(torch.zeros(4, dtype=torch.int64), 0, 1, adam=AdamSettings(), device="cpu")
    with pytest.raises(PlacementError, match=r"rank 3 is not in \[0, 2\)"):
        ExpertSlices(torch.zeros(2, 4), 3, 2, adam=AdamSettings(), device="cpu")
    sl = ExpertSlices(torch.zeros(2, 5), 1, 2, adam=AdamSettings(), device="cpu")
    with pytest.raises(ValueError, match=r"rank 1: the gradient slice must have shape \(2, 2\), got \(2, 3\)"):
        sl.step(torch.zeros(2, 3))


def test_world_of_one():
    """G = 1: every phase is local, nothing is sent, and the machinery still equals the dense reference."""
    W_EN = torch.arange(12.0).reshape(3, 4)
    counter = TrafficCounter()
    with single_rank_group():
        world = dist.group.WORLD
        cfg = AdamSettings(lr=0.1)
        with pytest.raises(ValueError, match="pass the replicate process group explicitly"):
            ReplicatedExperts(W_EN, [[0, 1, 2]], None, adam=cfg)
        with pytest.raises(ValueError, match="the topology has 2 devices but the group 1 ranks"):
            ReplicatedExperts(W_EN, [[0, 1, 2]], world, adam=cfg, topology=Topology.single_node(2))
        with pytest.raises(ValueError, match="slot_expert_RS has 2 ranks but the group 1"):
            ReplicatedExperts(W_EN, [[0, 1], [2, 2]], world, adam=cfg)
        experts = ReplicatedExperts(W_EN, [[0, 1, 1, 2]], world, adam=cfg, traffic=counter)
        assert experts.num_experts == 3 and experts.expert_numel == 4
        counts = torch.tensor([5, 0, 2])
        assert experts.popularity(counts) is counts and counts.tolist() == [5, 0, 2]
        with pytest.raises(ValueError, match=r"counts_E must be a \[3\] tensor, got \(4,\)"):
            experts.popularity(torch.zeros(4))
        with pytest.raises(ValueError, match=r"rank 0: grad_SN must have the slots' shape \(4, 4\), got \(3, 4\)"):
            experts.reduce_gradients(torch.zeros(3, 4))
        with pytest.raises(ValueError, match="rank 0: grad_SN must be torch.float32 on cpu, got torch.float64 on cpu"):
            experts.reduce_gradients(torch.zeros(4, 4, dtype=torch.float64))

        # Backward through slot views, as the MoE layer will run it: slots 1 and 2 (both expert 1) sum.
        x = torch.ones(4)
        loss = sum((experts.slots.slots_SN[j] * x * (j + 1)).sum() for j in range(4))
        loss.backward()
        grad_En = experts.reduce_gradients(experts.slots.slots_SN.grad)
        assert grad_En.tolist() == [[1.0] * 4, [5.0] * 4, [4.0] * 4]
        reference = torch.nn.Parameter(W_EN.clone())
        opt = torch.optim.Adam([reference], lr=0.1)
        reference.grad = grad_En.clone()
        opt.step()
        experts.step(grad_En)
        experts.push([[0, 1, 2, 2]])
        assert torch.equal(experts.slots.slots_SN.detach(), reference.detach()[[0, 1, 2, 2]])
        assert all(sum(link.values()) == 0 for link in counter.snapshot().values())
