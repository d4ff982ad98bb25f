"""Refusals shared by the modes that place expert instances over Megatron's expert-parallel
group (fssdp, replicate): both route token copies with a subclass of Megatron's all-to-all
dispatcher, copy whole experts (or their ETP shards), reduce the instances' gradients
themselves, and run the instances as one MLP each or as grouped matmuls (`compat.grouped`)."""

from __future__ import annotations

from megatron_patches.config.flags import fail


def check_instance_mode(args, mode: str) -> None:
    """Everything fssdp and replicate refuse alike, before any process group."""
    refusals = (
        ("--expert-model-parallel-size", args.expert_model_parallel_size, args.expert_model_parallel_size < 2,
         f"{mode} places expert instances on the other ranks of the expert-parallel group, so it needs at "
         "least 2 (launch several ranks, e.g. torchrun --nproc-per-node 4); with one rank use "
         "--moe-parallel-mode ep"),
        ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type, args.moe_token_dispatcher_type != "alltoall",
         f"{mode} routes token copies with (a subclass of) the alltoall dispatcher; valid: alltoall"),
        ("--moe-grouped-gemm", True, args.moe_grouped_gemm and args.add_bias_linear,
         f"{mode}'s grouped GEMM runs the experts without biases, as Megatron's GroupedMLP; add "
         "--disable-bias-linear or drop --moe-grouped-gemm"),
        ("--recompute-modules", "moe_act", "moe_act" in (args.recompute_modules or ()),
         f"{mode} does not recompute the experts' activation alone; recompute the whole layer "
         "(--recompute-granularity full) or drop moe_act from --recompute-modules"),
        ("--moe-pad-expert-input-to-capacity", True, args.moe_pad_expert_input_to_capacity,
         f"padding is per expert rank, instances make it per instance; not supported in {mode} mode"),
        ("--recompute-modules", "moe", "moe" in (args.recompute_modules or ()),
         f"{mode}'s MoE layer plans its collectives once per forward; recompute it with the whole layer "
         "(--recompute-granularity full) or drop moe from --recompute-modules"),
    )
    for flag, value, refused, why in refusals:
        if refused:
            fail(flag, value, why)
