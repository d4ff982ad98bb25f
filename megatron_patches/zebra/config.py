"""Zebra mode settings from the command line (`--zebra-*`), validated before any process group.

``add_args(parser)`` adds the flags (the training script's parser, through the mode registry);
``validate(args)`` checks them with the pool (training/validation.py calls it in zebra mode);
``ZebraConfig.from_args(args)`` reads them. Every refusal raises ``ZebraConfigError`` (in
``validate``: config.flags.ArgumentError) naming the flag, the value and what would be valid.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron_patches.config.flags import ArgumentError, fail
from megatron_patches.config.models import moe_layer_numbers, moe_layer_pattern
from megatron_patches.mode.spec import ModeSpec
from megatron_patches.zebra.pools import PoolError, ZebraLayout, pool_cluster, zebra_layout

__all__ = ["ZebraConfig", "ZebraConfigError", "add_args", "validate", "MODE", "parse_asym_ea"]


class ZebraConfigError(ValueError):
    """A --zebra-* value that cannot run; the message names the flag, the value and what is valid."""


def parse_asym_ea(value) -> str | tuple[int, ...]:
    """--zebra-asym-ea: "auto", "off", or chunks per layer ("0,1,1,0" or a sequence of ints >= 0)."""
    if isinstance(value, str):
        text = value.strip()
        if text in ("auto", "off"):
            return text
        try:
            chunks = tuple(int(item) for item in text.split(","))
        except ValueError:
            raise ZebraConfigError(
                f"--zebra-asym-ea={value!r} is invalid; valid: auto, off, or comma-separated chunks per "
                "layer such as 0,1,1,0"
            ) from None
    else:
        chunks = tuple(value)
        if any(isinstance(c, bool) or not isinstance(c, int) for c in chunks):
            raise ZebraConfigError(f"--zebra-asym-ea={value!r} is invalid; list entries must be integers")
    negative = [c for c in chunks if c < 0]
    if negative or not chunks:
        raise ZebraConfigError(
            f"--zebra-asym-ea={value!r} is invalid; chunks per layer must be integers >= 0, one per layer"
        )
    return chunks


@dataclass(frozen=True)
class ZebraConfig:
    """How a zebra run splits each ZP group and schedules micro-batches (DESIGN 4.7, 4.8)."""

    attention_ranks: int
    """M (--zebra-attention-ranks): ranks per ZP group that run embeddings, attention, gate, norms
    and the head (data-parallel over all attention ranks of all ZP groups)."""
    expert_ranks: int
    """N (--zebra-expert-ranks): ranks per ZP group that hold the experts of every layer
    (expert-parallel inside the group); must divide the experts per layer."""
    microbatches: int
    """R (--zebra-microbatches): micro-batches per attention rank and iteration; they zig-zag
    between attention and expert ranks so that both compute at once."""
    asym_ea: str | tuple[int, ...] = "off"
    """--zebra-asym-ea: "off", "auto" (gather and squeeze from --zebra-profile), or the chunks of
    experts each layer moves from the expert ranks to the attention ranks."""
    profile: str | None = None
    """--zebra-profile: the profile file of tools/profile_moe.py (needed by auto; with off or a
    list its memory bounds are checked)."""
    timeline: str | None = None
    """--zebra-timeline: JSON file that receives every task's start and end per rank and stream
    (tools/plot_timeline.py draws it); None records nothing."""
    replan_interval: int = 0
    """--zebra-replan-interval K: every K iterations, re-plan Asym-EA from the routed loads measured
    over those K iterations and the profile (placement/zebra/replan.py), and move the experts whose
    owner changes when the predicted gain over the next K iterations exceeds the move's time;
    0 never re-plans (the plan of --zebra-asym-ea holds for the run)."""
    cluster: str | None = None
    """--zebra-cluster: the cluster config (name under configs/clusters or a YAML path) whose
    node groups are the pools (attention GPU type first); None = this machine, one pool of
    identical devices (``zebra.pools.local_pool``)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--zebra-attention-ranks", self.attention_ranks),
            ("--zebra-expert-ranks", self.expert_ranks),
            ("--zebra-microbatches", self.microbatches),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ZebraConfigError(f"{flag}={value!r} is invalid; expected an integer >= 1")
        if isinstance(self.replan_interval, bool) or not isinstance(self.replan_interval, int) or self.replan_interval < 0:
            raise ZebraConfigError(f"--zebra-replan-interval={self.replan_interval!r} is invalid; expected an integer >= 0 "
                                   "(0: never re-plan)")
        if self.replan_interval and self.profile is None:
            raise ZebraConfigError(
                f"--zebra-replan-interval={self.replan_interval} needs --zebra-profile FILE (tools/profile_moe.py writes "
                "it): the re-plan prices each expert's measured load with the profiled per-expert times"
            )
        object.__setattr__(self, "asym_ea", parse_asym_ea(self.asym_ea))
        if self.asym_ea == "auto" and self.profile is None:
            raise ZebraConfigError(
                "--zebra-asym-ea=auto needs --zebra-profile FILE (tools/profile_moe.py writes it); "
                "or give the chunks per layer, or off"
            )
        if self.profile is not None and not os.path.isfile(self.profile):
            raise ZebraConfigError(f"--zebra-profile={self.profile!r}: no such file")
        if self.timeline is not None:
            folder = os.path.dirname(os.path.abspath(self.timeline))
            if not os.path.isdir(folder):
                raise ZebraConfigError(f"--zebra-timeline={self.timeline!r}: the folder {folder} does not exist")

    @property
    def group_size(self) -> int:
        """M + N: ranks per ZP group."""
        return self.attention_ranks + self.expert_ranks

    def layout(self, world_size: int, num_layers: int, num_experts: int) -> ZebraLayout:
        """The ZP layout of this pool for a model of ``num_layers`` MoE layers (zebra.pools.zebra_layout;
        raises PoolError)."""
        return zebra_layout(pool_cluster(self.cluster, world_size), self.attention_ranks, self.expert_ranks, world_size,
                            num_layers=num_layers, num_experts=num_experts, asym_ea=self.asym_ea, profile=self.profile,
                            replan=self.replan_interval > 0)

    @classmethod
    def from_args(cls, args) -> "ZebraConfig":
        return cls(
            attention_ranks=args.zebra_attention_ranks,
            expert_ranks=args.zebra_expert_ranks,
            microbatches=args.zebra_microbatches,
            asym_ea=args.zebra_asym_ea,
            profile=args.zebra_profile,
            timeline=args.zebra_timeline,
            replan_interval=args.zebra_replan_interval,
            cluster=args.zebra_cluster,
        )


def add_args(parser: argparse.ArgumentParser) -> None:
    """The --zebra-* flags (the training script's parser adds them through the mode registry)."""
    group = parser.add_argument_group(title="zebra (--moe-parallel-mode zebra)")
    group.add_argument(
        "--zebra-attention-ranks", type=int, default=None,
        help="M: attention ranks per ZP group (embeddings, attention, gate, norms, head; data-parallel "
        "over all attention ranks). The first M ranks of every group of M + N consecutive ranks. New flag.",
    )
    group.add_argument(
        "--zebra-expert-ranks", type=int, default=None,
        help="N: expert ranks per ZP group (the experts of every layer, expert-parallel); must divide "
        "--num-experts. New flag.",
    )
    group.add_argument(
        "--zebra-microbatches", type=int, default=None,
        help="R: micro-batches per attention rank and iteration, zig-zagging between attention and "
        "expert ranks. New flag.",
    )
    group.add_argument(
        "--zebra-asym-ea", type=str, default="off",
        help="Asymmetric expert assignment: off, auto (gather and squeeze from --zebra-profile), or "
        "the chunks of experts per layer moved to the attention ranks, e.g. 0,1. Needs M | N or "
        "N | M unless off. New flag.",
    )
    group.add_argument(
        "--zebra-profile", type=str, default=None,
        help="Profile file of tools/profile_moe.py (one entry per GPU type); needed by "
        "--zebra-asym-ea auto, checked against the memory bounds otherwise. New flag.",
    )
    group.add_argument(
        "--zebra-replan-interval", type=int, default=0,
        help="Re-plan Asym-EA every K iterations from the routed loads measured over them and "
        "--zebra-profile: the hot experts move to the attention ranks when the predicted gain over "
        "the next K iterations exceeds the time to move their weights and Adam state. 0: never. "
        "Needs --zebra-profile and M | N or N | M. New flag.",
    )
    group.add_argument(
        "--zebra-cluster", type=str, default=None,
        help="Cluster config of the pool (a name under configs/clusters, e.g. zebra_o1, or a YAML "
        "path): its node groups give each rank's GPU type (attention type first), checked against "
        "the roles and looked up in --zebra-profile. Default: this machine as one pool of identical "
        "devices (configs/clusters/local_cpu.yaml widened to the world size). New flag.",
    )
    group.add_argument(
        "--zebra-timeline", type=str, default=None,
        help="Write every task's start and end per rank and stream of the last iteration to this "
        "JSON file (tools/plot_timeline.py draws it). New flag.",
    )


GLOBAL_AUX_LOSS = ("with global_aux_loss Megatron-Core 0.16.1 all-reduces the token counts over its data-parallel group (router.py _apply_global_aux_loss: tp_dp_cp), which in zebra holds the expert ranks, and they run no router: the all-reduce would never complete; valid: aux_loss or seq_aux_loss")
"""Why zebra refuses the global auxiliary loss (the flags' validation and the engine's check)."""


MTP_DENSE = ("zebra runs each MTP layer as one more MoE layer of its schedule, and an MTP layer repeats the "
             "decoder's last layer, which is dense here (--moe-layer-freq); valid: an MoE last layer")
"""Why zebra refuses MTP after a dense last layer (the flags' validation and the engine's check)."""


def recompute_refusals(granularity: str | None, method: str | None, num_layers: int | None,
                       modules: list[str]) -> tuple[tuple[str, object, bool, str], ...]:
    """(flag, value, refused, why) of the recompute settings zebra cannot honour, for the flags'
    validation and the engine's own check alike: full recompute checkpoints each layer's
    segments apart, selective recompute only reaches the attention module's own."""
    return (
        ("--recompute-num-layers", num_layers, granularity == "full" and method == "uniform" and num_layers != 1,
         "with --recompute-method uniform zebra checkpoints each layer's attention and expert segments apart (the "
         "all-to-alls sit between them); valid: 1, or --recompute-method block N (the first N layers)"),
        ("--recompute-modules", " ".join(modules), granularity == "selective" and bool(set(modules) - {"core_attn"}),
         "zebra's schedule calls the layer's modules itself, so only the attention module's own recompute applies; "
         "valid: core_attn"),
    )


def validate(args: argparse.Namespace) -> None:
    """Zebra: every refusal before any process group, including the pool checks of
    zebra.pools.zebra_layout (world divisible by M + N, experts by N, Asym-EA shape, GPU types,
    profile memory bounds); the data-parallel size becomes the number of attention ranks."""
    for flag, dest in (("--zebra-attention-ranks", "zebra_attention_ranks"), ("--zebra-expert-ranks", "zebra_expert_ranks"),
                       ("--zebra-microbatches", "zebra_microbatches")):
        if getattr(args, dest) is None:
            fail(flag, None, "required with --moe-parallel-mode zebra (an integer >= 1)")
    why_whole_model = "zebra builds the whole model on every rank and splits it by role; valid: 1"
    refusals = (
        ("--model-family", args.model_family, args.model_family != "gpt", "zebra mode trains GPT models; valid: gpt"),
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size, args.tensor_model_parallel_size != 1,
         why_whole_model),
        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size, args.pipeline_model_parallel_size != 1,
         why_whole_model),
        ("--expert-model-parallel-size", args.expert_model_parallel_size, args.expert_model_parallel_size != 1,
         "zebra's expert parallelism is --zebra-expert-ranks (the experts of a ZP group are spread over its N "
         "expert ranks); valid: 1"),
        ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size, args.expert_tensor_parallel_size != 1,
         why_whole_model),
        ("--moe-router-load-balancing-type", args.moe_router_load_balancing_type,
         args.moe_aux_loss_coeff != 0 and args.moe_router_load_balancing_type == "global_aux_loss", GLOBAL_AUX_LOSS),
        ("--moe-grouped-gemm", True, args.moe_grouped_gemm, "zebra runs each expert's MLP module; drop it"),
        ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type, args.moe_token_dispatcher_type != "alltoall",
         "zebra runs its own bipartite all-to-all between attention and expert ranks; valid: alltoall (the default)"),
        *recompute_refusals(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                            args.recompute_modules or ["core_attn"]),
        ("--use-distributed-optimizer", True, args.use_distributed_optimizer,
         "zebra has its own optimizer (AdamW over each rank's own parameters); drop it"),
        ("--overlap-grad-reduce", True, args.overlap_grad_reduce, "zebra reduces gradients after its schedule; drop it"),
        ("--overlap-param-gather", True, args.overlap_param_gather, "not supported in zebra mode"),
        ("--mtp-num-layers", args.mtp_num_layers,
         bool(args.mtp_num_layers) and not moe_layer_pattern(args.moe_layer_freq, args.num_layers)[-1], MTP_DENSE),
        ("--moe-shared-expert-overlap", True, args.moe_shared_expert_overlap,
         "zebra runs the shared expert on the attention ranks inside their attention task, where other "
         "micro-batches' expert round trips overlap it; Megatron's overlap (a side stream of its all-to-all "
         "dispatcher, which zebra does not use) has nothing to act on; drop it"),
    )
    for flag, value, refused, why in refusals:
        if refused:
            fail(flag, value, why)
    try:
        config = ZebraConfig.from_args(args)
        layout = config.layout(args.world_size,
                               len(moe_layer_numbers(args.moe_layer_freq, args.num_layers, args.mtp_num_layers)),
                               args.num_experts)
    except (ZebraConfigError, PoolError) as err:
        raise ArgumentError(str(err)) from None
    # Only attention ranks read data: one global batch = micro batch x R x attention ranks.
    args.data_parallel_size = len(layout.attention_dp_group)
    expected = args.micro_batch_size * config.microbatches * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = expected
    if args.global_batch_size != expected:
        fail("--global-batch-size", args.global_batch_size,
             f"zebra runs --zebra-microbatches={config.microbatches} micro-batches of --micro-batch-size="
             f"{args.micro_batch_size} on each of its {args.data_parallel_size} attention ranks; valid: {expected} "
             "(or leave it unset)")


def simulated(args, where: str, zp_groups: int) -> tuple[list[str], dict[str, tuple]]:
    """The simulator's zebra system (with Asym-EA when the run asks for it) over one ZP group."""
    if zp_groups != 1:
        raise ValueError(f"{zp_groups} ZP groups; the simulator models one (every attention GPU and every expert GPU "
                         "of the pool in one group)")
    settings = {"zebra_microbatches": (args.zebra_microbatches, f"{where}: zebra_microbatches, "
                                       f"{args.zebra_attention_ranks} attention + {args.zebra_expert_ranks} expert ranks")}
    return ["zebra" if args.zebra_asym_ea == "off" else "zebra-asym"], settings


def model_state_shares(args, component_ranks: list[int], zp_groups: int, dense: float,
                       experts: float) -> list[tuple[float, int, float, int] | None]:
    """Non-expert parameters on every attention rank (component 0), the experts over the expert
    ranks of a ZP group (component 1); under Asym-EA the expert ranks' share is decided at start-up."""
    attention = (dense, 1, 0.0, 1)
    expert = None if args.zebra_asym_ea != "off" else (0.0, 1, experts / (component_ranks[1] // zp_groups), 1)
    return [attention, expert]


def zp_groups(args, component_ranks: list[int]) -> int:
    """ZP groups G of a zebra hetjob: component 0 = G x M attention ranks, component 1 = G x N expert ranks."""
    if len(component_ranks) != 2:
        raise ZebraConfigError(f"mode zebra needs a cluster with two node groups (attention GPUs first, then expert "
                               f"GPUs); this one has {len(component_ranks)}")
    attention, expert = component_ranks
    m = getattr(args, "zebra_attention_ranks", None) or attention
    n = getattr(args, "zebra_expert_ranks", None) or expert
    if attention % m != 0:
        raise ZebraConfigError(f"--zebra-attention-ranks={m} does not divide the {attention} attention ranks "
                               f"(component 0); valid: divisors of {attention}")
    groups = attention // m
    if expert != groups * n:
        raise ZebraConfigError(f"--zebra-expert-ranks={n}: {groups} ZP group(s) of {m} attention rank(s) need "
                               f"{groups} x {n} = {groups * n} expert ranks, but component 1 has {expert}; valid: "
                               f"{expert // groups if expert % groups == 0 else 'none (change the node counts)'}")
    return groups


def parallelism_line(args, world_size: int) -> str:
    """Zebra's split is by role, not Megatron's TP x PP x DP grid."""
    m, n = args.zebra_attention_ranks, args.zebra_expert_ranks
    moved = "" if str(args.zebra_asym_ea).strip() == "off" else " before Asym-EA moves some"
    return (f"# Zebra: world {world_size} = {world_size // (m + n)} ZP group(s) x ({m} attention + {n} "
            f"expert ranks); attention ranks data-parallel (DP {args.data_parallel_size}), each expert rank holds "
            f"{args.num_experts // n} of the {args.num_experts} experts of every layer{moved}; global batch "
            f"{args.global_batch_size} = {args.zebra_microbatches} micro-batches x {args.micro_batch_size} x "
            f"{args.data_parallel_size} attention ranks.")


def launch_flags(cluster_reference: str) -> list[tuple[str, str, str]]:
    """Zebra's pool checks (attention ranks on the faster GPU type, devices per role) and its
    profile lookup (by GPU type) read the cluster the job runs on; without the flag training would
    assume one local pool of identical devices."""
    return [("zebra_cluster", "--zebra-cluster", cluster_reference)]


MODE = ModeSpec(
    name="zebra",
    summary="attention/expert disaggregation over a pool of mixed GPU generations",
    runtime="megatron_patches.zebra.runtime:ZebraRuntime",
    add_args=add_args,
    validate=validate,
    default_expert_parallel_size=1,  # the whole model on every rank; zebra's own EP is --zebra-expert-ranks
    simulated=simulated,
    launch_flags=launch_flags,
    model_state_shares=model_state_shares,
    component_roles=("attention pool", "expert pool"),
    replica_groups=zp_groups,
    parallelism_line=parallelism_line,
)
