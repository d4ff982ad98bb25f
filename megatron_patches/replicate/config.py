"""Replicate mode settings: its flags (`--replicate-*`), their validation, and ReplicateConfig read
from them (with `--moe-expert-capacity-factor` and `--moe-load-window`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_patches.config.flags import fail
from megatron_patches.mode.envelope import check_instance_mode
from megatron_patches.mode.spec import ModeSpec

DEFAULT_LOAD_WINDOW = 1
"""--moe-load-window in replicate mode: the next placement follows the last iteration's
popularity (DESIGN 4.6)."""
DEFAULT_REBALANCE_INTERVAL = 10

POLICIES = ("adaptive", "static", "periodic")
"""adaptive: new replica counts every iteration from the predicted popularity (DESIGN 4.6);
static: every class keeps ranks x slots / E instances, DeepSpeed's counts, laid out by the
balanced rule as every replicate placement is (equal loads: each class's instances on distinct
ranks where the counts allow; the simulator's `static` is DeepSpeed's own layout,
`placement.baselines.static_replication`);
periodic: new replica counts only every `rebalance_interval` iterations, moving optimizer state
with the experts (a baseline with FlexMoE's cost of moving state, DESIGN 4.9; the simulator's
`flexmoe` system is FlexMoE's incremental replicate/relocate, a different policy)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="replicate (--moe-parallel-mode replicate)")
    group.add_argument(
        "--replicate-slots-per-rank", type=int, default=None,
        help="s: expert instances each rank runs per MoE layer; every iteration the ranks x s "
        "instances are shared out among the experts by popularity. Default: 4 (the replication "
        "paper's), or twice a rank's EP share of the experts where that is more (fine-grained "
        "models: 32 experts on 4 ranks get 16), so that there are always slots to spare. With "
        "--moe-expert-capacity-factor, an instance takes at most factor x tokens / (ranks x s) "
        "tokens (the rest are dropped); without it nothing is dropped. New flag.",
    )
    group.add_argument(
        "--replicate-offload-optimizer", action="store_true",
        help="Keep the experts' fp32 master weights and Adam state in host memory and step them "
        "there. New flag.",
    )
    group.add_argument(
        "--replicate-policy", type=str, default="adaptive",
        help="adaptive: new replica counts every iteration (DESIGN 4.6); static: every expert keeps "
        "ranks x s / experts instances (DeepSpeed's counts in replicate's balanced layout: each "
        "expert's instances on distinct ranks where the counts allow); periodic: new counts every "
        "--replicate-rebalance-interval iterations, moving optimizer state with the experts "
        "(FlexMoE-style baseline). New flag.",
    )
    group.add_argument(
        "--replicate-rebalance-interval", type=int, default=DEFAULT_REBALANCE_INTERVAL,
        help="With --replicate-policy periodic: iterations between re-placements (10, 50 and 100 in "
        "the comparison). New flag.",
    )


PAPER_SLOTS_PER_RANK = 4
"""The replication paper's slots per GPU (16 experts on 16 GPUs: each expert's EP rank, three to spare)."""


def default_slots_per_rank(experts: int, ranks: int) -> int:
    """--replicate-slots-per-rank when not given: the paper's 4, or twice a rank's EP share of the
    experts where that is more (fine-grained experts): every expert one instance and as many again
    for the popular ones, twice EP's expert memory. With only the EP share (16 experts on 4 ranks
    in 4 slots) no slot is left to replicate into and replicate would be ep (measured: imbalance
    1.41 placed and under EP alike, DeepSeek-V2-Lite tiny)."""
    return max(PAPER_SLOTS_PER_RANK, 2 * -(-experts // ranks))


def validate(args: argparse.Namespace) -> None:
    check_instance_mode(args, "replicate")
    ep, experts = args.expert_model_parallel_size, args.num_experts
    if args.replicate_slots_per_rank is None:
        args.replicate_slots_per_rank = default_slots_per_rank(experts, ep)
    slots = args.replicate_slots_per_rank
    if slots < 1:
        fail("--replicate-slots-per-rank", slots, "must be at least 1")
    if experts > ep * slots:
        fail("--replicate-slots-per-rank", slots,
             f"every expert needs at least one instance: --num-experts={experts} > ranks x slots = {ep} x {slots}; "
             f"valid: >= {-(-experts // ep)}")
    if args.replicate_policy not in POLICIES:
        fail("--replicate-policy", args.replicate_policy, f"valid: {', '.join(POLICIES)}")
    if args.replicate_rebalance_interval < 1:
        fail("--replicate-rebalance-interval", args.replicate_rebalance_interval, "must be at least 1 iteration")
    if args.replicate_policy != "periodic" and args.replicate_rebalance_interval != DEFAULT_REBALANCE_INTERVAL:
        fail("--replicate-rebalance-interval", args.replicate_rebalance_interval,
             f"only applies with --replicate-policy periodic (policy is {args.replicate_policy})")


@dataclass(frozen=True)
class ReplicateConfig:
    """How replicate mode places expert instances (DESIGN 4.6, 4.9)."""

    slots_per_rank: int
    """s: expert instances every rank runs per MoE layer (G x s instances per layer in all)."""
    capacity_factor: float | None
    """Tokens one instance may process = capacity_factor x tokens routed in the layer / (G x s),
    rounded up; the excess is dropped (the token passes through the residual, as in Megatron).
    None = dropless: every instance may take every token."""
    offload_optimizer: bool
    """Keep the experts' fp32 master weights and Adam state in host memory and step there."""
    load_window: int
    """Iterations of popularity averaged for the next placement (1 = the last iteration only)."""
    policy: str
    """adaptive, static or periodic (see `POLICIES`)."""
    rebalance_interval: int
    """periodic only: iterations between re-placements (10, 50, 100 in the FlexMoE comparison)."""
    reduce_in_fp32: bool = False
    """Sum and send replica gradients in fp32 (`--accumulate-allreduce-grads-in-fp32`, always on
    with --bf16, as Megatron's DDP); otherwise in the slots' dtype."""
    load_predictor: str = "adaptive"
    """How popularity is predicted from the last `load_window` iterations: "adaptive" (per layer
    the window among 1, 2, 4, ... that predicted the recent iterations best; with the default
    window of 1 the last iteration) or "mean" (all of them); `placement.loads.LoadTracker`."""
    microbatches: int = 1
    """k, the micro-batches of one iteration on this rank: a layer's slot gradient is complete after
    the k-th backward through it, when its gradient reduce starts."""
    grouped_gemm: bool = False
    """Run the instances a rank computes in one MoE layer pass as one grouped GEMM over their
    weight rows (`--moe-grouped-gemm`; `mode.layer.InstanceMoELayer.run_instances`); Megatron's
    own experts stay SequentialMLP modules, the parameters this mode owns."""

    def __post_init__(self) -> None:
        values = (
            f"slots_per_rank={self.slots_per_rank}, capacity_factor={self.capacity_factor}, load_window={self.load_window}, "
            f"policy={self.policy!r}, rebalance_interval={self.rebalance_interval}"
        )
        if self.slots_per_rank < 1:
            raise ValueError(f"ReplicateConfig: slots_per_rank must be >= 1 ({values})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"ReplicateConfig: capacity_factor must be > 0 or None ({values})")
        if self.load_window < 1:
            raise ValueError(f"ReplicateConfig: load_window must be >= 1 ({values})")
        if self.policy not in POLICIES:
            raise ValueError(f"ReplicateConfig: policy must be one of {POLICIES} ({values})")
        if self.rebalance_interval < 1:
            raise ValueError(f"ReplicateConfig: rebalance_interval must be >= 1 ({values})")

    @classmethod
    def from_args(cls, args) -> "ReplicateConfig":
        return cls(
            slots_per_rank=args.replicate_slots_per_rank,
            capacity_factor=args.moe_expert_capacity_factor,
            offload_optimizer=args.replicate_offload_optimizer,
            load_window=args.moe_load_window,
            policy=args.replicate_policy,
            rebalance_interval=args.replicate_rebalance_interval,
            reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            load_predictor=args.moe_load_predictor,
            microbatches=args.num_micro_batches,
            grouped_gemm=args.moe_grouped_gemm,
        )


def simulated(args, where: str, zp_groups: int) -> tuple[list[str], dict[str, tuple]]:
    """The simulator's system for the run's policy (adaptive replication, static, or FlexMoE's
    periodic rebalance at the run's interval) and its slots per rank."""
    system = {"adaptive": "replicate", "static": "static",
              "periodic": f"flexmoe-{args.replicate_rebalance_interval}"}[args.replicate_policy]
    return [system], {"slots_per_rank": (args.replicate_slots_per_rank, f"{where}: replicate_slots_per_rank")}


MODE = ModeSpec(
    name="replicate",
    summary="adaptive per-iteration expert replication with a decoupled optimizer",
    runtime="megatron_patches.replicate.runtime:ReplicateRuntime",
    add_args=add_args,
    validate=validate,
    default_load_window=DEFAULT_LOAD_WINDOW,
    grouped_gemm_on_instances=True,
    simulated=simulated,
)
