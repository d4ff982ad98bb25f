#!/usr/bin/env python
"""Plot expert loads, replicate-mode replica counts and per-layer imbalance of placement policies.

Examples:

    python tools/plot_loads.py --trace traces/skewed.npz --out-dir plots/ --gpus 32 --slots-per-rank 6
    python tools/plot_loads.py --trace traces/skewed.npz --plan-json plan.json --out-dir plots/

Writes PNG files into --out-dir:
- loads_heatmap.png: per layer, tokens per expert over iterations, as a multiple of the
  uniform share (1.0 = every expert equally loaded; log colour scale);
- replicas_vs_popularity.png: replicate mode (DESIGN 4.6) replayed on one layer: replica
  counts planned from the previous iteration next to the popularity actually seen,
  normalised to slots (p_e / sum(p) * G * s), over iterations for the hottest experts, and
  as a scatter over all iterations and experts;
- imbalance_per_layer.png (with --plan-json from tools/plan.py): mean imbalance per layer
  of every policy against EP, with the p95 as a shaded band.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from megatron_patches.placement.loads import LoadTracker  # noqa: E402
from megatron_patches.placement.replicate import replica_counts  # noqa: E402
from megatron_patches.placement.trace import read_trace  # noqa: E402
from megatron_patches.placement.types import PlacementError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=None, help=".npz trace for the heatmap and the replica plot")
    parser.add_argument(
        "--plan-json", default=None, help="JSON written by tools/plan.py --json, for the imbalance plot"
    )
    parser.add_argument("--out-dir", required=True, help="directory for the PNG files")
    parser.add_argument(
        "--max-layers", type=int, default=12, help="heatmap: plot at most this many layers (default 12)"
    )
    parser.add_argument("--layer", type=int, default=0, help="replica plot: the layer to replay (default 0)")
    parser.add_argument("--gpus", type=int, default=32, help="replica plot: ranks G (default 32)")
    parser.add_argument("--slots-per-rank", type=int, default=4, help="replica plot: slots per rank s (default 4)")
    parser.add_argument(
        "--window", type=int, default=1, help="replica plot: prediction window (default 1, as replicate mode)"
    )
    parser.add_argument("--top", type=int, default=4, help="replica plot: hottest experts drawn over time (default 4)")
    return parser.parse_args(argv)


def plot_heatmap(loads_ILE: np.ndarray, path: str, max_layers: int) -> None:
    """One panel per layer: expert (y) x iteration (x), load / uniform share, log colours."""
    I, L, E = loads_ILE.shape
    layers = min(L, max_layers)
    cols = min(layers, 4)
    rows = -(-layers // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, constrained_layout=True)
    total_IL = np.maximum(loads_ILE.sum(axis=2, keepdims=True), 1)
    share_ILE = loads_ILE / total_IL * E  # 1.0 = uniform
    positive = share_ILE[share_ILE > 0]
    vmin = max(float(positive.min()) if positive.size else 0.01, 0.01)
    vmax = max(float(share_ILE.max()), vmin * 10)
    norm = LogNorm(vmin=vmin, vmax=vmax)
    image = None
    for l in range(rows * cols):
        ax = axes[l // cols][l % cols]
        if l >= layers:
            ax.axis("off")
            continue
        image = ax.imshow(
            np.maximum(share_ILE[:, l, :].T, vmin),
            aspect="auto",
            origin="lower",
            cmap="magma",
            norm=norm,
            extent=(-0.5, I - 0.5, -0.5, E - 0.5),
            interpolation="nearest",
        )
        ax.set_title(f"layer {l}", fontsize=10)
        ax.set_xlabel("iteration")
        ax.set_ylabel("expert")
    fig.colorbar(image, ax=axes, shrink=0.8, label="tokens / uniform share")
    fig.suptitle(f"Expert loads ({I} iterations, {E} experts; {L} layers, {layers} shown)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replicate_counts(loads_IE: np.ndarray, gpus: int, slots: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Replay replicate mode on one layer: (planned counts, actual popularity in slots), both [I, E]."""
    I, E = loads_IE.shape
    tracker = LoadTracker(1, E, window)
    counts_IE = np.zeros((I, E), dtype=np.int64)
    for i in range(I):
        counts_IE[i] = replica_counts(tracker.predict()[0], gpus, slots)
        tracker.observe(loads_IE[i][None, :])
    goal_IE = loads_IE / np.maximum(loads_IE.sum(axis=1, keepdims=True), 1) * gpus * slots
    return counts_IE, goal_IE


def plot_replicas(loads_IE: np.ndarray, path: str, layer: int, gpus: int, slots: int, window: int, top: int) -> None:
    """Replica counts vs normalised popularity: time series of the hottest experts + scatter of all."""
    counts_IE, goal_IE = replicate_counts(loads_IE, gpus, slots, window)
    I, E = loads_IE.shape
    hottest = np.argsort(-loads_IE.sum(axis=0), kind="stable")[:top]
    fig, (ax_t, ax_s) = plt.subplots(
        1, 2, figsize=(13, 4.5), constrained_layout=True, gridspec_kw={"width_ratios": [2, 1]}
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    it = np.arange(I)
    for k, e in enumerate(hottest):
        c = colors[k % len(colors)]
        ax_t.plot(it, goal_IE[:, e], color=c, lw=1.0, alpha=0.7, ls="--")
        ax_t.step(it, counts_IE[:, e], where="mid", color=c, lw=1.6, label=f"expert {e}")
    ax_t.set_xlabel("iteration")
    ax_t.set_ylabel("instances (slots)")
    ax_t.set_title(
        f"layer {layer}: replicas (solid) vs popularity x G*s (dashed), G={gpus}, s={slots}, window {window}"
    )
    ax_t.legend(fontsize=8, ncol=2)
    ax_t.grid(alpha=0.3)
    lim = max(float(goal_IE.max()), float(counts_IE.max())) * 1.05 + 0.5
    ax_s.scatter(goal_IE.ravel(), counts_IE.ravel(), s=5, alpha=0.25)
    ax_s.plot([0, lim], [0, lim], color="grey", lw=1, ls=":", label="replicas = popularity")
    ax_s.axhline(1, color="black", lw=0.6, ls="--", label="minimum 1 instance")
    ax_s.set_xlim(0, lim)
    ax_s.set_ylim(0, lim)
    ax_s.set_xlabel("actual popularity x G*s (this iteration)")
    ax_s.set_ylabel("replicas (planned from previous iterations)")
    ax_s.set_title(f"all {E} experts x {I} iterations")
    ax_s.legend(fontsize=8, loc="upper left")
    ax_s.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_imbalance(plan: dict, path: str) -> None:
    """Mean imbalance per layer for every policy in a plan.py JSON, EP drawn thick and black."""
    policies = plan["policies"]
    fig, ax = plt.subplots(figsize=(11, 4.8), constrained_layout=True)
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for name, m in policies.items():
        per_layer = m["per_layer"]
        layers = [p["layer"] for p in per_layer]
        mean = np.array([p["imbalance_mean"] for p in per_layer])
        p95 = np.array([p["imbalance_p95"] for p in per_layer])
        is_ep = name == "ep"
        color = "black" if is_ep else next(colors)
        label = f"{name}: mean {m['imbalance_mean']:.2f}"
        if m["survival_mean"] < 1.0:
            # a policy that drops tokens looks balanced partly because it drops them
            label += f", survival {m['survival_mean']:.2f}"
        ax.plot(layers, mean, marker="o", ms=4, lw=2.5 if is_ep else 1.5, color=color, label=label)
        ax.fill_between(layers, mean, p95, color=color, alpha=0.12)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("imbalance = max / mean device load (log)")
    setup = plan.get("setup", {})
    where = (
        f"{setup.get('nodes', '?')} x {setup.get('gpus_per_node', '?')} devices, {setup.get('experts', '?')} experts"
    )
    ax.set_title(f"Imbalance per layer vs EP ({where}); band: mean to p95")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trace is None and args.plan_json is None:
        print("plot_loads: error: give --trace, --plan-json or both", file=sys.stderr)
        return 2
    for flag, path in (("--trace", args.trace), ("--plan-json", args.plan_json)):
        if path is not None and not os.path.isfile(path):
            print(f"plot_loads: error: {flag} file {path!r} does not exist", file=sys.stderr)
            return 2
    for flag, value in (
        ("--max-layers", args.max_layers),
        ("--gpus", args.gpus),
        ("--slots-per-rank", args.slots_per_rank),
        ("--window", args.window),
        ("--top", args.top),
    ):
        if value < 1:
            print(f"plot_loads: error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    if args.trace is not None:
        try:
            trace = read_trace(args.trace)
        except PlacementError as err:
            print(f"plot_loads: error: {err}", file=sys.stderr)
            return 2
        if not 0 <= args.layer < trace.num_layers:
            print(f"plot_loads: error: --layer {args.layer} is not in [0, {trace.num_layers})", file=sys.stderr)
            return 2
        if trace.num_experts > args.gpus * args.slots_per_rank:
            print(
                f"plot_loads: error: {trace.num_experts} experts do not fit in --gpus {args.gpus} x --slots-per-rank "
                f"{args.slots_per_rank} slots; raise --slots-per-rank to >= {-(-trace.num_experts // args.gpus)}",
                file=sys.stderr,
            )
            return 2
        path = os.path.join(args.out_dir, "loads_heatmap.png")
        plot_heatmap(trace.loads, path, args.max_layers)
        written.append(path)
        path = os.path.join(args.out_dir, "replicas_vs_popularity.png")
        plot_replicas(
            trace.loads[:, args.layer, :], path, args.layer, args.gpus, args.slots_per_rank, args.window, args.top
        )
        written.append(path)
    if args.plan_json is not None:
        with open(args.plan_json) as f:
            try:
                plan = json.load(f)
            except json.JSONDecodeError as err:
                print(f"plot_loads: error: {args.plan_json} is not JSON ({err})", file=sys.stderr)
                return 2
        if not isinstance(plan, dict) or "policies" not in plan:
            print(
                f"plot_loads: error: {args.plan_json} has no 'policies' (write it with tools/plan.py --json)",
                file=sys.stderr,
            )
            return 2
        path = os.path.join(args.out_dir, "imbalance_per_layer.png")
        plot_imbalance(plan, path)
        written.append(path)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
