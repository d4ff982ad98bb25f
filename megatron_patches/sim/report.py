"""Results of simulated systems and their presentation: table, JSON document and plots.

`SystemResult` holds one system's per-iteration arrays; `summarize` turns a set of results into
the JSON layout of issue 8 (top-level "systems" -> name -> iteration_s, speedup_vs_ep,
breakdown_s, imbalance_mean, memory_gb_max, survival_mean, per_layer_speedup, ...; and
"out_of_memory" -> name -> why, for the requested systems not simulated because they cannot fit
even with balanced loads);
`format_table` prints the same numbers for people; `plot` draws the speedup and breakdown bars
and the per-layer speedups.

Breakdown (seconds per iteration, mean over the trace): the parts attention, other,
expert_compute_mean, straggler_wait, all_to_all, exposed_collectives, rearrangement and
optimizer add up to iteration_s (each is the time the devices' compute streams spent on it or
waited for it, averaged over devices; see `engine`). expert_compute_max is not a part: it is the
expert compute of the busiest device, summed over layers and passes, for comparison with
expert_compute_mean (their ratio is the cost of imbalance). exposed_collectives is split by kind
of traffic in exposed_collectives_by_kind_s (replica refresh is weight_scatter; replica gradient
synchronisation grad_reduce_scatter (static replication's and the baselines' grad_allreduce); FSSDP's spag and sprs; Megatron's dense gradient
all-reduce dense_grad_allreduce), adding up to it.

Also per system: expert compute per device, the all-to-all's pricing terms (latency, busiest
intra-node link, busiest NIC), memory by component on the peak device, and per MoE layer both
the whole transformer layer's time and the MoE block's alone (per_layer_moe_s, the FSSDP
paper's per-layer comparison), each with its speedup over EP.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["BREAKDOWN_PARTS", "SystemResult", "imbalance_rows", "summarize", "format_table", "write_json", "plot"]

BREAKDOWN_PARTS = (
    "attention",
    "other",
    "expert_compute_mean",
    "straggler_wait",
    "all_to_all",
    "exposed_collectives",
    "rearrangement",
    "optimizer",
)
"""The breakdown entries that add up to the iteration time."""


def imbalance_rows(loads) -> np.ndarray:
    """`accounting.imbalance` (max / mean, 1.0 for all-zero loads) of every row of the last axis."""
    x = np.asarray(loads, dtype=np.float64)
    mean = x.mean(axis=-1)
    return np.where(mean > 0, x.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)


@dataclass
class SystemResult:
    """One system simulated over a trace."""

    name: str
    """System name (as on the command line)."""
    description: str
    """One line saying what the system is."""
    iteration_s_I: np.ndarray
    """Simulated time of every iteration, seconds; float [I]."""
    breakdown_I: dict[str, np.ndarray]
    """BREAKDOWN_PARTS plus expert_compute_max, seconds per iteration; float [I] each."""
    layer_s_IL: np.ndarray
    """Time of each MoE layer's transformer layer (forward + backward), seconds; float [I, L]."""
    moe_layer_s_IL: np.ndarray | None
    """Time of each MoE layer's MoE block alone (router, dispatch, experts, combine; forward,
    backward and any recompute), seconds; float [I, L]. None for zebra, whose attention and
    experts of different micro-batches run at once, so no MoE-only span exists."""
    exposed_by_kind_I: dict[str, np.ndarray]
    """breakdown_I["exposed_collectives"] split by kind of traffic (spag, sprs, grad_allreduce,
    grad_reduce_scatter, weight_scatter, shadow_broadcast, dense_grad_allreduce, ...); float [I] each,
    adding up to it."""
    expert_compute_D: np.ndarray
    """Expert compute per device, seconds per iteration (mean over the trace); float [D]."""
    all_to_all_parts: dict[str, float]
    """The token all-to-alls' pricing terms, seconds per iteration summed over every pass and
    layer: latency, intra_node_link (the busiest device's link) and inter_node_nic (the busiest
    NIC); each all-to-all takes latency + max(link, NIC), so they do not add up."""
    memory_parts: dict
    """Bytes by component on the peak device at its peak iteration ("device": its index; then
    `MemoryModel.by_part`'s dense parameters, gradients and optimizer state, expert parameters,
    gradients (owned instances and copies) and optimizer state, activations, reserve), adding up
    to memory_D.max()."""
    imbalance_IL: np.ndarray
    """max / mean device load (processed tokens) per iteration and MoE layer; float [I, L]."""
    survival_IL: np.ndarray
    """Tokens processed / routed; float [I, L]."""
    memory_D: np.ndarray
    """Peak bytes per device over the trace; float [D]."""
    memory_limit_D: np.ndarray
    """Device memory, bytes; float [D]."""
    traffic: dict[str, np.ndarray] = field(default_factory=dict)
    """Bytes by kind of communication, mean per iteration: kind -> float [2] (intra-node, inter-node)."""
    details: dict = field(default_factory=dict)
    """System-specific facts (chosen t, m, slots, shadows per layer, rearrangements, ...), JSON-able."""
    planner_s: float = 0.0
    """Wall time the placement planners took over the whole trace, seconds."""

    @property
    def iteration_s(self) -> float:
        """Mean iteration time over the trace."""
        return float(self.iteration_s_I.mean())

    @property
    def fits(self) -> bool:
        """Whether the peak memory of every device stays within its capacity."""
        return bool(np.all(self.memory_D <= self.memory_limit_D))


def _mean(x) -> float:
    return float(np.mean(x))


def summarize(results: list[SystemResult], setup: dict, reference: str | None = "ep",
              out_of_memory: dict[str, str] | None = None) -> dict:
    """The JSON document: {"setup": setup, "systems": {name: metrics}, "out_of_memory": {name:
    why}} (see the module docstring); out_of_memory lists the requested systems that were not
    simulated because they cannot fit even with balanced loads (`systems.check_memory`).

    speedup_vs_ep and per_layer_speedup are relative to the result named `reference`, which
    must be among `results`; None (EP cannot be laid out on the simulated devices, or does not
    fit) leaves them None.
    """
    by_name = {r.name: r for r in results}
    if reference is not None and reference not in by_name:
        raise ValueError(f"the reference system {reference!r} was not simulated (have {sorted(by_name)})")
    ref = by_name.get(reference)
    systems = {}
    for r in results:
        layer_L = r.layer_s_IL.mean(axis=0)
        systems[r.name] = {
            "description": r.description,
            "iteration_s": r.iteration_s,
            "iteration_s_p95": float(np.percentile(r.iteration_s_I, 95)),
            "speedup_vs_ep": None if ref is None else ref.iteration_s / r.iteration_s,
            "breakdown_s": {k: _mean(v) for k, v in r.breakdown_I.items()},
            "imbalance_mean": _mean(r.imbalance_IL),
            "imbalance_max": float(np.max(r.imbalance_IL)),
            "memory_gb_max": float(r.memory_D.max() / 1e9),
            "memory_gb_per_device": (r.memory_D / 1e9).round(3).tolist(),
            "memory_gb_capacity": float(r.memory_limit_D.min() / 1e9),
            "fits_in_memory": r.fits,
            "survival_mean": _mean(r.survival_IL),
            "exposed_collectives_by_kind_s": {k: _mean(v) for k, v in r.exposed_by_kind_I.items()},
            "expert_compute_s_per_device": r.expert_compute_D.tolist(),
            "all_to_all_terms_s": dict(r.all_to_all_parts),
            "memory_gb_parts": {k: (v if k == "device" else v / 1e9) for k, v in r.memory_parts.items()},
            "per_layer_s": layer_L.tolist(),
            "per_layer_speedup": None if ref is None else (ref.layer_s_IL.mean(axis=0) / layer_L).tolist(),
            "per_layer_moe_s": None if r.moe_layer_s_IL is None else r.moe_layer_s_IL.mean(axis=0).tolist(),
            "per_layer_moe_speedup": _moe_speedup(ref, r),
            "traffic_bytes_per_iteration": {
                k: {"intra": float(v[0]), "inter": float(v[1])} for k, v in r.traffic.items()
            },
            "planner_s": r.planner_s,
            "details": r.details,
        }
    return {"setup": setup, "systems": systems, "out_of_memory": dict(out_of_memory or {})}


def _moe_speedup(ref: SystemResult | None, r: SystemResult) -> list[float] | None:
    """EP's MoE-block time over the system's, per MoE layer (None where either has no MoE-only span)."""
    if ref is None or ref.moe_layer_s_IL is None or r.moe_layer_s_IL is None:
        return None
    return (ref.moe_layer_s_IL.mean(axis=0) / r.moe_layer_s_IL.mean(axis=0)).tolist()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"


def format_table(summary: dict) -> str:
    """A fixed-width table of the summary, one row per system, times in milliseconds."""
    head = (
        f"{'system':<14} {'iter ms':>8} {'speedup':>7} {'attn':>8} {'other':>8} {'exp mean':>8} {'exp max':>8} "
        f"{'strag':>8} {'a2a':>8} {'coll':>8} {'rearr':>8} {'optim':>8} {'imbal':>6} {'surv':>6} {'mem GB':>7}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summary["systems"].items():
        b = s["breakdown_s"]
        mem = f"{s['memory_gb_max']:6.1f}" + ("!" if not s["fits_in_memory"] else " ")
        speedup = f"{'-':>7}" if s["speedup_vs_ep"] is None else f"{s['speedup_vs_ep']:7.2f}"
        lines.append(
            f"{name:<14} {_ms(s['iteration_s'])} {speedup} {_ms(b['attention'])} {_ms(b['other'])} "
            f"{_ms(b['expert_compute_mean'])} {_ms(b['expert_compute_max'])} {_ms(b['straggler_wait'])} "
            f"{_ms(b['all_to_all'])} {_ms(b['exposed_collectives'])} {_ms(b['rearrangement'])} {_ms(b['optimizer'])} "
            f"{s['imbalance_mean']:6.2f} {s['survival_mean']:6.3f} {mem}"
        )
    for name, why in summary["out_of_memory"].items():
        lines.append(f"{name:<14} out of memory with balanced loads, not simulated: {why}")
    lines.append(
        "times: ms per iteration (mean over the trace); attn..optim except 'exp max' add up to 'iter ms'; "
        "'exp max' = busiest device's expert compute; '!' = its most loaded iteration exceeds device memory"
    )
    for name, s in summary["systems"].items():
        if s["per_layer_speedup"] is not None:
            per_layer = " ".join(f"{x:.2f}" for x in s["per_layer_speedup"])
            lines.append(f"per-layer speedup vs ep, {name}: {per_layer}")
        if s["per_layer_moe_speedup"] is not None:
            per_layer = " ".join(f"{x:.2f}" for x in s["per_layer_moe_speedup"])
            lines.append(f"MoE-block speedup vs ep per layer, {name}: {per_layer}")
    for name, s in summary["systems"].items():
        kinds = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s["exposed_collectives_by_kind_s"].items() if v > 0)
        a2a = s["all_to_all_terms_s"]
        mem = s["memory_gb_parts"]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if k != "device" and v > 0)
        lines.append(
            f"{name}: coll = {kinds or 'nothing exposed'} ms; a2a terms: latency {a2a['latency'] * 1e3:.1f}, "
            f"intra-node link {a2a['intra_node_link'] * 1e3:.1f}, NIC {a2a['inter_node_nic'] * 1e3:.1f} ms; "
            f"memory on device {mem['device']}: {parts} GB"
        )
    return "\n".join(lines)


def write_json(summary: dict, path: str) -> None:
    """Write the summary as indented JSON at `path` (directories created)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=False, allow_nan=False, default=_json_default)
        f.write("\n")


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def plot(summary: dict, path: str) -> None:
    """Save a figure: speedup over EP, stacked breakdown, per-layer speedup (PNG/PDF by suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["systems"])
    systems = [summary["systems"][n] for n in names]
    fig, (ax_speed, ax_break, ax_layer) = plt.subplots(1, 3, figsize=(20, 5.5))
    x = np.arange(len(names))
    ax_speed.bar(x, [np.nan if s["speedup_vs_ep"] is None else s["speedup_vs_ep"] for s in systems], color="tab:blue")
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_speed.set_xticks(x, names, rotation=45, ha="right")
    ax_speed.set_ylabel("speedup over EP")
    ax_speed.set_title("iteration time speedup")
    bottom = np.zeros(len(names))
    for part in BREAKDOWN_PARTS:
        values = np.array([s["breakdown_s"][part] for s in systems]) * 1e3
        ax_break.bar(x, values, bottom=bottom, label=part)
        bottom += values
    ax_break.set_xticks(x, names, rotation=45, ha="right")
    ax_break.set_ylabel("ms per iteration")
    ax_break.set_title("breakdown (adds up to the iteration time)")
    ax_break.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for name, s in zip(names, systems):
        if s["per_layer_speedup"] is None:
            continue
        ax_layer.plot(np.arange(len(s["per_layer_speedup"])), s["per_layer_speedup"], marker="o", label=name)
    ax_layer.axhline(1.0, color="black", linewidth=0.8)
    ax_layer.set_xlabel("MoE layer")
    ax_layer.set_ylabel("speedup over EP")
    ax_layer.set_title("per-layer speedup")
    ax_layer.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
