"""replicate's per-iteration figures: what the layers routed and processed in an iteration
(IterationStats), the record it becomes at the iteration's end (tokens, survival, imbalance,
replicas, bytes, seconds), its progress-line and TensorBoard forms, and the memory report."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.groups import sum_over_groups
from megatron_patches.comm.traffic import TrafficCounter
from megatron_patches.mode.runtime import traffic_scalars
from megatron_patches.placement.accounting import imbalance

__all__ = ["TRAFFIC_KINDS", "IterationStats", "iteration_record", "memory_report", "progress", "tensorboard_scalars"]

TRAFFIC_KINDS = ("popularity", "grad_reduce_scatter", "grad_edp", "weight_scatter", "rearrange")
"""The kinds of traffic replicate counts (placement.accounting.TRAFFIC_KINDS says what each is)."""


@dataclass
class IterationStats:
    """What the layers routed and processed in one iteration (global: from all-reduced counts)."""

    routed_LE: np.ndarray
    """Token copies routed per layer and expert, before dropping."""
    processed_LED: np.ndarray
    """Token copies processed per layer, expert and rank."""
    slots_LRS: np.ndarray
    """The slot assignment the iteration ran with: expert of slot j of rank r, per layer; int [L, G, s]."""
    backwards_L: np.ndarray
    """Backward passes that reached each layer's slots so far (the reduce starts at k)."""
    remote_copies: int = 0
    """Processed token copies that crossed ranks (all sources, layers, micro-batches)."""
    seconds: dict = field(default_factory=lambda: {"scheduler": 0.0, "metadata": 0.0, "optimizer": 0.0, "rearrange": 0.0})
    """This rank's time in the placement planner (scheduler), in spreading and routing tokens
    (metadata), in the slices' Adam step and weight push (optimizer), and moving the periodic
    baseline's optimizer state (rearrange)."""


def iteration_record(stats: IterationStats, traffic: TrafficCounter, layers: list, groups: dict, policy: str,
                     slots_per_rank: int, microbatches: int) -> dict:
    """The iteration's replicate figures (identical on every rank): tokens summed over the
    replicate groups of other expert-data-parallel and expert-tensor-parallel ranks; bytes and
    seconds are this group's. ``groups``: "replicate", "edp" and "etp" process groups. Collective."""
    stats.routed_LE, stats.processed_LED, remote = sum_over_groups(
        (groups["edp"], groups["etp"]), stats.routed_LE, stats.processed_LED, stats.remote_copies)
    stats.remote_copies = int(remote)
    sent = traffic.sent_over(TRAFFIC_KINDS, groups["replicate"])
    seconds = torch.tensor(list(stats.seconds.values()), dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=groups["replicate"])
    rows = []
    routed = processed = 0
    for index, layer in enumerate(layers):
        routed_E = stats.routed_LE[index]
        processed_ED = stats.processed_LED[index]
        device_D = processed_ED.sum(axis=0)
        routed += int(routed_E.sum())
        processed += int(processed_ED.sum())
        rows.append(
            {
                "layer": layer.layer_number,
                "routed": int(routed_E.sum()),
                "processed": int(processed_ED.sum()),
                "survival": float(processed_ED.sum() / routed_E.sum()) if routed_E.sum() else 1.0,
                "device_tokens": device_D.tolist(),
                "imbalance": imbalance(device_D),
                "popularity": routed_E.tolist(),
                "replicas": np.bincount(stats.slots_LRS[index].ravel(), minlength=routed_E.size).tolist(),
                "slots": stats.slots_LRS[index].tolist(),
                "reduce_started_in_backward": bool(stats.backwards_L[index] == microbatches),
            }
        )
    return {
        "policy": policy,
        "slots_per_rank": slots_per_rank,
        "survival": processed / routed if routed else 1.0,
        "layers": rows,
        "bytes": sent,
        "a2a_remote_copies": stats.remote_copies,
        "seconds": dict(zip(stats.seconds, seconds.tolist())),
    }


def progress(replicate: dict) -> tuple[str, float]:
    """The progress line's replicate part (after the imbalance, EP's -> after replication: the
    policy and the slots) and the survival it shows: Megatron's router drops nothing in replicate
    mode; the instances' capacity does."""
    survival = min(layer["survival"] for layer in replicate["layers"])
    return f" ({replicate['policy']}, {replicate['slots_per_rank']} slots/rank)", survival


def tensorboard_scalars(replicate: dict) -> dict[str, float]:
    scalars = {"replicate/survival": replicate["survival"]}
    for layer in replicate["layers"]:
        scalars[f"replicate/imbalance_layer{layer['layer']}"] = layer["imbalance"]
        scalars[f"replicate/survival_layer{layer['layer']}"] = layer["survival"]
        scalars[f"replicate/max_replicas_layer{layer['layer']}"] = max(layer["replicas"])
    scalars.update(traffic_scalars("replicate", replicate["bytes"], replicate["seconds"], "seconds"))
    return scalars


def memory_report(experts: list, device: torch.device, group, num_devices: int) -> dict:
    """Bytes per rank (gathered over the group): slots (working weights) and the experts'
    fp32 master weights + Adam moments (the slices, on the host with offload)."""
    slots = sum(e.slots.slots_SN.numel() * e.slots.slots_SN.element_size() for e in experts)
    state = sum(e.slices.state_bytes() for e in experts)
    local = torch.tensor([slots, state], dtype=torch.float64, device=device)
    parts = [torch.zeros_like(local) for _ in range(num_devices)]
    dist.all_gather(parts, local, group=group)
    stacked = torch.stack(parts).cpu().to(torch.int64)
    return {"slot_bytes": stacked[:, 0].tolist(), "optimizer_state_bytes": stacked[:, 1].tolist()}
