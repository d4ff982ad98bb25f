#!/usr/bin/env python
"""Predict the iteration time of MoE training systems on a described cluster from an expert-load trace.

Example (GPT-MoE-S on cluster A's 32 V100s, a skewed synthetic trace):

    python tools/make_trace.py --out T.npz --layers 12 --experts 64 --tokens 131072 --zipf 1.2 --ranks 32
    python tools/simulate.py --model configs/models/gpt_moe_s.yaml --cluster configs/clusters/cluster_a.yaml \\
        --gpus 32 --trace T.npz --systems ep,fastermoe,smartmoe,flexmoe-50,fssdp --json out.json

Or everything from a run config (model, cluster, world size, micro-batch, sequence length,
precision, recompute, the mode's systems and flags), on a synthetic trace made on the fly:

    python tools/simulate.py --run configs/runs/fssdp_gpt_moe_s_a32.yaml

Precision (`--precision fp32|fp16|bf16`, default bf16 where every simulated GPU supports it,
else fp16) sets the bytes of weights, gradients, optimizer state, tokens and activations and
the compute peaks; `--recompute none|selective|full` sets what activations are kept and what
the backward computes again. Explicit flags override the run config; the settings used and
where each came from are printed first.

Every placement system is planned by the placement engine's own code (megatron_patches/placement)
iteration by iteration, priced by the cost model (megatron_patches/sim/costs.py) and run through
an event-driven schedule of forward and backward per layer; zebra systems use the placement
engine's zebra schedule. The trace's routing is rescaled to the simulated batch (D x
--micro-batch-size x --seq-length tokens per iteration). EP is always simulated: speedups are
relative to it (where EP cannot place the experts on the devices, the other systems run without
speedups). `--list-systems` names every system; the table explains its columns.
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

from megatron_patches.config import ConfigError, load_cluster_config, load_model_config, model_config_from_dict
from megatron_patches.placement.synthetic import PAPERS_ROUTING, describe_routing, synthetic_trace
from megatron_patches.placement.trace import TraceError, read_trace, trace_statistics
from megatron_patches.placement.types import PlacementError
from megatron_patches.sim import (
    PRECISIONS,
    RECOMPUTE,
    SYSTEMS,
    Hardware,
    KernelEfficiency,
    LinkParameters,
    Precision,
    SimError,
    SimOptions,
    build_scenario,
    format_table,
    plot,
    resolve_systems,
    select_devices,
    summarize,
    write_json,
)
from megatron_patches.sim.profile import load_device_profile
from megatron_patches.sim.systems import (
    check_memory,
    layout_problems,
    periodic_acts,
    periodic_interval,
    simulate_all,
)
from megatron_patches.sim.scenario import SPARSE_COLLECTIVES


SYNTHETIC_ITERATIONS = 10
"""Iterations of the synthetic trace `--run` makes without `--trace` (enough for the load
predictors' windows to fill; more only repeats the same statistics)."""



def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="systems: " + ", ".join(SYSTEMS) + ", flexmoe-N, smartmoe-N",
    )
    parser.add_argument("--list-systems", action="store_true",
                        help="print the system names with a description and exit")
    parser.add_argument("--run", help="run config (configs/runs/NAME.yaml or NAME): model, cluster, world size, "
                        "micro-batch, sequence length, precision, recompute, the mode's systems and flags")
    parser.add_argument("--model", help="model config: a YAML path or a name under configs/models")
    parser.add_argument("--cluster", help="cluster config: a YAML path or a name under configs/clusters")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="experts per MoE layer instead of the model config's (the FSSDP paper's 16-GPU runs "
                        "use 32 where its models have 64)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to use, the cluster's first ones (default: all, or the run's world size)")
    parser.add_argument("--trace", help=".npz load trace (training's --moe-log-loads or tools/make_trace.py); "
                        f"with --run, default: a synthetic trace of {SYNTHETIC_ITERATIONS} iterations with the papers' "
                        "routing dynamics (make_trace.py --papers-routing; --iterations N for more; a periodic system that acts fewer than twice in the trace is named in the output)")
    parser.add_argument("--systems", default=None,
                        help="comma-separated systems (default ep,fssdp; with --run, ep and the run's mode)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="sequences per GPU per iteration (default 1, or the run's)")
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: the model's)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="training precision (default: bf16 where every simulated GPU supports it, else fp16; "
                        "with --run, the run's --bf16 / --fp16, else fp32)")
    parser.add_argument("--recompute", choices=RECOMPUTE, default=None,
                        help="activation recompute (default none, or the run's --recompute-granularity)")
    parser.add_argument("--iterations", type=int, default=None, help="simulate only the trace's first N iterations")
    parser.add_argument("--overlap-degree", type=int, default=None,
                        help="FSSDP's t (default: by cost as the runtime's auto t, on the trace's first "
                        "iteration and again after iterations 4, 16, 64 and every re-shard check: t = 0, "
                        "the powers of two up to E "
                        "and DESIGN 4.2's hidden t)")
    parser.add_argument("--memory-capacity", type=int, default=None,
                        help="FSSDP's m, copies per device and layer (default: what fits in free memory)")
    parser.add_argument("--reserved-slots", type=int, default=None,
                        help="FlexMoE's reserved replica slots per device and layer (default: what fits)")
    parser.add_argument("--slots-per-rank", type=int, default=None,
                        help="replicate / static expert slots per rank and layer (default: ceil(E/D) + reserved "
                        "slots; static takes the most DeepSpeed can lay out within them, and refuses a given s unless "
                        "s divides E and E/s the GPUs)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="capacity factor of replicate / static (default: the model's, else 1.0)")
    parser.add_argument("--nic-sharing", action=argparse.BooleanOptionalAction, default=True,
                        help="collectives that cross nodes share the NICs: one in flight slows the next "
                        "(default on; --no-nic-sharing gives every stream the whole NIC)")
    parser.add_argument("--pad-to-capacity", action=argparse.BooleanOptionalAction, default=None,
                        help="replicate and FlexMoE at a capacity pad their experts' input to it, as the "
                        "replication paper's DeepSpeed-based system does: every instance computes its whole "
                        "capacity, whatever it received (default: off, or a run's "
                        "moe_pad_expert_input_to_capacity; the replicate mode itself refuses that flag; static, "
                        "DeepSpeed's fixed-shape dispatch, always pads)")
    parser.add_argument("--reshard-interval", type=int, default=None,
                        help="iterations between FSSDP re-sharding and SmartMoE swaps (default 100, or the run's)")
    parser.add_argument("--zebra-microbatches", type=int, default=None,
                        help="micro-batches of zebra / zebra-asym (default 4, or the run's)")
    parser.add_argument("--memory-reserve-gb", type=float, default=None,
                        help="per-GPU memory kept free for CUDA context and workspaces (default 1.5)")
    parser.add_argument("--sparse-collectives", choices=SPARSE_COLLECTIVES, default=None,
                        help="price FSSDP's gather/reduce as the runtime's --fssdp-collectives runs them: hierarchical "
                        "(default, or the run's: one copy per remote node to a relay, then inside the node) or flat "
                        "(point to point from the owner to every holder); or as pipelined ring broadcasts/reduces "
                        "over the holders (ring, NCCL's algorithm, not run by the runtime)")
    parser.add_argument("--fssdp-calibrate", action=argparse.BooleanOptionalAction, default=None,
                        help="FSSDP calibrates after the gate (default on, as the runtime; or the run's "
                        "fssdp_calibrate; --no-fssdp-calibrate turns it off): with the "
                        "actual loads it gathers more copies when that saves more than the extra gather costs")
    parser.add_argument("--efficiency", action="append", default=[], metavar="KEY=VALUE",
                        help="override a kernel efficiency, e.g. expert_gemm=0.6 (repeatable; keys: "
                        + ", ".join(f.name for f in dataclasses.fields(KernelEfficiency)) + ")")
    parser.add_argument("--device-profile", default=None, metavar="FILE",
                        help="kernel rates measured on the simulated GPU type (tools/device_check.py's kernels "
                        "stage writes one) in place of the cluster file's peaks x the cited efficiencies; the "
                        "efficiencies it implies are printed and recorded (an --efficiency key it also sets is refused)")
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


def _run_settings(args: argparse.Namespace) -> dict[str, tuple]:
    """What a run config says, as {setting: (value, where it came from)}.

    The run is read and checked as the launcher does (megatron_patches/jobs/plan.py: load_run_config
    and plan_job, with --model / --cluster as the launcher's overrides), so the values are the
    training flags the job would run with: the run's `train` and `mode_flags` over the model
    config. Settings the simulator cannot model faithfully are refused, not approximated.
    """
    from megatron_patches.jobs import plan as jobs
    from megatron_patches.training import modes

    from megatron_patches.config.models import model_config_from_args

    try:
        run = jobs.load_run_config(args.run)
        job = jobs.plan_job(run, jobs.Overrides(model=args.model, cluster=args.cluster))
    except jobs.SubmitError as err:
        raise SimError(f"--run {args.run}: {err}") from None
    a, where = job.args, "run"
    model = model_config_from_args(a)
    # the nodes and GPUs per node the job uses, per node group (zebra: attention pool first)
    cluster = dataclasses.replace(job.cluster, nodes=tuple(
        dataclasses.replace(job.cluster.nodes[c.index], count=c.nodes, gpus_per_node=c.ranks_per_node)
        for c in job.components))
    out = {
        "run": (f"{run.source} (mode {job.mode})", "--run"),
        "model": (model, f"{where}: model {job.model_path.stem}" + (" (--model)" if args.model else "")
                  + " with the run's train keys"),
        "cluster": (cluster, f"{where}: cluster {job.cluster.name}" + (" (--cluster)" if args.cluster else "")
                    + ", nodes x GPUs per node " + " + ".join(f"{c.nodes} x {c.ranks_per_node}" for c in job.components)),
        "gpus": (job.world_size, f"{where}: world size"),
        "micro_batch_size": (a.micro_batch_size, f"{where}: train.micro_batch_size"),
        "seq_length": (a.seq_length, f"{where}: seq_length"),
    }
    if model.moe_expert_capacity_factor is not None:
        out["capacity_factor"] = (model.moe_expert_capacity_factor, f"{where}: moe_expert_capacity_factor")
    if a.moe_pad_expert_input_to_capacity:
        out["pad_to_capacity"] = (True, f"{where}: moe_pad_expert_input_to_capacity")
    if a.bf16:
        out["precision"] = (Precision("bf16"), f"{where}: train.bf16: true")
    elif a.fp16:
        out["precision"] = (Precision("fp16", a.accumulate_allreduce_grads_in_fp32), f"{where}: train.fp16: true"
                            + (", accumulate_allreduce_grads_in_fp32" if a.accumulate_allreduce_grads_in_fp32 else ""))
    else:
        out["precision"] = (Precision("fp32"), f"{where}: neither train.bf16 nor train.fp16")
    granularity = a.recompute_granularity or "none"
    every_layer = (a.recompute_method == "uniform" and a.recompute_num_layers == 1) or (
        a.recompute_method == "block" and (a.recompute_num_layers or 0) >= model.num_layers)
    if granularity == "full" and not every_layer:
        raise SimError(f"--run {args.run}: recompute_method {a.recompute_method} with recompute_num_layers "
                       f"{a.recompute_num_layers}: the simulator models full recompute with one checkpoint per layer "
                       "(uniform with 1 layer, or block over every layer)")
    if granularity == "selective" and (a.recompute_modules or ["core_attn"]) != ["core_attn"]:
        raise SimError(f"--run {args.run}: recompute_modules {a.recompute_modules}: the simulator models selective "
                       "recompute of core_attn only")
    out["recompute"] = (granularity, f"{where}: train.recompute_granularity" if a.recompute_granularity
                        else f"{where}: no recompute_granularity")
    mode = job.mode
    try:
        systems, settings = modes.spec(mode).simulated(a, where, job.zp_groups)
    except ValueError as err:
        raise SimError(f"--run {args.run}: {err}") from None
    out.update(settings)
    out["systems"] = (",".join(["ep"] + systems), f"{where}: mode {mode}")
    sequences = job.world_size * a.micro_batch_size
    if a.global_batch_size not in (None, sequences):
        out["batch_note"] = (f"the run's global batch is {a.global_batch_size} sequences; the simulator runs "
                             f"world size x micro-batch = {sequences} per iteration without gradient accumulation "
                             "(zebra splits the same batch into its micro-batches)", where)
    return out


def _settings(args: argparse.Namespace) -> dict[str, tuple]:
    """Every setting as (value, source): an explicit flag, else the run config's value, else the default."""
    run = _run_settings(args) if args.run else {}
    if not run:
        missing = [f"--{name}" for name in ("model", "cluster", "trace") if getattr(args, name) is None]
        if missing:
            raise SimError(f"{', '.join(missing)} required (or --run, or --list-systems)")
        run = {"model": (load_model_config(args.model), f"--model {args.model}"),
               "cluster": (load_cluster_config(args.cluster), f"--cluster {args.cluster}")}
    out = dict(run)
    if args.num_experts is not None:
        model, source = out["model"]
        if args.num_experts < 1:
            raise SimError(f"--num-experts must be >= 1, got {args.num_experts}")
        out["model"] = (model_config_from_dict({**model.to_dict(), "num_experts": args.num_experts}, "--num-experts"),
                        f"{source}; --num-experts {args.num_experts}")
    defaults = {"micro_batch_size": 1, "seq_length": None, "precision": None, "recompute": "none",
                "systems": "ep,fssdp", "reshard_interval": 100, "zebra_microbatches": 4, "gpus": None,
                "fssdp_calibrate": True, "sparse_collectives": SPARSE_COLLECTIVES[0], "pad_to_capacity": False}
    for name in ("gpus", "micro_batch_size", "seq_length", "precision", "recompute", "systems",
                 "overlap_degree", "memory_capacity", "slots_per_rank", "capacity_factor", "pad_to_capacity",
                 "reshard_interval", "zebra_microbatches", "fssdp_calibrate", "sparse_collectives"):
        flag = getattr(args, name)
        if flag is not None:
            out[name] = (flag, f"--{name.replace('_', '-')}")
        elif name not in out:
            out[name] = (defaults.get(name), "default")
    return out


def _trace(args: argparse.Namespace, model, gpus: int, tokens_per_gpu: int):
    """The --trace file, or with --run a synthetic trace of the run's routing (the papers' routing
    dynamics, synthetic.PAPERS_ROUTING, seed 0, per-rank loads for every GPU); (trace, description)."""
    if args.trace is not None:
        return read_trace(args.trace), os.path.abspath(args.trace)
    # the same trace whichever systems are asked for: a system's answer must not depend on its company
    iterations = args.iterations or SYNTHETIC_ITERATIONS
    trace = synthetic_trace(iterations=iterations, layers=model.num_moe_layers, experts=model.num_experts,
                            tokens=gpus * tokens_per_gpu * model.moe_router_topk, ranks=gpus, seed=0,
                            topk=model.moe_router_topk, **PAPERS_ROUTING)
    routing = describe_routing(PAPERS_ROUTING)
    return trace, (f"synthetic (no --trace): {iterations} iterations, the papers' routing dynamics ({routing}; "
                   f"no expert above 1/{model.moe_router_topk} of the tokens), seed 0, per-rank loads of {gpus} ranks")


def _routing_statistics(trace) -> tuple[dict | None, str]:
    """The trace's routing statistics as the summary records them, and as a line for the settings."""
    try:
        stats = trace_statistics(trace.loads)
    except TraceError as err:
        return None, str(err)
    return dataclasses.asdict(stats), stats.describe()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_systems:
        for spec in SYSTEMS.values():
            print(f"{spec.name:<13} {spec.description}")
        print(f"{'flexmoe-N':<13} FlexMoE-style replicate/relocate every N iterations")
        print(f"{'smartmoe-N':<13} SmartMoE-style swapping every N iterations")
        return 0
    started = time.perf_counter()
    try:
        if args.iterations is not None and args.iterations < 1:
            raise SimError(f"--iterations must be >= 1, got {args.iterations}")
        if args.jobs < 1:
            raise SimError(f"--jobs must be >= 1, got {args.jobs}")
        settings = _settings(args)
        value = {name: v for name, (v, _) in settings.items()}
        specs = resolve_systems(["ep"] + value["systems"].split(","))
        model, cluster = value["model"], value["cluster"]
        gpus = cluster.num_devices if value["gpus"] is None else value["gpus"]
        efficiency, link_params, options = _pricing(args, value, Hardware.from_cluster(cluster, gpus))
        seq_length = value["seq_length"] or model.seq_length
        trace, trace_label = _trace(args, model, select_devices(cluster, gpus).num_devices,
                                    value["micro_batch_size"] * seq_length)
        if args.iterations is not None:
            trace = dataclasses.replace(
                trace,
                loads=trace.loads[: args.iterations],
                source_loads=None if trace.source_loads is None else trace.source_loads[: args.iterations],
            )
        scn = build_scenario(model, cluster, gpus, trace, value["micro_batch_size"], seq_length,
                             efficiency, link_params, options, value["precision"], value["recompute"])
        if settings["precision"][1] == "default":
            settings["precision"] = (scn.workload.precision, scn.precision_note)
        # e.g. 24 experts on a zebra pool of 9 or 10 GPUs (EP), or zebra-asym at M:N = 4:3: the others still run
        unplaceable = layout_problems(scn, specs)
        if len(unplaceable) == len(specs):
            raise SimError("; ".join(unplaceable.values()))
        specs = [spec for spec in specs if spec.name not in unplaceable]
        ep_problem = unplaceable.get("ep")
        statistics, routing_line = _routing_statistics(trace)
        _print_settings(scn, settings, specs, trace_label, routing_line)
        for name, why in unplaceable.items():
            print(f"note: {name} is not simulated ({why})" + (", so there are no speedups over it" if name == "ep" else ""))
        # a system that cannot fit with balanced loads is not simulated, alone or beside others
        out_of_memory = check_memory(scn, specs)
        for name, why in out_of_memory.items():
            print(f"out of memory: {name} is not simulated: {why}")
        if "ep" in out_of_memory:
            print("note: ep does not fit, so there are no speedups over it")
        specs = [spec for spec in specs if spec.name not in out_of_memory]
        periodic = {}
        for spec in specs:
            acts = periodic_acts(scn, spec)
            if acts is None:
                continue
            periodic[spec.name] = acts
            if acts < 2:
                interval = periodic_interval(scn, spec)
                print(f"note: {spec.name} rearranges every {interval} iterations: {acts} time{'s' * (acts != 1)} in "
                      f"these {scn.num_iterations} (--iterations {2 * interval + 1} lets it act twice)")

        def progress(name: str, seconds: float) -> None:
            if not args.quiet:
                print(f"simulate: {name} took {seconds:.1f} s", file=sys.stderr)

        results = simulate_all(scn, specs, args.jobs, progress)
    except (SimError, ConfigError, TraceError, PlacementError, OSError) as err:
        return _fail(str(err))
    setup = _setup_record(scn, model, settings, trace_label, efficiency, link_params, options)
    reference = None if ep_problem or "ep" in out_of_memory else "ep"
    summary = summarize(results, setup, reference, out_of_memory)
    summary["setup"]["periodic_acts"] = periodic
    summary["setup"]["trace_statistics"] = statistics
    summary["setup"]["cannot_lay_out"] = unplaceable
    summary["setup"]["wall_s"] = time.perf_counter() - started
    _report(summary, args)
    print(f"simulated in {summary['setup']['wall_s']:.1f} s")
    return 0


def _pricing(args, value: dict, hardware: Hardware) -> tuple[KernelEfficiency, LinkParameters, SimOptions]:
    """The kernel efficiencies (--efficiency, and those a --device-profile implies on `hardware`),
    link parameters and simulator options of the command line."""
    overrides = _key_values(args.efficiency, "--efficiency")
    if args.device_profile is not None:
        precision = Precision(value["precision"] or hardware.default_precision[0])
        measured = load_device_profile(args.device_profile).efficiency_overrides(hardware, precision)
        both = sorted(set(measured) & set(overrides))
        if both:
            raise SimError(f"--efficiency {', '.join(both)} and --device-profile {args.device_profile} both set "
                           f"{', '.join(both)}; give one of them")
        print(f"device profile {args.device_profile} ({precision.name}): "
              + ", ".join(f"{k}={v:.3g}" for k, v in measured.items()))
        overrides.update(measured)
    efficiency = KernelEfficiency().with_overrides(overrides)
    links = _key_values(args.link, "--link")
    valid_links = [f.name for f in dataclasses.fields(LinkParameters)]
    unknown = sorted(set(links) - set(valid_links))
    if unknown:
        raise SimError(f"unknown link parameter(s) {unknown}; valid: {valid_links}")
    options = SimOptions(
        overlap_degree=value["overlap_degree"],
        memory_capacity=value["memory_capacity"],
        reserved_slots=args.reserved_slots,
        slots_per_rank=value["slots_per_rank"],
        capacity_factor=value["capacity_factor"],
        pad_to_capacity=value["pad_to_capacity"],
        nic_sharing=args.nic_sharing,
        reshard_interval=value["reshard_interval"],
        zebra_microbatches=value["zebra_microbatches"],
        memory_reserve_gb=args.memory_reserve_gb,
        sparse_collectives=value["sparse_collectives"],
        fssdp_calibrate=value["fssdp_calibrate"],
    )
    return efficiency, LinkParameters(**links), options


def _setup_record(scn, model, settings: dict[str, tuple], trace_label: str, efficiency, link_params, options) -> dict:
    """What the simulation ran with, as the JSON summary's "setup" (wall_s set at the end)."""
    wl = scn.workload
    return {
        "model": model.to_dict(),
        "model_config": settings["model"][1],
        "cluster": scn.hardware.describe(),
        "cluster_config": settings["cluster"][1],
        "run_config": settings["run"][0] if "run" in settings else None,
        "gpus": wl.num_devices,
        "micro_batch_size": wl.micro_batch_size,
        "seq_length": wl.seq_length,
        "tokens_per_iteration": wl.num_devices * wl.tokens_per_device,
        "precision": wl.precision.name,
        "precision_detail": wl.precision.describe(),
        "recompute": wl.recompute,
        "settings_from": {name: source for name, (_, source) in settings.items() if name not in ("run", "batch_note")},
        "trace": trace_label,
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


def _report(summary: dict, args) -> None:
    """The table, each system's details and memory warnings; the JSON and plot files asked for."""
    print(format_table(summary))
    for name, system in summary["systems"].items():
        details = {k: v for k, v in system["details"].items() if k != "profile"}
        if details:
            print(f"{name}: " + ", ".join(f"{k}={_short(v)}" for k, v in details.items()))
    for name, system in summary["systems"].items():
        if not system["fits_in_memory"]:
            print(f"warning: {name} needs up to {system['memory_gb_max']:.1f} GB on a device of "
                  f"{system['memory_gb_capacity']:.0f} GB at its most loaded iteration (see memory_gb_per_device)")
    if args.json:
        write_json(summary, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(summary, args.plot)
        print(f"wrote {args.plot}")


def _print_settings(scn, settings: dict[str, tuple], specs, trace_label: str, routing_line: str) -> None:
    """The settings the simulation uses, each with where it came from, before any result."""
    wl, model = scn.workload, scn.workload.model

    def line(label: str, text: str, *names: str) -> None:
        print(f"  {label:<10} {text}  [" + "; ".join(settings[name][1] for name in names) + "]")

    print("settings:")
    if "run" in settings:
        print(f"  {'run':<10} {settings['run'][0]}")
    line("model", f"{model.model_family}, {model.num_layers} layers ({model.num_moe_layers} MoE), "
         f"{model.num_experts} experts, top-{model.moe_router_topk}, hidden {model.hidden_size}", "model")
    line("cluster", f"{scn.hardware.describe()} ({wl.num_devices} GPUs)", "cluster", "gpus")
    line("batch", f"{wl.micro_batch_size} x {wl.seq_length} tokens per GPU, "
         f"{wl.num_devices * wl.tokens_per_device} per iteration", "micro_batch_size", "seq_length")
    line("precision", wl.precision.describe(), "precision")
    line("recompute", wl.recompute, "recompute")
    line("systems", ", ".join(s.name for s in specs), "systems")
    knobs = [f"{name.replace('_', ' ')} {settings[name][0]} [{settings[name][1]}]"
             for name in ("capacity_factor", "pad_to_capacity", "slots_per_rank", "reshard_interval", "overlap_degree",
                          "memory_capacity", "zebra_microbatches", "fssdp_calibrate", "sparse_collectives")
             if settings[name][1] != "default"]
    if not scn.options.nic_sharing:
        knobs.append("NIC sharing off [--no-nic-sharing]")
    if knobs:
        print(f"  {'options':<10} " + "; ".join(knobs))
    print(f"  {'trace':<10} {trace_label}; routing scaled x{scn.trace_scale:.3g}, sources: {scn.source_note}")
    print(f"  {'routing':<10} {routing_line}")
    if "batch_note" in settings:
        print(f"  {'note':<10} {settings['batch_note'][0]}")


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
