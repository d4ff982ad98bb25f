"""Policy replay: every placement system behind one interface, replayed over a load trace.

The plan CLI (`tools/plan.py`) and the simulator compare systems on the same trace. Each
system is a `Policy` that is fed one iteration at a time:

- `predicted_LE`: the loads it may plan from, predicted from *earlier* iterations only
  (`LoadTracker`, window w);
- `source_loads_LDE`: the tokens the gate actually routed this iteration, per source device.
  Only dispatch (which follows the gate by construction), FSSDP's optional calibration and
  FasterMoE's shadowing (both decided after the gate, on the critical path) look at them.

`Policy.plan` returns a `PolicyStep`: per layer the instance placement, where the tokens were
sent and how many were processed per (expert, device), plus the experts moved before the
iteration (rearrangement). `Policy.traffic` turns a step into bytes per kind of
communication, split intra- / inter-node. `replay` drives a policy over a trace and
collects the DESIGN 5 metrics in a `ReplayResult`.

Policies: ep, fssdp, replicate, static, fastermoe, smartmoe, flexmoe (`POLICIES`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterator

import numpy as np

from megatron_patches.placement import fssdp
from megatron_patches.placement.accounting import (
    CommBytes,
    apply_capacity,
    dispatch_bytes,
    imbalance,
    sparse_all_gather_bytes,
    sparse_reduce_scatter_bytes,
)
from megatron_patches.placement.baselines import (
    ByteModel,
    EPLayout,
    ExpertMove,
    MovedBytes,
    ShadowCostModel,
    deepspeed_dispatch,
    deepspeed_slots,
    ep_layout_moves,
    fastermoe_shadow,
    flexmoe_adjust,
    moved_bytes,
    smartmoe_swap,
    split_evenly,
    static_replication,
)
from megatron_patches.placement.loads import LOAD_PREDICTORS, LoadTracker
from megatron_patches.placement.replicate import (
    instance_capacity,
    popularity_slots,
    slot_placement,
    spread_tokens,
)
from megatron_patches.placement.types import (
    DispatchPlan,
    ElementShardLayout,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    Topology,
    check_int,
    check_loads,
)

__all__ = [
    "ReplayConfig",
    "replay_steps",
    "LayerPlan",
    "PolicyStep",
    "Policy",
    "EPPolicy",
    "FSSDPPolicy",
    "ReplicatePolicy",
    "StaticPolicy",
    "FasterMoEPolicy",
    "SmartMoEPolicy",
    "FlexMoEPolicy",
    "POLICIES",
    "make_policy",
    "even_source_loads",
    "ring_allreduce_bytes",
    "all_ranks_allreduce_bytes",
    "ReplayResult",
    "replay",
]


@dataclass(frozen=True)
class ReplayConfig:
    """Cluster, model and policy knobs shared by every policy of one comparison."""

    topology: Topology
    """The devices (D = nodes x devices per node) and link bandwidths."""
    byte_model: ByteModel
    """Bytes per expert (weights, gradients, optimizer state) and per token."""
    overlap_degree: int = 8
    """FSSDP's t: expert copies a device can receive while attention runs."""
    overlap_choice: Callable[[list[ShardLayout], np.ndarray], int] | None = None
    """FSSDP's auto t after the start: called at `fssdp.overlap_due`'s iterations with the layers'
    owners and the per-source loads of the iteration before it (int [L, D, E]), returns the t to
    plan with from then on, as the runtime re-chooses it there (`FSSDPRuntime.end_iteration`);
    None: t stays `overlap_degree`."""
    memory_capacity: int = 4
    """m: extra expert copies that fit on a device (FSSDP copies; FlexMoE's reserved slots)."""
    slots_per_rank: int | None = None
    """s for replicate / static; None means ceil(E / D) + memory_capacity, i.e. the same expert
    memory per device as FlexMoE's base experts plus reserved slots."""
    capacity_factor: float = 1.0
    """Capacity factor of the capacity-based policies (replicate, static); the others are dropless."""
    flexmoe_capacity: bool = False
    """FlexMoE applies `capacity_factor` too (the run sets a capacity): the layer's capacity
    ceil(capacity_factor x T / instances) per instance, as replicate's and static's G x s
    instances share theirs, so that drop counts compare (the replication paper runs FlexMoE
    this way)."""
    reshard_interval: int = 100
    """Iterations between FSSDP re-sharding, SmartMoE swapping and FlexMoE's periodic adjustment."""
    skew_threshold: float | None = 1.5
    """FlexMoE also adjusts a layer whose predicted imbalance exceeds this; None = interval only."""
    calibrate: bool = True
    """FSSDP: run the calibration step after the gate (DESIGN 4.2 step 4); on by default, as the
    runtime's --fssdp-calibrate."""
    gather_seconds: Callable[[ShardLayout, InstancePlacement], float] | None = None
    """FSSDP calibration's price of an extra gather (`fssdp.FSSDPCostModel.gather_seconds`; the
    simulator passes its link model); None: the topology's point-to-point model."""
    dispatch_seconds: Callable[[DispatchPlan], float] | None = None
    """FSSDP calibration's price of a layer's all-to-alls (`fssdp.FSSDPCostModel.dispatch_seconds`);
    None: calibration weighs expert compute only."""
    reduce_hidden_s: float = 0.0
    """FSSDP's cost model: backward time outside the MoE blocks that a layer's spRS hides behind
    (its attention backward); `fssdp.FSSDPCostModel.reduce_hidden_s`."""
    instance_overhead_s: float = 0.0
    """FSSDP's cost model: fixed time of one expert instance with tokens on a device, forward and
    backward (`fssdp.FSSDPCostModel.seconds_per_instance`)."""
    collectives: str = "flat"
    """FSSDP's sparse-collective algorithm for the byte counts ("flat" or "hierarchical")."""
    device_flops: float = 100e12
    """Sustained FLOP/s of one device, for the cost models of FasterMoE and FSSDP calibration."""
    load_predictor: str = LOAD_PREDICTORS[0]
    """How every policy predicts loads from its window (`LoadTracker`): "adaptive" (per layer the
    window among 1, 2, 4, ... up to the policy's that predicted the recent iterations best, as
    the fssdp and replicate runtimes do by default) or "mean" (DESIGN 4.1's plain mean)."""

    def __post_init__(self) -> None:
        check_int(self.overlap_degree, "overlap_degree")
        check_int(self.memory_capacity, "memory_capacity")
        if self.slots_per_rank is not None:
            check_int(self.slots_per_rank, "slots_per_rank", 1)
        check_int(self.reshard_interval, "reshard_interval", 1)
        if self.load_predictor not in LOAD_PREDICTORS:
            raise PlacementError(f"load_predictor must be one of {LOAD_PREDICTORS}, got {self.load_predictor!r}")
        if not np.isfinite(self.capacity_factor) or self.capacity_factor <= 0:
            raise PlacementError(f"capacity_factor must be > 0, got {self.capacity_factor!r}")
        if self.skew_threshold is not None and not self.skew_threshold >= 1.0:
            raise PlacementError(
                f"skew_threshold must be >= 1.0 (imbalance is max/mean) or None, got {self.skew_threshold!r}"
            )

    def tracker(self, num_layers: int, num_experts: int, window: int) -> LoadTracker:
        """The load predictor every policy plans from (`load_predictor`)."""
        return LoadTracker.for_predictor(num_layers, num_experts, window, self.load_predictor)

    def fssdp_cost(self) -> fssdp.FSSDPCostModel:
        """FSSDP's cost model (calibration and t by cost) from these figures: an expert's forward
        and backward at `device_flops` (6 FLOPs per parameter and token) plus
        `instance_overhead_s` per instance, the gather and all-to-all prices, the reduce's
        gradient-over-weight bytes."""
        return fssdp.FSSDPCostModel(
            seconds_per_token=6.0 * self.byte_model.params_per_expert / self.device_flops,
            expert_bytes=self.byte_model.expert_weight_bytes,
            seconds_per_instance=self.instance_overhead_s,
            gather_seconds=self.gather_seconds,
            dispatch_seconds=self.dispatch_seconds,
            reduce_ratio=self.byte_model.expert_grad_bytes / self.byte_model.expert_weight_bytes,
            reduce_hidden_s=self.reduce_hidden_s,
        )

    def slots(self, num_experts: int) -> int:
        """s actually used for E experts."""
        if self.slots_per_rank is not None:
            return int(self.slots_per_rank)
        return -(-num_experts // self.topology.num_devices) + self.memory_capacity


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """What a policy did in one layer and iteration."""

    placement: InstancePlacement
    """Instances per (expert, device) while the layer's experts ran."""
    dispatch: DispatchPlan
    """Where each source's tokens were sent (tokens dropped before sending are not in it; a
    fixed-shape dispatch's padding rows are: static's)."""
    processed_ED: np.ndarray
    """Tokens processed per (expert, device) after any capacity limit; int64 [E, D]."""
    shard: ShardLayout | None = None
    """FSSDP: the owners the copies were gathered from and reduce back to; None otherwise."""
    materialized: InstancePlacement | None = None
    """FSSDP with calibration: the copies gathered before the gate, when calibration gathered
    more after it (`placement` then holds both); None otherwise."""
    shadowed_E: np.ndarray | None = None
    """FasterMoE: boolean [E], experts broadcast to every device of their EP group; None otherwise."""
    capacity: int | None = None
    """Tokens one instance may process, for the capacity-limited policies (replicate, static, FlexMoE
    with a capacity); None: dropless. A system that pads its experts' input to the capacity
    computes this many rows per instance whatever it receives (the simulator prices that)."""


@dataclass(frozen=True, eq=False)
class PolicyStep:
    """One iteration of a policy: per-layer plans and the rearrangement done before it."""

    iteration: int
    """Trace iteration."""
    layers: tuple[LayerPlan, ...]
    """One plan per MoE layer."""
    moves: tuple[ExpertMove, ...] = ()
    """Experts whose weights and optimizer state were copied to another device before this iteration."""


def _a2a(plan: DispatchPlan, topology: Topology, token_bytes: int) -> CommBytes:
    """All-to-all bytes: dispatch + combine, forward + backward (each token crosses 4 times)."""
    one = dispatch_bytes(plan, topology, token_bytes)
    both = one + one.reversed()
    return both + both


def ring_allreduce_bytes(placement: InstancePlacement, chunk_bytes: float, topology: Topology) -> CommBytes:
    """Gradient all-reduce of every replicated expert as a ring over its holders (ascending ids).

    A ring all-reduce of r participants sends 2 (r - 1) / r of the buffer over each of its r
    edges: 2 (r - 1) buffers in total, DESIGN 3's AllReduce-equivalent volume.
    """
    holds_ED = placement.holds_ED()
    e_H, d_H = np.nonzero(holds_ED)
    r_E = holds_ED.sum(axis=1)
    start_E = np.concatenate(([0], np.cumsum(r_E)[:-1]))
    pos_H = np.arange(e_H.size) - start_E[e_H]
    next_H = d_H[start_E[e_H] + (pos_H + 1) % r_E[e_H]]
    bytes_H = 2.0 * (r_E[e_H] - 1) / r_E[e_H] * chunk_bytes
    return CommBytes.from_transfers(d_H, next_H, bytes_H, topology)


def all_ranks_allreduce_bytes(buffer_bytes: float, topology: Topology) -> CommBytes:
    """A ring all-reduce of `buffer_bytes` over every device (ascending ids): `ring_allreduce_bytes`
    of one "expert" every device holds (Megatron's dense gradients, replicate's counts)."""
    every_D = InstancePlacement(np.ones((1, topology.num_devices), dtype=np.int64))
    return ring_allreduce_bytes(every_D, buffer_bytes, topology)


def _total(comms: list[CommBytes], topology: Topology) -> CommBytes:
    zero = np.zeros(topology.num_devices, dtype=np.int64)
    out = CommBytes(zero, zero, zero, zero)
    for c in comms:
        out = out + c
    return out


def calibration_delta(lp: LayerPlan) -> InstancePlacement:
    """The owners plus the copies calibration added after the gate (what its extra spAG fills)."""
    return fssdp.calibration_gather(lp.shard, lp.materialized, lp.placement.holds_ED())


def even_source_loads(loads_LE, num_devices: int) -> np.ndarray:
    """Split each expert's tokens evenly over D source devices; int64 [L, D, E].

    For traces without per-rank loads (or recorded at another scale): every device gets
    n // D of an expert's n tokens and the n mod D left over go to devices e, e+1, ... (mod D),
    so the remainders of different experts land on different devices.
    """
    loads_LE = check_loads(loads_LE, "loads_LE", 2)
    D = int(num_devices)
    base_LE, rem_LE = loads_LE // D, loads_LE % D
    E = loads_LE.shape[1]
    offset_DE = (np.arange(D)[:, None] - np.arange(E)[None, :]) % D  # position of device d after expert e's start
    return base_LE[:, None, :] + (offset_DE[None, :, :] < rem_LE[:, None, :])


class Policy(ABC):
    """A placement system replayed over a trace. Subclasses set `name` and implement `plan`.

    Attributes:
        config: the shared knobs.
        num_layers: L.
        num_experts: E.
    """

    name: ClassVar[str] = ""
    default_window: ClassVar[int] = 5
    """Prediction window the system uses unless the caller overrides it."""
    moves_optimizer: ClassVar[bool] = True
    """Whether its rearrangements carry optimizer state along with the weights."""
    syncs_replica_gradients: ClassVar[bool] = False
    """Whether the holders of an expert in `LayerPlan.placement` all-reduce its gradients (a ring
    over the holders each iteration): replicas that each keep their own weights in step."""
    pads_to_capacity: ClassVar[bool] = False
    """Whether its experts always compute their whole `LayerPlan.capacity` (a fixed-shape
    dispatch), not only what they receive."""

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        self.config = config
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.topology = config.topology
        self.bytes = config.byte_model
        self.misprediction_L = np.zeros(self.num_layers)
        """Set by the driver (`replay`, the simulator) before each `plan`: the share of tokens per
        layer its predictor recently misplaced (`LoadTracker.misprediction`). FSSDP with
        calibration keeps that share of its copy slots free for after the gate."""

    @abstractmethod
    def plan(self, iteration: int, predicted_LE: np.ndarray, source_loads_LDE: np.ndarray) -> PolicyStep:
        """Plan one iteration from the prediction (float [L, E]); dispatch the actual tokens (int [L, D, E])."""

    def traffic(self, step: PolicyStep) -> dict[str, CommBytes]:
        """Bytes of one iteration by kind (all layers): the all-to-all, and the replicas' gradient
        all-reduce where `syncs_replica_gradients`."""
        out = {
            "all_to_all": _total(
                [_a2a(lp.dispatch, self.topology, self.bytes.token_bytes) for lp in step.layers], self.topology
            )
        }
        if self.syncs_replica_gradients:
            out["grad_allreduce"] = _total(
                [ring_allreduce_bytes(lp.placement, self.bytes.expert_grad_bytes, self.topology) for lp in step.layers],
                self.topology,
            )
        return out

    def rearrangement(self, step: PolicyStep) -> MovedBytes:
        """Weight and optimizer bytes of the step's moves."""
        return moved_bytes(list(step.moves), self.topology, self.bytes, with_optimizer=self.moves_optimizer)

    def _dropless(self, placement: InstancePlacement, plan: DispatchPlan, **extra) -> LayerPlan:
        return LayerPlan(placement, plan, plan.received_ED(), **extra)


class EPPolicy(Policy):
    """Megatron EP: static, even expert layout; tokens go to the expert's device in their EP group."""

    name = "ep"
    syncs_replica_gradients = True

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        super().__init__(config, num_layers, num_experts)
        self.layout = EPLayout.even(num_experts, self.topology.num_devices)
        self._placement = self.layout.placement()

    def plan(self, iteration, predicted_LE, source_loads_LDE):
        return PolicyStep(
            iteration, tuple(self._dropless(self._placement, self.layout.dispatch(src)) for src in source_loads_LDE)
        )


class FSSDPPolicy(Policy):
    """FSSDP: sparse materialization per layer and iteration, heterogeneous re-sharding every k.

    Starts from the even shard layout. Every `reshard_interval` iterations it chooses t again
    when the config says how (`ReplayConfig.overlap_choice`, the runtime's auto t), then applies
    the runtime's own re-shard rule (`fssdp.decide_reshard`: adopt the heterogeneous sharding of
    the predicted loads only if it lowers the predicted imbalance), then moves the weights and
    optimizer state of every expert whose owner changed.
    """

    name = "fssdp"

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        super().__init__(config, num_layers, num_experts)
        self.shard = fssdp.even_shard(num_layers, num_experts, self.topology.num_devices)
        self._cost = config.fssdp_cost()
        self.calibrations = 0
        """Layer-iterations in which calibration did the extra gather."""
        self.t = config.overlap_degree
        """The overlap degree planned with (`ReplayConfig.overlap_choice` may change it)."""
        self.t_changes: list[tuple[int, int]] = []
        """(iteration, new t) of every change of t."""
        self._previous_sources_LDE: np.ndarray | None = None

    def plan(self, iteration, predicted_LE, source_loads_LDE):
        cfg = self.config
        moves: list[ExpertMove] = []
        # the first choice (iteration 0's loads) is replay_config's; the later ones price the
        # iteration before's loads, as the runtime does, applied one iteration earlier than it does
        if cfg.overlap_choice is not None and iteration > 1 and fssdp.overlap_due(iteration, cfg.reshard_interval):
            t = int(cfg.overlap_choice([self.shard.layer(l) for l in range(self.num_layers)],
                                       self._previous_sources_LDE))
            if t != self.t:
                self.t_changes.append((iteration, t))
            self.t = t
        if fssdp.reshard_due(iteration, cfg.reshard_interval):
            decision = fssdp.decide_reshard(self.shard, predicted_LE, self.topology, self.t)
            if decision.adopt:
                new = decision.proposed
                l_M, e_M = np.nonzero(new.owners_LE != self.shard.owners_LE)
                moves = [
                    ExpertMove(int(l), int(e), int(self.shard.owners_LE[l, e]), int(new.owners_LE[l, e]))
                    for l, e in zip(l_M, e_M)
                ]
                self.shard = new
        layers = []
        for l in range(self.num_layers):
            shard = self.shard.layer(l)
            reserve = fssdp.calibration_reserve(cfg.memory_capacity, self.misprediction_L[l]) if cfg.calibrate else 0
            placement = fssdp.materialize(shard, predicted_LE[l], self.t, cfg.memory_capacity - reserve, self.topology)
            materialized = None
            if cfg.calibrate:
                remaining_D = np.maximum(cfg.memory_capacity - placement.extra_copies_D(shard), 0)
                calibrated, gathered = fssdp.calibrate(
                    placement, shard, source_loads_LDE[l].sum(axis=0), remaining_D, self.topology, self._cost,
                    source_loads_LDE[l],
                )
                if gathered:
                    materialized, placement = placement, calibrated
                self.calibrations += int(gathered)
            layers.append(self._dropless(placement, fssdp.dispatch(placement, source_loads_LDE[l], self.topology),
                                         shard=shard, materialized=materialized))
        self._previous_sources_LDE = source_loads_LDE
        return PolicyStep(iteration, tuple(layers), tuple(moves))

    def traffic(self, step):
        """spAG of the copies gathered before the gate, "spag_calibrate" of those gathered after it
        (calibration), spRS of all (they reduce together), besides the all-to-all."""
        out = super().traffic(step)
        algorithm, weight, grad = self.config.collectives, self.bytes.expert_weight_bytes, self.bytes.expert_grad_bytes
        gathers, extras, reduces = [], [], []
        for lp in step.layers:
            before = lp.placement if lp.materialized is None else lp.materialized
            gathers.append(sparse_all_gather_bytes(lp.shard, before, weight, self.topology, algorithm))
            if lp.materialized is not None:
                extras.append(sparse_all_gather_bytes(lp.shard, calibration_delta(lp), weight, self.topology, algorithm))
            reduces.append(sparse_reduce_scatter_bytes(lp.placement, lp.shard, grad, self.topology, algorithm))
        out["spag"] = _total(gathers, self.topology)
        if extras:
            out["spag_calibrate"] = _total(extras, self.topology)
        out["sprs"] = _total(reduces, self.topology)
        return out


class _SlotPolicy(Policy):
    """Shared by replicate and static: G ranks x s slots, a capacity per instance."""

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        super().__init__(config, num_layers, num_experts)
        self.slots_per_rank = config.slots(num_experts)
        D = self.topology.num_devices
        if num_experts > D * self.slots_per_rank:
            raise PlacementError(
                f"{self.name}: {num_experts} experts do not fit in {D} ranks x {self.slots_per_rank} slots; "
                f"use --slots-per-rank >= {-(-num_experts // D)}"
            )


class ReplicatePolicy(_SlotPolicy):
    """Adaptive replication with a decoupled optimizer (DESIGN 4.6).

    Replica counts follow the predicted popularity every iteration (window 1 by default:
    "mimic the previous iteration"). Optimizer state is partitioned element-wise over all
    ranks and never moves, so there is no rearrangement; per iteration, every holder sends each
    slice owner its slice of the expert's gradient (a sparse reduce-scatter, the mirror of the
    weight push: no all-reduce among the holders), and the updated slices are sent into the
    slots of the placement.
    """

    name = "replicate"
    default_window = 1
    moves_optimizer = False

    def plan(self, iteration, predicted_LE, source_loads_LDE):
        D, s = self.topology.num_devices, self.slots_per_rank
        layers = []
        for l in range(self.num_layers):
            placement = slot_placement(popularity_slots(predicted_LE[l], D, s), self.num_experts)
            spread = spread_tokens(placement, source_loads_LDE[l], self.config.capacity_factor, s)
            layers.append(LayerPlan(placement, spread.plan, spread.processed_ED, capacity=spread.capacity))
        return PolicyStep(iteration, tuple(layers))

    def traffic(self, step):
        out = super().traffic(step)
        D = self.topology.num_devices
        size_R = ElementShardLayout(self.bytes.params_per_expert, D).sizes_D().astype(np.float64)
        ranks = np.arange(D, dtype=np.int64)
        reduce, scatter = [], []
        for lp in step.layers:
            _, h_H = np.nonzero(lp.placement.holds_ED())
            # holder h of a class sends rank r its slice r of the class's gradient (r == h: local)
            reduce.append(
                CommBytes.from_transfers(
                    np.repeat(h_H, D),
                    np.tile(ranks, h_H.size),
                    np.tile(size_R, h_H.size) * self.bytes.grad_bytes_per_param,
                    self.topology,
                )
            )
            scatter.append(
                CommBytes.from_transfers(
                    np.tile(ranks, h_H.size),
                    np.repeat(h_H, D),
                    np.tile(size_R, h_H.size) * self.bytes.weight_bytes_per_param,
                    self.topology,
                )
            )
        out["grad_reduce_scatter"] = _total(reduce, self.topology)
        out["weight_scatter"] = _total(scatter, self.topology)
        # routing under the capacity needs every source's counts: one [G, E] int64 buffer
        # all-reduced per layer after the gate (`ReplicateRuntime.route`), as a ring over all ranks
        counts = all_ranks_allreduce_bytes(8.0 * D * self.num_experts, self.topology)
        out["popularity"] = _total([counts] * len(step.layers), self.topology)
        return out


class StaticPolicy(_SlotPolicy):
    """DeepSpeed-MoE's static replication: its fixed layout and its group-local, padded dispatch.

    s is `ReplayConfig.slots_per_rank` when set (refused unless DeepSpeed can lay it out), else
    the most slots DeepSpeed can lay out within `ReplayConfig.slots` (`deepspeed_slots`).
    """

    name = "static"
    syncs_replica_gradients = True
    pads_to_capacity = True  # DeepSpeed's gate dispatches into [experts, capacity, hidden] buffers

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        super().__init__(config, num_layers, num_experts)
        D = self.topology.num_devices
        self.slots_per_rank = deepspeed_slots(num_experts, D, self.slots_per_rank, config.slots_per_rank is not None)
        self._placement = static_replication(num_experts, D, self.slots_per_rank)

    def plan(self, iteration, predicted_LE, source_loads_LDE):
        layers = []
        for src_DE in source_loads_LDE:
            spread = deepspeed_dispatch(src_DE, self.slots_per_rank, self.config.capacity_factor)
            layers.append(LayerPlan(self._placement, spread.plan, spread.processed_ED, capacity=spread.capacity))
        return PolicyStep(iteration, tuple(layers))


class FasterMoEPolicy(Policy):
    """FasterMoE-style shadowing on top of EP, decided per layer after the gate (actual loads).

    Shadows are transient copies: weights are broadcast from the expert's holder in each EP
    group to the group's other devices and the gradients reduced back the same way; no
    optimizer state moves.
    """

    name = "fastermoe"

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        super().__init__(config, num_layers, num_experts)
        self.layout = EPLayout.even(num_experts, self.topology.num_devices)
        self.cost = ShadowCostModel.from_hardware(self.bytes, self.topology, config.device_flops)
        self._ep_placement = self.layout.placement()

    def plan(self, iteration, predicted_LE, source_loads_LDE):
        decisions = [fastermoe_shadow(self.layout, src, self.cost) for src in source_loads_LDE]
        return PolicyStep(
            iteration, tuple(self._dropless(d.placement, d.dispatch, shadowed_E=d.shadowed_E) for d in decisions)
        )

    def traffic(self, step):
        out = super().traffic(step)
        g = self.layout.group_size
        holders_EG = self.layout.devices_E_G()
        broadcasts, reduces, allreduce = [], [], []
        for lp in step.layers:
            # shadowed expert e: in group k, its holder sends to every other device of the group
            e_S = np.flatnonzero(lp.shadowed_E)
            src = np.repeat(holders_EG[e_S], g, axis=1).ravel()
            dst = np.tile(np.arange(self.topology.num_devices), e_S.size)
            broadcasts.append(CommBytes.from_transfers(src, dst, self.bytes.expert_weight_bytes, self.topology))
            reduces.append(CommBytes.from_transfers(dst, src, self.bytes.expert_grad_bytes, self.topology))
            allreduce.append(ring_allreduce_bytes(self._ep_placement, self.bytes.expert_grad_bytes, self.topology))
        out["shadow_broadcast"] = _total(broadcasts, self.topology)
        out["shadow_reduce"] = _total(reduces, self.topology)
        out["grad_allreduce"] = _total(allreduce, self.topology)
        return out


class SmartMoEPolicy(Policy):
    """SmartMoE-style periodic swapping on top of EP (one layout per layer), every k iterations."""

    name = "smartmoe"
    syncs_replica_gradients = True

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        super().__init__(config, num_layers, num_experts)
        even = EPLayout.even(num_experts, self.topology.num_devices)
        self.layouts = [even] * num_layers

    def plan(self, iteration, predicted_LE, source_loads_LDE):
        moves: list[ExpertMove] = []
        if iteration > 0 and iteration % self.config.reshard_interval == 0:
            for l in range(self.num_layers):
                new, swaps = smartmoe_swap(self.layouts[l], predicted_LE[l])
                if swaps:
                    moves += ep_layout_moves(self.layouts[l], new, l)
                    self.layouts[l] = new
        layers = tuple(
            self._dropless(lay.placement(), lay.dispatch(src)) for lay, src in zip(self.layouts, source_loads_LDE)
        )
        return PolicyStep(iteration, layers, tuple(moves))


class FlexMoEPolicy(Policy):
    """FlexMoE-style incremental replicate / relocate on top of EP's layout.

    Each device has E/g base slots (EP's experts) plus `memory_capacity` reserved slots. A
    layer is adjusted every `reshard_interval` iterations, and also whenever its predicted
    imbalance under the current placement exceeds `skew_threshold`. Replicas are full
    copies with their own optimizer state, kept in sync by a gradient all-reduce; tokens are
    split evenly over the replicas. Dropless, unless `flexmoe_capacity`: then the layer's
    capacity (capacity factor x tokens) is shared evenly by its instances, as replicate's is by
    its slots, and what an instance receives beyond its share is dropped.
    """

    name = "flexmoe"
    syncs_replica_gradients = True

    def __init__(self, config: ReplayConfig, num_layers: int, num_experts: int) -> None:
        super().__init__(config, num_layers, num_experts)
        base = EPLayout.even(num_experts, self.topology.num_devices)
        self.slots_per_device = num_experts // base.group_size + config.memory_capacity
        self.placements = [base.placement()] * num_layers

    def _predicted_imbalance(self, placement: InstancePlacement, loads_E: np.ndarray) -> float:
        holds_ED = placement.holds_ED()
        return imbalance((loads_E / holds_ED.sum(axis=1)) @ holds_ED)

    def plan(self, iteration, predicted_LE, source_loads_LDE):
        cfg = self.config
        periodic = iteration > 0 and iteration % cfg.reshard_interval == 0
        moves: list[ExpertMove] = []
        layers = []
        for l in range(self.num_layers):
            skewed = (
                cfg.skew_threshold is not None
                and self._predicted_imbalance(self.placements[l], predicted_LE[l]) > cfg.skew_threshold
            )
            if periodic or skewed:
                self.placements[l], added = flexmoe_adjust(
                    self.placements[l], predicted_LE[l], self.slots_per_device, self.topology, layer=l
                )
                moves += added
            placement = self.placements[l]
            plan = split_evenly(source_loads_LDE[l], placement.holds_ED())
            if cfg.flexmoe_capacity:
                # the layer's capacity cf x T shared by its instances, as replicate's G x s are
                tokens = int(np.asarray(source_loads_LDE[l]).sum())
                capacity = instance_capacity(cfg.capacity_factor, tokens, int(placement.counts_ED.sum()), 1)
                layers.append(LayerPlan(placement, plan, apply_capacity(plan, placement, capacity)[0], capacity=capacity))
            else:
                layers.append(self._dropless(placement, plan))
        return PolicyStep(iteration, tuple(layers), tuple(moves))


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (EPPolicy, FSSDPPolicy, ReplicatePolicy, FasterMoEPolicy, SmartMoEPolicy, FlexMoEPolicy, StaticPolicy)
}
"""Policy classes by CLI name."""


def make_policy(name: str, config: ReplayConfig, num_layers: int, num_experts: int) -> Policy:
    """Instantiate a policy by name; PlacementError naming the valid names otherwise."""
    if name not in POLICIES:
        raise PlacementError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
    return POLICIES[name](config, num_layers, num_experts)


@dataclass
class ReplayResult:
    """Per-iteration, per-layer metrics of one policy over a trace (DESIGN 5 definitions)."""

    policy: str
    """Policy name."""
    window: int
    """Prediction window used."""
    imbalance_IL: np.ndarray
    """max / mean device load (processed tokens) per iteration and layer; float [I, L]."""
    survival_IL: np.ndarray
    """Tokens processed / tokens routed; float [I, L]."""
    replicas_IL: np.ndarray
    """Mean distinct devices holding an expert; float [I, L]."""
    extra_copies_IL: np.ndarray
    """Expert instances beyond one per expert, per device: (sum of instances - E) / D; float [I, L]."""
    planner_s_I: np.ndarray
    """Wall time of `Policy.plan` per iteration (all layers), seconds; float [I]."""
    traffic: dict[str, np.ndarray] = field(default_factory=dict)
    """Bytes by kind summed over the replay: kind -> float [2] (intra-node, inter-node)."""
    rearrange: MovedBytes = field(default_factory=MovedBytes)
    """Everything rearrangement moved over the replay."""
    rearrange_events: int = 0
    """Iterations in which something moved."""


def replay_steps(policy: Policy, loads_ILE: np.ndarray, source_LDE: Callable[[int], np.ndarray],
                 window: int) -> Iterator[tuple[int, PolicyStep, float]]:
    """The predict -> plan -> observe loop of every replay (`replay` here, the simulator's): per
    iteration i the policy plans from the loads of the iterations before i only. Yields (i, the
    plan, seconds in `Policy.plan`); i's loads are observed once the caller has used the plan.
    ``source_LDE(i)``: iteration i's loads by source device, int [L, D, E]."""
    I, L, E = loads_ILE.shape
    tracker = policy.config.tracker(L, E, window)
    for i in range(I):
        predicted_LE = tracker.predict()
        policy.misprediction_L = tracker.misprediction()
        start = time.perf_counter()
        step = policy.plan(i, predicted_LE, source_LDE(i))
        yield i, step, time.perf_counter() - start
        tracker.observe(loads_ILE[i])


def replay(
    policy: Policy,
    loads_ILE,
    source_loads_ILDE=None,
    window: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay `policy` over a trace, predicting each iteration from the previous ones only.

    Args:
        policy: a fresh policy (it keeps state across iterations).
        loads_ILE: tokens per expert; int [I, L, E].
        source_loads_ILDE: the same split by source device, int [I, L, D, E]; None splits
            the loads evenly over the D devices (`even_source_loads`).
        window: prediction window; None uses the policy's default.
        progress: called as progress(done, total) after every iteration.
    """
    loads_ILE = check_loads(loads_ILE, "loads_ILE", 3)
    I, L, E = loads_ILE.shape
    D = policy.topology.num_devices
    if (L, E) != (policy.num_layers, policy.num_experts):
        raise PlacementError(
            f"trace has {L} layers x {E} experts but the policy was built for {policy.num_layers} x {policy.num_experts}"
        )
    if source_loads_ILDE is not None:
        source_loads_ILDE = check_loads(source_loads_ILDE, "source_loads_ILDE", 4)
        if source_loads_ILDE.shape != (I, L, D, E):
            raise PlacementError(f"source loads have shape {source_loads_ILDE.shape}, expected {(I, L, D, E)}")
    w = policy.default_window if window is None else int(window)
    result = ReplayResult(
        policy.name, w, np.ones((I, L)), np.ones((I, L)), np.ones((I, L)), np.zeros((I, L)), np.zeros(I)
    )
    totals: dict[str, np.ndarray] = {}

    def source_LDE(i: int) -> np.ndarray:
        return even_source_loads(loads_ILE[i], D) if source_loads_ILDE is None else source_loads_ILDE[i]

    for i, step, planner_s in replay_steps(policy, loads_ILE, source_LDE, w):
        result.planner_s_I[i] = planner_s
        for l, lp in enumerate(step.layers):
            routed = int(loads_ILE[i, l].sum())
            result.imbalance_IL[i, l] = imbalance(lp.processed_ED.sum(axis=0))
            result.survival_IL[i, l] = 1.0 if routed == 0 else lp.processed_ED.sum() / routed
            result.replicas_IL[i, l] = lp.placement.replicas_E().mean()
            result.extra_copies_IL[i, l] = (lp.placement.counts_ED.sum() - E) / D
        for kind, comm in policy.traffic(step).items():
            totals.setdefault(kind, np.zeros(2))
            totals[kind] += (comm.intra, comm.inter)
        if step.moves:
            moved = policy.rearrangement(step)
            result.rearrange = result.rearrange + moved
            result.rearrange_events += 1
        if progress is not None:
            progress(i + 1, I)
    moved = result.rearrange
    totals["rearrange"] = np.array(
        [moved.param_intra + moved.optimizer_intra, moved.param_inter + moved.optimizer_inter]
    )
    result.traffic = totals
    return result
