"""What a run sets beyond the model's shape: the parallel layout and the run settings that
Megatron's TransformerConfig needs (dropout, initialisation, router and dispatcher, precision).

One source for these values: the training script's parser takes its defaults from
`RunSettings` (training/arguments.py), validated flags become both dataclasses (`from_args`),
and the profiler builds them directly (`ParallelConfig()` is the single-rank layout it
measures on), so `compat.mcore.transformer_config(model, parallel, run, on_gpu)` sees the same
values whichever way a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


def router_pre_softmax(requested: bool, topk: int) -> bool:
    """Megatron-Core refuses top-1 routing without pre-softmax routing (a softmax over one selected
    expert is always 1, so the router would get no gradient): top-1 switches it on."""
    return requested or topk == 1


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron's parallel sizes (DP is what remains of the world)."""

    tensor_model_parallel_size: int = 1
    """TP (`--tensor-model-parallel-size`)."""
    pipeline_model_parallel_size: int = 1
    """PP (`--pipeline-model-parallel-size`)."""
    expert_model_parallel_size: int = 1
    """EP (`--expert-model-parallel-size`, resolved by validation)."""
    expert_tensor_parallel_size: int = 1
    """ETP (`--expert-tensor-parallel-size`, resolved to TP by default)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (`--sequence-parallel`; off with TP 1)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (derived from `--num-layers-per-virtual-pipeline-stage` or
    `--num-virtual-stages-per-pipeline-rank`); None: one chunk, the plain 1F1B schedule."""
    microbatch_group_size_per_vp_stage: int | None = None
    """`--microbatch-group-size-per-virtual-pipeline-stage` (None: PP, Megatron-Core's default)."""
    overlap_p2p_comm: bool = True
    """`--no-overlap-p2p-communication` clears it; only the interleaved schedule reads it (without
    virtual stages the schedule batches its sends and receives, as Megatron-LM sets)."""

    @classmethod
    def from_args(cls, args) -> "ParallelConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class RunSettings:
    """Run-level values of Megatron's TransformerConfig; the defaults are the training flags'."""

    hidden_dropout: float = 0.1
    """`--hidden-dropout`."""
    attention_dropout: float = 0.1
    """`--attention-dropout`."""
    init_method_std: float = 0.02
    """`--init-method-std`."""
    use_cpu_initialization: bool | None = None
    """`--use-cpu-initialization` (Megatron-LM's default None means off): build the weights on the host from the CPU generator, as every
    CPU run does; on GPU this gives a CPU run's initial weights for the same seed."""
    moe_router_pre_softmax: bool = False
    """`--moe-router-pre-softmax` (see `router_pre_softmax`)."""
    moe_aux_loss_coeff: float = 0.0
    """`--moe-aux-loss-coeff`."""
    moe_router_load_balancing_type: str = "aux_loss"
    """`--moe-router-load-balancing-type`."""
    moe_router_bias_update_rate: float = 1e-3
    """`--moe-router-bias-update-rate`: the expert bias's step per iteration (the bias itself, and the
    router's other architecture fields, are the model's: config.models.ModelConfig)."""
    moe_router_dtype: str | None = None
    """`--moe-router-dtype`: fp32 or fp64 for routing and the weighted combine; None keeps the model's."""
    moe_z_loss_coeff: float | None = None
    """`--moe-z-loss-coeff`: the router z-loss's coefficient (ST-MoE)."""
    moe_input_jitter_eps: float | None = None
    """`--moe-input-jitter-eps`: multiplicative uniform noise on the router's input while training."""
    moe_token_drop_policy: str = "probs"
    """`--moe-token-drop-policy`: with a capacity factor, drop the lowest-probability tokens
    (probs) or the last ones (position)."""
    moe_token_dispatcher_type: str = "alltoall"
    """`--moe-token-dispatcher-type` (Megatron-LM's default is allgather; see the flag's help)."""
    moe_pad_expert_input_to_capacity: bool = False
    """`--moe-pad-expert-input-to-capacity`."""
    moe_grouped_gemm: bool = False
    """`--moe-grouped-gemm`."""
    bf16: bool = False
    """`--bf16`."""
    fp16: bool = False
    """`--fp16`."""
    attention_softmax_in_fp32: bool = False
    """`--attention-softmax-in-fp32`: the attention softmax of a half-precision model in fp32
    (Megatron-LM's default is off; Megatron-Core's TransformerConfig would default it on)."""
    masked_softmax_fusion: bool = True
    """`--no-masked-softmax-fusion` (False): GPU only, where the fused kernels import."""
    bias_swiglu_fusion: bool = True
    """`--no-bias-swiglu-fusion` (False): GPU only, SwiGLU MLPs."""
    bias_dropout_fusion: bool = True
    """`--no-bias-dropout-fusion` (False): GPU only."""
    attention_backend: str = "auto"
    """`--attention-backend` (an AttnBackend name): GPU only."""
    cross_entropy_loss_fusion: bool = False
    """`--cross-entropy-loss-fusion`: GPU only."""
    cross_entropy_fusion_impl: str = "native"
    """`--cross-entropy-fusion-impl`: native or te."""
    moe_permute_fusion: bool = False
    """`--moe-permute-fusion`: GPU only, Transformer Engine's permutation (ep)."""
    moe_router_fusion: bool = False
    """`--moe-router-fusion`: GPU only, Transformer Engine's fused top-k and aux loss."""
    moe_shared_expert_overlap: bool = False
    """`--moe-shared-expert-overlap`: GPU only, the shared expert on a side stream during the dispatch."""
    deterministic_mode: bool = False
    """`--deterministic-mode`: GPU only (CPU runs are bit-identical anyway)."""
    mtp_loss_scaling_factor: float = 0.1
    """`--mtp-loss-scaling-factor`: the multi-token-prediction loss's weight (the mean over MTP layers)."""
    recompute_granularity: str | None = None
    """`--recompute-granularity`: None (keep every activation), `full` (keep only each
    recomputed layer's input and run its forward again in the backward) or `selective` (recompute
    the `--recompute-modules` inside each layer)."""
    recompute_method: str | None = None
    """`--recompute-method` (`full` only): `uniform` (checkpoint chunks of
    `--recompute-num-layers` layers) or `block` (the first `--recompute-num-layers` layers of each
    pipeline stage)."""
    recompute_num_layers: int | None = None
    """`--recompute-num-layers` (`full` only)."""
    recompute_modules: tuple[str, ...] | None = None
    """`--recompute-modules` (`selective` only; Megatron-Core's default: core_attn)."""

    @classmethod
    def from_args(cls, args) -> "RunSettings":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


RUN_DEFAULTS = RunSettings()
"""The defaults the training script's parser uses for these flags."""
