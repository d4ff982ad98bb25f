"""The simulated systems: their names, how each is planned and how its iteration is scheduled.

Every placement-based system is the placement engine's own policy (`placement.policies`),
replayed iteration by iteration on the scaled trace exactly as training would plan it: loads
predicted from earlier iterations only (`LoadTracker`, the policy's window), the gate's actual
per-source tokens for dispatch and post-gate decisions. From each iteration's plan the
simulator takes the tokens processed per (expert, device), the dispatch all-to-all, the other
traffic by kind (`Policy.traffic` of that layer alone) and the experts moved before the
iteration, prices them with the cost model and runs one event-driven schedule of forward and
backward per transformer layer (`_schedule`), vectorised over all iterations.

Where each kind of traffic runs in the schedule:
- all-to-all (dispatch, combine; forward and backward): "a2a" stream, on the critical path;
- "shadow_broadcast" (FasterMoE): "a2a" stream after the gate, before dispatch (on the path);
  priced as NCCL's pipelined ring broadcast inside each EP group (`costs.ring_broadcast_bytes`),
  as FasterMoE broadcasts shadows and as its own cost model assumes (expert bytes / bandwidth
  per shadow), not as the holder's point-to-point fan-out `Policy.traffic` counts; likewise
  "shadow_reduce" as a ring reduce;
- "spag" (FSSDP): "sparse" stream, launched when the layer's attention starts (hidden behind
  it when short enough); with re-materialization again in backward, launched after the
  layer above's expert backward. Priced as the runtime moves it (SimOptions.sparse_collectives
  = `--fssdp-collectives`): "hierarchical" (the default), the owner sends to its node's holders
  and to one relay per other node, then each relay to its node's other holders, the stages one
  after the other (two transfer times); "flat", point-to-point from each owner to every holder;
  or as pipelined ring broadcasts over the holders ("ring", NCCL's algorithm: the same bytes
  in total, each copy across a node boundary once, but not what the runtime runs);
- "sprs", and every gradient synchronisation ("grad_allreduce", "shadow_reduce",
  "grad_reduce_scatter"): after the layer's expert backward, on "sparse" (sprs) or "grad";
- dense (non-expert) gradients: a ring all-reduce per layer on "grad" after its attention
  backward (Megatron DDP's overlapped bucket reduction);
- "weight_scatter" (replicate): the updated weights sent into the slots of the iteration's
  placement after the previous optimizer step; on its own "scatter" stream from the start of
  the iteration, layer by layer, each layer's dispatch waiting for its own layer's weights;
- rearrangement (moved experts with their optimizer state): before the iteration, on the path.
Activation recompute: selective re-runs each layer's core attention forward right before its
attention backward; full re-runs each layer's whole forward (attention, gate, dispatch,
experts, combine) when its output gradient arrives, on the same streams, with the first
forward's copies, replicas and shadows (no second spAG or broadcast).
The optimizer step waits for all gradient traffic. Kinds a future policy adds are scheduled
like gradient synchronisation and listed in the result's details.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import re
import time
from dataclasses import dataclass

import numpy as np

from megatron_patches.placement import fssdp
from megatron_patches.placement.accounting import CommBytes, gather_stage_bytes, sparse_all_gather_seconds
from megatron_patches.placement.baselines import EPLayout, deepspeed_slots
from megatron_patches.placement.policies import (
    FSSDPPolicy,
    Policy,
    PolicyStep,
    ReplayConfig,
    calibration_delta,
    make_policy,
    replay_steps,
)
from megatron_patches.placement.types import PlacementError
from megatron_patches.sim.costs import (
    RECOMPUTE,
    MemoryNeed,
    SimError,
    all_ranks_allreduce_steps,
    all_to_all_bytes,
    ring_broadcast_bytes,
)
from megatron_patches.sim.events import Timeline
from megatron_patches.sim.report import SystemResult, imbalance_rows
from megatron_patches.sim.scenario import Scenario

__all__ = [
    "SystemSpec",
    "SYSTEMS",
    "check_memory",
    "periodic_acts",
    "periodic_interval",
    "ep_layout_problem",
    "layout_problems",
    "resolve_systems",
    "simulate",
    "simulate_all",
    "simulate_placement_system",
    "replay_config",
]


@dataclass(frozen=True)
class SystemSpec:
    """A simulated system: which planner, with which knobs, scheduled how."""

    name: str
    """Name on the command line."""
    description: str
    """One line for --list-systems and the JSON."""
    family: str
    """"placement" (a placement-engine policy on homogeneous roles) or "zebra" (disaggregated pools)."""
    policy: str = ""
    """Placement family: the `placement.policies.POLICIES` key."""
    interval: int | None = None
    """Rearrangement interval in iterations (FlexMoE, SmartMoE); None: the scenario's reshard_interval."""
    fssdp_mode: str = ""
    """FSSDP: "both" (materialization + heterogeneous sharding), "materialize" or "shard"."""
    remat: bool = False
    """FSSDP: free copies after forward use and gather them again for backward."""
    bound: bool = False
    """ep-bound: every compute task takes the device-mean time (no stragglers of speed or load)."""
    per_gpu_type: bool = False
    """ep-ideal (HeterMoE's EP (Ideal)): EP run separately on each GPU type's devices, throughputs summed."""
    zebra_mode: str = ""
    """Zebra family: "naive" (disaggregation, one micro-batch), "zp" (zig-zag) or "asym" (zig-zag + Asym-EA)."""


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("ep", "Megatron expert parallelism: static even expert layout, dropless", "placement", "ep"),
        SystemSpec(
            "ep-ideal",
            "HeterMoE's EP (Ideal): EP on each GPU type's devices alone, the types' throughputs summed",
            "placement",
            "ep",
            per_gpu_type=True,
        ),
        SystemSpec(
            "ep-bound",
            "EP with every compute task at the device-mean time: no straggler from load or device speed (a bound)",
            "placement",
            "ep",
            bound=True,
        ),
        SystemSpec(
            "fastermoe",
            "FasterMoE-style shadowing: popular experts broadcast after the gate when the cost model says it pays",
            "placement",
            "fastermoe",
        ),
        SystemSpec(
            "smartmoe",
            "SmartMoE-style swapping of experts between devices every reshard interval (moves optimizer state)",
            "placement",
            "smartmoe",
        ),
        *(
            SystemSpec(
                f"flexmoe-{k}",
                f"FlexMoE-style replicate/relocate every {k} iterations into reserved slots (moves optimizer state)",
                "placement",
                "flexmoe",
                interval=k,
            )
            for k in (10, 50, 100)
        ),
        SystemSpec(
            "fssdp",
            "FSSDP: per-iteration sparse materialization overlapped with attention + heterogeneous re-sharding",
            "placement",
            "fssdp",
            fssdp_mode="both",
        ),
        SystemSpec(
            "fssdp-mat", "FSSDP materialization only (even sharding, never re-sharded)", "placement", "fssdp",
            fssdp_mode="materialize",
        ),
        SystemSpec(
            "fssdp-shard", "FSSDP heterogeneous sharding only (no materialized copies)", "placement", "fssdp",
            fssdp_mode="shard",
        ),
        SystemSpec(
            "fssdp-remat",
            "FSSDP with re-materialization: copies freed after forward use and gathered again for backward",
            "placement",
            "fssdp",
            fssdp_mode="both",
            remat=True,
        ),
        SystemSpec(
            "replicate",
            "adaptive per-iteration replication with a decoupled optimizer, capacity-limited (drops tokens)",
            "placement",
            "replicate",
        ),
        SystemSpec(
            "static",
            "DeepSpeed-style static replication with an expert capacity (drops tokens)",
            "placement",
            "static",
        ),
        SystemSpec(
            "zebra-naive",
            "attention on the newer GPUs, experts on the older ones, one micro-batch (no zig-zag)",
            "zebra",
            zebra_mode="naive",
        ),
        SystemSpec("zebra", "zebra parallelism: disaggregated pools with the zig-zag micro-batch schedule", "zebra",
                   zebra_mode="zp"),
        SystemSpec("zebra-asym", "zebra parallelism with asymmetric expert assignment (Asym-EA)", "zebra",
                   zebra_mode="asym"),
    )
}
"""The fixed system names; `flexmoe-N` and `smartmoe-N` take any interval N >= 1."""

_INTERVAL = re.compile(r"^(flexmoe|smartmoe)-([0-9]+)$")


def resolve_systems(names) -> list[SystemSpec]:
    """Specs for a list of names (duplicates dropped, order kept); SimError naming an unknown one."""
    specs = []
    for raw in names:
        name = raw.strip()
        if not name or name in [s.name for s in specs]:
            continue
        if name in SYSTEMS:
            specs.append(SYSTEMS[name])
            continue
        match = _INTERVAL.match(name)
        if match and int(match.group(2)) >= 1:
            kind, k = match.group(1), int(match.group(2))
            base = SYSTEMS["flexmoe-10"] if kind == "flexmoe" else SYSTEMS["smartmoe"]
            what = "replicate/relocate" if kind == "flexmoe" else "swapping"
            specs.append(dataclasses.replace(
                base, name=name, interval=k, description=f"{kind} {what} every {k} iterations (moves optimizer state)"
            ))
            continue
        raise SimError(
            f"unknown system {name!r}; valid systems: {', '.join(SYSTEMS)}, flexmoe-N, smartmoe-N (N >= 1 iterations)"
        )
    if not specs:
        raise SimError(f"no system given; valid systems: {', '.join(SYSTEMS)}")
    return specs


def simulate(scn: Scenario, spec: SystemSpec) -> SystemResult:
    """Simulate one system over the scenario's trace."""
    if spec.family == "zebra":
        from megatron_patches.sim.zebra import simulate_zebra_system

        return simulate_zebra_system(scn, spec)
    if spec.per_gpu_type:
        return simulate_ep_per_gpu_type(scn, spec)
    return simulate_placement_system(scn, spec)


_FORKED_SCENARIO: Scenario | None = None
"""The scenario worker processes of `simulate_all` inherit (fork), so it is not pickled per system."""


def _simulate_forked(spec: SystemSpec) -> tuple[SystemResult, float]:
    start = time.perf_counter()
    return simulate(_FORKED_SCENARIO, spec), time.perf_counter() - start


def simulate_all(scn: Scenario, specs: list[SystemSpec], jobs: int = 1, progress=None) -> list[SystemResult]:
    """Simulate several systems, in `jobs` forked worker processes when jobs > 1 (results in spec order).

    progress(name, seconds) is called as each system finishes.
    """
    global _FORKED_SCENARIO
    if jobs <= 1 or len(specs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        results = []
        for spec in specs:
            result, seconds = _timed(scn, spec)
            results.append(result)
            if progress:
                progress(spec.name, seconds)
        return results
    _FORKED_SCENARIO = scn
    try:
        context = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(specs)), mp_context=context) as pool:
            futures = [pool.submit(_simulate_forked, spec) for spec in specs]
            results = []
            for spec, future in zip(specs, futures):
                result, seconds = future.result()
                results.append(result)
                if progress:
                    progress(spec.name, seconds)
    finally:
        _FORKED_SCENARIO = None
    return results


def _timed(scn: Scenario, spec: SystemSpec) -> tuple[SystemResult, float]:
    start = time.perf_counter()
    return simulate(scn, spec), time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Planning knobs: t, m, slots
# ---------------------------------------------------------------------------------------------


def _free_bytes(scn: Scenario) -> float:
    """Free memory of the tightest device under EP with perfectly balanced loads, bytes."""
    L, E, D = scn.num_layers, scn.num_experts, scn.num_devices
    per_device = max(E // D, 1) * L
    balanced_LD = np.full((L, D), scn.workload.routed_tokens_per_layer / D)
    return float(scn.memory.free_bytes_D(np.full(D, per_device), balanced_LD).min())


def ep_layout_problem(scn: Scenario) -> str | None:
    """Why Megatron's even EP layout cannot place the experts on the simulated devices (the
    device count must divide the expert count or be a multiple of it), or None."""
    try:
        EPLayout.even(scn.num_experts, scn.num_devices)
    except PlacementError as err:
        return str(err)
    return None


def layout_problems(scn: Scenario, specs) -> dict[str, str]:
    """Why each of `specs` that cannot lay out the model on the simulated devices cannot, by
    name: EP's even layout (`ep_layout_problem`), static's DeepSpeed groups (s | E, E/s | D
    within the slots given or the memory budget), and zebra-asym's Asym-EA chunks (M | N or
    N | M, N | experts). Such a system is not simulated, alone or beside others, as one that
    does not fit in memory."""
    problems = {}
    for spec in specs:
        if spec.name == "ep":
            why = ep_layout_problem(scn)
        elif spec.policy == "static":
            try:
                _slots_per_rank(scn, spec)
                why = None
            except PlacementError as err:
                why = str(err)
        elif spec.family == "zebra" and spec.zebra_mode == "asym":
            from megatron_patches.sim.zebra import asym_layout_problem

            why = asym_layout_problem(scn)
        else:
            why = None
        if why is not None:
            problems[spec.name] = why
    return problems


def ep_memory_need(scn: Scenario) -> MemoryNeed:
    """EP's need with perfectly balanced loads on the device with the least memory left.

    Every placement system owns at least EP's experts per device, so when this does not fit,
    none of them can train the model on these devices.
    """
    L, E, D = scn.num_layers, scn.num_experts, scn.num_devices
    mem = scn.memory
    balanced_LD = np.full((L, D), scn.workload.routed_tokens_per_layer / D)
    d = int(np.argmin(mem.free_bytes_D(np.full(D, max(E // D, 1) * L), balanced_LD)))
    owned = max(E // D, 1) * L * scn.workload.expert_params
    parts = {k: float(v) for k, v in
             mem.by_part(mem.dense_parts(), owned, owned, mem.activation_bytes(balanced_LD)[d]).items()}
    return MemoryNeed("EP", scn.hardware.device_types[d], parts, float(scn.hardware.memory_D[d]))


def _memory_needs(scn: Scenario, specs: list[SystemSpec]) -> dict[str, tuple[list[str], list[MemoryNeed]]]:
    """Balanced-load needs per group of systems, as {group: (its systems, needs)}: the placement
    systems share EP's, each zebra system has its attention and expert ranks'."""
    groups: dict[str, tuple[list[str], list[MemoryNeed]]] = {}
    placement = [s.name for s in specs if s.family == "placement"]
    if placement:
        groups[", ".join(placement)] = (placement, [ep_memory_need(scn)])
    for spec in specs:
        if spec.family == "zebra":
            from megatron_patches.sim.zebra import zebra_memory_needs

            groups[spec.name] = ([spec.name], zebra_memory_needs(scn, spec))
    return groups


def check_memory(scn: Scenario, specs: list[SystemSpec]) -> dict[str, str]:
    """The requested systems that cannot fit even with perfectly balanced loads, each with why
    ({name: "EP needs 17.9 GB per device (...); a V100-SXM2-16GB has 16 GB"}); SimError when
    none of them fits.

    Such a system is never simulated, whichever systems run beside it: its answer is "out of
    memory" alone or in company (one that fits with balanced loads is simulated, and its result
    says whether its most loaded iteration exceeds the memory). A zebra planner that must move
    experts to fit refuses on its own (`zebra._plan`). When nothing fits, the message gives every
    group's parts and what each other activation recompute would need.
    """
    groups = _memory_needs(scn, specs)
    failing = {group: [n for n in needs if not n.fits] for group, (_, needs) in groups.items()}
    if any(not bad for bad in failing.values()):
        return {name: "; ".join(n.describe() for n in failing[group])
                for group, (names, _) in groups.items() if failing[group] for name in names}
    model = scn.workload.model
    reasons = "; ".join(n.describe() for bad in failing.values() for n in bad)
    hints = []
    for recompute in reversed(RECOMPUTE):  # full first: it keeps the least per layer
        if recompute in ("none", scn.workload.recompute):
            continue
        other = _memory_needs(scn.with_recompute(recompute), specs)
        fits = [group for group, (_, needs) in other.items() if all(n.fits for n in needs)]
        figures = ", ".join(f"{n.what} {n.need / 1e9:.1f} GB of {n.capacity / 1e9:.0f}"
                            for _, needs in other.values() for n in needs)
        verdict = f"{' and '.join(fits)} would fit" if fits else "nothing would fit"
        hints.append(f"--recompute {recompute} ({verdict}: {figures})")
    raise SimError(
        f"the model does not fit: {model.num_layers} layers x {scn.num_experts} experts on "
        f"{scn.hardware.describe()} with balanced loads, {scn.workload.precision.name}, recompute "
        f"{scn.workload.recompute}: {reasons}; use more GPUs, a smaller --micro-batch-size or --seq-length"
        + (", or " + " or ".join(hints) if hints else "")
    )


def periodic_interval(scn: Scenario, spec: SystemSpec) -> int | None:
    """Iterations between a system's periodic rearrangements (FlexMoE-N, SmartMoE-N, FSSDP's
    re-shard check), or None for a system without one. Such a mechanism acts at every iteration
    i > 0 that the interval divides (`placement.policies`)."""
    if spec.policy in ("flexmoe", "smartmoe"):
        return spec.interval or scn.options.reshard_interval
    if spec.policy == "fssdp" and spec.fssdp_mode != "materialize":
        return scn.options.reshard_interval
    return None


def periodic_acts(scn: Scenario, spec: SystemSpec) -> int | None:
    """How often the system's periodic mechanism acts within the scenario's iterations (None: it has none)."""
    interval = periodic_interval(scn, spec)
    return None if interval is None else (scn.num_iterations - 1) // interval


def _reserved_slots(scn: Scenario) -> int:
    """FlexMoE's reserved slots per device and layer: SimOptions.reserved_slots, or free memory
    over L full expert instances (weights, gradients, optimizer state), at most E."""
    if scn.options.reserved_slots is not None:
        return scn.options.reserved_slots
    free = max(_free_bytes(scn), 0.0)
    return min(fssdp.memory_capacity(free / scn.num_layers, scn.memory.expert_bytes_per_instance(True)),
               scn.num_experts)


def _slots_per_rank(scn: Scenario, spec: SystemSpec) -> int:
    """Slots per rank of replicate and static: SimOptions.slots_per_rank, or ceil(E / D) + FlexMoE's
    reserved slots (the same memory budget). Static's must be one DeepSpeed can lay out
    (`baselines.deepspeed_slots`): a given one that is not is refused, and by default it takes
    the most within the budget (PlacementError when none fits)."""
    E, D, given = scn.num_experts, scn.num_devices, scn.options.slots_per_rank
    slots = given if given is not None else -(-E // D) + _reserved_slots(scn)
    if spec.policy == "static":
        return deepspeed_slots(E, D, slots, chosen=given is not None)
    return slots


def replay_config(scn: Scenario, spec: SystemSpec) -> tuple[ReplayConfig, dict]:
    """The policy knobs of a placement system, derived from the cost and memory model.

    - t (FSSDP overlap degree): by cost, as the runtime chooses it (`fssdp.choose_overlap_degree`
      on the first iteration's loads, and again on the loads of the iteration before at
      `fssdp.overlap_due`'s iterations (powers of 4, then every re-shard check), with
      calibration's copies when it calibrates), among t = 0,
      the powers of two up to E and DESIGN 4.2's floor(T_nonMoE x bw / expert bytes) (T_nonMoE
      the forward of a layer's attention block, norms and gate on the slowest device; bw from the
      bandwidths the runtime's probe measures).
    - m (FSSDP copies per device and layer): the free memory under EP (balanced loads) over the
      bytes of one copy (weights + gradients) times the layers whose copies are alive at once
      (all L without re-materialization, 1 with it).
    - FlexMoE's reserved slots: free memory over L full expert instances (weights, gradients,
      optimizer state): the replicas of every layer are resident.
    - replicate / static slots: ceil(E / D) + FlexMoE's reserved slots (the same memory budget);
      static takes the most within it that DeepSpeed can lay out (`_slots_per_rank`).
    Every value can be fixed by SimOptions instead. Returns the ReplayConfig and the chosen values.
    """
    o = scn.options
    bm = scn.workload.byte_model
    topo = scn.hardware.topology
    L, E, D = scn.num_layers, scn.num_experts, scn.num_devices
    compute = scn.compute
    t_non_moe = float(np.max(compute.attention_fwd_D() + compute.other_fwd_D(True)))
    free = max(_free_bytes(scn), 0.0)
    copy_bytes = bm.expert_weight_bytes + bm.expert_grad_bytes
    t = o.overlap_degree
    if t is None:
        algorithm = "hierarchical" if o.sparse_collectives == "hierarchical" else "flat"
        # from the figures the runtime's probe would measure, as the runtime chooses its t
        bandwidth = fssdp.gather_bandwidth(scn.hardware.probed_topology, algorithm)
        t = fssdp.overlap_degree(t_non_moe, bandwidth, bm.expert_weight_bytes, E)
    m = o.memory_capacity
    if m is None:
        m = min(fssdp.memory_capacity(free / (1 if spec.remat else L), copy_bytes), E)
    reserved = _reserved_slots(scn)
    interval = o.reshard_interval
    knobs: dict = {}
    memory_capacity = 0
    overlap = t
    if spec.policy == "fssdp":
        if spec.fssdp_mode == "shard":
            overlap, memory_capacity = 0, 0
        else:
            memory_capacity = m
        if spec.fssdp_mode == "materialize":
            interval = scn.num_iterations + 1  # never re-shard: even sharding throughout
        knobs = {"overlap_degree_t": overlap, "memory_capacity_m": memory_capacity, "t_non_moe_s": t_non_moe,
                 "reshard_interval": interval if spec.fssdp_mode != "materialize" else None}
    elif spec.policy == "flexmoe":
        memory_capacity = reserved
        interval = periodic_interval(scn, spec)
        knobs = {"reserved_slots": reserved, "interval": interval,
                 "capacity_factor": scn.capacity_factor if scn.capacity_set else None}
    elif spec.policy == "smartmoe":
        interval = periodic_interval(scn, spec)
        knobs = {"interval": interval}
    device_flops = float(np.min(scn.compute.peak_flops_D)) * scn.efficiency.expert_gemm
    slots = None
    try:
        if spec.policy in ("replicate", "static"):
            slots = _slots_per_rank(scn, spec)
            knobs = {"slots_per_rank": slots, "capacity_factor": scn.capacity_factor}
        config = ReplayConfig(
            topology=topo,
            byte_model=bm,
            overlap_degree=int(overlap),
            memory_capacity=int(memory_capacity),
            slots_per_rank=slots,
            capacity_factor=scn.capacity_factor,
            flexmoe_capacity=scn.capacity_set,
            reshard_interval=int(interval),
            skew_threshold=None,
            calibrate=spec.policy == "fssdp" and o.fssdp_calibrate and spec.fssdp_mode != "shard",
            gather_seconds=lambda shard, placement: _sparse_gather_seconds(scn, shard, placement),
            dispatch_seconds=lambda plan: 4.0 * float(scn.comm.transfer_time(
                *all_to_all_bytes([plan], topo, bm.token_bytes)[0])),
            reduce_hidden_s=float(np.max(compute.attention_bwd_D())),
            collectives="flat" if o.sparse_collectives == "flat" else "hierarchical",
            device_flops=device_flops,
            instance_overhead_s=compute.expert_instance_overhead_s(),
        )
        if spec.policy == "fssdp" and spec.fssdp_mode != "shard" and o.overlap_degree is None:
            # t by cost, as the runtime chooses it: after its first iteration on that iteration's
            # loads, and again before every re-shard check on the loads of the iteration before
            candidates, cost, calibrated = fssdp.overlap_candidates(t, E), config.fssdp_cost(), config.calibrate

            def choose(shards, sources_LDE, hidden_t=t):
                prices = fssdp.overlap_prices(shards, sources_LDE, candidates, memory_capacity, topo, cost, t_non_moe,
                                              calibrated=calibrated)
                return fssdp.choose_overlap_degree(candidates, prices, hidden_t).t

            shards = [fssdp.even_shard(L, E, D).layer(k) for k in range(L)]  # FSSDPPolicy's starting layout
            first = choose(shards, scn.source_ILDE[0])
            config = dataclasses.replace(config, overlap_degree=first, overlap_choice=choose)
            knobs.update(overlap_degree_t=first, overlap_degree_hidden_t=t)
    except PlacementError as err:
        raise SimError(f"{spec.name}: {err}") from None
    return config, knobs


def _sparse_gather_seconds(scn: Scenario, shard, placement) -> float:
    """Time of one spAG(shard -> placement) as the simulator prices it (SimOptions.sparse_collectives):
    calibration decides on the same figures its gather is charged."""
    bm, topo = scn.workload.byte_model, scn.hardware.topology
    if scn.options.sparse_collectives == "ring":
        return scn.comm.time(ring_broadcast_bytes(placement.holds_ED(), shard.owner_E, bm.expert_weight_bytes, topo))
    return sparse_all_gather_seconds(shard, placement, bm.expert_weight_bytes, topo, scn.options.sparse_collectives,
                                     scn.comm.time)


# ---------------------------------------------------------------------------------------------
# Replay: plan every iteration, collect what the schedule needs
# ---------------------------------------------------------------------------------------------


_BYTE_FIELDS = ("sent_intra_D", "sent_inter_D", "recv_intra_D", "recv_inter_D")


class _Bytes:
    """Per-device bytes of one kind of collective for every iteration and layer; float [I, L, 4, D]."""

    LATER = 2
    """Stages after the first (the hierarchical spAG's ring broadcasts and relays' sends)."""

    def __init__(self, I: int, L: int, D: int) -> None:
        self.data = np.zeros((I, L, 4, D))
        self.steps = np.ones((I, L))
        self.later = np.zeros((I, L, self.LATER, 4, D))
        """Stages that each start when the one before has landed (`gather_stage_bytes`)."""

    def put(self, i: int, k: int, comm: CommBytes, steps: float = 1.0, later: tuple[CommBytes, ...] = ()) -> None:
        for j, name in enumerate(_BYTE_FIELDS):
            self.data[i, k, j] = getattr(comm, name)
            self.later[i, k, :, j] = 0.0
            for stage, c in enumerate(later):
                self.later[i, k, stage, j] = getattr(c, name)
        self.steps[i, k] = steps

    def times_IL(self, scn: Scenario) -> np.ndarray:
        d, s = self.data, self.later
        first = scn.comm.transfer_time(d[:, :, 0], d[:, :, 1], d[:, :, 2], d[:, :, 3], self.steps)
        return first + sum(scn.comm.transfer_time(s[:, :, j, 0], s[:, :, j, 1], s[:, :, j, 2], s[:, :, j, 3])
                           for j in range(self.LATER))

    def nic_IL(self, scn: Scenario) -> np.ndarray:
        """Seconds the busiest node's NIC carries these bytes at its full rate, every stage; [I, L]."""
        d, s = self.data, self.later
        return sum(scn.comm.transfer_parts(x[:, :, 0], x[:, :, 1], x[:, :, 2], x[:, :, 3])[2]
                   for x in (d, *(s[:, :, j] for j in range(self.LATER))))

    def totals(self) -> np.ndarray:
        """Mean bytes per iteration over all layers and stages: [intra, inter] (counted at the sender)."""
        every = self.data + self.later.sum(axis=2)
        return np.array([every[:, :, 0].sum(axis=(1, 2)).mean(), every[:, :, 1].sum(axis=(1, 2)).mean()])


@dataclass
class _Replayed:
    """What one system's replay produced (arrays over iterations I, MoE layers L, devices D)."""

    expert_fwd_ILD: np.ndarray
    processed_ILD: np.ndarray
    computed_ILD: np.ndarray
    """Rows the experts compute: the processed tokens, or the whole capacity where padded."""
    a2a: _Bytes
    kinds: dict[str, _Bytes]
    moves_I4D: np.ndarray
    held_params_ILD: np.ndarray
    """Parameters of the expert instances a device keeps all iteration (weights and gradients)."""
    transient_params_ILD: np.ndarray
    """Parameters of the copies a device holds for one layer only (FSSDP's gathered copies,
    FasterMoE's shadows; weights and gradients)."""
    optimizer_state_params_ILD: np.ndarray
    """Parameters whose optimizer state a device keeps (memory)."""
    optimizer_params_ILD: np.ndarray
    """Parameters whose optimizer state a device steps (time): FlexMoE keeps state for every slot
    but steps the filled ones."""
    survival_IL: np.ndarray
    shadowed_IL: np.ndarray
    moves_I: np.ndarray
    planner_s: float


def _shadow_rings(layout: EPLayout, shadowed_E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One ring per (shadowed expert, EP group): the group's devices, rooted at the expert's holder."""
    g, D = layout.group_size, layout.num_devices
    roots_R = layout.devices_E_G()[shadowed_E].ravel()
    holds_RD = (np.arange(D)[None, :] // g) == (roots_R[:, None] // g)
    return holds_RD, roots_R


def _replay(scn: Scenario, policy: Policy) -> _Replayed:
    I, L, E, D = scn.num_iterations, scn.num_layers, scn.num_experts, scn.num_devices
    topo = scn.hardware.topology
    bm = scn.workload.byte_model
    P = float(bm.params_per_expert)
    ep_owned_D = None
    ep_layout = None  # FasterMoE's static layout: shadows are broadcast from it, it owns the optimizer state
    out = _Replayed(
        expert_fwd_ILD=np.zeros((I, L, D)),
        processed_ILD=np.zeros((I, L, D)),
        computed_ILD=np.zeros((I, L, D)),
        a2a=_Bytes(I, L, D),
        kinds={},
        moves_I4D=np.zeros((I, 4, D)),
        held_params_ILD=np.zeros((I, L, D)),
        transient_params_ILD=np.zeros((I, L, D)),
        optimizer_state_params_ILD=np.zeros((I, L, D)),
        optimizer_params_ILD=np.zeros((I, L, D)),
        survival_IL=np.ones((I, L)),
        shadowed_IL=np.zeros((I, L)),
        moves_I=np.zeros(I),
        planner_s=0.0,
    )
    ring_sparse = scn.options.sparse_collectives == "ring"
    relayed = scn.options.sparse_collectives == "hierarchical"
    for i, step, planner_s in replay_steps(policy, scn.loads_ILE, lambda i: scn.source_ILDE[i], policy.default_window):
        out.planner_s += planner_s
        processed_LED = np.stack([lp.processed_ED for lp in step.layers])
        # padded to the capacity, every instance computes its whole capacity, whatever it received
        # (static's dispatch plan holds DeepSpeed's fixed-size buffers; the others' are not priced)
        padded_L = [lp.capacity is not None and (policy.pads_to_capacity or scn.options.pad_to_capacity)
                    for lp in step.layers]
        computed_LED = np.stack([lp.capacity * lp.placement.counts_ED if pad else lp.processed_ED
                                 for lp, pad in zip(step.layers, padded_L)])
        out.expert_fwd_ILD[i] = scn.compute.expert_fwd(computed_LED)
        out.processed_ILD[i] = processed_LED.sum(axis=1)
        out.computed_ILD[i] = computed_LED.sum(axis=1)
        out.a2a.data[i] = all_to_all_bytes([lp.dispatch for lp in step.layers], topo, bm.token_bytes)
        for k, lp in enumerate(step.layers):
            traffic = policy.traffic(PolicyStep(i, (lp,)))
            traffic.pop("all_to_all", None)
            if lp.shadowed_E is not None:
                if ep_layout is None:
                    ep_layout = EPLayout.even(E, D)
                    ep_owned_D = ep_layout.placement().counts_ED.sum(axis=0)
                holds_RD, root_R = _shadow_rings(ep_layout, lp.shadowed_E)
                traffic["shadow_broadcast"] = ring_broadcast_bytes(holds_RD, root_R, bm.expert_weight_bytes, topo)
                traffic["shadow_reduce"] = ring_broadcast_bytes(holds_RD, root_R, bm.expert_grad_bytes, topo).reversed()
            later = {}
            if lp.shard is not None and (ring_sparse or relayed):
                before = lp.placement if lp.materialized is None else lp.materialized
                gathers = {"spag": before}
                if lp.materialized is not None:
                    gathers["spag_calibrate"] = calibration_delta(lp)
                for kind, placement in (*gathers.items(), ("sprs", lp.placement)):
                    size = bm.expert_grad_bytes if kind == "sprs" else bm.expert_weight_bytes
                    if ring_sparse:
                        comm = ring_broadcast_bytes(placement.holds_ED(), lp.shard.owner_E, size, topo)
                        traffic[kind] = comm.reversed() if kind == "sprs" else comm
                    else:
                        stages = gather_stage_bytes(lp.shard, placement, size, topo)
                        if kind == "sprs":  # the reduce runs the stages backwards, reversed
                            stages = tuple(stage.reversed() for stage in reversed(stages))
                        traffic[kind], later[kind] = stages[0], stages[1:]
            for kind, comm in traffic.items():
                # a ring over an expert's r holders takes 2 (r - 1) latency-bound steps, replicate's
                # counts all-reduce over all D ranks NCCL's ring or tree (`all_ranks_allreduce_steps`);
                # point-to-point kinds (replicate's reduce-scatter and push, the sparse collectives) one
                steps = (2.0 * max(int(lp.placement.replicas_E().max()) - 1, 0) if kind == "grad_allreduce"
                         else float(all_ranks_allreduce_steps(topo)) if kind == "popularity" else 1.0)
                if kind not in out.kinds:
                    out.kinds[kind] = _Bytes(I, L, D)
                out.kinds[kind].put(i, k, comm, max(steps, 1.0), later.get(kind, ()))
            held_D = lp.placement.counts_ED.sum(axis=0)
            if lp.shard is not None:
                owned_D = lp.shard.counts_D()
                out.transient_params_ILD[i, k] = lp.placement.extra_copies_D(lp.shard) * P
            elif lp.shadowed_E is not None:
                owned_D = ep_owned_D
                out.transient_params_ILD[i, k] = (lp.placement.holds_ED().sum(axis=0) - owned_D) * P
                out.shadowed_IL[i, k] = int(lp.shadowed_E.sum())
            elif policy.name == "replicate":
                owned_D = None
                slice_params = E * P / D  # decoupled optimizer: every rank owns 1/D of every expert
                out.held_params_ILD[i, k] = held_D * P
                out.optimizer_state_params_ILD[i, k] = out.optimizer_params_ILD[i, k] = slice_params
            elif policy.name == "flexmoe":
                # every slot, reserved or filled, holds memory for weights and optimizer state from
                # the start; the optimizer steps the filled ones
                owned_D = None
                out.held_params_ILD[i, k] = out.optimizer_state_params_ILD[i, k] = policy.slots_per_device * P
                out.optimizer_params_ILD[i, k] = held_D * P
            else:
                owned_D = held_D
            if owned_D is not None:
                out.held_params_ILD[i, k] = owned_D * P
                out.optimizer_state_params_ILD[i, k] = out.optimizer_params_ILD[i, k] = owned_D * P
            routed = int(scn.loads_ILE[i, k].sum())
            out.survival_IL[i, k] = 1.0 if routed == 0 else float(lp.processed_ED.sum()) / routed
        if step.moves:
            moved = policy.rearrangement(step)
            per_move = bm.expert_weight_bytes + (bm.expert_optimizer_bytes if policy.moves_optimizer else 0.0)
            src = np.array([m.src for m in step.moves], dtype=np.int64)
            dst = np.array([m.dst for m in step.moves], dtype=np.int64)
            comm = CommBytes.from_transfers(src, dst, per_move, topo)
            if not math.isclose(comm.total, moved.total, rel_tol=1e-9, abs_tol=1.0):
                raise SimError(
                    f"{policy.name}: rearrangement bytes {comm.total} differ from the placement engine's {moved.total}"
                )
            out.moves_I4D[i] = [getattr(comm, name) for name in _BYTE_FIELDS]
            out.moves_I[i] = len(step.moves)
    return out


# ---------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------

_BEFORE_DISPATCH = ("spag", "spag_calibrate", "weight_scatter", "shadow_broadcast", "popularity")
"""Kinds a layer's dispatch waits for; every other kind except "sprs" is gradient synchronisation."""
_GRADIENT_SYNC = ("grad_allreduce", "shadow_reduce", "grad_reduce_scatter")


@dataclass
class _Stages:
    """Seconds of the program's compute stages per iteration and device, [I, D] (ep-bound: every
    device takes the device mean), and of the dense gradient all-reduces."""

    att_fwd: np.ndarray
    att_bwd: np.ndarray
    """With selective recompute, core attention again right before the attention backward."""
    other_moe: np.ndarray
    """Norms and the gate of a MoE layer."""
    other_dense: np.ndarray
    """Norms and the dense MLP of a dense layer."""
    head: np.ndarray
    """The output head, forward and backward."""
    expert_fwd: list[np.ndarray]
    """Per MoE layer."""
    optimizer: np.ndarray
    dense_grad_s: list[float]
    """Per layer: its dense gradients' all-reduce."""
    outer_grad_s: float
    """The embeddings' and head's gradient all-reduce."""
    dense_grad_nic: list[float]
    """Per layer: the NIC's part of `dense_grad_s` (`Timeline.collective`'s nic_I)."""
    outer_grad_nic: float
    """The NIC's part of `outer_grad_s`."""


def _stages(scn: Scenario, spec: SystemSpec, rep: _Replayed) -> _Stages:
    I, L, D = scn.num_iterations, scn.num_layers, scn.num_devices
    c, wl = scn.compute, scn.workload

    def even(duration):
        """ep-bound: every device takes the device-mean time."""
        d = np.broadcast_to(np.asarray(duration, dtype=np.float64), (I, D))
        return np.repeat(d.mean(axis=1, keepdims=True), D, axis=1) if spec.bound else d

    dense = wl.dense_params()
    grad_bytes = wl.byte_model.grad_bytes_per_param
    optimizer_params = sum(dense["per_layer"]) + dense["outer"]
    dense_grads = [scn.comm.dense_allreduce(p * grad_bytes) for p in dense["per_layer"]]
    outer_grads = scn.comm.dense_allreduce(dense["outer"] * grad_bytes)
    return _Stages(
        att_fwd=even(c.attention_fwd_D()),
        att_bwd=even(c.attention_bwd_D() + (c.core_attention_fwd_D() if wl.recompute == "selective" else 0.0)),
        other_moe=even(c.other_fwd_D(True)),
        other_dense=even(c.other_fwd_D(False)),
        head=even(c.head_fwd_D() * (1.0 + c.BACKWARD)),
        expert_fwd=[even(rep.expert_fwd_ILD[:, k]) for k in range(L)],
        optimizer=even(c.optimizer_D(optimizer_params / D + rep.optimizer_params_ILD.sum(axis=1))),
        dense_grad_s=[seconds for _, seconds in dense_grads],
        outer_grad_s=outer_grads[1],
        dense_grad_nic=[scn.comm.nic_seconds(comm) for comm, _ in dense_grads],
        outer_grad_nic=scn.comm.nic_seconds(outer_grads[0]),
    )


def _span(first, last) -> np.ndarray:
    """From the first device to start `first` to the last to finish `last`; [I]."""
    return last.end_ID.max(axis=1) - first.start_ID.min(axis=1)


@dataclass
class _Comm:
    """Per kind of collective ("a2a" for one all-to-all, "spag", "grad_allreduce", ...): its
    seconds and the NIC's part of them, [I, L] each."""

    seconds: dict[str, np.ndarray]
    nic: dict[str, np.ndarray]

    def __contains__(self, kind: str) -> bool:
        return kind in self.seconds

    def at(self, kind: str, k: int) -> dict[str, np.ndarray]:
        """`Timeline.collective`'s duration_I and nic_I for MoE layer k."""
        return {"duration_I": self.seconds[kind][:, k], "nic_I": self.nic[kind][:, k]}


def _schedule(scn: Scenario, spec: SystemSpec, rep: _Replayed, comm: _Comm, rearrange_I: np.ndarray,
              rearrange_nic_I: np.ndarray):
    """Run the forward/backward program of every iteration: the rearrangement, the forward, the
    head, the backward (with a full recompute's second forward), the optimizer.

    Returns (timeline, iteration_s_I, layer_s_IL, moe_s_IL): the time of each MoE layer's whole
    transformer layer, and of its MoE block alone (router, dispatch, experts, combine: forward,
    backward and a full recompute's second forward; the span from the first device to start to
    the last to finish), the per-layer figure the FSSDP paper compares.
    """
    I, L, D = scn.num_iterations, scn.num_layers, scn.num_devices
    stages = _stages(scn, spec, rep)
    tl = Timeline(I, D, share_nic=scn.options.nic_sharing)
    spans = {name: np.zeros((I, L)) for name in ("forward", "backward", "moe")}
    prev = tl.collective("a2a", "rearrangement", rearrange_I, nic_I=rearrange_nic_I) if rearrange_I.any() else None
    prev = _forward(tl, scn, stages, comm, prev, spans)
    prev = tl.compute("other", stages.head, after=[prev])
    prev = _backward(tl, scn, spec, stages, comm, prev, spans)
    tl.collective("grad", "exposed_collectives", stages.outer_grad_s, after=[prev], label="dense_grad_allreduce",
                  nic_I=stages.outer_grad_nic)
    waits = [prev] + [tl.last(stream) for stream in ("grad", "sparse")]
    tl.compute("optimizer", stages.optimizer, after=waits)
    total_I = tl.finish()
    return tl, total_I, spans["forward"] + spans["backward"], spans["moe"]


def _forward(tl: Timeline, scn: Scenario, stages: _Stages, comm: _Comm, prev, spans: dict[str, np.ndarray]):
    """Every layer's forward: the weights the system moves before dispatch (replicate's scatter,
    fssdp's gather, FasterMoE's shadows, calibration's copies), attention, gate, dispatch, experts,
    combine. Returns the last task."""
    wl = scn.workload
    L = scn.num_layers
    scatters = [tl.collective("scatter", "exposed_collectives", **comm.at("weight_scatter", k), after=[prev],
                              label="weight_scatter")
                for k in range(L)] if "weight_scatter" in comm else [None] * L
    moe_index = {j: k for k, j in enumerate(wl.moe_layers)}
    gathers: dict[int, object] = {}
    for j in range(wl.model.num_layers):
        k = moe_index.get(j)
        if k is not None and "spag" in comm:
            gathers[k] = tl.collective("sparse", "exposed_collectives", **comm.at("spag", k), after=[prev],
                                       label="spag")
        att = tl.compute("attention", stages.att_fwd, after=[prev])
        if k is None:
            prev = tl.compute("other", stages.other_dense, after=[att])
            continue
        gate = tl.compute("other", stages.other_moe, after=[att])
        shadow = None
        if "shadow_broadcast" in comm:
            shadow = tl.collective("a2a", "exposed_collectives", **comm.at("shadow_broadcast", k), after=[gate],
                                   label="shadow_broadcast")
        counts = None
        if "popularity" in comm:
            # replicate routes under the capacity from every source's counts: an all-reduce after the gate
            counts = tl.collective("a2a", "exposed_collectives", **comm.at("popularity", k), after=[gate],
                                   label="popularity")
        extra = None
        if "spag_calibrate" in comm:
            # calibration's copies: gathered after the gate (they follow the actual loads), on the path
            extra = tl.collective("sparse", "exposed_collectives", **comm.at("spag_calibrate", k),
                                  after=[gate, gathers.get(k)], label="spag_calibrate")
        dispatch = tl.collective("a2a", "all_to_all", **comm.at("a2a", k),
                                 after=[gate, shadow, counts, gathers.get(k), extra, scatters[k]])
        experts = tl.compute("expert", stages.expert_fwd[k], after=[dispatch])
        prev = tl.collective("a2a", "all_to_all", **comm.at("a2a", k), after=[experts])
        spans["forward"][:, k] = _span(att, prev)
        spans["moe"][:, k] = _span(gate, prev)
    return prev


def _backward(tl: Timeline, scn: Scenario, spec: SystemSpec, stages: _Stages, comm: _Comm, prev,
              spans: dict[str, np.ndarray]):
    """Every layer's backward from the last: a full recompute's forward again, combine, experts,
    dispatch, the gradient collectives, gate, attention, the dense gradient all-reduce. Returns
    the last attention backward."""
    c, wl = scn.compute, scn.workload
    recompute = wl.recompute
    moe_index = {j: k for k, j in enumerate(wl.moe_layers)}
    grad_kinds = [k for k in comm.seconds if k not in _BEFORE_DISPATCH + ("sprs", "a2a")]
    regather: dict[int, object] = {}
    sprs_above = None
    for j in reversed(range(wl.model.num_layers)):
        k = moe_index.get(j)
        if recompute == "full":
            # the checkpointed layer's forward again, from its kept input, when its output
            # gradient arrives: attention, gate, dispatch, experts, combine. The copies (fssdp),
            # replicas and shadows of the first forward serve it; with re-materialization the
            # re-gathered copies do, so its dispatch waits for them. No second gather.
            prev = start = tl.compute("attention", stages.att_fwd, after=[prev])
            if k is None:
                prev = tl.compute("other", stages.other_dense, after=[prev])
            else:
                gate = prev = tl.compute("other", stages.other_moe, after=[prev])
                if "popularity" in comm:  # the recomputed forward routes its tokens again
                    prev = tl.collective("a2a", "exposed_collectives", **comm.at("popularity", k), after=[prev],
                                         label="popularity")
                prev = tl.collective("a2a", "all_to_all", **comm.at("a2a", k), after=[prev, regather.get(k)])
                prev = tl.compute("expert", stages.expert_fwd[k], after=[prev])
                prev = tl.collective("a2a", "all_to_all", **comm.at("a2a", k), after=[prev])
                spans["moe"][:, k] += _span(gate, prev)
        if k is None:
            first = tl.compute("other", c.BACKWARD * stages.other_dense, after=[prev])
        else:
            combine_b = tl.collective("a2a", "all_to_all", **comm.at("a2a", k), after=[prev])
            if recompute != "full":
                start = combine_b
            experts_b = tl.compute("expert", c.BACKWARD * stages.expert_fwd[k], after=[combine_b, regather.get(k)])
            dispatch_b = tl.collective("a2a", "all_to_all", **comm.at("a2a", k), after=[experts_b])
            below = [m for m in moe_index.values() if m < k]
            if spec.remat and below and "spag" in comm:
                # copies of the next MoE layer down were freed after its forward: gather them again
                regather[below[-1]] = tl.collective(
                    "sparse", "exposed_collectives", **comm.at("spag", below[-1]), after=[experts_b],
                    label="spag_remat",
                )
            for kind in grad_kinds:
                tl.collective("grad", "exposed_collectives", **comm.at(kind, k), after=[experts_b], label=kind)
            # the runtime's spRS(l): launched when the gradient reaches the layer's MoE input, after
            # the wait for spRS of the MoE layer above (`FSSDPRuntime.on_layer_backward` / `drain`)
            first = tl.compute("other", c.BACKWARD * stages.other_moe, after=[dispatch_b, sprs_above])
            if "sprs" in comm:
                sprs_above = tl.collective("sparse", "exposed_collectives", **comm.at("sprs", k),
                                           after=[dispatch_b], label="sprs")
            spans["moe"][:, k] += _span(combine_b, first)
        attention_b = tl.compute("attention", stages.att_bwd, after=[first])
        tl.collective("grad", "exposed_collectives", stages.dense_grad_s[j], after=[attention_b],
                      label="dense_grad_allreduce", nic_I=stages.dense_grad_nic[j])
        if k is not None:
            spans["backward"][:, k] = _span(start, attention_b)
        prev = attention_b
    return prev


def simulate_placement_system(scn: Scenario, spec: SystemSpec) -> SystemResult:
    """Replay a placement-engine policy over the trace and schedule every iteration."""
    config, knobs = replay_config(scn, spec)
    try:
        policy = make_policy(spec.policy, config, scn.num_layers, scn.num_experts)
        rep = _replay(scn, policy)
    except PlacementError as err:
        raise SimError(f"{spec.name}: {err}") from None
    a2a_IL = rep.a2a.times_IL(scn)
    kind_times = {kind: b.times_IL(scn) for kind, b in rep.kinds.items()}
    comm = _Comm({"a2a": a2a_IL, **kind_times},
                 {"a2a": rep.a2a.nic_IL(scn), **{kind: b.nic_IL(scn) for kind, b in rep.kinds.items()}})
    m = rep.moves_I4D
    moved = rep.moves_I > 0
    rearrange_I = np.where(moved, scn.comm.transfer_time(m[:, 0], m[:, 1], m[:, 2], m[:, 3]), 0.0)
    rearrange_nic_I = np.where(moved, scn.comm.transfer_parts(m[:, 0], m[:, 1], m[:, 2], m[:, 3])[2], 0.0)
    tl, total_I, layer_s_IL, moe_s_IL = _schedule(scn, spec, rep, comm, rearrange_I, rearrange_nic_I)

    breakdown = tl.breakdown()
    expert_index = list(breakdown).index("expert")
    breakdown_I = {
        "attention": breakdown["attention"],
        "other": breakdown["other"],
        "expert_compute_mean": breakdown["expert"],
        "expert_compute_max": tl.max_busy[expert_index],
        "straggler_wait": breakdown["straggler_wait"],
        "all_to_all": breakdown["all_to_all"],
        "exposed_collectives": breakdown["exposed_collectives"],
        "rearrangement": breakdown["rearrangement"],
        "optimizer": breakdown["optimizer"],
    }
    # remat keeps one layer's copies at a time, the others every layer's
    transient = rep.transient_params_ILD.max(axis=1) if spec.remat else rep.transient_params_ILD.sum(axis=1)
    memory_parts_ID = scn.memory.by_part(scn.memory.dense_parts(), rep.held_params_ILD.sum(axis=1) + transient,
                                         rep.optimizer_state_params_ILD.sum(axis=1),
                                         scn.memory.activation_bytes(rep.computed_ILD))
    memory_ID = sum(memory_parts_ID.values())
    peak_i, peak_d = np.unravel_index(int(np.argmax(memory_ID)), memory_ID.shape)
    a2a_parts = scn.comm.transfer_parts(*(rep.a2a.data[:, :, j] for j in range(4)))
    traffic = {"all_to_all": 4.0 * rep.a2a.totals()}
    traffic.update({kind: b.totals() for kind, b in rep.kinds.items()})
    dense = scn.workload.dense_params()
    dense_comm = scn.comm.dense_allreduce(
        (sum(dense["per_layer"]) + dense["outer"]) * scn.workload.byte_model.grad_bytes_per_param
    )[0]
    traffic["dense_grad_allreduce"] = np.array([dense_comm.intra, dense_comm.inter], dtype=np.float64)
    traffic["rearrange"] = np.array([rep.moves_I4D[:, 0].sum(axis=1).mean(), rep.moves_I4D[:, 1].sum(axis=1).mean()])
    details = dict(knobs)
    details["collective_s"] = {"all_to_all": float(4 * a2a_IL.sum(axis=1).mean())}
    details["collective_s"].update({kind: float(t.sum(axis=1).mean()) for kind, t in kind_times.items()})
    if spec.remat and "spag" in kind_times:
        # every MoE layer but the top one gathers its copies again for the backward
        details["collective_s"]["spag_remat"] = float(kind_times["spag"][:, :-1].sum(axis=1).mean())
    # what each kind of collective waited for the NIC behind others (NIC sharing), s per iteration
    details["nic_contention_s"] = {label: float(s_I.mean()) for label, s_I in tl.contention().items()}
    details["prediction_window"] = policy.default_window
    if isinstance(policy, FSSDPPolicy):
        details["overlap_degree_changes"] = [list(change) for change in policy.t_changes]
    details["rearrangement_events"] = int(np.count_nonzero(rep.moves_I))
    details["experts_moved"] = int(rep.moves_I.sum())
    if spec.policy == "fastermoe":
        details["shadowed_experts_per_layer_mean"] = float(rep.shadowed_IL.mean())
    unknown = sorted(set(rep.kinds) - set(_BEFORE_DISPATCH + _GRADIENT_SYNC + ("sprs",)))
    if unknown:
        details["kinds_scheduled_as_gradient_sync"] = unknown
    return SystemResult(
        name=spec.name,
        description=spec.description,
        iteration_s_I=total_I,
        breakdown_I=breakdown_I,
        layer_s_IL=layer_s_IL,
        moe_layer_s_IL=moe_s_IL,
        exposed_by_kind_I=tl.by_label("exposed_collectives"),
        expert_compute_D=tl.busy[expert_index].mean(axis=0),
        all_to_all_parts={name: float(4 * x.sum(axis=1).mean())
                          for name, x in zip(("latency", "intra_node_link", "inter_node_nic"), a2a_parts)},
        memory_parts={"device": int(peak_d), **{k: float(v[peak_i, peak_d]) for k, v in memory_parts_ID.items()}},
        imbalance_IL=imbalance_rows(rep.processed_ILD),
        survival_IL=rep.survival_IL,
        memory_D=memory_ID.max(axis=0),
        memory_limit_D=scn.hardware.memory_D,
        traffic=traffic,
        details=details,
        planner_s=rep.planner_s,
    )


def simulate_ep_per_gpu_type(scn: Scenario, spec: SystemSpec) -> SystemResult:
    """HeterMoE's EP (Ideal): DeepSpeed-style EP run separately on all GPUs of each type, with the
    throughputs summed.

    Type t's n_t devices train the model alone on their share of the batch (the same micro-batch
    per GPU): one of their iterations takes T_t and moves n_t x micro-batch x sequence tokens.
    The pool's iteration of D devices' tokens then takes T = D / sum_t(n_t / T_t), per trace
    iteration. Every time in the result (breakdown, per-layer) is the types' own weighted by
    their throughput shares f_t = (n_t / T_t) / sum(n / T), so the breakdown still adds up to T;
    traffic is per pool iteration (type t does f_t of its tokens). A type that cannot run EP on
    its own (the experts do not divide over its devices, it lacks the precision, or the model
    does not fit its memory) contributes nothing and is named in the details; on a homogeneous
    cluster this is EP.
    """
    ep = dataclasses.replace(spec, per_gpu_type=False)
    D = scn.num_devices
    gpus = {t: scn.hardware.device_types.count(t) for t in dict.fromkeys(scn.hardware.device_types)}
    per_type: dict[str, SystemResult] = {}
    details: dict = {"gpu_types": {}}
    for gpu_type, n in gpus.items():
        entry = {"gpus": n}
        details["gpu_types"][gpu_type] = entry
        try:
            sub = scn if len(gpus) == 1 else scn.on_gpu_type(gpu_type)
        except SimError as err:
            entry["excluded"] = str(err)
            continue
        problem = ep_layout_problem(sub)
        if problem is not None:
            entry["excluded"] = problem
            continue
        result = simulate_placement_system(sub, ep)
        if not result.fits:
            entry["excluded"] = (f"EP needs {result.memory_D.max() / 1e9:.1f} GB per GPU, "
                                 f"{gpu_type} has {result.memory_limit_D.min() / 1e9:.0f}")
            continue
        per_type[gpu_type] = result
        entry["iteration_s"] = result.iteration_s
    if not per_type:
        raise SimError(f"{spec.name}: no GPU type can run EP on its own: "
                       + "; ".join(f"{t}: {e['excluded']}" for t, e in details["gpu_types"].items()))
    rate_TI = np.stack([gpus[t] / r.iteration_s_I for t, r in per_type.items()])
    total_I = D / rate_TI.sum(axis=0)
    share_TI = rate_TI / rate_TI.sum(axis=0)
    for (t, r), share_I in zip(per_type.items(), share_TI):
        details["gpu_types"][t]["throughput_share"] = float(share_I.mean())
    results = list(per_type.values())

    def mix(arrays):
        """Throughput-weighted mean of per-type arrays with a leading iteration axis."""
        return sum(a * share_I.reshape(-1, *([1] * (np.ndim(a) - 1))) for a, share_I in zip(arrays, share_TI))

    memory_D, expert_compute_D = np.zeros(D), np.zeros(D)
    device_types = np.array(scn.hardware.device_types)
    for t, r in per_type.items():
        memory_D[device_types == t] = r.memory_D
        expert_compute_D[device_types == t] = r.expert_compute_D
    peak_type = max(per_type, key=lambda t: per_type[t].memory_D.max())
    peak_parts = dict(per_type[peak_type].memory_parts)
    peak_parts["device"] = int(np.flatnonzero(device_types == peak_type)[peak_parts["device"]])
    traffic = {}
    for (t, r), share_I in zip(per_type.items(), share_TI):
        scale = float(share_I.mean()) * D / gpus[t]
        for kind, v in r.traffic.items():
            traffic[kind] = traffic.get(kind, 0.0) + scale * v
    kinds = sorted({k for r in results for k in r.exposed_by_kind_I})
    return SystemResult(
        name=spec.name,
        description=spec.description,
        iteration_s_I=total_I,
        breakdown_I={k: mix([r.breakdown_I[k] for r in results]) for k in results[0].breakdown_I},
        layer_s_IL=mix([r.layer_s_IL for r in results]),
        moe_layer_s_IL=mix([r.moe_layer_s_IL for r in results]),
        exposed_by_kind_I={k: mix([r.exposed_by_kind_I.get(k, np.zeros_like(total_I)) for r in results])
                           for k in kinds},
        expert_compute_D=expert_compute_D,
        all_to_all_parts={k: sum(float(s.mean()) * r.all_to_all_parts[k] for r, s in zip(results, share_TI))
                          for k in results[0].all_to_all_parts},
        memory_parts=peak_parts,
        imbalance_IL=mix([r.imbalance_IL for r in results]),
        survival_IL=mix([r.survival_IL for r in results]),
        memory_D=memory_D,
        memory_limit_D=scn.hardware.memory_D,
        traffic=traffic,
        details=details,
        planner_s=sum(r.planner_s for r in results),
    )
