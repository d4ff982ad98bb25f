"""FSSDP mode settings: its flags (`--fssdp-*`), their validation, and FSSDPConfig read from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_patches.config.flags import auto_or_int, fail
from megatron_patches.mode.envelope import check_instance_mode
from megatron_patches.mode.spec import ModeSpec
from megatron_patches.placement.collectives import ALGORITHMS

DEFAULT_LOAD_WINDOW = 5
"""--moe-load-window in fssdp mode: predict from the mean of the last 5 iterations (DESIGN 4.1)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="fssdp (--moe-parallel-mode fssdp)")
    group.add_argument(
        "--fssdp-overlap-degree", type=auto_or_int, default="auto",
        help="t: expert copies a device may receive per layer (DESIGN 4.2: as many as attention "
        "hides). auto: chosen by cost after the first iteration (run without copies): t = 0, the "
        "powers of two up to the number of experts and the t attention hides (from the measured "
        "non-MoE time, the probed bandwidth and the bytes of one expert) are priced on that "
        "iteration's loads (expert time per token and per instance, all-to-all, the gather and "
        "reduce beyond what they overlap) and the cheapest is kept; the log lists the prices. Chosen "
        "again, on the loads of the iteration just run, after iterations 4, 16, 64, ... (powers of 4, "
        "below --fssdp-reshard-interval) and at every re-shard check, as the router's loads drift. "
        "New flag.",
    )
    group.add_argument(
        "--fssdp-memory-capacity", type=auto_or_int, default="auto",
        help="m: extra expert copies a device may hold per layer. auto: free memory per MoE layer "
        "whose copies are alive over the bytes of one copy (weights and gradient). GPU: the first "
        "iteration runs without copies and measures its activation peak; m is what stays free "
        "after reserving that peak plus --fssdp-memory-margin. CPU: --fssdp-memory-budget-mb. "
        "New flag.",
    )
    group.add_argument(
        "--fssdp-memory-margin", type=float, default=0.25,
        help="GPU, with --fssdp-memory-capacity auto: reserve this fraction of the measured "
        "activation peak on top of it before counting copy slots (routing varies between "
        "iterations, and with it the activation and all-to-all memory). New flag.",
    )
    group.add_argument(
        "--fssdp-memory-budget-mb", type=float, default=256.0,
        help="CPU only, with --fssdp-memory-capacity auto: host memory (MiB) a rank may spend on "
        "expert copies. New flag.",
    )
    group.add_argument(
        "--fssdp-reshard-interval", type=int, default=100,
        help="Iterations between heterogeneous re-sharding decisions (0 = never). New flag.",
    )
    group.add_argument(
        "--fssdp-rematerialize", action="store_true",
        help="Free each layer's expert copies right after its forward and gather them again for its "
        "backward (less memory, one more gather per layer). New flag.",
    )
    group.add_argument(
        "--fssdp-collectives", choices=ALGORITHMS, default=ALGORITHMS[0],
        help="How spAG and spRS move copies between nodes. hierarchical: each expert crosses into a "
        "node at most once, to one relay there that forwards it to the node's other holders (spRS: "
        "the relay sums its node's gradients and sends one sum to the owner). flat: every copy from "
        "its owner, point to point (an expert held on k GPUs of a remote node crosses k times). "
        "hierarchical also sends the experts every GPU holds by ring broadcast (spRS: ring reduce) "
        "when a ring is faster, e.g. a hot expert copied everywhere leaves its owner once, not once "
        "per node. Without such experts, identical on one node. New flag.",
    )
    group.add_argument(
        "--fssdp-calibrate", action=argparse.BooleanOptionalAction, default=True,
        help="After the gate, add copies for the actual loads (relieving the busiest rank one copy at "
        "a time, or FasterMoE-style shadowing) and gather them when the cost model says it pays off. "
        "Before the gate, each layer then keeps m x the share of tokens the load predictor "
        "recently misplaced (rounded) copy slots free for it. On by default: routing drifts, and the "
        "prediction from past iterations misses the expert that turns hot (docs/benchmarks.md, "
        "Drift); --no-fssdp-calibrate plans from the prediction alone. New flag.",
    )
    group.add_argument(
        "--fssdp-planner-thread", action=argparse.BooleanOptionalAction, default=False,
        help="Make each iteration's plans before the gate on a host thread, in layer order, while the "
        "layers before them run (only the first layer's plan is waited for, and any not ready when "
        "its layer starts). Off by default: on CPU, where the ranks' compute fills the cores, it did "
        "not shorten iterations (docs/benchmarks.md, 'Planner thread'), and on GPU it is not measured "
        "yet. The records' planner_exposed_s shows the planner time left on the training thread "
        "either way. New flag.",
    )


def validate(args: argparse.Namespace) -> None:
    check_instance_mode(args, "fssdp")
    if args.fssdp_reshard_interval < 0:
        fail("--fssdp-reshard-interval", args.fssdp_reshard_interval, "must be >= 0 (0 = never re-shard)")
    if not args.fssdp_memory_budget_mb > 0:
        fail("--fssdp-memory-budget-mb", args.fssdp_memory_budget_mb, "must be positive")
    if not 0 <= args.fssdp_memory_margin <= 10:
        fail("--fssdp-memory-margin", args.fssdp_memory_margin,
             "must be a fraction of the activation peak in [0, 10] (0.25 reserves a quarter more)")


@dataclass(frozen=True)
class FSSDPConfig:
    """How FSSDP materializes expert copies (DESIGN 4.2-4.5)."""

    overlap_degree: int | None
    """t: expert copies a device may receive per layer. None = auto: chosen by cost after the
    first iteration (which runs without copies and measures), among t = 0, the powers of two up
    to E and the t attention hides (`FSSDPRuntime._auto_overlap_degree`)."""
    memory_capacity: int | None
    """m: extra expert copies a device may hold per layer. None = auto: the free memory per
    MoE layer whose copies are alive over the bytes of one copy, weights and gradient (GPU:
    free device memory after the first iteration, which runs without copies, minus its
    measured activation peak x (1 + `memory_margin`); CPU: `memory_budget_bytes`)."""
    memory_budget_bytes: int
    """CPU only, for m = auto: bytes of host memory a rank may spend on expert copies."""
    memory_margin: float
    """GPU, for m = auto: fraction of the measured activation peak reserved on top of it."""
    reshard_interval: int
    """Iterations between heterogeneous re-sharding decisions; 0 = never."""
    rematerialize: bool
    """Free a layer's copies right after its forward and gather them again for its backward."""
    calibrate: bool
    """After the gate, re-plan with the actual loads; gather once more if it pays off."""
    load_window: int
    """Iterations averaged to predict the next iteration's expert loads (DESIGN 4.1)."""
    load_predictor: str = "adaptive"
    """How loads are predicted from the last `load_window` iterations: "adaptive" (per layer the
    window among 1, 2, 4, ... that predicted the recent iterations best) or "mean" (all of them);
    `placement.loads.LoadTracker`."""
    collectives: str = ALGORITHMS[0]
    """spAG/spRS algorithm: "hierarchical" (one copy per remote node, relayed inside it; experts
    every rank holds by ring broadcast / reduce when faster) or "flat" (every copy from its owner);
    `placement.collectives`."""
    microbatches: int = 1
    """k, the micro-batches of one iteration on this rank (`--global-batch-size` / (micro-batch x
    data-parallel size)): each layer's copies are gathered on the first and reduced after the
    k-th backward (without re-materialization)."""
    reduce_in_fp32: bool = False
    """spRS sends and sums the copies' gradients in fp32 (`--accumulate-allreduce-grads-in-fp32`,
    always on with --bf16), as Megatron's DDP reduces the dense gradients in fp32; otherwise in
    the compute dtype (fp16 without the flag, half the spRS bytes). The copies themselves, and so
    spAG, stay in the compute dtype."""
    planner_thread: bool = False
    """Make the plans before the gate on a host thread while the layers before them run
    (`--fssdp-planner-thread`); otherwise all of them in `begin_iteration`."""
    grouped_gemm: bool = False
    """Run the instances a rank computes in one MoE layer pass as one grouped GEMM over their
    weight rows (`--moe-grouped-gemm`; `mode.layer.InstanceMoELayer.run_instances`); Megatron's
    own experts stay SequentialMLP modules, the parameters this mode owns."""

    @classmethod
    def from_args(cls, args) -> "FSSDPConfig":
        return cls(
            overlap_degree=None if args.fssdp_overlap_degree == "auto" else int(args.fssdp_overlap_degree),
            memory_capacity=None if args.fssdp_memory_capacity == "auto" else int(args.fssdp_memory_capacity),
            memory_budget_bytes=int(args.fssdp_memory_budget_mb * 2**20),
            memory_margin=args.fssdp_memory_margin,
            reshard_interval=args.fssdp_reshard_interval,
            rematerialize=args.fssdp_rematerialize,
            calibrate=args.fssdp_calibrate,
            load_window=args.moe_load_window,
            load_predictor=args.moe_load_predictor,
            collectives=args.fssdp_collectives,
            microbatches=args.num_micro_batches,
            reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            grouped_gemm=args.moe_grouped_gemm,
            planner_thread=args.fssdp_planner_thread,
        )


def simulated(args, where: str, zp_groups: int) -> tuple[list[str], dict[str, tuple]]:
    """The simulator's FSSDP system (with re-materialization when the run asks for it) and the
    run's t, m, re-shard interval, calibration and collectives."""
    settings = {"reshard_interval": (args.fssdp_reshard_interval, f"{where}: fssdp_reshard_interval")}
    for key, option in (("fssdp_overlap_degree", "overlap_degree"), ("fssdp_memory_capacity", "memory_capacity")):
        value = getattr(args, key)
        if value != "auto":
            settings[option] = (int(value), f"{where}: {key}")
    settings["fssdp_calibrate"] = (args.fssdp_calibrate, f"{where}: fssdp_calibrate")
    settings["sparse_collectives"] = (args.fssdp_collectives, f"{where}: fssdp_collectives")
    return ["fssdp-remat" if args.fssdp_rematerialize else "fssdp"], settings


MODE = ModeSpec(
    name="fssdp",
    summary="fully sharded sparse data parallelism: experts sharded once, copies materialized by load",
    runtime="megatron_patches.fssdp.runtime:FSSDPRuntime",
    add_args=add_args,
    validate=validate,
    default_load_window=DEFAULT_LOAD_WINDOW,
    grouped_gemm_on_instances=True,
    simulated=simulated,
)
