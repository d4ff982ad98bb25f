"""Validation of the simulator against what must hold (issue 8, item 7).

- balanced loads: systems that only react to imbalance behave exactly like EP;
- a closed-form all-to-all and ring all-reduce reproduced end to end;
- the sparse collectives' simulated bytes equal the placement engine's accounting;
- monotonicity: more bandwidth never makes an iteration slower;
- zebra with equal speeds and free communication approaches its analytic bound;
- the breakdown adds up to the iteration time for every system.
"""

import os

import numpy as np
import pytest
from sim_builders import balanced_trace, make_cluster, make_model, make_pool, skewed_trace

from megatron_patches.config import load_cluster_config, load_model_config
from megatron_patches.placement.accounting import allreduce_equivalent_bytes, sparse_all_gather_bytes
from megatron_patches.placement.policies import make_policy
from megatron_patches.placement.trace import Trace, read_trace
from megatron_patches.sim import (
    BREAKDOWN_PARTS,
    KernelEfficiency,
    LinkParameters,
    SimError,
    SimOptions,
    build_scenario,
    replay_config,
    resolve_systems,
    simulate,
)
from megatron_patches.sim.systems import layout_problems

MODEL = make_model(layers=2, experts=8, hidden=512, seq=1024)
PLACEMENT_SYSTEMS = ["ep", "smartmoe", "flexmoe-2", "fastermoe", "fssdp", "fssdp-mat", "fssdp-shard",
                     "fssdp-remat", "replicate", "static", "ep-ideal", "ep-bound"]


def run(scn, name):
    return simulate(scn, resolve_systems([name])[0])


@pytest.fixture(scope="module")
def balanced():
    trace = balanced_trace(6, 2, 8, 8, 64)
    return build_scenario(MODEL, make_cluster(), 8, trace, options=SimOptions(reshard_interval=3, overlap_degree=2))


@pytest.fixture(scope="module")
def skewed():
    trace = skewed_trace(8, 2, 8, 8, 16384, seed=1)
    return build_scenario(MODEL, make_cluster(), 8, trace,
                          options=SimOptions(reshard_interval=3, overlap_degree=2, memory_capacity=1))


def test_balanced_loads_make_load_reactive_systems_equal_ep(balanced):
    """SmartMoE finds no swap, FlexMoE no replica that lowers the maximum, FasterMoE no shadow that
    pays, FSSDP without copies (t = 0) dispatches like EP: identical iteration times. FSSDP's
    sharding-only variant does not re-shard at all: balanced loads cannot lower the even layout's
    imbalance bound, so nothing moves."""
    ep = run(balanced, "ep")
    for name in ("smartmoe", "flexmoe-2", "fastermoe", "ep-ideal", "ep-bound"):
        np.testing.assert_allclose(run(balanced, name).iteration_s_I, ep.iteration_s_I, rtol=1e-12, err_msg=name)
    no_copies = build_scenario(MODEL, make_cluster(), 8, balanced_trace(6, 2, 8, 8, 64),
                               options=SimOptions(overlap_degree=0))
    np.testing.assert_allclose(run(no_copies, "fssdp-mat").iteration_s_I, ep.iteration_s_I, rtol=1e-12)
    shard = run(balanced, "fssdp-shard")
    np.testing.assert_allclose(shard.iteration_s_I, ep.iteration_s_I, rtol=1e-12)
    assert shard.details["rearrangement_events"] == 0


def test_balanced_loads_every_system_is_balanced_and_dropless(balanced):
    """Imbalance 1 and survival 1 for every system that does not materialize copies; replicated
    systems pay only for what replication costs (gradient synchronisation, optimizer state), never
    for imbalance."""
    ep = run(balanced, "ep")
    for name in ("smartmoe", "flexmoe-2", "fastermoe", "fssdp-shard"):
        r = run(balanced, name)
        np.testing.assert_allclose(r.imbalance_IL, 1.0, err_msg=name)
        np.testing.assert_allclose(r.survival_IL, 1.0, err_msg=name)
        np.testing.assert_allclose(r.breakdown_I["straggler_wait"], 0.0, atol=1e-15, err_msg=name)
        np.testing.assert_allclose(r.breakdown_I["all_to_all"], ep.breakdown_I["all_to_all"], rtol=1e-9, err_msg=name)
    # DeepSpeed's layout (4 slots: every class on 4 devices) serves a source's tokens from its local
    # replica where it has one, so less crosses the all-to-all; the replicas all-reduce gradients.
    # (The default 9 slots would give one class 2 instances on one device, which replicate's
    # local-first spreading cannot balance at capacity 1.0; DeepSpeed cannot express 9 slots.)
    four = build_scenario(MODEL, make_cluster(), 8, balanced_trace(6, 2, 8, 8, 64),
                          options=SimOptions(slots_per_rank=4, reshard_interval=3, overlap_degree=2))
    static = run(four, "static")
    # remote tokens spread over 3 replicas in whole tokens: 1 in 2,000 uneven
    np.testing.assert_allclose(static.imbalance_IL, 1.0, rtol=1e-3)
    np.testing.assert_allclose(static.survival_IL, 1.0)
    # fewer bytes (its time also holds the NIC shared with its replicas' gradient all-reduce)
    assert static.traffic["all_to_all"].sum() < run(four, "ep").traffic["all_to_all"].sum()
    assert static.details["collective_s"]["grad_allreduce"] > 0
    # replicate's balanced layout deals equal experts' instances out over distinct devices, as
    # DeepSpeed's does: local replicas, less all-to-all than ep, whole-token unevenness only
    replicate = run(four, "replicate")
    np.testing.assert_allclose(replicate.imbalance_IL, 1.0, rtol=1e-3)
    np.testing.assert_allclose(replicate.survival_IL, 1.0)
    assert replicate.traffic["all_to_all"].sum() < run(four, "ep").traffic["all_to_all"].sum()
    # At the default 9 slots (8 experts, 8 devices) each expert has 9 instances: two on one device,
    # one on each other. 64 tokens per source and expert, capacity ceil(4,096 / 72) = 57: a source
    # with one local instance keeps 57 and splits 7 evenly over the other 8 instances, 6 of which
    # are full, so about 3 in 4 of those are dropped (survival 475.25 / 512). The paper's contiguous
    # layout put all 9 on one device (ep with a capacity of 513) and kept everything; this is the
    # balanced layout's one known loss, measured on the drifting traces as 0.822 survival against
    # 0.825 (docs/benchmarks.md, "Replicate's slot layout").
    replicate = run(balanced, "replicate")
    np.testing.assert_allclose(replicate.survival_IL, 3802 / 4096)
    np.testing.assert_allclose(replicate.imbalance_IL, 1.0, rtol=1e-3)


def test_static_replication_hand_case():
    """DeepSpeed-style static replication, 2 devices (one per node, 80 Gbps NICs), 2 experts, 2 slots
    each: both devices hold both experts, so every token is served where it was routed (no
    all-to-all) and each expert's gradient is ring-all-reduced over its 2 replicas. An expert has
    2 x 256 x 512 + 512 + 256 = 262,912 parameters, 1,051,648 B of fp32 gradients (bf16 run); each
    device sends one buffer per expert (2 (r - 1) / r = 1): 2,103,296 B through its NIC at
    10 GB/s x 0.85 efficiency = 247.45 us, plus 2 ring steps x 25 us latency = 297.45 us per
    iteration. Replicate mode's balanced layout with equal loads puts one instance of each expert
    on each device too: no all-to-all, no replica all-reduce; its reduce-scatter sends the other
    device its half of both experts' gradients, 2 x 525,824 B through the NIC in one exchange:
    25 us + 123.72 us (half static's bytes and one latency step: the decoupled optimizer). Before
    its dispatch, replicate all-reduces every source's counts ([2 ranks, 2 experts] int64, 32 B)
    in a ring of 2 (D - 1) = 2 latency steps, each device sending 2 (D - 1) / D x 32 = 32 B:
    50 us + 32 B / 8.5 GB/s on the critical path; static routes from its own counts."""
    model = make_model(layers=1, experts=2, hidden=256, seq=512)
    scn = build_scenario(model, make_cluster(nodes=2, gpus_per_node=1), 2, balanced_trace(2, 1, 2, 2, 64),
                         options=SimOptions(slots_per_rank=2, capacity_factor=1.0))
    assert scn.workload.byte_model.expert_grad_bytes == 4 * 262_912
    static, ep, replicate = run(scn, "static"), run(scn, "ep"), run(scn, "replicate")
    assert static.details["collective_s"]["grad_allreduce"] == pytest.approx(2 * 25e-6 + 2_103_296 / 8.5e9, rel=1e-12)
    assert static.details["collective_s"]["all_to_all"] == 0.0
    assert static.traffic["grad_allreduce"].tolist() == [0.0, 2 * 2_103_296]
    assert ep.details["collective_s"]["all_to_all"] > 0
    assert replicate.details["collective_s"]["all_to_all"] == 0.0
    assert "grad_allreduce" not in replicate.details["collective_s"]
    assert replicate.details["collective_s"]["grad_reduce_scatter"] == pytest.approx(25e-6 + 2 * 525_824 / 8.5e9,
                                                                                     rel=1e-12)
    assert replicate.traffic["grad_reduce_scatter"].tolist() == [0.0, 2 * 2 * 525_824]
    assert replicate.details["collective_s"]["popularity"] == pytest.approx(2 * 25e-6 + 32 / 8.5e9, rel=1e-12)
    assert replicate.traffic["popularity"].tolist() == [0.0, 2 * 32]
    assert "popularity" not in static.details["collective_s"]


def test_padded_experts_compute_their_whole_capacity():
    """Issue 47 item 2, the capacity's padded compute, by hand: 2 devices, 2 experts, 2 slots each
    (both devices hold both), n tokens per (source, expert), so T = 4n routed per layer and an
    instance's capacity is ceil(cf x 4n / (2 x 2)) = cf x n. DeepSpeed's static replication pads:
    at cf 4 each instance computes 4n rows, forward and backward (x 3), though it receives n.
    Replicate computes what it receives (n) unless the run pads (Megatron's
    --moe-pad-expert-input-to-capacity), and then 4n too; at cf 1 padding changes nothing. The
    padded rows' activations are kept too, so the padded runs need more memory."""
    model = make_model(layers=1, experts=2, hidden=256, seq=512)
    cluster, trace = make_cluster(nodes=2, gpus_per_node=1), balanced_trace(2, 1, 2, 2, 64)

    def scenario(cf, pad=False):
        return build_scenario(model, cluster, 2, trace, options=SimOptions(slots_per_rank=2, capacity_factor=cf,
                                                                               pad_to_capacity=pad))

    one, four, four_padded = scenario(1.0), scenario(4.0), scenario(4.0, pad=True)
    n = int(one.source_ILDE[0, 0, 0, 0])

    def expert_s(scn, rows):  # forward + backward of both experts' instances on one device
        return 3.0 * float(scn.compute.expert_fwd(np.full((2, 2), float(rows)))[0])

    def expert_mean(scn, name):
        return run(scn, name).breakdown_I["expert_compute_mean"]

    np.testing.assert_allclose(expert_mean(four, "static"), expert_s(four, 4 * n), rtol=1e-12)
    np.testing.assert_allclose(expert_mean(one, "static"), expert_s(one, n), rtol=1e-12)
    np.testing.assert_allclose(expert_mean(four, "replicate"), expert_s(four, n), rtol=1e-12)
    np.testing.assert_allclose(expert_mean(four_padded, "replicate"), expert_s(four, 4 * n), rtol=1e-12)
    np.testing.assert_allclose(expert_mean(scenario(1.0, pad=True), "replicate"), expert_s(one, n), rtol=1e-12)
    assert run(four_padded, "replicate").memory_D.max() > run(four, "replicate").memory_D.max()
    assert run(four, "static").memory_D.max() > run(one, "static").memory_D.max()


@pytest.mark.parametrize("nodes, per_node", [(8, 1), (2, 4)])
def test_adaptive_replication_keeps_more_tokens_than_static(nodes, per_node):
    """The replication paper's comparison on skewed loads with a capacity: replicate, whose
    replica counts follow the popularity, drops fewer tokens than static replication's fixed
    4 instances per class. Both synchronise replica gradients every iteration (static by
    all-reduce among its replicas, replicate by reduce-scatter to the slice owners and the
    weights' scatter back). On the paper's cluster (one GPU per node) replicate is also faster.
    With 4 GPUs per node it need not be: 8 experts in 4 slots make DeepSpeed's expert-parallel
    groups pairs of ranks within a node, so static's all-to-all never crosses the network (and
    drops over the capacity at each source), while replicate's spreads over both nodes."""
    model = make_model(layers=2, experts=8, hidden=512, seq=1024, topk=1)
    for seed in range(2):
        scn = build_scenario(model, make_cluster(nodes=nodes, gpus_per_node=per_node), 8,
                             skewed_trace(6, 2, 8, 8, 16384, seed=seed),
                             options=SimOptions(slots_per_rank=4, capacity_factor=1.0))
        static, replicate = run(scn, "static"), run(scn, "replicate")
        assert replicate.survival_IL.mean() > static.survival_IL.mean() + 0.1
        if per_node == 1:
            assert replicate.iteration_s < static.iteration_s
        else:
            assert static.traffic["all_to_all"][1] == 0.0  # [intra, inter] bytes
            assert replicate.details["collective_s"]["all_to_all"] > 5 * static.details["collective_s"]["all_to_all"]


def test_ep_all_to_all_reproduces_the_closed_form(balanced):
    """Balanced EP, one expert per device: every source sends b tokens to every other device, four
    all-to-alls per layer (dispatch and combine, forward and backward), nothing hides them.

    Without NIC sharing that is the closed form. With it (the default), the combine all-to-all of
    layer 0's backward starts together with layer 1's dense-gradient all-reduce, issued before it:
    it waits that all-reduce's NIC time (a ring over 8 devices on 2 nodes: each node's NIC sends
    and receives 2 (D - 1) / D of the buffer, 2 x 7 / 8 x G bytes at 8.5 GB/s), and the iteration
    with it. Nothing else overlaps on the NIC: forward has no gradient traffic, and layer 0's
    all-reduce is the last thing but the embeddings' (on the same stream)."""
    alone = build_scenario(MODEL, make_cluster(), 8, balanced_trace(6, 2, 8, 8, 64),
                           options=SimOptions(reshard_interval=3, overlap_degree=2, nic_sharing=False))
    ep = run(alone, "ep")
    b = 64 * alone.trace_scale  # tokens per (source, expert) after scaling to the batch
    token_bytes, P, D = 2 * 512, 4, 8
    links = LinkParameters()
    intra = (P - 1) * b * token_bytes / (100e9 * links.intra_efficiency)
    nic = P * (D - P) * b * token_bytes / (10e9 * links.inter_efficiency)
    one = links.inter_latency_s + max(intra, nic)
    np.testing.assert_allclose(ep.breakdown_I["all_to_all"], 4 * 2 * one, rtol=1e-12)
    assert ep.traffic["all_to_all"][1] == pytest.approx(4 * 2 * D * (D - P) * b * token_bytes)

    shared = run(balanced, "ep")
    dense_layer_bytes = balanced.workload.dense_params()["per_layer"][1] * balanced.workload.byte_model.grad_bytes_per_param
    dense_nic = 2 * (D - 1) / D * dense_layer_bytes / (10e9 * links.inter_efficiency)
    np.testing.assert_allclose(shared.breakdown_I["all_to_all"], 4 * 2 * one + dense_nic, rtol=1e-12)
    np.testing.assert_allclose(shared.iteration_s_I, ep.iteration_s_I + dense_nic, rtol=1e-12)
    np.testing.assert_allclose(shared.details["nic_contention_s"]["all_to_all"], dense_nic, rtol=1e-12)


@pytest.mark.parametrize("nodes, per_node, latency, bandwidth", [(2, 1, 25e-6, 10e9 * 0.85), (1, 2, 10e-6, 100e9 * 0.8)])
def test_the_dispatch_plans_split_prices_the_all_to_all(nodes, per_node, latency, bandwidth):
    """2 devices, 2 experts, every one of the 2 x 512 tokens routed to expert 0 (on device 0 under
    EP), 512 B per token. EP: device 1 sends its 512 tokens, 262,144 B, over the NIC (two nodes:
    25 us + 262,144 B / 8.5 GB/s) or the intra-node link (one node: 10 us + 262,144 B / 80 GB/s),
    four times per layer. FSSDP gathers a copy of expert 0 onto device 1 (t = m = 1): every token
    is served where it was routed, so nothing crosses and the all-to-all costs nothing; the copy
    costs spAG + spRS instead."""
    model = make_model(layers=1, experts=2, hidden=256, seq=512, topk=1)
    source = np.zeros((3, 1, 2, 2), dtype=np.int64)
    source[..., 0] = 512
    scn = build_scenario(model, make_cluster(nodes=nodes, gpus_per_node=per_node), 2,
                         Trace(source.sum(axis=2), source, {}), options=SimOptions(overlap_degree=1, memory_capacity=1))
    assert scn.workload.byte_model.token_bytes == 512
    ep, fssdp = run(scn, "ep"), run(scn, "fssdp")
    assert ep.details["collective_s"]["all_to_all"] == pytest.approx(4 * (latency + 262_144 / bandwidth), rel=1e-12)
    assert fssdp.details["collective_s"]["all_to_all"] == 0.0
    assert fssdp.traffic["all_to_all"].tolist() == [0.0, 0.0]
    assert fssdp.details["collective_s"]["spag"] > 0
    np.testing.assert_allclose(fssdp.imbalance_IL, 1.0)


@pytest.mark.parametrize("pricing", ["hierarchical", "flat", "ring"])
def test_sparse_collective_bytes_equal_the_placement_accounting(pricing):
    """FSSDP's gather and reduce bytes, recomputed from an independent replay of the same policy
    with the placement engine's accounting, equal what the simulator priced; and spAG + spRS
    equals the all-reduce-equivalent volume of DESIGN 3 (2 (r - 1) x expert bytes), taken at the
    weight size for spAG and at the gradient size for spRS."""
    trace = skewed_trace(8, 2, 8, 8, 16384, seed=1)
    scn = build_scenario(MODEL, make_cluster(), 8, trace,
                         options=SimOptions(reshard_interval=3, overlap_degree=2, memory_capacity=1,
                                            sparse_collectives=pricing, fssdp_calibrate=False))
    spec = resolve_systems(["fssdp"])[0]
    result = simulate(scn, spec)
    config, _ = replay_config(scn, spec)
    policy = make_policy("fssdp", config, 2, 8)
    bm = scn.workload.byte_model
    tracker = config.tracker(2, 8, policy.default_window)
    gather = np.zeros(2)
    equivalent = 0
    for i in range(scn.num_iterations):
        step = policy.plan(i, tracker.predict(), scn.source_ILDE[i])
        for lp in step.layers:
            algorithm = "flat" if pricing == "ring" else pricing
            comm = sparse_all_gather_bytes(lp.shard, lp.placement, bm.expert_weight_bytes, scn.hardware.topology, algorithm)
            gather += (comm.intra, comm.inter)
            # spAG moves (r - 1) weight copies, spRS (r - 1) gradients: half of DESIGN 3's
            # all-reduce-equivalent volume at each size. In bf16 the gradients are fp32 (4 B) and the
            # weights 2 B, so spRS moves twice spAG's bytes and the sum is 1.5x the weight-sized volume.
            equivalent += (allreduce_equivalent_bytes(lp.placement, bm.expert_weight_bytes)
                           + allreduce_equivalent_bytes(lp.placement, bm.expert_grad_bytes)) / 2
        tracker.observe(scn.loads_ILE[i])
    gather /= scn.num_iterations
    spag, sprs = result.traffic["spag"], result.traffic["sprs"]
    assert gather.sum() > 0
    if pricing != "ring":  # the runtime's algorithms, per link class
        np.testing.assert_allclose(spag, gather)
    np.testing.assert_allclose(spag.sum(), gather.sum())
    np.testing.assert_allclose(spag.sum() + sprs.sum(), equivalent / scn.num_iterations)


@pytest.mark.parametrize("name", ["ep", "fssdp", "fssdp-remat", "smartmoe", "flexmoe-2", "replicate", "static"])
def test_more_bandwidth_is_never_slower(name):
    """Doubling every link (t and m fixed, so the plans stay the same) shortens or keeps every iteration."""
    trace = skewed_trace(8, 2, 8, 8, 16384, seed=2)
    options = SimOptions(reshard_interval=3, overlap_degree=2, memory_capacity=1, reserved_slots=1)
    times = []
    for factor in (1.0, 2.0, 8.0):
        cluster = make_cluster(intra_gb_s=100.0 * factor, nic_gbps=80.0 * factor)
        times.append(run(build_scenario(MODEL, cluster, 8, trace, options=options), name).iteration_s_I)
    assert np.all(times[1] <= times[0] * (1 + 1e-12)) and np.all(times[2] <= times[1] * (1 + 1e-12))
    assert times[2].mean() < times[0].mean()


def test_breakdown_adds_up_to_the_iteration_time_for_every_system(skewed):
    for name in PLACEMENT_SYSTEMS:
        r = run(skewed, name)
        parts = sum(r.breakdown_I[k] for k in BREAKDOWN_PARTS)
        np.testing.assert_allclose(parts, r.iteration_s_I, rtol=1e-9, err_msg=name)
        assert np.all(r.breakdown_I["expert_compute_max"] >= r.breakdown_I["expert_compute_mean"] - 1e-15)
        assert np.all(r.imbalance_IL >= 1.0 - 1e-12)


def test_rematerialization_trades_memory_for_gathers(skewed):
    """Without re-materialization every layer's copies live until its backward; with it only one
    layer's do, and the backward gathers them again (more sparse-collective time). No device
    needs more memory, and the devices that hold copies need less (the peak device may hold none:
    load-aware placement puts copies on the least-loaded devices)."""
    keep, remat = run(skewed, "fssdp"), run(skewed, "fssdp-remat")
    assert np.all(remat.memory_D <= keep.memory_D)
    assert remat.memory_D.sum() < keep.memory_D.sum()
    assert remat.details["collective_s"]["spag"] == pytest.approx(keep.details["collective_s"]["spag"])
    assert remat.details["collective_s"]["spag_remat"] > 0
    assert np.all(remat.iteration_s_I >= keep.iteration_s_I * (1 - 1e-12))


def test_flexmoe_drops_at_the_runs_capacity_and_holds_its_reserved_slots_from_the_start(skewed):
    """FlexMoE runs dropless unless the run sets a capacity; then it drops over the same
    per-instance capacity as replicate and static (the replication paper's comparison). Its
    reserved slots hold weights and optimizer state from iteration 0, so its memory is every
    device's full slot count whatever the loads (it was the filled slots only)."""
    assert np.all(run(skewed, "flexmoe-2").survival_IL == 1.0)
    options = dict(reshard_interval=3, overlap_degree=2, memory_capacity=1, reserved_slots=2)
    capped_skewed = build_scenario(MODEL, make_cluster(), 8, skewed_trace(8, 2, 8, 8, 16384, seed=1),
                                   options=SimOptions(capacity_factor=1.0, **options))
    capped_balanced = build_scenario(MODEL, make_cluster(), 8, balanced_trace(8, 2, 8, 8, 64),
                                     options=SimOptions(capacity_factor=1.0, **options))
    flexmoe, static = run(capped_skewed, "flexmoe-2"), run(capped_skewed, "static")
    assert flexmoe.details["capacity_factor"] == 1.0 and run(skewed, "flexmoe-2").details["capacity_factor"] is None
    assert flexmoe.survival_IL.mean() < 1.0 and static.survival_IL.mean() < 1.0
    balanced = run(capped_balanced, "flexmoe-2")
    np.testing.assert_allclose(balanced.survival_IL, 1.0)
    # balanced loads make no replica: FlexMoE is EP plus 2 empty reserved slots per device and layer
    slot_bytes = capped_balanced.memory.expert_bytes_per_instance(True)
    np.testing.assert_allclose(balanced.memory_D - run(capped_balanced, "ep").memory_D, 2 * MODEL.num_layers * slot_bytes,
                               rtol=1e-9)


def test_skew_makes_ep_wait_for_the_busiest_device(skewed):
    """EP's straggler wait is the gap between the busiest device's expert compute and the mean."""
    ep = run(skewed, "ep")
    b = ep.breakdown_I
    assert np.all(ep.imbalance_IL > 1.5)
    np.testing.assert_allclose(b["expert_compute_mean"] + b["straggler_wait"], b["expert_compute_max"], rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# Zebra
# ---------------------------------------------------------------------------------------------

ZEBRA_MODEL = make_model(layers=3, experts=8, hidden=512, seq=1024)
IDEAL_GEMMS = KernelEfficiency(expert_half_tokens=0.0, kernel_launch_s=0.0)
FREE_LINKS = LinkParameters(intra_latency_s=0.0, inter_latency_s=0.0)


def zebra_scenario(R, bandwidth_factor=1.0, efficiency=IDEAL_GEMMS, links=FREE_LINKS, trace=None):
    pool = make_pool(2, 2, intra_gb_s=100.0 * bandwidth_factor, nic_gbps=80.0 * bandwidth_factor)
    trace = trace or balanced_trace(2, 3, 8, 4, 64)
    return build_scenario(ZEBRA_MODEL, pool, 4, trace, efficiency=efficiency, links=links,
                          options=SimOptions(zebra_microbatches=R))


def test_zebra_with_equal_speeds_and_free_communication_approaches_its_bound():
    """Equal GPU types, no communication cost, ideal GEMMs: each role must do its own work, so the
    schedule takes at least max(attention role's work, expert role's work). One micro-batch makes
    the roles take turns; with a few micro-batches the zig-zag hides the faster role entirely.
    (At R = 32 the expert GEMMs get small enough to be bound by streaming their weights, which
    raises the expert role's work, but the schedule still stays at its bound.)"""
    excess = []
    for R in (1, 2, 4, 8, 16, 32):
        scn = zebra_scenario(R, bandwidth_factor=1e6)
        r = run(scn, "zebra")
        p = r.details["profile"]  # per micro-batch, forward + backward
        tokens_per_microbatch = 4 * 1024 / (2 * R)
        head = float(scn.compute.head_fwd_D()[0]) * tokens_per_microbatch / 1024 * 3
        bound = max(3 * R * p["t_attn_A"] + R * head, 3 * R * p["t_exp_E"])
        makespan = r.iteration_s - r.details["gradient_sync_s"] - r.details["optimizer_s"]
        assert makespan >= bound * (1 - 1e-9)
        excess.append(makespan / bound - 1)
    assert excess[0] > 0.5
    assert excess[1] < excess[0]
    assert max(excess[2:]) < 0.01


def test_zebra_beats_naive_disaggregation_and_asym_ea_fills_bubbles_on_a_slow_expert_pool():
    """Expert GPUs 4x slower than attention GPUs: the zig-zag overlaps the two roles, and Asym-EA
    moves experts onto the idle attention GPUs."""
    pool = make_pool(2, 2, expert_gpu={"peak_fp16_tflops": 25.0, "hbm_gb_s": 250.0})
    trace = balanced_trace(2, 3, 8, 4, 64)
    scn = build_scenario(ZEBRA_MODEL, pool, 4, trace, options=SimOptions(zebra_microbatches=4))
    naive, zp, asym = (run(scn, name) for name in ("zebra-naive", "zebra", "zebra-asym"))
    assert zp.iteration_s < naive.iteration_s
    assert sum(asym.details["offload_chunks_per_layer"]) > 0
    assert asym.iteration_s < zp.iteration_s
    for r in (naive, zp, asym):
        parts = sum(r.breakdown_I[k] for k in BREAKDOWN_PARTS)
        np.testing.assert_allclose(parts, r.iteration_s_I, rtol=1e-9, err_msg=r.name)


def test_zebra_more_bandwidth_is_never_slower():
    trace = skewed_trace(4, 3, 8, 4, 8192, seed=3)
    times = [run(zebra_scenario(4, f, KernelEfficiency(), LinkParameters(), trace), "zebra-asym").iteration_s_I
             for f in (1.0, 4.0)]
    assert np.all(times[1] <= times[0] * (1 + 1e-12))


def test_zebra_needs_a_two_type_pool():
    scn = build_scenario(ZEBRA_MODEL, make_cluster(1, 4), 4, balanced_trace(2, 3, 8, 4, 64))
    with pytest.raises(SimError, match="zebra systems need a pool of two GPU types"):
        run(scn, "zebra")


def test_ep_ideal_is_hetermoes_ep_per_gpu_type_with_throughputs_summed():
    """A pool of one GPU at full speed and one with half of every peak and bandwidth, 2 experts.
    Alone, each runs EP on one device (no all-to-all, no gradient all-reduce): the slow one's
    iteration takes exactly twice the fast one's t. Summing their throughputs, the pool does
    2 devices' tokens in 2 / (1/t + 1/(2t)) = 4t/3. When the slow type cannot hold the model,
    the fast one does everything: 2t. ep-bound (EP with every task at the device-mean time) is
    another system."""
    model = make_model(layers=1, experts=2, hidden=256, seq=512)
    half = {"peak_fp16_tflops": 50.0, "peak_fp32_tflops": 10.0, "peak_tf32_tflops": 25.0, "hbm_gb_s": 500.0}
    trace = skewed_trace(3, 1, 2, 2, 4096, seed=0)
    no_launch = KernelEfficiency(kernel_launch_s=0.0)  # a fixed cost per kernel would not halve
    t_fast = run(build_scenario(model, make_pool(1, 1), 1, trace, efficiency=no_launch), "ep").iteration_s_I
    pool = build_scenario(model, make_pool(1, 1, expert_gpu=half), 2, trace, efficiency=no_launch)
    t_slow = run(pool.on_gpu_type("OLD"), "ep").iteration_s_I
    np.testing.assert_allclose(t_slow, 2 * t_fast, rtol=1e-12)
    ideal = run(pool, "ep-ideal")
    np.testing.assert_allclose(ideal.iteration_s_I, 4 / 3 * t_fast, rtol=1e-12)
    assert ideal.details["gpu_types"]["OLD"]["throughput_share"] == pytest.approx(1 / 3)
    np.testing.assert_allclose(sum(ideal.breakdown_I[k] for k in BREAKDOWN_PARTS), ideal.iteration_s_I, rtol=1e-12)
    assert not np.allclose(run(pool, "ep-bound").iteration_s_I, ideal.iteration_s_I)
    tiny = build_scenario(model, make_pool(1, 1, expert_gpu=dict(half, memory_gb=0.5)), 2, trace, efficiency=no_launch)
    alone = run(tiny, "ep-ideal")
    np.testing.assert_allclose(alone.iteration_s_I, 2 * t_fast, rtol=1e-12)
    assert "EP needs" in alone.details["gpu_types"]["OLD"]["excluded"]
    homogeneous = build_scenario(model, make_cluster(nodes=1, gpus_per_node=2), 2, trace, efficiency=no_launch)
    np.testing.assert_allclose(run(homogeneous, "ep-ideal").iteration_s_I, run(homogeneous, "ep").iteration_s_I)


def test_distep_is_a_serial_schedule_hand_case():
    """zebra-naive (DistEP: attention on the new GPUs, experts on the old, one micro-batch) has
    nothing to overlap: per layer the forward runs attention, dispatch, experts, combine one after
    the other, the backward the same in reverse. 2 + 2 GPUs on two nodes (80 Gbps NICs, latency
    0), 3 layers, balanced loads: each attention rank holds 2 x 1024 tokens, top-2, 1024 B per
    token (512 x bf16), so every all-to-all pushes 2 x 4096 x 1024 = 8,388,608 B through one
    NIC at 10 GB/s x 0.85: 986.9 us, four per layer (dispatch and combine, forward and
    backward). Makespan = 3 (attention fwd+bwd + experts fwd+bwd + 4 x 986.9 us) + the head."""
    scn = zebra_scenario(1)
    r = run(scn, "zebra-naive")
    p = r.details["profile"]
    head = float(scn.compute.head_fwd_D()[0]) * 2048 / 1024 * 3  # forward + backward (2x)
    a2a = 8_388_608 / 8.5e9
    makespan = r.iteration_s - r.details["gradient_sync_s"] - r.details["optimizer_s"]
    assert makespan == pytest.approx(3 * (p["t_attn_A"] + p["t_exp_E"] + 4 * a2a) + head, rel=1e-9)
    assert r.traffic["all_to_all"][1] == pytest.approx(4 * 3 * 8_388_608)  # one way each: 4 per layer, 3 layers


def test_plain_zebra_runs_at_any_ratio_and_only_asym_ea_needs_divisibility():
    """HeterMoE ran pools of 4:5, 4:7 and 4:3 attention to expert GPUs. Plain zebra takes any M:N:
    8 experts over N = 3 expert ranks are blocks of 3, 3 and 2. The batch is the pool's devices x
    the tokens per device (5 against 6 devices at N = 4), so with balanced loads and ideal GEMMs
    (time linear in tokens, no launch cost) the busiest expert rank's work per iteration is 3
    experts x 5 at N = 3 against 2 experts x 6 at N = 4: 15/12 = 1.25, by hand. DistEP's serial
    schedule spends it all on the critical path (3 layers x the profile's t_exp_E, which is that
    busiest rank's forward + backward). Asym-EA's chunks need M | N
    or N | M and equal blocks: at 2:3 zebra-asym is not simulated, and says why, beside the systems
    that run."""
    busiest = {}
    for n in (4, 3):
        pool = make_pool(2, n, one_gpu_nodes=True)
        scn = build_scenario(ZEBRA_MODEL, pool, 2 + n, balanced_trace(2, 3, 8, 2 + n, 64), efficiency=IDEAL_GEMMS,
                             links=FREE_LINKS, options=SimOptions(zebra_microbatches=2))
        naive = run(scn, "zebra-naive")
        busiest[n] = naive.breakdown_I["expert_compute_max"]
        np.testing.assert_allclose(busiest[n], 3 * naive.details["profile"]["t_exp_E"], rtol=1e-12)
        assert np.all(np.isfinite(run(scn, "zebra").iteration_s_I))
        problems = layout_problems(scn, resolve_systems(["zebra-naive", "zebra", "zebra-asym"]))
        assert list(problems) == ([] if n == 4 else ["zebra-asym"])
    np.testing.assert_allclose(busiest[3] / busiest[4], 1.25, rtol=1e-12)
    assert "Asym-EA needs expert_ranks N=3 to divide num_experts=8" in problems["zebra-asym"]


def test_static_takes_deepspeeds_slot_counts_or_says_why_not():
    """DeepSpeed-MoE lays out s | E with E/s | D only. 8 experts on 8 GPUs: s in 1, 2, 4, 8. A given
    --slots-per-rank of 3 is refused for static alone (replicate takes it); by default static
    takes the most DeepSpeed can lay out within the memory budget (ceil(E/D) + reserved slots)."""
    systems = resolve_systems(["replicate", "static"])

    def scenario(**options):
        return build_scenario(MODEL, make_cluster(), 8, balanced_trace(2, 2, 8, 8, 64),
                              options=SimOptions(capacity_factor=1.0, **options))

    problems = layout_problems(scenario(slots_per_rank=3), systems)
    assert list(problems) == ["static"]
    assert problems["static"] == ("static replication cannot use 3 slots per rank: DeepSpeed's expert-parallel "
                                  "groups need s | E and E/s | ranks; valid s for 8 experts on 8 ranks: 1, 2, 4, 8")
    for reserved, chosen in ((2, 2), (6, 4), (0, 1)):
        scn = scenario(reserved_slots=reserved)
        assert layout_problems(scn, systems) == {}
        assert replay_config(scn, systems[1])[1]["slots_per_rank"] == chosen  # within 1 + reserved
        assert replay_config(scn, systems[0])[1]["slots_per_rank"] == 1 + reserved


RECORDED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "traces",
                        "tiny_ep4_austen.npz")


def test_a_trace_recorded_by_training_replays_at_its_own_scale():
    """The trace ep training wrote with --moe-log-loads (tests/data/traces): simulated at the run's
    own batch (4 ranks x micro-batch 4 x 128 tokens, top-2) it is used as recorded: the per-rank
    loads unchanged, and EP's device loads are the recorded loads summed over each rank's 2
    experts, so the simulated imbalance is the run's."""
    trace = read_trace(RECORDED)
    assert trace.metadata["model"] == "gpt" and trace.num_ranks == 4
    scn = build_scenario(load_model_config("tiny"), load_cluster_config("cluster_a"), 4, trace,
                         micro_batch_size=4, seq_length=128, precision="fp32")
    assert scn.trace_scale == 1.0 and scn.source_note == "per-rank loads of the trace (4 ranks)"
    np.testing.assert_array_equal(scn.source_ILDE, trace.source_loads)
    device_ILD = trace.loads.reshape(trace.num_iterations, 2, 4, 2).sum(axis=3)
    ep = run(scn, "ep")
    np.testing.assert_allclose(ep.imbalance_IL, device_ILD.max(axis=2) / device_ILD.mean(axis=2), rtol=1e-12)
    assert ep.imbalance_IL[-10:].mean() > 1.8  # the router has collapsed by the end of the run
    replicate = run(scn, "replicate")
    assert replicate.imbalance_IL[-10:].mean() < ep.imbalance_IL[-10:].mean()


def test_every_traffic_kind_is_named_in_the_one_vocabulary(skewed):
    """The simulator's traffic, its exposed time by kind and its collective times use the names of
    placement.accounting.TRAFFIC_KINDS, which the runtime's counters use too (tests/test_architecture.py)."""
    from megatron_patches.placement.accounting import TRAFFIC_KINDS

    for name in PLACEMENT_SYSTEMS:
        r = run(skewed, name)
        used = set(r.traffic) | set(r.exposed_by_kind_I) | set(r.details.get("collective_s", {}))
        assert used <= set(TRAFFIC_KINDS), (name, sorted(used - set(TRAFFIC_KINDS)))
