"""fssdp's per-iteration figures: what a rank measures during an iteration (IterationStats), the
record it becomes at the iteration's end (tokens, imbalance, copies, bytes, exposed waits,
re-shards), its progress-line and TensorBoard forms, and the memory report."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.groups import sum_over_groups
from megatron_patches.comm.relay import RelayReduceScatter
from megatron_patches.comm.traffic import TrafficCounter
from megatron_patches.mode.runtime import traffic_scalars
from megatron_patches.placement.accounting import imbalance

__all__ = ["EXPOSED_KINDS", "PLANNER_STEPS", "TRAFFIC_KINDS", "IterationStats", "iteration_record", "memory_report", "progress_suffix",
           "tensorboard_scalars"]

TRAFFIC_KINDS = ("spag", "sprs", "spag_remat", "spag_calibrate", "reshard", "reshard_edp")
"""The kinds of traffic fssdp counts (placement.accounting.TRAFFIC_KINDS says what each is). The
calibration's gathers are counted apart so that spag + spag_calibrate = sprs holds."""
EXPOSED_KINDS = ("spag", "spag_calibrate", "sprs", "spag_remat")
"""Collectives whose waits are timed as exposed (the timer span "fssdp.wait.<kind>")."""
PLANNER_STEPS = ("materialize", "calibrate", "dispatch")
"""The host planner's steps timed per iteration (`IterationStats.planner_s`): the plans of every
layer before the forward (materialization and the layers' collective schedules), and, after each
layer's gate, calibration and the dispatch plan."""


@dataclass
class IterationStats:
    """What this rank measured in one iteration."""

    device_tokens_LD: np.ndarray
    """Token copies processed per layer and device under the dispatch plans (every rank
    computes every plan, so this is global without communication)."""
    t: int
    """Overlap degree the iteration's plans used."""
    m: int = 0
    """Memory capacity the iteration's plans used (0 while auto m measures on GPU)."""
    exposed_s: dict = field(default_factory=lambda: defaultdict(float))
    """Seconds the compute stream stalled in wait() per collective kind (not hidden by compute);
    this and the other times are the runtime's `DeviceTimer` spans (CUDA events on GPU)."""
    non_moe_s: list = field(default_factory=list)
    """Seconds from a MoE layer's TransformerLayer start to its MoE start (attention etc.)."""
    expert_s: float = 0.0
    """Seconds of expert forward compute on the stream (for the cost model)."""
    expert_tokens: int = 0
    """Token copies those seconds processed."""
    calibrations: int = 0
    """Layer forwards in which calibration gathered extra copies."""
    calibrated_copies: dict = field(default_factory=lambda: defaultdict(int))
    """Per MoE layer number, the copies calibration gathered in its training forwards (summed
    over the forwards that calibrated: one per iteration, or one per micro-batch with
    re-materialization)."""
    planner_s: dict = field(default_factory=lambda: defaultdict(float))
    """Host seconds in the planner per step (`PLANNER_STEPS`), wall clock on the thread that ran
    it: "materialize" (the plans before the gate: on the training thread before the forward, or
    with --fssdp-planner-thread on the planner thread while the layers before them run),
    "calibrate" and "dispatch" on the training thread after each gate, on the critical path
    (their counts reach the host before the dispatch they decide is launched)."""
    planner_wait_s: float = 0.0
    """Seconds the training thread spent on the plans before the gate: making them (without
    --fssdp-planner-thread), or waiting for the planner thread's (the first layer's, needed as
    the forward starts, and any not ready when its layer started)."""
    reserved: dict = field(default_factory=dict)
    """Per MoE layer number, the copy slots per device materialization left free for
    calibration (`placement.fssdp.calibration_reserve`; 0 without calibration)."""
    reshard: dict | None = None
    """The re-shard decision taken before this iteration (None when none was due)."""
    reshard_s: float = 0.0
    """Seconds this rank spent moving experts (packing, transfers, unpacking)."""

    remote_copies: int = 0
    """Token copies the dispatch plans send to another rank (all sources, all layers)."""
    source_loads_LDE: np.ndarray | None = None
    """Routed tokens per layer of this stage, source device and expert, summed over the
    micro-batches (what auto t prices at the iteration's end); int64 [L, D, E], kept only in the
    iterations auto t is chosen after: the first, and `planner.overlap_due`'s (None otherwise)."""

    def add_dispatch(self, layer_index: int, plan, counts_DE: np.ndarray) -> None:
        self.device_tokens_LD[layer_index] += plan.device_loads_D()
        self.remote_copies += plan.remote_tokens()
        if self.source_loads_LDE is not None:
            self.source_loads_LDE[layer_index] += counts_DE

    def add_times(self, times: dict[str, list[float]]) -> None:
        """The iteration's timed spans (the runtime's DeviceTimer.collect)."""
        for kind in EXPOSED_KINDS:
            self.exposed_s[kind] += sum(times.get(f"fssdp.wait.{kind}", []))
        self.expert_s += sum(times.get("fssdp.experts", []))
        self.non_moe_s.extend(times.get("fssdp.non_moe", []))
        self.reshard_s += sum(times.get("fssdp.reshard", []))


def iteration_record(stats: IterationStats, traffic: TrafficCounter, layers: list, plans: dict, groups: dict,
                     rematerialize: bool, expert_numel: int, expert_bytes: int) -> dict:
    """The iteration's FSSDP figures: tokens per device position and remote copies summed over
    the FSSDP groups, those of other expert-data-parallel and expert-tensor-parallel ranks
    (like the common record's ep figures; ETP ranks route their own tokens and process the
    union); bytes, times and copies are this group's (every group runs the same plans),
    identical on every rank of the group. ``groups``: "fssdp" (the sparse collectives'), "edp"
    and "etp" process groups. Collective."""
    stats.device_tokens_LD, remote = sum_over_groups((groups["edp"], groups["etp"]), stats.device_tokens_LD,
                                                     stats.remote_copies)
    stats.remote_copies = int(remote)
    sent = traffic.sent_over(TRAFFIC_KINDS, groups["fssdp"])
    # the planner time the training thread spent: waiting for plans, then calibrating and dispatching
    planner_exposed = stats.planner_wait_s + stats.planner_s["calibrate"] + stats.planner_s["dispatch"]
    exposed = torch.tensor([stats.exposed_s[k] for k in EXPOSED_KINDS] + [stats.reshard_s, planner_exposed]
                           + [stats.planner_s[k] for k in PLANNER_STEPS], dtype=torch.float64)
    dist.all_reduce(exposed, op=dist.ReduceOp.MAX, group=groups["fssdp"])
    exposed = exposed.tolist()
    exposed_s, planner_s = exposed[:len(EXPOSED_KINDS)], exposed[-len(PLANNER_STEPS):]
    reshard_s, planner_exposed_s = exposed[len(EXPOSED_KINDS)], exposed[len(EXPOSED_KINDS) + 1]
    rows = []
    for layer in layers:
        plan = plans[layer.layer_number]
        device_D = stats.device_tokens_LD[plan.index]
        rows.append(
            {
                "layer": layer.layer_number,
                "device_tokens": device_D.tolist(),
                "imbalance": imbalance(device_D),
                "replicas": plan.placement.replicas_E().tolist(),
                "copies": plan.placement.extra_copies_D(plan.shard).tolist(),
                # experts every rank held whose gradients went back by ring reduce (and copies
                # out by ring broadcast; placement.collectives.copy_sources)
                "ring_experts": int(plan.reduce.relay.ring_chunks.size) if isinstance(plan.reduce, RelayReduceScatter) else 0,
                "owned": plan.shard.counts_D().tolist(),
                "calibration_reserve": stats.reserved[layer.layer_number],
                "calibrated_copies": stats.calibrated_copies[layer.layer_number],
            }
        )
    copies_D = np.stack([np.asarray(r["copies"]) for r in rows])
    alive_D = copies_D.sum(axis=0) if not rematerialize else copies_D[-1] + copies_D[:-1].max(axis=0, initial=0)
    return {
        "t": stats.t,
        "m": stats.m,
        "layers": rows,
        "bytes": sent,
        "exposed_s": dict(zip(EXPOSED_KINDS, exposed_s)),
        # seconds: the slowest rank's (packing, transfers, unpacking)
        "reshard": None if stats.reshard is None else {**stats.reshard, "seconds": reshard_s},
        "calibrations": stats.calibrations,
        # the slowest rank's host seconds in the planner, per step (IterationStats.planner_s)
        "planner_s": dict(zip(PLANNER_STEPS, planner_s)),
        # the slowest rank's planner time on the training thread: its waits for the planner
        # thread's plans plus calibration and dispatch after each gate (issue 44 item 2)
        "planner_exposed_s": planner_exposed_s,
        # every rank computes every plan: this is already the global count
        "a2a_remote_copies": stats.remote_copies,
        "copies_bytes_peak": (alive_D * expert_bytes).tolist(),
        # one copy in the compute dtype: what spAG moves and spRS returns per copy
        "expert_elements": expert_numel,
        "expert_bytes": expert_bytes,
    }


def progress_suffix(fssdp: dict) -> str:
    """The progress line's fssdp part, after the imbalance (EP's -> after FSSDP's copies): the
    overlap degree and the copies gathered."""
    spag = sum(fssdp["bytes"]["spag"].values())
    return f" (t={fssdp['t']}, spAG {spag / 2**20:.2f} MiB)"


def tensorboard_scalars(fssdp: dict) -> dict[str, float]:
    scalars = {"fssdp/overlap_degree": fssdp["t"]}
    for layer in fssdp["layers"]:
        scalars[f"fssdp/imbalance_layer{layer['layer']}"] = layer["imbalance"]
        scalars[f"fssdp/replicas_layer{layer['layer']}"] = sum(layer["replicas"])
    scalars.update(traffic_scalars("fssdp", fssdp["bytes"], fssdp["exposed_s"], "exposed_s"))
    scalars["fssdp/planner_ms"] = 1e3 * sum(fssdp["planner_s"].values())
    scalars["fssdp/planner_exposed_ms"] = 1e3 * fssdp["planner_exposed_s"]
    for name in ("shard_bytes", "optimizer_state_bytes"):
        if name in fssdp.get("memory", {}):
            scalars[f"fssdp/{name}_max_rank"] = max(fssdp["memory"][name])
    scalars["fssdp/copies_bytes_peak_max_rank"] = max(fssdp["copies_bytes_peak"])
    if fssdp.get("reshard"):
        scalars["fssdp/reshard_moved"] = fssdp["reshard"]["moved"]
        scalars["fssdp/reshard_seconds"] = fssdp["reshard"]["seconds"]
    return scalars


def memory_report(layers: list, optimizer, group, num_devices: int) -> dict:
    """Bytes per rank (gathered over the group): owned expert shards (in the compute dtype)
    and their optimizer state (Adam's moments, and in mixed precision the fp32 main weights)."""
    shards = [p for layer in layers for p in layer.experts.parameters()]
    owned = sum(p.numel() * p.element_size() for p in shards)
    # a main weight sharing the model parameter's memory (fp32 with the distributed
    # optimizer: a view of the parameter's range) is not counted twice
    model_storage = {p.untyped_storage().data_ptr() for p in shards}
    state = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for param_group in inner.param_groups:
            if not param_group.get("is_expert_parallel", False):
                continue
            for p in param_group["params"]:
                if p.untyped_storage().data_ptr() not in model_storage:  # mixed precision's fp32 main weight
                    state += p.numel() * p.element_size()
                for value in inner.state.get(p, {}).values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        state += value.numel() * value.element_size()
    local = torch.tensor([owned, state], dtype=torch.float64)
    parts = [torch.zeros_like(local) for _ in range(num_devices)]
    dist.all_gather(parts, local, group=group)
    stacked = torch.stack(parts).to(torch.int64)
    return {"shard_bytes": stacked[:, 0].tolist(), "optimizer_state_bytes": stacked[:, 1].tolist()}
