"""Cost model of the simulator: closed-form collectives, worked compute examples, device selection,
trace scaling and memory checks."""

import numpy as np
import pytest
from sim_builders import balanced_trace, make_cluster, make_model

from megatron_patches.config import expert_parameter_count
from megatron_patches.placement.accounting import dispatch_bytes
from megatron_patches.placement.baselines import EPLayout
from megatron_patches.sim import (
    CommModel,
    ComputeModel,
    Hardware,
    KernelEfficiency,
    LinkParameters,
    SimError,
    Workload,
    build_scenario,
    resolve_systems,
    scale_counts,
    select_devices,
)
from megatron_patches.placement.accounting import imbalance
from megatron_patches.placement.fssdp import dispatch, gather_bandwidth, materialize
from megatron_patches.placement.types import ShardLayout, Topology
from megatron_patches.sim.costs import all_ranks_allreduce_steps, all_to_all_bytes, ring_broadcast_bytes
from megatron_patches.sim.report import imbalance_rows
from megatron_patches.sim.systems import check_memory

LINKS = LinkParameters()


def hardware(nodes=2, per_node=4, intra=100.0, nic_gbps=80.0, **gpu):
    cluster = make_cluster(nodes, per_node, intra, nic_gbps, gpu=gpu or None)
    return Hardware.from_cluster(cluster, nodes * per_node)


# ---------------------------------------------------------------------------------------------
# Communication: closed forms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 4), (4, 2)])
def test_uniform_all_to_all_matches_its_closed_form(nodes, per_node):
    """Every device sends b tokens to every device (EP, one expert each): the busiest link class decides.

    t = latency + max((P - 1) b B / (bw_intra e_intra), P (D - P) b B / (bw_nic e_inter)), the second
    term counting the P devices of a node sharing its NIC; latency is inter-node when D > P.
    """
    hw = hardware(nodes, per_node)
    D, P, b, token_bytes = nodes * per_node, per_node, 100, 512
    plan = EPLayout.even(D, D).dispatch(np.full((D, D), b))
    t = CommModel(hw, LINKS).time(dispatch_bytes(plan, hw.topology, token_bytes))
    intra = (P - 1) * b * token_bytes / (100e9 * LINKS.intra_efficiency)
    nic = P * (D - P) * b * token_bytes / (10e9 * LINKS.inter_efficiency)
    latency = LINKS.inter_latency_s if nodes > 1 else LINKS.intra_latency_s
    assert t == pytest.approx(latency + max(intra, nic), rel=1e-12)


@pytest.mark.parametrize("nodes, per_node, steps", [(1, 2, 2), (1, 4, 6), (2, 4, 8), (3, 2, 6)])
def test_ring_allreduce_matches_its_closed_form(nodes, per_node, steps):
    """S bytes over a ring of D devices: 2 (D-1)/D S over every ring edge; node-major order puts one
    ring edge into and out of every node's NIC. Its latency-bound steps are NCCL's fewer of the
    ring's 2 (D - 1) and the double binary tree's 2 (g - 1 + ceil(log2 N)): on one node the ring's
    (2 and 6), on 2 x 4 the tree's 2 (3 + 1) = 8 of the ring's 14, on 3 x 2 2 (1 + 2) = 6 of 10."""
    hw = hardware(nodes, per_node)
    D, S = nodes * per_node, 8e6
    comm, t = CommModel(hw, LINKS).dense_allreduce(S)
    per_edge = 2 * (D - 1) / D * S
    assert comm.total == pytest.approx(D * per_edge, rel=1e-7)
    latency = LINKS.inter_latency_s if nodes > 1 else LINKS.intra_latency_s
    busiest = per_edge / (100e9 * LINKS.intra_efficiency)
    if nodes > 1:
        busiest = max(busiest, per_edge / (10e9 * LINKS.inter_efficiency))
    # the accounting keeps whole bytes, so a fractional per-edge share is rounded down
    assert t == pytest.approx(steps * latency + busiest, rel=1e-7)


def test_all_ranks_allreduce_takes_nccls_fewer_steps():
    """2 nodes of 1 GPU: ring and tree both 2 steps. 256 DGX nodes (2,048 GPUs): the ring's 4,094
    steps against the tree's 2 (7 + 8) = 30. 5 nodes of 8: ceil(log2 5) = 3, 2 (7 + 3) = 20."""
    assert all_ranks_allreduce_steps(Topology(2, 1, 1e9, 1e9)) == 2
    assert all_ranks_allreduce_steps(Topology(256, 8, 1e9, 1e9)) == 30
    assert all_ranks_allreduce_steps(Topology(5, 8, 1e9, 1e9)) == 20
    assert all_ranks_allreduce_steps(Topology(1, 8, 1e9, 1e9)) == 14
    assert all_ranks_allreduce_steps(Topology(1, 1, 1e9, 1e9)) == 1


def test_transfer_time_counts_per_nic_contention():
    """Two devices of node 0 each sending X off-node share one NIC: twice the time of one sender."""
    hw = hardware(2, 4)
    model = CommModel(hw, LINKS)
    zero = np.zeros(8)
    one = zero.copy()
    one[0] = 1e6
    two = one.copy()
    two[1] = 1e6
    recv = zero.copy()
    recv[4:6] = 1e6
    t1 = model.transfer_time(zero, one, zero, recv * 0.5)
    t2 = model.transfer_time(zero, two, zero, recv)
    nic = 10e9 * LINKS.inter_efficiency
    assert t1 == pytest.approx(LINKS.inter_latency_s + 1e6 / nic)
    assert t2 == pytest.approx(LINKS.inter_latency_s + 2e6 / nic)
    assert model.transfer_time(zero, zero, zero, zero) == 0.0


def test_all_to_all_bytes_equal_the_dense_traffic():
    """The simulator's byte count of dispatch plans (the accounting's, which fssdp's compact plans
    answer without their entries) equals what the dense source-to-device traffic implies (token
    bytes are whole: hidden size x element size)."""
    rng = np.random.default_rng(5)
    hw = hardware(2, 4)
    plans = []
    for _ in range(3):
        loads = rng.integers(0, 200, size=(8, 16))
        placement = materialize(ShardLayout.even(16, 8), loads.sum(axis=0), 3, 2, hw.topology)
        plans.append(dispatch(placement, loads, hw.topology))
    same = hw.topology.same_node_DD()
    for token_bytes in (512, 768.0):
        for plan, got in zip(plans, all_to_all_bytes(plans, hw.topology, token_bytes)):
            t = plan.traffic_SD() * token_bytes
            intra = np.where(same & ~np.eye(8, dtype=bool), t, 0.0)
            inter = np.where(same, 0.0, t)
            np.testing.assert_array_equal(got, [intra.sum(axis=1), inter.sum(axis=1), intra.sum(axis=0),
                                                inter.sum(axis=0)])
        assert all_to_all_bytes(plans, hw.topology, token_bytes)[:, 1].sum() > 0  # some bytes cross nodes


def test_vectorised_imbalance_equals_the_accounting():
    rng = np.random.default_rng(6)
    loads = rng.integers(0, 100, size=(7, 9)).astype(float)
    loads[3] = 0
    np.testing.assert_allclose(imbalance_rows(loads), [imbalance(row) for row in loads])


def test_ring_broadcast_worked_example():
    """Holders {1, 2, 5, 6}, root 5, 2 nodes x 4: the buffer goes 5 -> 6 -> 1 -> 2."""
    hw = hardware(2, 4)
    holds = np.zeros((1, 8), dtype=bool)
    holds[0, [1, 2, 5, 6]] = True
    comm = ring_broadcast_bytes(holds, [5], 1000.0, hw.topology)
    np.testing.assert_array_equal(comm.sent_intra_D, [0, 1000, 0, 0, 0, 1000, 0, 0])
    np.testing.assert_array_equal(comm.sent_inter_D, [0, 0, 0, 0, 0, 0, 1000, 0])
    np.testing.assert_array_equal(comm.recv_intra_D, [0, 0, 1000, 0, 0, 0, 1000, 0])
    np.testing.assert_array_equal(comm.recv_inter_D, [0, 1000, 0, 0, 0, 0, 0, 0])
    reduce = comm.reversed()
    assert reduce.recv_D[5] == 1000 and reduce.sent_D[5] == 0


def test_ring_broadcast_moves_k_minus_1_copies_and_every_holder_but_the_root_receives_once():
    rng = np.random.default_rng(3)
    hw = hardware(2, 4)
    holds = rng.random((20, 8)) < 0.5
    holds[np.arange(20), rng.integers(0, 8, 20)] = True
    roots = np.array([rng.choice(np.flatnonzero(row)) for row in holds])
    comm = ring_broadcast_bytes(holds, roots, 10.0, hw.topology)
    assert comm.total == pytest.approx(10.0 * (holds.sum() - 20))
    expected_recv = 10.0 * (holds.sum(axis=0) - np.bincount(roots, minlength=8))
    np.testing.assert_allclose(comm.recv_D, expected_recv)
    with pytest.raises(SimError, match="root"):
        ring_broadcast_bytes(np.array([[True, False]]), [1], 1.0, hardware(1, 2).topology)


# ---------------------------------------------------------------------------------------------
# Compute: worked examples
# ---------------------------------------------------------------------------------------------


def test_expert_time_worked_example():
    """h = 256, f = 512 (with biases: P = 262,912): 1000 tokens on one expert, none on another."""
    hw = hardware(1, 2)
    model = make_model(hidden=256)
    eff = KernelEfficiency()
    compute = ComputeModel(Workload(model, 2, 1, 512), hw, eff)
    P = expert_parameter_count(model)
    assert P == 262912
    gemm = 2 * P * (1000 + eff.expert_half_tokens) / (100e12 * eff.expert_gemm)
    act = 1000 * 4 * 512 / (1000e9 * eff.memory)
    expected = eff.kernel_launch_s + gemm + act
    tokens_ED = np.array([[1000, 0], [0, 0]])
    np.testing.assert_allclose(compute.expert_fwd(tokens_ED), [expected, 0.0], rtol=1e-12)
    # 2 tokens on a GPU with slow memory: streaming the expert's weights dominates the GEMM
    slow = ComputeModel(Workload(model, 2, 1, 512), hardware(1, 2, hbm_gb_s=100.0), eff)
    weights = 2 * P / (100e9 * eff.memory)
    assert weights > 2 * P * (2 + eff.expert_half_tokens) / (100e12 * eff.expert_gemm)
    small = slow.expert_fwd(np.array([[2, 2], [0, 0]]))
    np.testing.assert_allclose(small, eff.kernel_launch_s + weights + 2 * 2048 / (100e9 * eff.memory))


def test_expert_gemm_efficiency_rises_with_tokens():
    compute = ComputeModel(Workload(make_model(), 2, 1, 512), hardware(1, 2), KernelEfficiency())
    n = np.array([16, 64, 256, 1024, 4096, 16384])
    t = compute.expert_fwd(n[:, None, None] * np.ones((1, 1, 2)))[:, 0]
    per_token = t / n
    assert np.all(np.diff(per_token) < 0)


def test_attention_flash_is_causal_and_unfused_attention_is_memory_bound():
    model = make_model(hidden=1024, heads=8, seq=4096)
    eff = KernelEfficiency()
    n, s = 4096, 4096
    flash = ComputeModel(Workload(model, 1, 1, s), hardware(1, 1), eff)
    projections = (2 * n * 1024 * 3072 + 2 * n * 1024 * 1024) / (100e12 * eff.dense_gemm)
    core = 0.5 * 4 * n * s * 1024 / (100e12 * eff.flash_attention)
    assert flash.attention_fwd_D()[0] == pytest.approx(projections + core)
    assert flash.attention_bwd_D()[0] == pytest.approx(2 * projections + 2.5 * core)
    unfused = ComputeModel(Workload(model, 1, 1, s), hardware(1, 1, flash_attention=False), eff)
    scores = n * 8 * s * 2 * ComputeModel.SCORE_PASSES / (1000e9 * eff.memory)
    assert scores > 4 * n * s * 1024 / (100e12 * eff.dense_gemm)  # memory-bound at these sizes
    assert unfused.attention_fwd_D()[0] == pytest.approx(projections + scores)


def test_kernel_efficiency_overrides_are_validated():
    assert KernelEfficiency().with_overrides({"expert_gemm": 0.7}).expert_gemm == 0.7
    with pytest.raises(SimError, match="unknown kernel efficiency parameter.*valid"):
        KernelEfficiency().with_overrides({"gemm": 0.5})
    with pytest.raises(SimError, match="dense_gemm is a fraction of peak"):
        KernelEfficiency(dense_gemm=1.5)


# ---------------------------------------------------------------------------------------------
# Devices, trace scaling, memory
# ---------------------------------------------------------------------------------------------


def test_select_devices_takes_one_partial_node_or_whole_nodes():
    cluster = make_cluster(4, 8)
    assert select_devices(cluster, 3).num_devices == 3
    assert select_devices(cluster, 16).num_nodes == 2
    assert select_devices(cluster, 32).num_devices == 32
    with pytest.raises(SimError, match=r"--gpus 40: cluster test has only 32 GPUs.*whole nodes \[8, 16, 24, 32\]"):
        select_devices(cluster, 40)
    with pytest.raises(SimError, match="cannot be cut at 12 GPUs"):
        select_devices(cluster, 12)
    with pytest.raises(SimError, match="positive integer"):
        select_devices(cluster, 0)


def test_scale_counts_is_exact_and_proportional():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(5, 3, 17))
    counts[0, 0] = 0
    scaled = scale_counts(counts, 1000)
    assert scaled.dtype == np.int64
    assert np.all(scaled.sum(axis=-1) == 1000)
    rows = np.maximum(counts.sum(axis=-1, keepdims=True), 1)
    exact = np.where(counts.sum(axis=-1, keepdims=True) > 0, counts * 1000 / rows, 1000 / 17)
    assert np.all(np.abs(scaled - exact) < 1)
    np.testing.assert_array_equal(scale_counts(scaled, 1000), scaled)


def test_trace_must_match_the_model():
    with pytest.raises(SimError, match="trace has 2 layers x 4 experts but the model has 2 MoE layers x 8 experts"):
        build_scenario(make_model(experts=8), make_cluster(1, 4), 4, balanced_trace(2, 2, 4, 4, 10))


def test_a_model_that_does_not_fit_fails_with_its_parts():
    cluster = make_cluster(1, 2, gpu={"memory_gb": 2})
    scn = build_scenario(make_model(hidden=1024, seq=2048, layers=4), cluster, 2, balanced_trace(2, 4, 8, 2, 100))
    ep = resolve_systems(["ep"])
    with pytest.raises(SimError, match=r"does not fit: .* needs [0-9.]+ GB per device .*activations .* has 2 GB"):
        check_memory(scn, ep)
    roomy = build_scenario(make_model(), make_cluster(1, 2), 2, balanced_trace(2, 2, 8, 2, 100))
    assert check_memory(roomy, ep) == {}


def test_probed_topology_shares_each_nic_among_its_node_as_the_runtimes_probe_measures():
    """t comes from these figures (sim.systems), as the runtime's comes from its probe: all same-
    position rings run at once, so a node's 8 devices share its 100 Gbps NIC."""
    hw = hardware(4, 8, 300.0, 100.0)
    assert hw.topology.inter_node_bw == 12.5e9  # one pair alone gets the NIC
    probed = hw.probed_topology
    assert (probed.nodes, probed.devices_per_node) == (4, 8)
    assert probed.inter_node_bw == 12.5e9 / 8 and probed.intra_node_bw == 300e9
    # node-aware gather: the node's NIC carries each expert once, relayed inside: ~12.1 GB/s, not 77
    assert gather_bandwidth(probed, "hierarchical") == pytest.approx(1 / (1 / 12.5e9 + 7 / (8 * 300e9)))
    assert gather_bandwidth(probed, "flat") == 12.5e9 / 8
    # one node: no NIC in the way
    assert hardware(1, 8, 300.0, 100.0).probed_topology.inter_node_bw == 300e9


def test_memory_parts_separate_parameters_gradients_and_optimizer_state():
    """By hand (issue 47 item 6): the model has dense parameters 2 x 266,248 + 393,728 = 926,224
    and experts of 2 x 256 x 512 + 512 + 256 = 262,912 parameters; EP on 2 devices owns 8 / 2 = 4
    experts per layer, 8 over its 2 layers. bf16: 2 B weights, 4 B fp32 gradients, 12 B optimizer
    state (fp32 master weights and two moments), the dense optimizer state sharded over D = 2."""
    from megatron_patches.sim import simulate

    scn = build_scenario(make_model(), make_cluster(1, 2), 2, balanced_trace(2, 2, 8, 2, 100))
    result = simulate(scn, resolve_systems(["ep"])[0])
    parts = dict(result.memory_parts)
    device = parts.pop("device")
    expected = {
        "dense parameters": 926_224 * 2, "dense gradients": 926_224 * 4, "dense optimizer state": 926_224 * 12 / 2,
        "expert parameters": 8 * 262_912 * 2, "expert gradients": 8 * 262_912 * 4,
        "expert optimizer state": 8 * 262_912 * 12,
    }
    assert {k: parts[k] for k in expected} == expected
    assert list(parts)[-2:] == ["activations", "reserve"] and parts["reserve"] == scn.memory.reserved_bytes
    assert sum(parts.values()) == pytest.approx(float(result.memory_D[device]), rel=1e-12)
    # a refusal names the same parts
    tight = build_scenario(make_model(hidden=1024, seq=2048, layers=4), make_cluster(1, 2, gpu={"memory_gb": 2}), 2,
                           balanced_trace(2, 4, 8, 2, 100))
    with pytest.raises(SimError, match=r"dense parameters .* GB, dense gradients .* expert optimizer state [0-9.]+ GB, "
                                       r"activations"):
        check_memory(tight, resolve_systems(["ep"]))
