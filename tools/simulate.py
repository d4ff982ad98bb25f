#!/usr/bin/env python
"""Predict the iteration time of MoE training systems on a described cluster from an expert-load trace.

Example (GPT-MoE-S on cluster A's 32 V100s, a skewed synthetic trace):

    python tools/make_trace.py --out T.npz --layers 12 --experts 64 --tokens 131072 --zipf 1.2 --ranks 32
    python tools/simulate.py --model configs/models/gpt_moe_s.yaml --cluster configs/clusters/cluster_a.yaml \\
        --gpus 32 --trace T.npz --systems ep,fastermoe,smartmoe,flexmoe-50,fssdp --json out.json

Every placement system is planned by the placement engine's own code (megatron_patches/placement)
iteration by iteration, priced by the cost model (megatron_patches/sim/costs.py) and run through
an event-driven schedule of forward and backward per layer; zebra systems use the placement
engine's zebra schedule. The trace's routing is rescaled to the simulated batch (D x
--micro-batch-size x --seq-length tokens per iteration). EP is always simulated: speedups are
relative to it. `--list-systems` names every system; the table explains its columns.
`--json OUT` writes {"setup": ..., "systems": {name: {iteration_s, speedup_vs_ep, breakdown_s,
imbalance_mean, memory_gb_max, survival_mean, per_layer_speedup, ...}}}; `--plot OUT.png`
draws the speedups, the breakdowns and the per-layer speedups.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from megatron_patches.config import ConfigError, load_cluster_config, load_model_config
from megatron_patches.placement.trace import TraceError, read_trace
from megatron_patches.placement.types import PlacementError
from megatron_patches.sim import (
    SYSTEMS,
    KernelEfficiency,
    LinkParameters,
    SimError,
    SimOptions,
    build_scenario,
    format_table,
    plot,
    resolve_systems,
    summarize,
    write_json,
)
from megatron_patches.sim.systems import check_memory, simulate_all


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="systems: " + ", ".join(SYSTEMS) + ", flexmoe-N, smartmoe-N",
    )
    parser.add_argument("--list-systems", action="store_true",
                        help="print the system names with a description and exit")
    parser.add_argument("--model", help="model config: a YAML path or a name under configs/models")
    parser.add_argument("--cluster", help="cluster config: a YAML path or a name under configs/clusters")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use, the cluster's first ones (default: all)")
    parser.add_argument("--trace", help=".npz load trace (training's --moe-log-loads or tools/make_trace.py)")
    parser.add_argument("--systems", default="ep,fssdp", help="comma-separated systems (default ep,fssdp)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per GPU per iteration (default 1)")
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: the model's)")
    parser.add_argument("--iterations", type=int, default=None, help="simulate only the trace's first N iterations")
    parser.add_argument("--overlap-degree", type=int, default=None,
                        help="FSSDP's t (default: DESIGN 4.2's formula from the cost model)")
    parser.add_argument("--memory-capacity", type=int, default=None,
                        help="FSSDP's m, copies per device and layer (default: what fits in free memory)")
    parser.add_argument("--reserved-slots", type=int, default=None,
                        help="FlexMoE's reserved replica slots per device and layer (default: what fits)")
    parser.add_argument("--slots-per-rank", type=int, default=None,
                        help="replicate / static expert slots per rank and layer (default: ceil(E/D) + reserved slots)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="capacity factor of replicate / static (default: the model's, else 1.0)")
    parser.add_argument("--reshard-interval", type=int, default=100,
                        help="iterations between FSSDP re-sharding and SmartMoE swaps (default 100)")
    parser.add_argument("--zebra-microbatches", type=int, default=4,
                        help="micro-batches of zebra / zebra-asym (default 4)")
    parser.add_argument("--memory-reserve-gb", type=float, default=None,
                        help="per-GPU memory kept free for CUDA context and workspaces (default 1.5)")
    parser.add_argument("--sparse-collectives", choices=("p2p", "ring"), default="p2p",
                        help="price FSSDP's gather/reduce as point-to-point from owners (default, as the placement "
                        "engine counts bytes) or as pipelined ring broadcasts/reduces over the holders")
    parser.add_argument("--efficiency", action="append", default=[], metavar="KEY=VALUE",
                        help="override a kernel efficiency, e.g. expert_gemm=0.6 (repeatable; keys: "
                        + ", ".join(f.name for f in dataclasses.fields(KernelEfficiency)) + ")")
    parser.add_argument("--link", action="append", default=[], metavar="KEY=VALUE",
                        help="override a link parameter (repeatable; keys: "
                        + ", ".join(f.name for f in dataclasses.fields(LinkParameters)) + ")")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--plot", default=None, metavar="OUT", help="save speedup / breakdown / per-layer plots to OUT")
    parser.add_argument("--jobs", type=int, default=1,
                        help="systems simulated in parallel worker processes (default 1; more helps on idle cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


def _fail(message: str) -> int:
    print(f"simulate: error: {message}", file=sys.stderr)
    return 2


def _key_values(items: list[str], flag: str) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SimError(f"{flag} {item!r} must look like KEY=VALUE")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise SimError(f"{flag} {item!r}: {value!r} is not a number") from None
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_systems:
        for spec in SYSTEMS.values():
            print(f"{spec.name:<13} {spec.description}")
        print(f"{'flexmoe-N':<13} FlexMoE-style replicate/relocate every N iterations")
        print(f"{'smartmoe-N':<13} SmartMoE-style swapping every N iterations")
        return 0
    missing = [f"--{name}" for name in ("model", "cluster", "trace") if getattr(args, name) is None]
    if missing:
        return _fail(f"{', '.join(missing)} required (or --list-systems)")
    started = time.perf_counter()
    try:
        specs = resolve_systems(["ep"] + args.systems.split(","))
        efficiency = KernelEfficiency().with_overrides(_key_values(args.efficiency, "--efficiency"))
        links = _key_values(args.link, "--link")
        valid_links = [f.name for f in dataclasses.fields(LinkParameters)]
        unknown = sorted(set(links) - set(valid_links))
        if unknown:
            raise SimError(f"unknown link parameter(s) {unknown}; valid: {valid_links}")
        link_params = LinkParameters(**links)
        options = SimOptions(
            overlap_degree=args.overlap_degree,
            memory_capacity=args.memory_capacity,
            reserved_slots=args.reserved_slots,
            slots_per_rank=args.slots_per_rank,
            capacity_factor=args.capacity_factor,
            reshard_interval=args.reshard_interval,
            zebra_microbatches=args.zebra_microbatches,
            memory_reserve_gb=args.memory_reserve_gb,
            sparse_collectives=args.sparse_collectives,
        )
        if args.iterations is not None and args.iterations < 1:
            raise SimError(f"--iterations must be >= 1, got {args.iterations}")
        model = load_model_config(args.model)
        cluster = load_cluster_config(args.cluster)
        trace = read_trace(args.trace)
        if args.iterations is not None:
            trace = dataclasses.replace(
                trace,
                loads=trace.loads[: args.iterations],
                source_loads=None if trace.source_loads is None else trace.source_loads[: args.iterations],
            )
        gpus = cluster.num_devices if args.gpus is None else args.gpus
        scn = build_scenario(model, cluster, gpus, trace, args.micro_batch_size, args.seq_length,
                             efficiency, link_params, options)
        check_memory(scn)
        if args.jobs < 1:
            raise SimError(f"--jobs must be >= 1, got {args.jobs}")

        def progress(name: str, seconds: float) -> None:
            if not args.quiet:
                print(f"simulate: {name} took {seconds:.1f} s", file=sys.stderr)

        results = simulate_all(scn, specs, args.jobs, progress)
    except (SimError, ConfigError, TraceError, PlacementError, OSError) as err:
        return _fail(str(err))
    wl = scn.workload
    setup = {
        "model": model.to_dict(),
        "model_config": str(args.model),
        "cluster": scn.hardware.describe(),
        "cluster_config": str(args.cluster),
        "gpus": gpus,
        "micro_batch_size": wl.micro_batch_size,
        "seq_length": wl.seq_length,
        "tokens_per_iteration": wl.num_devices * wl.tokens_per_device,
        "trace": os.path.abspath(args.trace),
        "iterations": scn.num_iterations,
        "trace_scale": scn.trace_scale,
        "source_loads": scn.source_note,
        "kernel_efficiency": dataclasses.asdict(efficiency),
        "link_parameters": dataclasses.asdict(link_params),
        "options": dataclasses.asdict(options),
        "breakdown_note": "attention, other, expert_compute_mean, straggler_wait, all_to_all, exposed_collectives, "
        "rearrangement and optimizer add up to iteration_s; expert_compute_max is the busiest device's expert "
        "compute (not a part)",
        "wall_s": None,
    }
    summary = summarize(results, setup)
    summary["setup"]["wall_s"] = time.perf_counter() - started
    print(f"{model.model_family} model {args.model}: {model.num_layers} layers, {model.num_experts} experts, "
          f"top-{model.moe_router_topk}; {scn.hardware.describe()} ({gpus} GPUs)")
    print(f"{wl.num_devices * wl.tokens_per_device} tokens per iteration "
          f"({wl.micro_batch_size} x {wl.seq_length} per GPU); "
          f"trace {args.trace}: {scn.num_iterations} iterations, routing scaled x{scn.trace_scale:.3g}, "
          f"sources: {scn.source_note}")
    print(format_table(summary))
    for name, s in summary["systems"].items():
        details = {k: v for k, v in s["details"].items() if k != "profile"}
        if details:
            print(f"{name}: " + ", ".join(f"{k}={_short(v)}" for k, v in details.items()))
    for name, s in summary["systems"].items():
        if not s["fits_in_memory"]:
            print(f"warning: {name} needs up to {s['memory_gb_max']:.1f} GB on a device of "
                  f"{s['memory_gb_capacity']:.0f} GB at its most loaded iteration (see memory_gb_per_device)")
    if args.json:
        write_json(summary, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(summary, args.plot)
        print(f"wrote {args.plot}")
    print(f"simulated in {summary['setup']['wall_s']:.1f} s")
    return 0


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
