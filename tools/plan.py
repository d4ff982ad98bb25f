#!/usr/bin/env python
"""Replay an expert-load trace under several placement policies and compare them side by side.

Example (a skewed synthetic trace on 4 nodes x 8 GPUs):

    python tools/make_trace.py --out traces/skewed.npz --experts 64 --zipf 1.2 --ranks 32
    python tools/plan.py --trace traces/skewed.npz --policy ep,fssdp,replicate,flexmoe \\
        --nodes 4 --gpus-per-node 8 --memory-capacity 4 --overlap-degree 8 --json plan.json

Every policy is replayed iteration by iteration: it plans from loads predicted out of the
previous iterations only (sliding window, adaptive by default: --load-predictor); the actual routed tokens of the iteration are used
for dispatch and for the decisions a system makes after the gate (FSSDP calibration,
on unless --no-calibrate; FasterMoE shadowing). Metrics follow DESIGN 5: imbalance = max / mean device
load per layer and iteration, survival = processed / routed tokens.

`--json OUT` writes {"setup": ..., "policies": {name: metrics}}; per policy:
imbalance_mean, imbalance_p95, imbalance_max, survival_mean, replicas_per_expert,
extra_copies_per_device, bytes ({kind: {"intra", "inter"}}, mean bytes per iteration over
all layers), rearrange_bytes (total weight + optimizer bytes moved by rearrangement over the
replay), rearrange (its breakdown), planner_ms_mean, planner_ms_max, window and per_layer
(one dict of the same per-layer metrics for every layer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from megatron_patches.placement.baselines import ByteModel, ep_group_size
from megatron_patches.placement.loads import LOAD_PREDICTORS
from megatron_patches.placement.policies import POLICIES, ReplayConfig, ReplayResult, make_policy, replay
from megatron_patches.placement.trace import read_trace
from megatron_patches.placement.types import PlacementError, Topology

# policies that start from Megatron's EP layout and so need D | E or E | D
EP_BASED = ("ep", "fastermoe", "smartmoe", "flexmoe")
# policies whose experts live in G x s slots
SLOT_BASED = ("replicate", "static")

GPT_MOE_S_EXPERT_BYTES = 2 * 768 * 1536 * 2  # two 768x1536 matrices, bf16


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="policies: " + ", ".join(POLICIES),
    )
    parser.add_argument("--trace", required=True, help=".npz trace (tools/make_trace.py or training's --moe-log-loads)")
    parser.add_argument("--policy", required=True, help=f"comma-separated policies to compare: {','.join(POLICIES)}")
    parser.add_argument("--nodes", type=int, required=True, help="nodes N")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node G; D = N x G devices")
    parser.add_argument(
        "--overlap-degree", type=int, default=8, help="FSSDP's t, copies received during attention (default 8)"
    )
    parser.add_argument(
        "--memory-capacity",
        type=int,
        default=4,
        help="m, extra expert copies per device: FSSDP copies and FlexMoE's reserved slots (default 4)",
    )
    parser.add_argument(
        "--slots-per-rank",
        type=int,
        default=None,
        help="s for replicate / static (default ceil(E / D) + m: the same expert memory as FlexMoE)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=1.0,
        help="capacity factor of replicate / static; the other policies are dropless (default 1.0)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help="load-prediction window for every policy (default: 1 for replicate, 5 for the others)",
    )
    parser.add_argument(
        "--load-predictor",
        choices=LOAD_PREDICTORS,
        default=LOAD_PREDICTORS[0],
        help="adaptive: per layer the window among 1, 2, 4, ... up to --window that predicted the "
        "recent iterations best (the runtimes' default); mean: the mean over the window (default adaptive)",
    )
    parser.add_argument(
        "--reshard-interval",
        type=int,
        default=100,
        help="iterations between FSSDP re-sharding (kept only if it lowers the predicted imbalance), "
        "SmartMoE swaps and FlexMoE adjustments (default 100)",
    )
    parser.add_argument(
        "--skew-threshold",
        type=float,
        default=1.5,
        help="FlexMoE also adjusts a layer whose predicted imbalance exceeds this; 0 disables (default 1.5)",
    )
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="FSSDP: calibrate the placement after the gate (default on, as the runtime's "
                        "--fssdp-calibrate; --no-calibrate plans from the predicted loads alone)")
    parser.add_argument(
        "--expert-bytes",
        type=int,
        default=GPT_MOE_S_EXPERT_BYTES,
        help=f"bf16 bytes of one expert's weights (default {GPT_MOE_S_EXPERT_BYTES}, GPT-MoE-S)",
    )
    parser.add_argument(
        "--intra-node-bw", type=float, default=300.0, help="intra-node bandwidth, GB/s (default 300, NVLink)"
    )
    parser.add_argument(
        "--inter-node-bw", type=float, default=12.5, help="inter-node bandwidth, GB/s (default 12.5 = 100 Gbps)"
    )
    parser.add_argument("--iterations", type=int, default=None, help="replay only the first ITERATIONS iterations")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the metrics as JSON to OUT")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser.parse_args(argv)


def _fail(message: str) -> int:
    print(f"plan: error: {message}", file=sys.stderr)
    return 2


def validate(args: argparse.Namespace, num_experts: int | None = None) -> list[str]:
    """Problems with the arguments (empty if none). With `num_experts`, also the E vs D checks."""
    problems = []
    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not names:
        problems.append("--policy is empty; give one or more of: " + ", ".join(POLICIES))
    for name in names:
        if name not in POLICIES:
            problems.append(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
    if len(set(names)) != len(names):
        problems.append(f"--policy lists a policy twice: {args.policy}")
    for flag, value, low in (
        ("--nodes", args.nodes, 1),
        ("--gpus-per-node", args.gpus_per_node, 1),
        ("--overlap-degree", args.overlap_degree, 0),
        ("--memory-capacity", args.memory_capacity, 0),
        ("--reshard-interval", args.reshard_interval, 1),
        ("--expert-bytes", args.expert_bytes, 1),
    ):
        if value < low:
            problems.append(f"{flag} must be >= {low}, got {value}")
    for flag, value in (
        ("--slots-per-rank", args.slots_per_rank),
        ("--window", args.window),
        ("--iterations", args.iterations),
    ):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    for flag, value in (
        ("--capacity-factor", args.capacity_factor),
        ("--intra-node-bw", args.intra_node_bw),
        ("--inter-node-bw", args.inter_node_bw),
    ):
        if not np.isfinite(value) or value <= 0:
            problems.append(f"{flag} must be > 0, got {value}")
    if args.skew_threshold != 0 and not args.skew_threshold >= 1.0:
        problems.append(
            f"--skew-threshold must be >= 1.0 (imbalance is max / mean) or 0 to disable, got {args.skew_threshold}"
        )
    if problems or num_experts is None:
        return problems
    D = args.nodes * args.gpus_per_node
    E = num_experts
    ep_users = [n for n in names if n in EP_BASED]
    if ep_users:
        try:
            ep_group_size(E, D)
        except PlacementError:
            valid = [d for d in range(1, max(2 * E, D) + 1) if E % d == 0 or d % E == 0]
            problems.append(
                f"{', '.join(ep_users)} need the device count to divide the expert count or be a multiple of it, "
                f"but --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = {D} devices and the trace has {E} experts; "
                f"valid device counts: {', '.join(map(str, valid[:12]))}{', ...' if len(valid) > 12 else ''}"
            )
    slot_users = [n for n in names if n in SLOT_BASED]
    if slot_users and args.slots_per_rank is not None and args.slots_per_rank * D < E:
        problems.append(
            f"{', '.join(slot_users)}: {D} devices x --slots-per-rank {args.slots_per_rank} = {D * args.slots_per_rank} slots "
            f"cannot hold {E} experts; use --slots-per-rank >= {-(-E // D)}"
        )
    return problems


def summarize(result: ReplayResult) -> dict:
    """The JSON metrics of one policy."""
    I = result.imbalance_IL.shape[0]
    per_layer = [
        {
            "layer": l,
            "imbalance_mean": float(result.imbalance_IL[:, l].mean()),
            "imbalance_p95": float(np.percentile(result.imbalance_IL[:, l], 95)),
            "survival_mean": float(result.survival_IL[:, l].mean()),
            "replicas_per_expert": float(result.replicas_IL[:, l].mean()),
            "extra_copies_per_device": float(result.extra_copies_IL[:, l].mean()),
        }
        for l in range(result.imbalance_IL.shape[1])
    ]
    moved = result.rearrange
    return {
        "window": result.window,
        "imbalance_mean": float(result.imbalance_IL.mean()),
        "imbalance_p95": float(np.percentile(result.imbalance_IL, 95)),
        "imbalance_max": float(result.imbalance_IL.max()),
        "survival_mean": float(result.survival_IL.mean()),
        "replicas_per_expert": float(result.replicas_IL.mean()),
        "extra_copies_per_device": float(result.extra_copies_IL.mean()),
        "bytes": {
            kind: {"intra": float(v[0] / I), "inter": float(v[1] / I)} for kind, v in sorted(result.traffic.items())
        },
        "rearrange_bytes": float(moved.total),
        "rearrange": {
            "param_bytes": float(moved.param),
            "optimizer_bytes": float(moved.optimizer),
            "intra_bytes": float(moved.param_intra + moved.optimizer_intra),
            "inter_bytes": float(moved.param_inter + moved.optimizer_inter),
            "events": result.rearrange_events,
        },
        "planner_ms_mean": float(result.planner_s_I.mean() * 1e3),
        "planner_ms_max": float(result.planner_s_I.max() * 1e3),
        "per_layer": per_layer,
    }


def format_table(metrics: dict[str, dict]) -> str:
    """Side-by-side table: one row per policy."""
    header = (
        f"{'policy':<10} {'imb mean':>8} {'imb p95':>8} {'survival':>8} {'replicas':>8} {'extra/dev':>9} "
        f"{'a2a GB/it':>9} {'(inter)':>8} {'sync GB/it':>10} {'(inter)':>8} {'rearr GB':>9} {'plan ms':>8}"
    )
    lines = [header, "-" * len(header)]
    gb = 1e9
    for name, m in metrics.items():
        a2a = m["bytes"].get("all_to_all", {"intra": 0.0, "inter": 0.0})
        sync = [v for kind, v in m["bytes"].items() if kind not in ("all_to_all", "rearrange")]
        sync_intra = sum(v["intra"] for v in sync)
        sync_inter = sum(v["inter"] for v in sync)
        lines.append(
            f"{name:<10} {m['imbalance_mean']:>8.3f} {m['imbalance_p95']:>8.3f} {m['survival_mean']:>8.4f} "
            f"{m['replicas_per_expert']:>8.2f} {m['extra_copies_per_device']:>9.2f} "
            f"{(a2a['intra'] + a2a['inter']) / gb:>9.3f} {a2a['inter'] / gb:>8.3f} "
            f"{(sync_intra + sync_inter) / gb:>10.3f} {sync_inter / gb:>8.3f} {m['rearrange_bytes'] / gb:>9.3f} "
            f"{m['planner_ms_mean']:>8.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    problems = validate(args)
    if not os.path.isfile(args.trace):
        problems.insert(0, f"trace file {args.trace!r} does not exist (make one with tools/make_trace.py)")
    if problems:
        return _fail("\n  ".join(problems))
    try:
        trace = read_trace(args.trace)
    except PlacementError as err:
        return _fail(str(err))
    problems = validate(args, trace.num_experts)
    if problems:
        return _fail("\n  ".join(problems))

    D = args.nodes * args.gpus_per_node
    loads = trace.loads if args.iterations is None else trace.loads[: args.iterations]
    source = None
    if trace.source_loads is not None and trace.num_ranks == D:
        source = trace.source_loads[: loads.shape[0]]
    elif not args.quiet:
        why = (
            "has no per-rank loads"
            if trace.source_loads is None
            else f"has per-rank loads for {trace.num_ranks} ranks, not {D}"
        )
        print(f"plan: the trace {why}; splitting each expert's tokens evenly over the {D} devices", file=sys.stderr)
    topology = Topology(args.nodes, args.gpus_per_node, args.intra_node_bw * 1e9, args.inter_node_bw * 1e9)
    config = ReplayConfig(
        topology=topology,
        byte_model=ByteModel.from_expert_bytes(args.expert_bytes),
        overlap_degree=args.overlap_degree,
        memory_capacity=args.memory_capacity,
        slots_per_rank=args.slots_per_rank,
        capacity_factor=args.capacity_factor,
        reshard_interval=args.reshard_interval,
        skew_threshold=args.skew_threshold or None,
        calibrate=args.calibrate,
        load_predictor=args.load_predictor,
    )
    I, L, E = loads.shape
    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not args.quiet:
        print(
            f"plan: {args.trace}: {I} iterations x {L} layers x {E} experts on {args.nodes} x {args.gpus_per_node} devices",
            file=sys.stderr,
        )
    metrics: dict[str, dict] = {}
    for name in names:
        try:
            policy = make_policy(name, config, L, E)
        except PlacementError as err:
            return _fail(f"{name}: {err}")
        started = time.perf_counter()
        every = max(1, I // 10)

        def progress(done: int, total: int, name=name, started=started, every=every) -> None:
            if not args.quiet and (done % every == 0 or done == total):
                print(
                    f"  {name}: {done}/{total} iterations, {time.perf_counter() - started:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )

        metrics[name] = summarize(replay(policy, loads, source, args.window, progress))

    print(format_table(metrics))
    if args.json:
        setup = {
            "trace": args.trace,
            "iterations": I,
            "layers": L,
            "experts": E,
            "nodes": args.nodes,
            "gpus_per_node": args.gpus_per_node,
            "overlap_degree": args.overlap_degree,
            "memory_capacity": args.memory_capacity,
            "slots_per_rank": config.slots(E),
            "capacity_factor": args.capacity_factor,
            "reshard_interval": args.reshard_interval,
            "skew_threshold": config.skew_threshold,
            "calibrate": args.calibrate,
            "expert_bytes": args.expert_bytes,
            "token_bytes": config.byte_model.token_bytes,
            "source_loads": "trace" if source is not None else "even split",
        }
        out_dir = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(out_dir, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "policies": metrics}, f, indent=1)
        if not args.quiet:
            print(f"plan: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
