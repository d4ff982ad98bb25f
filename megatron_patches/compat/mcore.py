"""Every version-sensitive touch point into Megatron-Core, in one module.

The rest of the project talks to Megatron-Core through these functions (plus the stable
public names `parallel_state` and the model classes' attributes). When megatron-core is
upgraded, this file, `cpu.py` and `fixes.py` are what must be re-verified; `check_version`
refuses any version other than the pinned one so that this can never happen silently.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import queue
import threading
from typing import Callable

import torch

import megatron.core
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    LNImpl,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import checkpoint as _checkpoint
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import Float16Module, param_is_not_shared
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as moe_router
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_patches.compat import fixes
from megatron_patches.config.models import moe_layer_pattern
from megatron_patches.config.run import ParallelConfig, RunSettings

MEGATRON_CORE_VERSION = "0.16.1"


def check_version() -> None:
    found = megatron.core.__version__
    if found != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"megatron-core {found} is installed, but megatron_patches is pinned to and verified "
            f"against megatron-core=={MEGATRON_CORE_VERSION} (compat/cpu.py, compat/fixes.py and "
            f"compat/mcore.py patch its internals); install megatron-core=={MEGATRON_CORE_VERSION}"
        )


def jit_fuser_kind() -> str:
    """How megatron/core/jit.py's `jit_fuser` decorates: "eager" (its noop_decorator: on CPU,
    compat.cpu.import_megatron_with_eager_fusers) or "torch.compile" (Megatron's default)."""
    from megatron.core import jit

    return "eager" if jit.jit_fuser is jit.noop_decorator else "torch.compile"


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------
# Parallel state and RNG
# ----------------------------------------------------------------------------------------


def initialize_model_parallel(tp: int, pp: int, ep: int, etp: int, vp: int | None = None) -> None:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def seed_model_parallel_rng(seed: int) -> None:
    """Megatron's named RNG states (data-, tensor- and expert-parallel) from one seed."""
    model_parallel_cuda_manual_seed(seed)


# ----------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------


FUSED_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")
"""The CUDA extensions of Megatron's fused masked softmax (fusions/fused_softmax.py:31-131): built
by Megatron-LM's or Apex's compilation, not shipped in the megatron-core wheel."""


def fused_softmax_kernels() -> bool:
    """Whether Megatron's fused softmax kernels can be imported. Without them a GPU run with
    masked_softmax_fusion on fails at its first half-precision attention (ModuleNotFoundError,
    seen on an H200 with the plain wheel), so the fusion is asked for only where they exist;
    Megatron's torch softmax computes the same values otherwise."""
    return all(importlib.util.find_spec(name) is not None for name in FUSED_SOFTMAX_MODULES)

def transformer_config(model, parallel: ParallelConfig, run: RunSettings, on_gpu: bool) -> TransformerConfig:
    """Megatron's TransformerConfig (its field names are version-specific).

    `model` is the model's shape under Megatron-LM's flag names: a config.models.ModelConfig, or
    the validated training namespace (the same names); `parallel` and `run` the rest
    (config/run.py)."""
    dtype = torch.bfloat16 if run.bf16 else torch.float16 if run.fp16 else torch.float32
    freq = model.moe_layer_freq
    overlap_p2p = parallel.overlap_p2p_comm and parallel.virtual_pipeline_model_parallel_size is not None
    config_class, mla = TransformerConfig, {}
    if model.multi_latent_attention:
        # Megatron-LM's core_transformer_config_from_args: MLATransformerConfig takes the MLA flags
        # and the rotary ones; rope_type None keeps MLA's default (yarn)
        config_class = MLATransformerConfig
        mla = dict(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
                   qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
                   rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
                   rotary_scaling_factor=model.rotary_scaling_factor, mscale=model.mscale,
                   mscale_all_dim=model.mscale_all_dim, **({"rope_type": model.rope_type} if model.rope_type else {}))
    return config_class(
        **mla,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        hidden_dropout=run.hidden_dropout,
        attention_dropout=run.attention_dropout,
        init_method_std=run.init_method_std,
        kv_channels=model.kv_channels,
        num_query_groups=model.num_query_groups if model.group_query_attention else None,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        qk_layernorm=model.qk_layernorm,
        add_qkv_bias=model.add_qkv_bias,
        rotary_interleaved=model.rotary_interleaved,
        gated_linear_unit=model.swiglu,
        activation_func=torch.nn.functional.silu if model.swiglu else torch.nn.functional.gelu,
        moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
        add_bias_linear=model.add_bias_linear,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=parallel.microbatch_group_size_per_vp_stage,
        # Megatron-LM's core_transformer_config_from_args: batched sends unless they overlap, and
        # overlap only in the interleaved schedule
        overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p,
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_router_pre_softmax=run.moe_router_pre_softmax,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_aux_loss_coeff=run.moe_aux_loss_coeff,
        moe_router_load_balancing_type=run.moe_router_load_balancing_type,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=run.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_router_dtype=run.moe_router_dtype,
        moe_z_loss_coeff=run.moe_z_loss_coeff,
        moe_input_jitter_eps=run.moe_input_jitter_eps,
        moe_token_drop_policy=run.moe_token_drop_policy,
        moe_token_dispatcher_type=run.moe_token_dispatcher_type,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=model.moe_shared_expert_gate,
        mtp_num_layers=model.mtp_num_layers,
        mtp_loss_scaling_factor=run.mtp_loss_scaling_factor,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=run.moe_pad_expert_input_to_capacity,
        moe_grouped_gemm=run.moe_grouped_gemm,
        bf16=run.bf16,
        fp16=run.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # CPU: initialise on the host (on GPU too with --use-cpu-initialization); the fused
        # kernels below need Apex/TE/CUDA.
        use_cpu_initialization=not on_gpu or bool(run.use_cpu_initialization),
        gradient_accumulation_fusion=False,
        # the experts' fused bias + activation with their per-token probabilities exists only for
        # gated SiLU / quick-GELU (transformer/mlp.py:171-193 raises for plain GELU: seen on an H200)
        bias_activation_fusion=on_gpu and model.swiglu and run.bias_swiglu_fusion,
        bias_dropout_fusion=on_gpu and run.bias_dropout_fusion,
        masked_softmax_fusion=on_gpu and fused_softmax_kernels() and run.masked_softmax_fusion,
        # the other GPU kernel choices (config/run.py); on CPU validation lists them instead
        **({"attention_backend": AttnBackend[run.attention_backend], "cross_entropy_loss_fusion": run.cross_entropy_loss_fusion,
            "cross_entropy_fusion_impl": run.cross_entropy_fusion_impl, "moe_permute_fusion": run.moe_permute_fusion,
            "moe_router_fusion": run.moe_router_fusion, "deterministic_mode": run.deterministic_mode,
            "moe_shared_expert_overlap": run.moe_shared_expert_overlap} if on_gpu else {}),
        persist_layer_norm=False,  # needs Apex's FusedLayerNorm (Megatron-LM: --no-persist-layer-norm)
        apply_rope_fusion=False,
        attention_softmax_in_fp32=run.attention_softmax_in_fp32,
        recompute_granularity=run.recompute_granularity,
        recompute_method=run.recompute_method,
        recompute_num_layers=run.recompute_num_layers,
        recompute_modules=list(run.recompute_modules) if run.recompute_modules else None,
        # 0.16.1's default "full" is deprecated by its own __post_init__ (a warning per config
        # built); the empty list means the same (a whole layer) and only matters with CUDA graphs
        cuda_graph_scope=[],
    )


class SeedIsolatedSequentialMLP(SequentialMLP):
    """Megatron's SequentialMLP whose construction leaves the CPU default generator untouched.

    With use_cpu_initialization (every CPU run) Megatron draws each linear's initial weight from
    the default generator, experts included, so every weight built after an MoE layer's experts
    (the next layer's attention, router, ...) would depend on how many experts this rank builds,
    i.e. on EP. The experts are re-initialised from (seed, layer, global expert id) anyway
    (training.model.init_experts_from_global_ids), so their construction runs on a forked
    generator: the non-expert weights are then the same for every EP and mode (zebra builds
    EP = 1). On GPU Megatron already draws experts from the expert-parallel RNG tracker."""

    def __init__(self, *args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            super().__init__(*args, **kwargs)


def _seed_isolated_experts(moe_layer_spec: ModuleSpec) -> ModuleSpec:
    mlp = moe_layer_spec.submodules.mlp
    experts = mlp.submodules.experts
    if experts.module is not SequentialMLP:
        return moe_layer_spec  # grouped-GEMM experts: GPU only, drawn from the expert RNG tracker
    experts = dataclasses.replace(experts, module=SeedIsolatedSequentialMLP)
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts))
    return dataclasses.replace(moe_layer_spec, submodules=dataclasses.replace(moe_layer_spec.submodules, mlp=mlp))


class LatentDotProductAttention(DotProductAttention):
    """Megatron's local DotProductAttention for multi-latent attention, whose heads are wider for
    queries and keys (qk_head_dim + qk_pos_emb_head_dim) than for values (v_head_dim).

    MLASelfAttention builds its core attention with `k_channels` and `v_channels`
    (multi_latent_attention.py:155-166), which only TEDotProductAttention takes; the local class
    computes the same scores (the softmax scale comes from MLA) and sizes its output from
    kv_channels x heads (dot_product_attention.py:65-78). Here the output width is v_channels x
    heads, so MLA runs without Transformer Engine (on CPU). Attention's base class first builds
    the core attention once without either argument (attention.py:318) and MLA replaces it."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def _latent_attention_core(layer_spec: ModuleSpec) -> ModuleSpec:
    attention = layer_spec.submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=LatentDotProductAttention))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention))


def layer_specs(family: str, config: TransformerConfig, use_te: bool) -> tuple[ModuleSpec, ModuleSpec]:
    """(dense layer spec, MoE layer spec) of one transformer layer.

    GPT: Megatron's own GPT layer specs (TE on GPU when available, local modules otherwise;
    multi-latent attention on local modules through LatentDotProductAttention).
    BERT: Megatron's BERT local layer spec (padding attention mask) with the MLP taken from
    the GPT spec of the same kind (dense MLP or Megatron's MoE block).
    """
    attention = dict(qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention)
    kwargs = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    if use_te:
        dense = get_gpt_layer_with_transformer_engine_spec(**attention)
        moe = get_gpt_layer_with_transformer_engine_spec(**attention, **kwargs)
    else:
        dense = get_gpt_layer_local_spec(normalization=config.normalization, **attention)
        moe = get_gpt_layer_local_spec(normalization=config.normalization, **attention, **kwargs)
        if config.multi_latent_attention:
            dense, moe = _latent_attention_core(dense), _latent_attention_core(moe)
    moe = _seed_isolated_experts(moe)
    if family == "gpt":
        return dense, moe

    def bert_with_mlp_of(spec: ModuleSpec) -> ModuleSpec:
        submodules = dataclasses.replace(bert_layer_local_spec.submodules, mlp=spec.submodules.mlp)
        return dataclasses.replace(bert_layer_local_spec, submodules=submodules)

    return bert_with_mlp_of(dense), bert_with_mlp_of(moe)


def block_spec(config: TransformerConfig, dense: ModuleSpec, moe: ModuleSpec, use_te: bool,
               vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (of its virtual stage `vp_stage`): MoE where the pattern
    says so, dense elsewhere."""
    specs = [moe if is_moe else dense for is_moe in moe_layer_pattern(config.moe_layer_freq, config.num_layers)]
    offset = get_transformer_layer_offset(config, vp_stage)
    local = specs[offset : offset + get_num_layers_to_build(config, vp_stage)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=local, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=LNImpl)


def language_model(args, config: TransformerConfig, spec, vocab_size: int, pre_process: bool, post_process: bool,
                   mtp_layer_spec: ModuleSpec | None = None, use_te: bool = False, vp_stage: int | None = None):
    """GPTModel or BertModel of this stage (of its virtual stage `vp_stage`; BertModel has none).
    `mtp_layer_spec`: the decoder's last layer's spec, which each multi-token-prediction layer
    repeats (Megatron-LM's gpt_builders.py), with --mtp-num-layers: built on the last stage's
    last virtual stage only."""
    common = dict(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    if args.model_family == "gpt":
        mtp = (get_gpt_mtp_block_spec(config, mtp_layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage)
               if config.mtp_num_layers else None)
        return GPTModel(rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
                        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor, mtp_block_spec=mtp,
                        vp_stage=vp_stage, **common)
    return BertModel(num_tokentypes=2 if args.bert_binary_head else 0, add_binary_head=args.bert_binary_head, **common)


def half_precision(config: TransformerConfig, model):
    """The model as Megatron-LM's get_model wraps it for --bf16/--fp16: Megatron's Float16Module
    casts every parameter and buffer (embeddings included) to the compute dtype, casts the first
    stage's inputs to it and the last stage's outputs back to fp32. The model unchanged in fp32.

    The cast is in place, so module references taken from `model` stay valid."""
    if not (config.bf16 or config.fp16):
        return model
    return Float16Module(config, model)


def unwrap(chunk):
    """The GPT/BERT model inside Megatron's DDP and Float16Module wrappers."""
    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def virtual_stages() -> list[int | None]:
    """The virtual pipeline stages of this rank, one per model chunk: [None] without virtual
    pipeline parallelism, else 0 .. VP - 1."""
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return [None] if vp is None else list(range(vp))


def pipeline_stage_flags(vp_stage: int | None = None) -> tuple[bool, bool]:
    """(pre_process, post_process) of the chunk of virtual stage `vp_stage` (None: the rank's one
    chunk): whether it holds the embedding and the output layer."""
    virtual = vp_stage is None
    return (
        parallel_state.is_pipeline_first_stage(ignore_virtual=virtual, vp_stage=vp_stage),
        parallel_state.is_pipeline_last_stage(ignore_virtual=virtual, vp_stage=vp_stage),
    )


def every_stage(items: list) -> list:
    """`items` of every pipeline stage, in stage order: this rank's concatenated with those of the
    ranks that hold the other stages of its model replica (a collective over Megatron's pipeline
    group; `items` as is without pipeline parallelism)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return items
    stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(stages, items, group=parallel_state.get_pipeline_model_parallel_group())
    return [item for stage in stages for item in stage]


def transformer_layers(model) -> list:
    """The TransformerLayer modules of an (unwrapped) GPT/BERT model on this stage: the decoder's
    (BERT: encoder's), then the multi-token-prediction layers' (numbered num_layers + 1, ...)."""
    if not hasattr(model, "decoder"):
        return list(model.encoder.layers)
    mtp = getattr(model, "mtp", None)
    return list(model.decoder.layers) + ([layer.transformer_layer for layer in mtp.layers] if mtp is not None else [])


def moe_transformer_layers(model) -> list:
    """Of `transformer_layers`, those whose MLP is an MoE layer (it has a router; --moe-layer-freq's
    dense layers have none), in order."""
    return [layer for layer in transformer_layers(model) if hasattr(layer.mlp, "router")]


def local_experts(moe_layer) -> list:
    """(global expert id, expert MLP module) for the experts this rank hosts."""
    experts = moe_layer.experts
    if not hasattr(experts, "local_experts"):
        raise RuntimeError(
            f"{type(experts).__name__} keeps its experts in packed weights; placement-independent "
            "expert initialisation supports SequentialMLP experts (drop --moe-grouped-gemm)"
        )
    return list(zip(moe_layer.local_expert_indices, experts.local_experts))


# ----------------------------------------------------------------------------------------
# DDP, optimizer, scheduler
# ----------------------------------------------------------------------------------------


def wrap_ddp(config: TransformerConfig, models: list, args) -> list:
    """Megatron's DDP around each model chunk, and the schedule's hooks in `config`, as
    Megatron-LM's get_model and train do: only the first chunk buckets its gradients (a later
    chunk's backward ends first in the interleaved schedule, and each chunk's reduce starts when
    its own backward is done); with virtual stages each hook is a list, one per chunk."""
    virtual = len(models) > 1
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # Megatron-LM's default (--no-align-param-gather is not built), which it clears without
        # virtual stages: every stage launches its chunks' gathers at once
        align_param_gather=virtual,
    )
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, disable_bucketing=i > 0)
              for i, model in enumerate(models)]

    def per_chunk(hooks: list):
        return hooks if virtual else hooks[0]

    # Without these two hooks no gradient is ever synchronised (and with overlap on, the
    # second iteration fails with "multiple communication calls outstanding").
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = per_chunk([chunk.no_sync for chunk in chunks])
    if args.overlap_grad_reduce and args.pipeline_model_parallel_size > 1:
        config.grad_sync_func = per_chunk([chunk.start_grad_sync for chunk in chunks])
    if args.overlap_param_gather and virtual:
        config.param_sync_func = [chunk.start_param_sync for chunk in chunks]
    fixes.untag_expert_bias_sequence_parallel(chunks)
    return chunks


def packed_param_hooks(ddp_chunks: list) -> tuple[Callable[[torch.nn.Parameter], None] | None, Callable[[torch.nn.Parameter], None] | None]:
    """DDP's per-parameter overlap hooks (each parameter's own chunk's), for parameters a mode reads and writes outside autograd
    and outside their module's forward (fssdp packs its owned experts into rows: spAG reads them
    at the layer's start, spRS adds their gradient into main_grad after the backward). Returns
    (param_sync, grad_ready), each None when its overlap is off:

    - param_sync(param), with --overlap-param-gather: waits for the all-gather that brings the
      distributed optimizer's update of `param`, as DDP's module forward pre-hook does
      (distributed_data_parallel.py:384 in 0.16.1), which the packing would otherwise run ahead of
      (measured: fssdp read the previous iteration's expert weights, losses 2.4e-3 off ep by
      iteration 10 with EDP 2);
    - grad_ready(param), with --overlap-grad-reduce: registers `param`'s gradient complete for its
      bucket's reduce, as DDP's backward hook does (distributed_data_parallel.py:420,
      param_and_grad_buffer.py:539). The packed parameters are in no autograd graph, so that hook
      never fires for them: without this their buckets reduce only at the end of the backward.
    """
    param_sync = grad_ready = None
    chunk_of = {param: chunk for chunk in ddp_chunks for param in chunk.param_to_bucket_group}
    first = ddp_chunks[0]
    if first.use_forward_hook:
        skip_next = first.ddp_config.align_param_gather or first.overlap_param_gather_with_optimizer_step

        def param_sync(param: torch.nn.Parameter) -> None:
            chunk_of[param].param_to_bucket_group[param].finish_param_sync(skip_next_bucket_dispatch=skip_next)

    if first.ddp_config.overlap_grad_reduce:

        def grad_ready(param: torch.nn.Parameter) -> None:
            chunk_of[param].param_to_bucket_group[param].register_grad_ready(param, chunk_of[param].force_all_reduce)

    return param_sync, grad_ready


def finish_param_gather(model_chunks) -> None:
    """With --overlap-param-gather the distributed optimizer's all-gather of the updated weights
    is still in flight after its step (DDP's forward pre-hooks wait for it bucket by bucket in the
    next forward), so a checkpoint written then would hold the previous iteration's weights beside
    the current main weights (measured: a resume 2e-3 off on its first loss). Completes it
    synchronously, as Megatron-LM does before its saves (`disable_forward_pre_hook(param_sync=True)`;
    `DistributedDataParallel.start_param_sync(force_sync=True)`, distributed_data_parallel.py:463 in
    0.16.1: waits for a dispatched gather, runs the others). A no-op without the overlap."""
    for chunk in model_chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def optimizer(args, model_chunks):
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            fp16=args.fp16,
            params_dtype=args.params_dtype,
            loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis,
            use_distributed_optimizer=args.use_distributed_optimizer,
            log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        ),
        model_chunks,
    )
    fixes.use_expert_tp_group_for_expert_optimizer(opt)
    for chunk in model_chunks:
        # The pipeline schedules multiply the loss by this before the backward (Megatron-LM's
        # training loop sets it the same way); 1 without loss scaling.
        chunk.config.grad_scale_func = opt.scale_loss
    if isinstance(opt, ChainedOptimizer) and getattr(opt.chained_optimizers[0], "grad_scaler", None) is not None:
        WorldLossScaling(opt)
    else:
        WorldFiniteCheck(opt)
    return opt


def grad_scaler(args):
    """The loss scaler Megatron's optimizer would make for these flags (get_megatron_optimizer in
    0.16.1): --loss-scale: constant; --fp16 without it: dynamic (growth 2, backoff 0.5 every
    --loss-scale-window steps, --hysteresis, from --initial-loss-scale down to --min-loss-scale);
    otherwise None. For a mode whose optimizer is its own (zebra)."""
    if args.loss_scale:
        return ConstantGradScaler(args.loss_scale)
    if args.fp16:
        return DynamicGradScaler(initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=args.loss_scale_window, hysteresis=args.hysteresis)
    return None


class WorldLossScaling:
    """One loss scale and one overflow decision for every gradient of the world.

    Megatron-Core gives the dense and the expert optimizer of its ChainedOptimizer a grad scaler
    each, and each reduces its found-inf flag over its own gradient-statistics group only (the
    dense one over TP x PP, the expert one over the expert TP x PP group; optimizer.py:496-521 in
    0.16.1). Expert gradients differ between expert-parallel ranks, so an overflow in one rank's
    expert would skip the step on that rank alone and the two scalers could drift apart; that is
    why Megatron-LM refuses --fp16 with expert parallelism. Here every sub-optimizer shares the
    first one's scaler, and `prepare_grads` (which ChainedOptimizer.step calls before anything
    else) unscales every main gradient, plus the gradients a mode keeps outside Megatron's
    optimizer (`outside`), with that one scale, all-reduces the found-inf flag over the whole
    world (one scalar) and updates the scale once. Every rank then skips or steps together.
    """

    def __init__(self, opt: ChainedOptimizer):
        self.optimizers = opt.chained_optimizers
        self.scaler = self.optimizers[0].grad_scaler
        for sub in self.optimizers:
            sub.grad_scaler = self.scaler
        self.outside: list[Callable[[], list[torch.Tensor]]] = []
        """Sources of gradients held outside Megatron's optimizer (replicate's expert slices)."""
        opt.prepare_grads = self.prepare_grads
        opt.world_step_check = self

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.scaler.scale.device)
        for sub in self.optimizers:
            if sub.is_stub_optimizer:
                continue
            sub._copy_model_grads_to_main_grads()
            torch._amp_foreach_non_finite_check_and_unscale_(
                sub._collect_main_grad_data_for_unscaling(), found_inf, self.scaler.inv_scale
            )
        for source in self.outside:
            grads = source()
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.scaler.inv_scale.to(grads[0].device))
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        overflow = bool(found_inf.item() > 0)
        self.scaler.update(overflow)
        return overflow


class WorldFiniteCheck:
    """Without loss scaling (bf16, fp32) Megatron-Core steps whatever gradients it has: a NaN or
    an infinity in one gradient reaches every weight through the clipping coefficient, and
    expert gradients differ between ranks. Here, after Megatron's own `prepare_grads` (which
    copies the model's gradients to the optimizer's main gradients), every main gradient and the
    gradients a mode keeps outside the optimizer (`outside`) are checked for non-finite values,
    the flag is all-reduced over the whole world (one scalar), and a non-finite gradient anywhere
    makes every rank skip the step (`step()` returns update_successful False), as fp16's
    overflow does under WorldLossScaling. The training loop decides whether to go on."""

    def __init__(self, opt):
        self.optimizers = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
        self._megatron_prepare_grads = opt.prepare_grads
        self.outside: list[Callable[[], list[torch.Tensor]]] = []
        """Sources of gradients held outside Megatron's optimizer (replicate's expert slices)."""
        opt.prepare_grads = self.prepare_grads
        opt.world_step_check = self

    def _main_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizers are about to step (fp32 main weights' in bf16)."""
        return [p.grad for sub in self.optimizers if not sub.is_stub_optimizer
                for group in sub.optimizer.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_megatron = self._megatron_prepare_grads()
        grads = self._main_grads() + [g for source in self.outside for g in source()]
        # a rank without gradients still joins the all-reduce, with a flag where NCCL can reduce it
        device = grads[0].device if grads else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            # the fused check of torch's amp, with a scale of one: the gradients stay as they are
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.ones(1, device=device))
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        return bool(found_megatron) or bool(found_inf.item() > 0)


def forget_loss_trackers() -> None:
    """Empty Megatron's logging trackers of the MoE auxiliary losses
    (`moe_utils.get_moe_layer_wise_logging_tracker()`: per loss name, a values tensor sized at its
    first use to that run's layers, with that run's reduce groups) and of the MTP losses
    (`MTPLossLoggingHelper.tracker`). Each is a process-wide dict, so a second training in the
    same process (tests/support/multirun.py) with more layers would index past the first one's
    tensor (moe_utils.py:897, an IndexError) and reduce over destroyed groups. Called at every
    run's start; Megatron-LM's training_log reads and zeroes them, this loop reads only the MTP
    one (`take_mtp_losses`)."""
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker.clear()


def mtp_layer_input(mtp_layer, input_ids: torch.Tensor, position_ids: torch.Tensor, embedding,
                    hidden_SBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MultiTokenPredictionLayer's own steps before its transformer layer, for a mode that runs
    that layer itself (zebra): the token ids and positions rolled by one (_get_embeddings), their
    embedding normed and concatenated with the normed hidden states, projected (_concat_embeddings).
    Returns (the transformer layer's input, the rolled ids, the rolled positions: the next depth's)."""
    ids, positions, embedded_SBH, hidden_SBH = mtp_layer._get_embeddings(
        input_ids=input_ids, position_ids=position_ids, embedding=embedding, hidden_states=hidden_SBH)
    return mtp_layer._concat_embeddings(hidden_SBH, embedded_SBH), ids, positions


def set_mtp_loss_scale(scale: torch.Tensor) -> None:
    """The factor the MTP losses' gradient gets in the next backward (Megatron's schedule sets it
    per micro-batch as the auxiliary loss's; zebra runs its own schedule)."""
    MTPLossAutoScaler.set_loss_scale(scale)


def mtp_layer_output(mtp_layer, hidden_SBH: torch.Tensor) -> torch.Tensor:
    """A MultiTokenPredictionLayer's step after its transformer layer (_postprocess: its final norm)."""
    return mtp_layer._postprocess(hidden_SBH)


def gpt_mtp_losses(model, hidden_SBH: list[torch.Tensor], batch: dict) -> torch.Tensor:
    """GPTModel's post-processing after its MTP block (_postprocess without running the block): the
    MTP losses of `hidden_SBH[1:]` (each depth's normed output) into MTPLossLoggingHelper's tracker
    and, through MTPLossAutoScaler, into the backward of `hidden_SBH[0]` (the decoder's normed
    output), then the output layer and the per-token language-model losses [b, s] of the main
    prediction, as ep computes them."""
    return model._postprocess(
        hidden_states=torch.cat(hidden_SBH, dim=0), input_ids=batch["tokens"], position_ids=batch["position_ids"],
        labels=batch["labels"], rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
        mtp_in_postprocess=False, loss_mask=batch["loss_mask"], attention_mask=batch["attention_mask"])


def take_mtp_losses(num_mtp_layers: int, num_micro_batches: int) -> list[float]:
    """This iteration's multi-token-prediction loss per MTP layer, the mean over micro-batches and
    data-parallel ranks (Megatron-LM's "mtp_k loss"), and the tracker emptied. A collective.

    GPTModel adds each micro-batch's MTP loss to MTPLossLoggingHelper's tracker on the last
    pipeline stage (models/gpt/gpt_model.py:643-650) and Megatron-LM's training_log reads and
    clears it; here every last-stage TP-rank-0 rank contributes once and the world averages."""
    tracker = MTPLossLoggingHelper.tracker
    sums = torch.zeros(num_mtp_layers + 1, dtype=torch.float64)
    if "values" in tracker:
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and parallel_state.get_tensor_model_parallel_rank() == 0:
            sums[:num_mtp_layers] = tracker["values"].detach().double().cpu() / num_micro_batches
            sums[-1] = 1.0
        tracker["values"].zero_()
    torch.distributed.all_reduce(sums)
    return (sums[:-1] / sums[-1]).tolist() if sums[-1] > 0 else [float("nan")] * num_mtp_layers


def params_norm(opt, outside_sq: float = 0.0) -> float:
    """Megatron-LM's --log-params-norm: the L2 norm of the weights the optimizer steps (fp32 main
    weights in half precision, the distributed optimizer's shards), each counted once: every
    chained optimizer's parameters filtered as for its gradient norm (not shared, not a tensor-
    parallel duplicate) and reduced over its gradient-statistics group, the optimizers' norms
    then combined as ChainedOptimizer.get_grad_norm combines theirs; plus `outside_sq`, the
    squared norm of the weights a mode steps outside it (`ModeRuntime.outside_params_norm_sq`)."""
    squares = float(outside_sq)
    for sub in getattr(opt, "chained_optimizers", [opt]):
        params = [p for p in sub.get_parameters() if param_is_not_shared(p)
                  and tensor_parallel.param_is_not_tensor_parallel_duplicate(p, getattr(sub, "tp_group", None))]
        squares += get_grad_norm_fp32(params, grad_stats_parallel_group=sub.get_grad_stats_parallel_group()) ** 2
    return math.sqrt(squares)


def loss_scale(opt) -> float:
    """The loss scale of the last step's scaler (1.0 without loss scaling)."""
    return float(opt.get_loss_scale().item())


def add_outside_gradients(opt, grads: Callable[[], list[torch.Tensor]]) -> None:
    """Gradients a mode keeps outside Megatron's optimizer get the same unscaling (with loss
    scaling) and the same world-wide non-finite check as Megatron's."""
    check = getattr(opt, "world_step_check", None)
    if check is not None:
        check.outside.append(grads)


def add_grad_norm_term(opt, extra_norm_sq: Callable[[], float]) -> None:
    """Make Megatron's grad norm (used for clipping and logging) include parameters it does not own.

    `get_megatron_optimizer` returns a ChainedOptimizer; its step() clips every sub-optimizer's
    gradients by `self.get_grad_norm()` (optimizer/optimizer.py:1308-1330 in 0.16.1). Replacing
    that method on the instance by sqrt(norm^2 + extra_norm_sq()) gives clipping and the returned
    norm the squared norm of gradients held outside the optimizer (replicate mode's expert
    slices); the caller clips those with the same factor.
    """
    if not isinstance(opt, ChainedOptimizer):
        raise TypeError(f"expected Megatron's ChainedOptimizer, got {type(opt).__name__}")
    own = opt.get_grad_norm

    def get_grad_norm():
        return math.sqrt(float(own()) ** 2 + float(extra_norm_sq()))

    opt.get_grad_norm = get_grad_norm


def scheduler(args, opt) -> OptimizerParamScheduler:
    """Megatron-Core's scheduler, stepped once per iteration: warm-up and decay in iterations
    (validation converts sample counts, possibly to fractions of an iteration)."""
    return OptimizerParamScheduler(
        opt,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.lr_decay_steps,
        wd_incr_style="constant",
        # on --load: the checkpoint's schedule values, or with the override these flags'
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
    )


def override_schedule_peaks(opt, sched: OptimizerParamScheduler) -> None:
    """--override-opt_param-scheduler, after the optimizer state is loaded and before the
    scheduler's: Megatron-Core's scheduler takes each param group's own max_lr / min_lr before
    its own values, and the loaded param groups hold the checkpoint's, so the override alone
    would leave the old peak in force. Set them to the scheduler's (these flags')."""
    for group in opt.param_groups:
        group["max_lr"], group["min_lr"] = sched.max_lr, sched.min_lr


def forward_backward(step_fn, data_iterator, model_chunks, num_microbatches, seq_length, micro_batch_size, forward_only):
    return get_forward_backward_func()(
        forward_step_func=step_fn,
        data_iterator=data_iterator,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def update_expert_bias(routers: list) -> None:
    """The aux-loss-free expert bias update that Megatron's finalize_model_grads applies
    (_update_router_expert_bias), for a mode whose own schedule replaces Megatron's (zebra):
    the routers' token counts since the last update are summed over Megatron's TP x DP x CP group
    (moe_utils.get_updated_expert_bias), each bias moves by the update rate towards the mean load,
    and the counts restart at 0 (reset_model_temporary_tensors). Collective over that group."""
    biased = [router for router in routers if router.expert_bias is not None]
    if not biased:
        return
    with torch.no_grad():
        counts_LE = torch.stack([router.local_tokens_per_expert for router in biased])
        bias_LE = torch.stack([router.expert_bias for router in biased])
        updated_LE = moe_utils.get_updated_expert_bias(counts_LE, bias_LE, biased[0].config.moe_router_bias_update_rate)
        for router, updated_E in zip(biased, updated_LE):
            router.expert_bias.copy_(updated_E)
            router.local_tokens_per_expert.zero_()


def expert_bias_group_size() -> int:
    """Ranks whose token counts `update_expert_bias` sums (Megatron's TP x DP x CP group)."""
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True).size()


# ----------------------------------------------------------------------------------------
# Router observation (expert loads before and after capacity dropping)
# ----------------------------------------------------------------------------------------

_routing_observer = threading.local()


def _observing_token_dropping(original: Callable) -> Callable:
    def apply_router_token_dropping(probs, routing_map, *args, **kwargs):
        final_probs, final_map = original(probs, routing_map, *args, **kwargs)
        callbacks = getattr(_routing_observer, "callbacks", None)
        if callbacks is not None:
            on_routed, on_processed = callbacks
            on_routed(routing_map)
            # with --moe-pad-expert-input-to-capacity the final map also marks the padded slots
            # (copies of unrouted tokens, computed and sent but no token's output): they are sent
            # rows, not kept tokens
            on_processed(routing_map & final_map, final_map)
            _routing_observer.observed = True
        return final_probs, final_map

    apply_router_token_dropping._megatron_patches = True
    return apply_router_token_dropping


def checkpointed(function: Callable, *tensors: torch.Tensor):
    """`function(*tensors)` under Megatron's activation checkpointing (tensor_parallel.checkpoint,
    what --recompute-granularity full applies per layer): only the inputs are kept, the forward
    runs again in the backward with the same RNG states. Every output must be a tensor that
    needs a gradient; a mode whose own schedule calls the modules (zebra) checkpoints its
    segments with it."""
    return _checkpoint(function, False, *tensors)


def recomputing() -> bool:
    """True while activation recompute re-runs a forward (Megatron's CheckpointFunction and
    CheckpointWithoutOutput re-run it inside the autograd engine's backward, the only place a
    forward runs there). Loads, dispatch statistics and collectives planned once per forward
    use it to recognise the second run of the same micro-batch."""
    return torch._C._current_graph_task_id() != -1


def observe_routing(router_module, on_routed: Callable, on_processed: Callable) -> list:
    """Calls on_routed(routing map before capacity dropping) and on_processed(kept map, sent
    map) for every forward of `router_module`; returns the hook handles.

    Maps are Megatron's bool [tokens, experts]. kept: the routed copies that survive the
    capacity; sent: what the dispatcher sends, which with --moe-pad-expert-input-to-capacity
    also holds the padded slots. Without a capacity factor all three are the same map.
    """
    if not getattr(moe_router.apply_router_token_dropping, "_megatron_patches", False):
        moe_router.apply_router_token_dropping = _observing_token_dropping(moe_router.apply_router_token_dropping)

    def pre_hook(module, inputs):
        _routing_observer.callbacks = (on_routed, on_processed)
        _routing_observer.observed = False

    def post_hook(module, inputs, output):
        _routing_observer.callbacks = None
        if not _routing_observer.observed:  # no capacity: Megatron did not call the dropping
            on_routed(output[1])
            on_processed(output[1], output[1])

    return [router_module.register_forward_pre_hook(pre_hook), router_module.register_forward_hook(post_hook)]


# ----------------------------------------------------------------------------------------
# Distributed checkpoints (torch_dist)
# ----------------------------------------------------------------------------------------


def _in_process_results_queue() -> None:
    """Megatron's torch_dist writer hands its write results over a queue it makes on a spawned
    multiprocessing.Manager (filesystem_async._get_write_results_queue), needed only when the
    writing runs in another process (asynchronous saves). Our saves are synchronous: the writer
    runs in this process (AsyncRequest.execute_sync) and `retrieve_write_results` reads the queue
    right after, so an in-process queue carries them. No helper process then: it cost ~0.5 GB
    per rank, outlived a rank killed with SIGKILL, and unpickling the results imported torch in
    it, ~10 s per save at 8 ranks on 2 cores (measured: 13 s -> 3 s for the tiny model)."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_sharded(state: dict, directory: str) -> None:
    """`dist_checkpointing.save`, synchronous, its write results through an in-process queue."""
    _in_process_results_queue()
    dist_checkpointing.save(state, directory)


def load_sharded(state: dict, directory: str, strictness: str) -> dict:
    """`dist_checkpointing.load`: the checkpoint's values for the sharded template `state`.
    `strictness` (a StrictHandling value) says what a key the template and the checkpoint do not
    share does: assume_ok_unexpected (Megatron-LM's default) skips the check, log_* log the keys,
    raise_* raise, ignore_all drops them quietly. The return_* values, which make the call return
    the keys as well, are refused by validation."""
    return dist_checkpointing.load(state, directory, strict=StrictHandling(strictness))


def saved_tensor_keys(directory: str) -> set[str]:
    """The keys of every sharded tensor a torch_dist checkpoint holds (its metadata only)."""
    return set(dist_checkpointing.load_tensors_metadata(directory))


def _model_keys(num_chunks: int) -> list[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_sharded_state(model_chunks) -> dict:
    """The model's part of a checkpoint, as Megatron-LM writes it: {"model": ...} for one chunk,
    {"model0": ..., "model1": ...} for one per virtual stage. The tensors' keys are global (layer
    offsets included), so a checkpoint loads under another pipeline or virtual layout."""
    return {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(len(model_chunks)), model_chunks)}


_IN_CHUNK = "@chunk"


def in_chunk(chunk: int, key: str) -> str:
    """A model state-dict key for an entry whose module is in model chunk `chunk`, in another
    chunk's sharded state dict (fssdp keeps a layer's expert in any slot module of its rank);
    `load_model_state` loads it into that chunk."""
    return f"{_IN_CHUNK}{chunk}:{key}"


def load_model_state(model_chunks, loaded: dict) -> None:
    """Each chunk's weights from a loaded `model_sharded_state` (its entries popped from `loaded`),
    the `in_chunk` entries into their chunk."""
    states = [loaded.pop(key) for key in _model_keys(len(model_chunks))]
    for state in states:
        for key in [key for key in state if key.startswith(_IN_CHUNK)]:
            chunk, path = key.removeprefix(_IN_CHUNK).split(":", 1)
            states[int(chunk)][path] = state.pop(key)
    for chunk, state in zip(model_chunks, states):
        chunk.load_state_dict(state, strict=False)


def save_checkpoint(directory: str, model_chunks, opt, extra_state: dict) -> None:
    state = model_sharded_state(model_chunks)
    if opt is not None:
        prepare_optimizer_state(opt, is_loading=False)
        state["optimizer"] = opt.sharded_state_dict(
            dict(state), metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        )
    state.update(extra_state)
    save_sharded(state, directory)


def load_common_state(directory: str) -> dict:
    """A torch_dist checkpoint's common (non-sharded) state, read alone: a mode adopts its saved
    placement before it builds the sharded state dict that says which module loads what."""
    return dist_checkpointing.load_common_state_dict(str(directory))


def load_checkpoint(directory: str, model_chunks, opt, extra_template: dict, strictness: str) -> dict:
    model_sd = model_sharded_state(model_chunks)
    state = dict(model_sd)
    if opt is not None:
        prepare_optimizer_state(opt, is_loading=True)
        state["optimizer"] = opt.sharded_state_dict(
            model_sd, is_loading=True, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        )
    state.update(extra_template)
    loaded = load_sharded(state, directory, strictness)
    load_model_state(model_chunks, loaded)
    if opt is not None:
        optimizer_state = loaded.pop("optimizer")
        _restore_step_zero(optimizer_state)
        opt.load_state_dict(optimizer_state)
    return loaded


def _restore_step_zero(state) -> None:
    """Give back the shared Adam step of an optimizer saved at step 0.

    Megatron stores the step shared by all parameters only `if step:` (optimizer/optimizer.py:845),
    so a checkpoint of an optimizer that never stepped (fp16: every iteration so far skipped)
    has moments but no step, and torch's Adam refuses such state on load (KeyError 'step'). The
    step it lost is 0. Walks the loaded optimizer state (a chained optimizer's per-optimizer
    entries too) and adds it where the moments have no step.
    """
    if not isinstance(state, dict):
        return
    per_param = state.get("state")
    if isinstance(per_param, dict) and "common_step" not in per_param:
        entries = [v for v in per_param.values() if isinstance(v, dict)]
        if entries and all("exp_avg" in v and "step" not in v for v in entries):
            per_param["common_step"] = torch.zeros((), dtype=torch.float32)
    for value in state.values():
        _restore_step_zero(value)


def prepare_optimizer_state(opt, is_loading: bool) -> None:
    """Give Megatron's optimizer the Adam state its sharded state dict describes.

    Loading: every parameter without state gets zeros at step 0 (the template to load into;
    a DistributedOptimizer without Apex / TE cannot even describe itself without a step).
    Saving: an optimizer that never stepped (fp16: every iteration so far skipped for overflow)
    has no Adam state, and the checkpoint would lack the moments every load asks for (KeyError
    on resume: seen on CPU and on an H200); its state is zeros at step 0. Only a sub-optimizer
    without any state: Megatron refuses to save different steps per parameter.
    """
    for sub in getattr(opt, "chained_optimizers", [opt]):
        if is_loading or not any(sub.optimizer.state.values()):
            _materialize_optimizer_state(sub)


def _materialize_optimizer_state(opt) -> None:
    """Create Adam state (exp_avg, exp_avg_sq, step) where a parameter has none yet.

    Megatron's sharded optimizer state dict describes the *existing* state; a fresh torch
    Adam has none until its first step, so without this nothing would be loaded, or saved.
    Zero moments at step 0 are what torch's Adam creates at its first step, so a run that
    continues after the save steps exactly as it would have.
    """
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p not in inner.state or not inner.state[p]:
                    inner.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }
