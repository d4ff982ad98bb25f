"""FSSDP's t and m (DESIGN 4.2): how many expert copies can be gathered while attention runs
(`overlap_degree`, from `gather_bandwidth`) and how many fit in memory (`memory_capacity`)."""

from __future__ import annotations

import numpy as np

from megatron_patches.placement.types import PlacementError, Topology, check_int


def gather_bandwidth(topology: Topology, algorithm: str = "flat") -> float:
    """Bandwidth (bytes/s) at which a device receives copies during attention, for t.

    DESIGN 4.2 uses the inter-node bandwidth when inter-node links are much slower than
    intra-node ones, else the uniform device bandwidth. With the flat collectives (every copy
    from its owner) a spAG that spans nodes is limited by its slowest link class, so with more
    than one node this is min(intra, inter); on one node it is the intra-node bandwidth.

    With the node-aware ("hierarchical") collectives an expert crosses into a node once, at one
    of its G devices (the relays take turns), and the relay forwards it inside the node. For t
    experts on every device of a node, a device receives t / G of them over its inter-node link
    and the other (G - 1) t / G from its node-mates, stage after stage:
    bw = 1 / (1 / (G inter) + (G - 1) / (G intra)).

    `inter_node_bw` must be what a device gets while every device of its node uses the network
    at once, as the runtime's probe measures it (`fssdp.tuning.probe_bandwidths`): with one
    100 Gbps NIC per node of G = 8 devices, 1.56 GB/s, so G x inter is the NIC's 12.5 GB/s and,
    with 300 GB/s inside the node, bw = 12.1 GB/s (flat: 1.56, so t is 7.7x larger). Given the
    NIC rate of one pair alone (12.5 GB/s), the formula would claim 77 GB/s through a 12.5 GB/s
    NIC: the simulator passes the probe's figures (`sim.costs.Hardware.probed_topology`;
    docs/benchmarks.md, "Gather bandwidth"). One bandwidth for both classes gives that
    bandwidth: t is unchanged.
    """
    if topology.nodes == 1:
        return topology.intra_node_bw
    if algorithm == "flat":
        return min(topology.intra_node_bw, topology.inter_node_bw)
    if algorithm != "hierarchical":
        raise PlacementError(f"gather_bandwidth: algorithm must be 'flat' or 'hierarchical', got {algorithm!r}")
    G = topology.devices_per_node
    return 1.0 / (1.0 / (G * topology.inter_node_bw) + (G - 1) / (G * topology.intra_node_bw))


def overlap_degree(t_non_moe_s: float, bandwidth: float, expert_bytes: float, num_experts: int) -> int:
    """t = floor(T_nonMoE * bw / expert_bytes), clamped to [0, num_experts] (DESIGN 4.2).

    t is how many expert copies a device can receive while the non-MoE computation that
    precedes the MoE layer runs, so their gather is hidden.

    Args:
        t_non_moe_s: time of the non-MoE part of a layer (attention etc.), seconds, >= 0.
        bandwidth: bytes/s available to the gather (see `gather_bandwidth`), > 0.
        expert_bytes: bytes of one expert's parameters, > 0.
        num_experts: E; t never exceeds it.
    """
    for name, value, positive in (
        ("t_non_moe_s", t_non_moe_s, False),
        ("bandwidth", bandwidth, True),
        ("expert_bytes", expert_bytes, True),
    ):
        if not np.isfinite(value) or value < 0 or (positive and value == 0):
            raise PlacementError(f"overlap_degree: {name} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")
    num_experts = check_int(num_experts, "overlap_degree: num_experts", 1)
    # a relative epsilon so that e.g. 0.3 s * 10 B/s / 1 B = 2.9999999999999996 counts as 3
    t = int(np.floor(t_non_moe_s * bandwidth / expert_bytes * (1 + 1e-12)))
    return min(t, num_experts)


def memory_capacity(free_bytes, expert_bytes: float):
    """m = floor(free_bytes / expert_bytes): extra expert copies that fit in free memory.

    `free_bytes` may be a number (-> int) or an array per device (-> int64 array). Negative
    free memory (already over budget) gives 0 copies.
    """
    if not np.isfinite(expert_bytes) or expert_bytes <= 0:
        raise PlacementError(f"memory_capacity: expert_bytes must be finite and > 0, got {expert_bytes!r}")
    free = np.asarray(free_bytes, dtype=np.float64)
    if not np.all(np.isfinite(free)):
        raise PlacementError(f"memory_capacity: free_bytes must be finite, got {free_bytes!r}")
    m = np.floor(np.maximum(free, 0.0) / expert_bytes).astype(np.int64)
    return int(m) if m.ndim == 0 else m


def memory_capacity_after_activations(free_bytes: float, activation_peak_bytes: float, margin: float,
                                      layers_alive: int, copy_bytes: float) -> int:
    """m from measured memory: free - activation peak x (1 + margin), per layer whose copies
    are alive at once, over the bytes of one copy (weights and its gradient); >= 0.

    The activation peak is what one iteration without copies added on top of the memory held
    before it (activations, their gradients, the all-to-all buffers, the optimizer step's
    temporaries); the copies must leave room for it, and the margin for the iterations whose
    routing makes it larger.
    """
    for name, value in (("free_bytes", free_bytes), ("activation_peak_bytes", activation_peak_bytes),
                        ("margin", margin), ("copy_bytes", copy_bytes)):
        if not np.isfinite(value) or value < 0:
            raise PlacementError(f"memory_capacity_after_activations: {name} must be finite and >= 0, got {value!r}")
    layers_alive = check_int(layers_alive, "layers_alive", 1)
    budget = free_bytes - activation_peak_bytes * (1.0 + margin)
    return memory_capacity(budget / layers_alive, copy_bytes)
