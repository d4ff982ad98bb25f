"""Validation of the training script's flags and the values derived from them.

`validate_args(args, world_size)` runs before any process group: Megatron-LM's rules (sizes,
choices, the TP x PP x DP and ETP x EP x EDP layouts, the model shape, MoE, batch, learning
rate, device, precision, data, tokenizer, checkpoints), with the selected mode's own rules
(`ModeSpec.validate`, in the mode's package) at the point where the parallel layout and the
model are known. Every refusal is a config.flags.ArgumentError naming the flag, its value and
what would be valid.
"""

import argparse
import importlib.util
import math
from pathlib import Path

from megatron_patches.config.flags import ArgumentError, divisors, fail
from megatron_patches.config.models import ROUTER_SCORE_FUNCTIONS, check_modern_rules, check_routing_rules
from megatron_patches.config.run import RUN_DEFAULTS, router_pre_softmax
from megatron_patches.data.index_check import index_problem
from megatron_patches.training import checkpoint_dirs, outputs, resume
from megatron_patches.training.arguments import (
    ATTENTION_BACKENDS,
    DEFAULT_SPLIT,
    FLAGS_WITHOUT_EFFECT,
    DISTRIBUTED_BACKENDS,
    EMBEDDED_CORPUS_SPLIT,
    KERNEL_CHOICES,
    LOAD_BALANCING_TYPES,
    LR_DECAY_STYLES,
    MODEL_FAMILIES,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_MODULES,
    ROUTER_DTYPES,
    TOKENIZERS_NEEDING_MODEL,
    TOKENIZERS_NEEDING_VOCAB,
    TOKENIZERS_NEEDING_VOCAB_AND_MERGES,
    TOKENIZERS_NEEDING_VOCAB_SIZE,
    TOKENIZER_TYPES,
    TOKEN_DISPATCHER_TYPES,
    TOKEN_DROP_POLICIES,
    TRANSFORMER_IMPLS,
    build_parser,
    flag_of_dest,
)
from megatron_patches.placement.loads import LOAD_PREDICTORS
from megatron_patches.training.modes import MODES


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Resolve derived values and refuse impossible combinations, before any process group.

    Mutates and returns `args`; running it twice gives the same namespace. Raises ArgumentError
    naming the flag, its value and what would be valid."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"world size {world_size!r}: must be a positive integer")
    args.world_size = world_size
    _check_finite(args)
    _check_sizes(args)
    _check_choices(args)
    _resolve_parallel_layout(args, world_size)
    _resolve_model_shape(args)
    _resolve_moe(args)
    _resolve_mode_flags(args)
    _check_routing(args)
    _resolve_batch(args)
    _resolve_virtual_pipeline(args)
    _resolve_learning_rate(args)
    _check_intervals(args)
    _check_partnered_flags(args)
    _check_timing(args)
    _check_gpt_data_flags(args)
    _check_logging_level(args)
    _resolve_device(args)
    _check_precision(args)
    _check_recompute(args)
    _resolve_data(args)
    _resolve_tokenizer(args)
    _check_checkpointing(args)
    _resolve_outputs(args)
    return args


def _check_finite(args):
    """`inf` and `nan` parse as floats, and no flag means anything by them: `--lr inf` would train
    to NaN and `--fssdp-memory-budget-mb inf` would fail at the first plan."""
    for action in build_parser()._actions:
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        if action.option_strings and any(isinstance(v, float) and not math.isfinite(v) for v in values):
            fail(action.option_strings[0], value, "must be a finite number")


# Flags Megatron-LM requires (it has no default for them), with an example of a value.
REQUIRED = {
    "num_layers": "configs/models/*.yaml set it",
    "hidden_size": "configs/models/*.yaml set it",
    "num_attention_heads": "configs/models/*.yaml set it",
    "seq_length": "configs/models/*.yaml set it",
    "micro_batch_size": "the tiny job's: 4",
    "train_iters": "or --train-samples; the tiny job's: 200",
    "lr": "the tiny job's: 1e-3",
}


def _check_sizes(args):
    # (a namespace validated before holds the iterations it derived from --train-samples)
    if args.train_iters is not None and args.train_samples is not None \
            and args.train_iters != getattr(args, "train_iters_from_samples", None):
        fail("--train-samples", args.train_samples, f"give either it or --train-iters (is {args.train_iters}), "
             "as Megatron-LM requires")
    missing = [dest for dest in REQUIRED if getattr(args, dest) is None
               and not (dest == "train_iters" and args.train_samples is not None)]
    if missing:
        raise ArgumentError(
            "; ".join(f"--{dest.replace('_', '-')} is not set ({REQUIRED[dest]})" for dest in missing)
            + ": Megatron-LM has no default for these flags; give them on the command line or in a --config "
            f"YAML (configs/tiny_job.yaml holds the tiny job's run flags). The model came from {args.model_source}"
        )
    positive = (
        "num_layers", "hidden_size", "num_attention_heads", "seq_length", "ffn_hidden_size",
        "max_position_embeddings", "moe_ffn_hidden_size", "moe_router_topk", "micro_batch_size",
        "global_batch_size", "train_iters", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "make_vocab_size_divisible_by", "vocab_size",
        "lr_decay_iters", "tiktoken_num_special_tokens", "kv_channels", "num_query_groups",
        "rotary_base", "train_samples", "lr_decay_samples", "exit_interval", "exit_duration_in_mins",
        "distributed_timeout_minutes", "rotary_seq_len_interpolation_factor", "moe_shared_expert_intermediate_size",
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
        "tensorboard_log_interval", "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
        "microbatch_group_size_per_vp_stage",
    )
    for dest in positive:
        value = getattr(args, dest)
        if value is not None and value <= 0:
            fail(f"--{dest.replace('_', '-')}", value, "must be a positive integer")
    non_negative = ("lr_warmup_iters", "num_workers", "eval_iters", "max_nonfinite_steps", "keep_last_checkpoints",
                    "lr_warmup_samples", "manual_gc_interval")
    for dest in non_negative:
        value = getattr(args, dest)
        if value < 0:
            fail(f"--{dest.replace('_', '-')}", value, "must be 0 or more")
    if args.num_workers > 0:
        # accepted silently before, and read by nothing: refused until worker processes are built
        fail("--num-workers", args.num_workers, "the micro-batches are read in the training process "
             "(data/datasets.py BatchIterator); data-loader worker processes are not built here; valid: 0")
    if not 0 <= args.seed < 2**31:
        # numpy's seeds are 0..2**32-1, and Megatron adds per-rank offsets to this one
        fail("--seed", args.seed, f"valid: 0..{2**31 - 1}")
    if not args.num_experts:
        # Megatron-LM trains a dense model without --num-experts (or with 0); every mode here
        # places experts, so a dense model is refused rather than trained as something else
        fail("--num-experts", args.num_experts,
             "without experts the model is dense, which Megatron-LM's pretrain_gpt.py trains; every "
             f"--moe-parallel-mode here places experts; valid: 1 or more (the model came from {args.model_source})")
    if args.num_experts < 0:
        fail("--num-experts", args.num_experts, "must be a positive integer")
    for dest in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, dest)
        if not 0.0 <= value < 1.0:
            fail(f"--{dest.replace('_', '-')}", value, "must be a probability in [0, 1)")
    for dest in ("adam_beta1", "adam_beta2"):
        value = getattr(args, dest)
        if not 0.0 <= value < 1.0:
            fail(f"--{dest.replace('_', '-')}", value, "must be in [0, 1)")
    for dest in ("adam_eps", "init_method_std"):
        value = getattr(args, dest)
        if not value > 0.0:
            fail(f"--{dest.replace('_', '-')}", value, "must be positive")
    for dest in ("weight_decay", "clip_grad", "moe_aux_loss_coeff", "stall_timeout"):
        value = getattr(args, dest)
        if not value >= 0.0:
            fail(f"--{dest.replace('_', '-')}", value, "must be 0 or more")


def _check_choices(args):
    # Megatron-LM's rules: the deprecated rope switch sets the type; linear biases include QKV's
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.add_bias_linear:
        args.add_qkv_bias = True
    choices = (
        ("--model-family", args.model_family, MODEL_FAMILIES),
        ("--normalization", args.normalization, NORMALIZATIONS),
        ("--position-embedding-type", args.position_embedding_type, POSITION_EMBEDDING_TYPES),
        ("--moe-parallel-mode", args.moe_parallel_mode, tuple(MODES)),
        ("--lr-decay-style", args.lr_decay_style, LR_DECAY_STYLES),
        ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type, TOKEN_DISPATCHER_TYPES),
        ("--moe-router-load-balancing-type", args.moe_router_load_balancing_type,
         LOAD_BALANCING_TYPES),
        ("--moe-router-score-function", args.moe_router_score_function, ROUTER_SCORE_FUNCTIONS),
        ("--moe-token-drop-policy", args.moe_token_drop_policy, TOKEN_DROP_POLICIES),
    )
    if args.moe_router_dtype is not None and args.moe_router_dtype not in ROUTER_DTYPES:
        fail("--moe-router-dtype", args.moe_router_dtype, f"unknown value; valid: {', '.join(ROUTER_DTYPES)}, or leave it out")
    for flag, value, valid in choices:
        if value not in valid:
            fail(flag, value, f"unknown value; valid: {', '.join(valid)}")
    optional_choices = (
        ("--tokenizer-type", args.tokenizer_type, TOKENIZER_TYPES,
         " (the types megatron.core's build_tokenizer supports)"),
        ("--distributed-backend", args.distributed_backend, DISTRIBUTED_BACKENDS, ""),
        ("--transformer-impl", args.transformer_impl, TRANSFORMER_IMPLS, ""),
    )
    for flag, value, valid, note in optional_choices:
        if value is not None and value not in valid:
            fail(flag, value, f"unknown value; valid: {', '.join(valid)}{note}")


def _resolve_parallel_layout(args, world_size):
    if args.context_parallel_size != 1:
        fail("--context-parallel-size", args.context_parallel_size, "context parallelism is not built yet: Megatron-Core "
             "0.16.1 splits attention over the sequence only in Transformer Engine's attention (its local attention "
             "refuses it), and the placement modes plan expert loads per full sequence; valid: 1")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        fail("--tensor-model-parallel-size", tp,
             f"TP x --pipeline-model-parallel-size = {tp} x {pp} = {tp * pp} does not divide "
             f"the world size {world_size}; valid: TP x PP in {divisors(world_size)}")
    args.data_parallel_size = world_size // (tp * pp)
    if args.num_layers % pp != 0:
        fail("--num-layers", args.num_layers,
             f"not divisible by --pipeline-model-parallel-size={pp}; valid PP: "
             f"{divisors(args.num_layers)}")
    if args.num_attention_heads % tp != 0:
        fail("--num-attention-heads", args.num_attention_heads,
             f"not divisible by --tensor-model-parallel-size={tp}; valid TP: "
             f"{divisors(args.num_attention_heads)}")
    if tp == 1:
        # As Megatron-LM does: with TP 1 there is no sequence to split, and the flag would
        # only change numerics.
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % tp != 0:
        fail("--seq-length", args.seq_length,
             f"--sequence-parallel splits the sequence over --tensor-model-parallel-size={tp} "
             f"ranks; valid: a multiple of {tp}")
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        fail("--overlap-param-gather", True,
             "needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)")


def _check_attention_flags(args):
    if not 0.0 < args.layernorm_epsilon < 1.0:
        fail("--norm-epsilon", args.layernorm_epsilon, "valid: a number in (0, 1)")
    if not 0.0 < args.rotary_percent <= 1.0:
        fail("--rotary-percent", args.rotary_percent, "valid: a share in (0, 1]")
    factor = args.rotary_seq_len_interpolation_factor
    rotary = (("--rotary-percent", args.rotary_percent, args.rotary_percent != 1.0),
              ("--rotary-interleaved", True, args.rotary_interleaved),
              ("--rotary-seq-len-interpolation-factor", factor, factor is not None))
    for flag, value, given in rotary:
        if given and args.position_embedding_type != "rope":
            fail(flag, value, f"it shapes rotary embeddings, which --position-embedding-type="
                 f"{args.position_embedding_type} does not use (Megatron-LM ignores it there); add "
                 "--position-embedding-type rope or leave it out")
    if args.qk_layernorm and args.model_family == "bert":
        fail("--qk-layernorm", True, "Megatron-Core's BERT layer spec has no query/key norm (Megatron-LM's "
             "pretrain_bert.py ignores the flag); valid with --model-family gpt")


# dist_checkpointing's StrictHandling values, Megatron-LM's --dist-ckpt-strictness choices (a test
# compares them with megatron.core's enum; this module stays torch-free).
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "return_unexpected", "return_all", "ignore_all")

# Python's logging levels (what --logging-level takes).
LOGGING_LEVELS = {0: "NOTSET", 10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}

def _check_modern_model(args):
    """Shared experts, multi-latent attention and multi-token prediction: config.models' rules
    (Megatron-Core's and Megatron-LM's), each naming the flag."""
    flags = flag_of_dest()
    check_modern_rules(args, lambda dest, value, why: fail(flags[dest], value, why))


def _resolve_model_shape(args):
    _check_attention_flags(args)
    _check_modern_model(args)
    tp, heads = args.tensor_model_parallel_size, args.num_attention_heads
    if args.kv_channels is None:
        if args.hidden_size % heads != 0:
            fail("--hidden-size", args.hidden_size,
                 f"not divisible by --num-attention-heads={heads}; valid: multiples of {heads}, "
                 "or give --kv-channels")
        args.kv_channels = args.hidden_size // heads
    if args.group_query_attention:
        groups = args.num_query_groups
        if heads % groups != 0:
            fail("--num-query-groups", groups,
                 f"does not divide --num-attention-heads={heads}; valid: {divisors(heads)}")
        if groups % tp != 0:
            fail("--num-query-groups", groups,
                 f"not divisible by --tensor-model-parallel-size={tp} (key/value heads are split "
                 f"over TP ranks); valid: multiples of {tp} that divide {heads}")
    if args.ffn_hidden_size is None:
        # Megatron-LM's defaults; with SwiGLU, two thirds of 4h keep the parameter count.
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.ffn_hidden_size % tp != 0:
        fail("--ffn-hidden-size", args.ffn_hidden_size,
             f"not divisible by --tensor-model-parallel-size={tp} (the FFN is split over TP "
             f"ranks); valid: multiples of {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        fail("--seq-length", args.seq_length,
             f"exceeds --max-position-embeddings={args.max_position_embeddings}; valid: "
             f"seq-length <= {args.max_position_embeddings}, or raise --max-position-embeddings "
             f"to at least {args.seq_length}")


def _resolve_moe(args):
    world, tp, pp = args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    experts = args.num_experts
    # Megatron-Core lays the experts out as a second grid ETP x EP x expert-DP x PP over the
    # same ranks, so ETP x EP must divide world / PP.
    ranks_per_stage = world // pp
    if ranks_per_stage % etp != 0:
        fail("--expert-tensor-parallel-size", etp,
             f"does not divide world size / --pipeline-model-parallel-size = {world} / {pp} = "
             f"{ranks_per_stage}; valid ETP: {divisors(ranks_per_stage)}")
    valid_ep = [ep for ep in divisors(experts) if ranks_per_stage % (etp * ep) == 0]
    if args.expert_model_parallel_size is None:
        default = MODES[args.moe_parallel_mode].default_expert_parallel_size
        args.expert_model_parallel_size = max(valid_ep) if default is None else default
    ep = args.expert_model_parallel_size
    if experts % ep != 0:
        fail("--expert-model-parallel-size", ep,
             f"--num-experts={experts} is not divisible by it; valid EP here: {valid_ep}")
    if ranks_per_stage % (etp * ep) != 0:
        fail("--expert-model-parallel-size", ep,
             f"ETP x EP = {etp} x {ep} = {etp * ep} does not divide world size / "
             f"--pipeline-model-parallel-size = {world} / {pp} = {ranks_per_stage} (Megatron-Core "
             f"builds the expert grid ETP x EP x expert-DP x PP over the same ranks); valid EP "
             f"here: {valid_ep}")
    args.expert_data_parallel_size = ranks_per_stage // (etp * ep)

    freq = args.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        fail("--moe-layer-freq", freq, "must be 1 or more (1 = every layer is MoE)")
    if isinstance(freq, list) and (len(freq) != args.num_layers
                                   or any(x not in (0, 1) for x in freq) or 1 not in freq):
        fail("--moe-layer-freq", freq,
             f"a layer pattern needs one 0 (dense) or 1 (MoE) per layer, {args.num_layers} in "
             "all, with at least one 1")
    if args.model_family == "bert" and freq != 1:
        fail("--moe-layer-freq", freq,
             "with --model-family bert every layer must be MoE: Megatron-Core's BertModel takes one "
             "layer spec for all layers; valid: 1")
    if args.moe_router_topk > experts:
        fail("--moe-router-topk", args.moe_router_topk,
             f"exceeds --num-experts={experts}; valid: 1..{experts}")
    args.moe_router_pre_softmax = router_pre_softmax(args.moe_router_pre_softmax, args.moe_router_topk)
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.moe_ffn_hidden_size % etp != 0:
        fail("--moe-ffn-hidden-size", args.moe_ffn_hidden_size,
             f"not divisible by --expert-tensor-parallel-size={etp} (each expert's FFN is split "
             f"over ETP ranks); valid: multiples of {etp}")
    if tp > 1 and not args.sequence_parallel:
        fail("--tensor-model-parallel-size", tp,
             "MoE with tensor parallelism needs --sequence-parallel: Megatron-Core's MoELayer "
             "refuses to train with TP > 1 without it; add --sequence-parallel or use "
             "--tensor-model-parallel-size=1")
    if args.add_bias_linear and etp > 1:
        fail("--expert-tensor-parallel-size", etp,
             "Megatron-Core 0.16.1 supports MoE biases only with ETP=1 (transformer_config.py:1591 "
             "asserts it; ETP defaults to TP); "
             "use --expert-tensor-parallel-size=1 or --disable-bias-linear")
    capacity = args.moe_expert_capacity_factor
    if capacity is not None and not capacity > 0:
        fail("--moe-expert-capacity-factor", capacity,
             "must be positive (e.g. 1.0 = each expert takes its even share of tokens); leave it "
             "unset for no token dropping")
    if args.moe_pad_expert_input_to_capacity and capacity is None:
        fail("--moe-pad-expert-input-to-capacity", True,
             "needs --moe-expert-capacity-factor (padding is to the expert capacity)")
    if capacity is not None and args.moe_router_load_balancing_type == "sinkhorn":
        fail("--moe-router-load-balancing-type", "sinkhorn",
             "Megatron-Core drops tokens by capacity only with aux_loss, seq_aux_loss, "
             "global_aux_loss or none; valid with --moe-expert-capacity-factor: those four")
    if args.moe_token_dispatcher_type == "flex" and tp * ep == 1:
        fail("--moe-token-dispatcher-type", "flex",
             "Megatron-Core's flex dispatcher needs TP x EP > 1; valid here: alltoall, allgather")


def _resolve_mode_flags(args):
    """Every mode's own flags are refused in the other modes (compared with the parser defaults);
    the selected mode's load window and its own rules."""
    mode = MODES[args.moe_parallel_mode]
    parser = build_parser()
    for other in MODES.values():
        if other is mode:
            continue
        for dest in other.own_dests():
            if getattr(args, dest) != parser.get_default(dest):
                fail(f"--{dest.replace('_', '-')}", getattr(args, dest),
                     f"only applies with --moe-parallel-mode {other.name} (mode is {mode.name})")
    if mode.default_load_window is None:
        adaptive = [spec.name for spec in MODES.values() if spec.default_load_window is not None]
        for flag, value in (("--moe-load-window", args.moe_load_window),
                            ("--moe-load-predictor", args.moe_load_predictor)):
            if value is not None:
                fail(flag, value, f"only applies with --moe-parallel-mode {' or '.join(adaptive)} "
                     f"(mode is {mode.name}, which places experts statically)")
    else:
        if args.moe_load_window is None:
            args.moe_load_window = mode.default_load_window
        if args.moe_load_predictor is None:
            args.moe_load_predictor = LOAD_PREDICTORS[0]
        if args.moe_load_window < 1:
            fail("--moe-load-window", args.moe_load_window, "must be at least 1 iteration")
    mode.validate(args)


def _check_routing(args):
    """Megatron-Core's own checks of the routing flags (transformer_config.py __post_init__), before
    any process group, with the flags' names: config.models' rules for the router's architecture,
    then the training-only options."""
    flags = flag_of_dest()
    check_routing_rules(args, lambda dest, value, why: fail(flags[dest], value, why))
    if not args.moe_router_bias_update_rate >= 0.0:
        fail("--moe-router-bias-update-rate", args.moe_router_bias_update_rate, "must be 0 or more")
    for dest in ("moe_z_loss_coeff", "moe_input_jitter_eps"):
        value = getattr(args, dest)
        if value is not None and not value > 0.0:
            fail(f"--{dest.replace('_', '-')}", value, "must be positive (leave it out to switch it off)")


def _resolve_batch(args):
    dp, micro = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = micro * dp
    if args.global_batch_size % (micro * dp) != 0:
        fail("--global-batch-size", args.global_batch_size,
             f"not a multiple of --micro-batch-size x data-parallel size = {micro} x {dp} = "
             f"{micro * dp}; valid: multiples of {micro * dp}, e.g. {micro * dp} or "
             f"{2 * micro * dp}")
    args.num_micro_batches = args.global_batch_size // (micro * dp)


def _resolve_virtual_pipeline(args):
    """Megatron-LM's virtual pipeline size (`args.virtual_pipeline_model_parallel_size`, None
    without virtual stages): the model chunks each pipeline rank holds, from
    --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank; one
    chunk is no virtual pipeline. Megatron-Core's interleaved schedule splits the layers evenly
    over PP x VP chunks and runs micro-batches in groups of
    --microbatch-group-size-per-virtual-pipeline-stage (default PP)."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    per_layers, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_layers is not None and per_rank is not None:
        fail("--num-layers-per-virtual-pipeline-stage", per_layers,
             f"give either it or --num-virtual-stages-per-pipeline-rank (is {per_rank}), as Megatron-LM requires")
    vp = None
    if per_layers is not None:
        if (layers // pp) % per_layers != 0:
            fail("--num-layers-per-virtual-pipeline-stage", per_layers,
                 f"does not divide the {layers // pp} layers of a pipeline stage (--num-layers {layers} / "
                 f"--pipeline-model-parallel-size {pp}); valid: {divisors(layers // pp)}")
        vp = layers // pp // per_layers
    elif per_rank is not None:
        if layers % (pp * per_rank) != 0:
            fail("--num-virtual-stages-per-pipeline-rank", per_rank,
                 f"Megatron-Core splits the layers evenly over PP x VP = {pp} x {per_rank} model chunks, and "
                 f"--num-layers {layers} does not divide; valid: {divisors(layers // pp)}")
        vp = per_rank
    args.virtual_pipeline_model_parallel_size = vp if vp != 1 else None
    if args.virtual_pipeline_model_parallel_size is None:
        for flag, value, given in (
                ("--microbatch-group-size-per-virtual-pipeline-stage", args.microbatch_group_size_per_vp_stage,
                 args.microbatch_group_size_per_vp_stage is not None),
                ("--no-overlap-p2p-communication", True, not args.overlap_p2p_comm)):
            if given:
                fail(flag, value, "shapes the interleaved schedule of virtual pipeline stages, which this run does "
                     "not use (one model chunk per pipeline rank); add --num-layers-per-virtual-pipeline-stage or "
                     "--num-virtual-stages-per-pipeline-rank, or leave it out")
        return
    vp = args.virtual_pipeline_model_parallel_size
    if args.model_family == "bert":
        fail("--num-layers-per-virtual-pipeline-stage" if per_layers is not None else "--num-virtual-stages-per-pipeline-rank",
             per_layers if per_layers is not None else per_rank,
             "Megatron-Core's BertModel builds no virtual pipeline stage (it takes no vp_stage); valid with "
             "--model-family gpt")
    if pp == 1:
        fail("--pipeline-model-parallel-size", pp, f"virtual pipeline stages ({vp} model chunks per rank) interleave "
             "the stages of a pipeline; valid: 2 or more")
    if not args.overlap_p2p_comm and pp <= 2:
        fail("--no-overlap-p2p-communication", True, f"with --pipeline-model-parallel-size {pp} the batched sends and "
             "receives of the interleaved schedule pair the same two ranks twice in one batch (Megatron-LM requires "
             "PP > 2 then); valid: PP of 3 or more, or leave the flag out")
    micro, group = args.num_micro_batches, args.microbatch_group_size_per_vp_stage
    if group is not None and not pp <= group <= micro:
        fail("--microbatch-group-size-per-virtual-pipeline-stage", group,
             f"must be between --pipeline-model-parallel-size {pp} and the {micro} micro-batches of an iteration")
    group = group or pp
    if micro < pp or 0 < micro % group < pp:
        fail("--global-batch-size", args.global_batch_size,
             f"gives {micro} micro-batches per iteration; the interleaved schedule runs them in groups of {group} "
             f"per virtual stage (--microbatch-group-size-per-virtual-pipeline-stage, default PP {pp}), and needs at "
             f"least PP of them with no last group smaller than PP; valid: a multiple of {group} micro-batches")


def _resolve_train_samples(args):
    """Megatron-LM's sample-based training without batch ramp-up: train-samples // global batch
    iterations, and the schedule's sample counts in iterations (fractional where a count is not a
    multiple of the global batch: Megatron-LM steps its scheduler by the global batch, so the
    learning rate of every iteration is the same)."""
    gbs = args.global_batch_size
    if args.train_samples is None:
        for flag, value, unset in (("--lr-warmup-samples", args.lr_warmup_samples, 0),
                                   ("--lr-decay-samples", args.lr_decay_samples, None)):
            if value != unset:
                fail(flag, value, "counts samples, which only a --train-samples run reads; with --train-iters "
                     f"use {flag.replace('samples', 'iters')}")
        args.lr_warmup_steps = args.lr_warmup_iters
        args.lr_decay_steps = args.lr_decay_iters = args.lr_decay_iters or args.train_iters
        return
    for flag, value, unset in (("--lr-warmup-iters", args.lr_warmup_iters, 0),
                               ("--lr-decay-iters", args.lr_decay_iters, None)):
        if value != unset:
            fail(flag, value, f"counts iterations, which a --train-samples run does not read (Megatron-LM "
                 f"expects sample-based schedules there); use {flag.replace('iters', 'samples')}")
    if args.train_samples < gbs:
        fail("--train-samples", args.train_samples, f"is less than one global batch ({gbs}); valid: >= {gbs}")
    args.train_iters = args.train_iters_from_samples = args.train_samples // gbs
    args.lr_warmup_steps = args.lr_warmup_samples / gbs
    args.lr_decay_steps = (args.lr_decay_samples or args.train_samples) / gbs


def _resolve_learning_rate(args):
    if not args.lr >= 0.0:
        fail("--lr", args.lr, "must be 0 or more")
    if not args.min_lr >= 0.0:
        fail("--min-lr", args.min_lr, "must be 0 or more")
    if args.min_lr > args.lr:
        fail("--min-lr", args.min_lr, f"exceeds --lr={args.lr}; valid: 0 <= min-lr <= lr")
    if not 0.0 <= args.lr_warmup_init <= args.lr:
        fail("--lr-warmup-init", args.lr_warmup_init, f"valid: 0 <= lr-warmup-init <= --lr={args.lr}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        fail("--use-checkpoint-opt_param-scheduler", True, "excludes --override-opt_param-scheduler (as in "
             "Megatron-LM); give one")
    _resolve_train_samples(args)
    unit = "samples" if args.train_samples is not None else "iters"
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            fail("--lr-warmup-fraction", args.lr_warmup_fraction, "valid: a fraction in [0, 1)")
        if args.lr_warmup_steps:
            fail("--lr-warmup-fraction", args.lr_warmup_fraction, f"excludes --lr-warmup-{unit} (as in Megatron-LM); "
                 "give one")
        args.lr_warmup_steps = args.lr_warmup_fraction * args.lr_decay_steps
    if args.lr_warmup_steps >= args.lr_decay_steps:
        decay = getattr(args, f"lr_decay_{unit}") or args.train_samples
        fail(f"--lr-warmup-{unit}", getattr(args, f"lr_warmup_{unit}"),
             f"must be below --lr-decay-{unit}={decay} (Megatron-Core's scheduler requires warmup < decay); "
             f"valid: 0..{decay - 1}")


def _check_partnered_flags(args):
    """Flags Megatron-LM reads only beside another one: it ignores them alone, here they are refused."""
    partnered = (  # (flag, its value, given, partner given, partner)
        ("--moe-router-bias-update-rate", args.moe_router_bias_update_rate,
         args.moe_router_bias_update_rate != RUN_DEFAULTS.moe_router_bias_update_rate,
         args.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        ("--moe-token-drop-policy", args.moe_token_drop_policy,
         args.moe_token_drop_policy != RUN_DEFAULTS.moe_token_drop_policy,
         args.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor"),
        ("--moe-shared-expert-overlap", True, args.moe_shared_expert_overlap,
         args.moe_shared_expert_intermediate_size is not None, "--moe-shared-expert-intermediate-size"),
        ("--mtp-loss-scaling-factor", args.mtp_loss_scaling_factor,
         args.mtp_loss_scaling_factor != RUN_DEFAULTS.mtp_loss_scaling_factor, args.mtp_num_layers is not None,
         "--mtp-num-layers"),
        ("--manual-gc-interval", args.manual_gc_interval, args.manual_gc_interval != 0, args.manual_gc, "--manual-gc"),
        ("--no-manual-gc-eval", True, not args.manual_gc_eval, args.manual_gc, "--manual-gc"),
    )
    for flag, value, given, partner_given, partner in partnered:
        if given and not partner_given:
            fail(flag, value, f"is read only with {partner}; add it or leave this out")


def _check_gpt_data_flags(args):
    """The GPT dataset's end-of-document options (Megatron-Core's GPTDatasetConfig)."""
    gpt_only = (("--reset-position-ids", args.reset_position_ids), ("--reset-attention-mask", args.reset_attention_mask),
                ("--eod-mask-loss", args.eod_mask_loss),
                ("--no-create-attention-mask-in-dataloader", not args.create_attention_mask_in_dataloader))
    for flag, given in gpt_only:
        if given and args.model_family != "gpt":
            fail(flag, True, "it shapes Megatron-Core's GPT dataset; BERT's masked-LM dataset has no such option "
                 "(Megatron-LM's pretrain_bert.py ignores it); valid with --model-family gpt")
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        fail("--reset-attention-mask", True, "the reset mask is the data loader's attention mask, which "
             "--no-create-attention-mask-in-dataloader leaves out (the model's causal mask would attend across "
             "documents); drop one of the two")


def _check_logging_level(args):
    if args.logging_level is not None and args.logging_level not in LOGGING_LEVELS:
        fail("--logging-level", args.logging_level, "not one of Python's logging levels; valid: "
             + ", ".join(f"{level} ({name})" for level, name in LOGGING_LEVELS.items()))


def _check_timing(args):
    if args.timing_log_level != 0:
        fail("--timing-log-level", args.timing_log_level, "levels 1 and 2 time the schedule's phases with Megatron-LM's "
             "timers, which are not built here; valid: 0 (the iteration time of every progress line and record)")


def _check_intervals(args):
    for dest in ("log_interval", "eval_interval", "save_interval"):
        value = getattr(args, dest)
        if value is not None and value <= 0:
            fail(f"--{dest.replace('_', '-')}", value, "must be a positive number of iterations")


def _resolve_device(args):
    # Imported here so that building the parser and the docs stays torch-free.
    import torch

    # --cpu must not touch CUDA at all: the entry point hides the GPUs after validation, which
    # only works while the CUDA runtime has not been initialised.
    args.use_cuda = not args.cpu and torch.cuda.is_available()
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.use_cuda else "gloo"
    if args.distributed_backend == "nccl" and not args.use_cuda:
        fail("--distributed-backend", "nccl",
             "NCCL needs CUDA, which is unavailable or disabled by --cpu; valid here: gloo")
    have_te = importlib.util.find_spec("transformer_engine") is not None
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if args.use_cuda and have_te else "local"
    if args.transformer_impl == "transformer_engine" and not (args.use_cuda and have_te):
        fail("--transformer-impl", "transformer_engine",
             "needs CUDA and the transformer-engine package (pip install "
             "'megatron-patches[gpu]'); valid here: local")
    _resolve_kernel_choices(args, have_te)
    if args.moe_token_dispatcher_type == "flex" and not args.use_cuda:
        fail("--moe-token-dispatcher-type", "flex",
             "the flex dispatcher needs CUDA (DeepEP/HybridEP kernels); valid on CPU: alltoall, "
             "allgather")


def _resolve_kernel_choices(args, have_te: bool) -> None:
    """GPU kernel choices reach Megatron-Core on GPU; on CPU the ones given are listed in
    `args.kernel_choices_not_applied` (one start-up line). Flags that change nothing here
    (FLAGS_WITHOUT_EFFECT) are listed in `args.flags_without_effect`."""
    if args.attention_backend not in ATTENTION_BACKENDS:
        fail("--attention-backend", args.attention_backend, f"unknown value; valid: {', '.join(ATTENTION_BACKENDS)}")
    if args.cross_entropy_fusion_impl not in ("native", "te"):
        fail("--cross-entropy-fusion-impl", args.cross_entropy_fusion_impl, "unknown value; valid: native, te")
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        fail("--no-position-embedding", True, "deprecated, and refused by Megatron-LM except with rope (where it "
             "changes nothing); use --position-embedding-type none")
    actions = build_parser()._actions

    def given(dests) -> list[str]:  # the flags of `dests` set away from their defaults, in parser order
        return [a.option_strings[0] for a in actions if a.dest in dests and getattr(args, a.dest) != a.default]

    # a second validation of the same namespace sees --moe-grouped-gemm already switched off below
    grouped_not_applied = "--moe-grouped-gemm" in getattr(args, "kernel_choices_not_applied", [])
    args.flags_without_effect = given(FLAGS_WITHOUT_EFFECT)
    args.kernel_choices_not_applied = []
    if args.use_cuda:
        needs_te = [flag for flag, on in (("--moe-permute-fusion", args.moe_permute_fusion),
                                          ("--moe-router-fusion", args.moe_router_fusion),
                                          ("--cross-entropy-fusion-impl", args.cross_entropy_fusion_impl == "te")) if on]
        if needs_te and not have_te:
            fail(needs_te[0], True, "needs Transformer Engine (pip install 'megatron-patches[gpu]'); leave it out")
        if args.moe_permute_fusion and args.moe_parallel_mode != "ep":
            fail("--moe-permute-fusion", True, f"{args.moe_parallel_mode} permutes the token copies itself; valid "
                 "with --moe-parallel-mode ep")
        return
    args.kernel_choices_not_applied = given(KERNEL_CHOICES)
    if grouped_not_applied or (args.moe_grouped_gemm and not MODES[args.moe_parallel_mode].grouped_gemm_on_instances):
        # Megatron's GroupedMLP needs CUDA; the experts' arithmetic is the same one after another
        args.moe_grouped_gemm = False
        args.kernel_choices_not_applied.append("--moe-grouped-gemm")


def _instance_grouped_modes() -> list[str]:
    return [spec.name for spec in MODES.values() if spec.grouped_gemm_on_instances]


def _check_precision(args):
    import torch

    from megatron_patches.compat.grouped import grouped_mm_problem

    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are mutually exclusive; choose one (or neither for "
                            "float32)")
    if args.moe_grouped_gemm and not args.bf16 and not MODES[args.moe_parallel_mode].grouped_gemm_on_instances:
        fail("--moe-grouped-gemm", True, "needs --bf16 (as in Megatron-LM) with --moe-parallel-mode "
             f"{args.moe_parallel_mode}; {' and '.join(_instance_grouped_modes())} group their GEMMs in any precision")
    half = args.fp16 or args.bf16
    if args.loss_scale is not None:
        if not half:
            fail("--loss-scale", args.loss_scale, "loss scaling needs --fp16 (or --bf16); float32 "
                 "training has no loss scale")
        if not (math.isfinite(args.loss_scale) and args.loss_scale > 0):
            fail("--loss-scale", args.loss_scale, "must be a finite positive number (a power of 2 "
                 "such as 1024 keeps the scaling exact)")
    for flag, value in (("--initial-loss-scale", args.initial_loss_scale),
                        ("--min-loss-scale", args.min_loss_scale)):
        if not (math.isfinite(value) and value > 0):
            fail(flag, value, "must be a finite positive number")
    if args.min_loss_scale > args.initial_loss_scale:
        fail("--min-loss-scale", args.min_loss_scale,
             f"must not exceed --initial-loss-scale={args.initial_loss_scale:g}")
    if not (math.isfinite(args.loss_scale_window) and args.loss_scale_window >= 1):
        fail("--loss-scale-window", args.loss_scale_window, "must be a finite number >= 1 (the "
             "iterations without overflow before the scale doubles)")
    if args.hysteresis < 1:
        fail("--hysteresis", args.hysteresis, "must be >= 1 (the overflows tolerated before the "
             "scale halves)")
    if args.bf16:
        # Megatron-LM: bfloat16 accumulates and all-reduces gradients in fp32.
        args.accumulate_allreduce_grads_in_fp32 = True
    elif args.accumulate_allreduce_grads_in_fp32 and not args.fp16:
        fail("--accumulate-allreduce-grads-in-fp32", True, "only means something with --fp16 "
             "(float32 gradients are fp32 already; --bf16 always accumulates in fp32)")
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.moe_grouped_gemm and MODES[args.moe_parallel_mode].grouped_gemm_on_instances:
        # the instance modes' grouped matmuls (compat.grouped) in the run's dtype and widths
        ffn = args.moe_ffn_hidden_size // args.expert_tensor_parallel_size
        problem = grouped_mm_problem(args.params_dtype, {
            "--hidden-size": args.hidden_size, "--moe-ffn-hidden-size / --expert-tensor-parallel-size": ffn})
        if problem:
            fail("--moe-grouped-gemm", True, f"{args.moe_parallel_mode}: {problem}; or drop --moe-grouped-gemm")


def _check_recompute(args):
    """Megatron-Core's TransformerConfig rules for activation recompute, as flag errors."""
    granularity, method, layers, modules = (args.recompute_granularity, args.recompute_method,
                                            args.recompute_num_layers, args.recompute_modules)
    if granularity is None:
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers),
                            ("--recompute-modules", modules)):
            if value is not None:
                fail(flag, value if not isinstance(value, list) else " ".join(value),
                     "needs --recompute-granularity full or selective")
        return
    if granularity == "full":
        if method is None or layers is None:
            fail("--recompute-granularity", "full", "needs --recompute-method (uniform or block) "
                 "and --recompute-num-layers")
        chunks = args.virtual_pipeline_model_parallel_size or 1
        per_chunk = args.num_layers // args.pipeline_model_parallel_size // chunks
        lowest = 0 if method == "block" else 1
        if not lowest <= layers <= per_chunk:
            where = "one virtual pipeline stage" if chunks > 1 else "one pipeline stage"
            fail("--recompute-num-layers", layers, f"with --recompute-method {method} it must be "
                 f"between {lowest} and {per_chunk} (the layers of {where})")
        if modules is not None:
            fail("--recompute-modules", " ".join(modules), "is for --recompute-granularity "
                 "selective; full recomputes whole layers")
        return
    if method is not None or layers is not None:
        fail("--recompute-method" if method is not None else "--recompute-num-layers",
             method if method is not None else layers,
             "is for --recompute-granularity full; selective recomputes --recompute-modules in "
             "every layer")
    if modules is not None:
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown or not modules:
            fail("--recompute-modules", " ".join(modules) or "(empty)",
                 f"valid modules: {', '.join(RECOMPUTE_MODULES)}")
        if "moe_act" in modules and not args.moe_grouped_gemm:
            fail("--recompute-modules", "moe_act", "needs --moe-grouped-gemm (Megatron-Core "
                 "recomputes the activation of grouped experts only)")
        if "mla_up_proj" in modules and not args.multi_latent_attention:
            fail("--recompute-modules", "mla_up_proj", "recomputes multi-latent attention's up-projections; "
                 "needs --multi-latent-attention")
        if "shared_experts" in modules and args.moe_shared_expert_intermediate_size is None:
            fail("--recompute-modules", "shared_experts", "needs --moe-shared-expert-intermediate-size")


def _data_prefixes(data_path: list[str]) -> list[str]:
    """The dataset prefixes in Megatron-LM's --data-path forms: one prefix, `weight prefix ...`
    pairs, or a list of prefixes (megatron.core.datasets.utils.get_blend_from_list)."""
    if not data_path:
        fail("--data-path", "(empty)", "give at least one dataset prefix")
    if len(data_path) % 2 == 1:
        return list(data_path)
    weights = data_path[0::2]
    parsed = []
    for weight in weights:
        try:
            parsed.append(float(weight))
        except ValueError:
            parsed.append(None)
    if all(weight is None for weight in parsed):
        return list(data_path)
    if any(weight is None for weight in parsed):
        fail("--data-path", " ".join(data_path),
             "mixes weight/prefix pairs with bare prefixes; valid: `prefix`, `w1 p1 w2 p2 ...` "
             "or `p1 p2 ...`")
    for weight, raw in zip(parsed, weights):
        if not (math.isfinite(weight) and weight > 0):
            fail("--data-path", " ".join(data_path),
                 f"blend weight {raw} must be a positive number")
    return list(data_path[1::2])


def _resolve_data(args):
    if args.mock_data and args.data_path is not None:
        fail("--data-path", " ".join(args.data_path),
             "given together with --mock-data; valid: one data source, --data-path or "
             "--mock-data")
    if args.data_path is not None:
        for prefix in _data_prefixes(args.data_path):
            missing = [f"{prefix}{suffix}" for suffix in (".bin", ".idx")
                       if not Path(f"{prefix}{suffix}").is_file()]
            if missing:
                fail("--data-path", prefix,
                     f"missing {' and '.join(missing)}; each prefix must name a Megatron indexed "
                     "dataset <prefix>.bin + <prefix>.idx (tools/prepare_data.py builds one)")
            problem = index_problem(prefix)
            if problem is not None:
                fail("--data-path", prefix, f"{problem} (tools/prepare_data.py builds a valid dataset)")
    if args.split is None:
        # The embedded corpus has 269 documents: Megatron-LM's 969,30,1 would give its test
        # split none (and Megatron's sampler then loops forever); the test split is unused here.
        embedded = not args.data_path and not args.mock_data
        args.split = EMBEDDED_CORPUS_SPLIT if embedded else DEFAULT_SPLIT
    parts = [part.strip() for part in str(args.split).split(",")]
    try:
        proportions = [float(part) for part in parts]
    except ValueError:
        proportions = None
    if (proportions is None or not 1 <= len(proportions) <= 3
            or any(not (math.isfinite(p) and p >= 0) for p in proportions)
            or sum(proportions) <= 0):
        fail("--split", args.split,
             "valid: 1 to 3 comma-separated non-negative proportions for train,validation,test "
             f"with a positive sum, e.g. {DEFAULT_SPLIT} or 90,5,5")
    if proportions[0] == 0:
        fail("--split", args.split, "gives the training set no data; valid: a positive first proportion")
    evaluates = args.eval_iters > 0 and args.eval_interval and args.eval_interval <= args.train_iters
    if evaluates and (len(proportions) < 2 or proportions[1] == 0):
        # Megatron's validation dataset would be empty and the first evaluation would fail
        fail("--split", args.split,
             f"gives the validation set no data while evaluation is on (--eval-interval {args.eval_interval}, "
             f"--eval-iters {args.eval_iters}); valid: a positive second proportion (e.g. 98,2,0), or --eval-iters 0")


def _resolve_tokenizer(args):
    has_data = args.data_path is not None or args.mock_data
    if args.tokenizer_type is None:
        if args.mock_data:
            args.tokenizer_type = "NullTokenizer"
        elif args.data_path is not None:
            raise ArgumentError(
                "--tokenizer-type is not set: it is required with --data-path (the tokenizer the "
                f"data was prepared with); valid: {', '.join(TOKENIZER_TYPES)}")
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if path is not None and not Path(path).is_file():
            fail(flag, path, "file not found")
    kind = args.tokenizer_type
    if kind in TOKENIZERS_NEEDING_MODEL and args.tokenizer_model is not None:
        # A HuggingFace tokenizer may also be a hub name; only local files can be checked.
        if kind != "HuggingFaceTokenizer" and not Path(args.tokenizer_model).exists():
            fail("--tokenizer-model", args.tokenizer_model, "file not found")
    if not has_data:
        # The default corpus brings its own tokenizer files; the training script sets them.
        return
    needs = []
    if kind in TOKENIZERS_NEEDING_VOCAB_AND_MERGES:
        needs = [("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)]
    elif kind in TOKENIZERS_NEEDING_VOCAB:
        needs = [("--vocab-file", args.vocab_file)]
    elif kind in TOKENIZERS_NEEDING_MODEL:
        needs = [("--tokenizer-model", args.tokenizer_model)]
    elif kind in TOKENIZERS_NEEDING_VOCAB_SIZE:
        needs = [("--vocab-size", args.vocab_size)]
    missing = [flag for flag, value in needs if value is None]
    if missing:
        fail("--tokenizer-type", kind, f"needs {' and '.join(missing)}")


def _resolve_outputs(args):
    outputs.apply_run_dir(args)
    outputs.check_outputs(args)


def _compare_with_checkpoint(args, root: Path, iteration: int) -> None:
    """A changed model shape is refused; every other change goes to `args.resume_changes`,
    which the loop logs after loading."""
    saved = resume.read_flags(checkpoint_dirs.iteration_dir(root, iteration))
    if saved is None:
        args.resume_changes = [f"{checkpoint_dirs.iteration_dir(root, iteration)} holds no {resume.FLAGS_FILE}: flags not compared"]
        return
    compared = [action.dest for action in build_parser()._actions if action.option_strings]
    refused, args.resume_changes = resume.compare(args, saved, compared)
    for dest, before, after, why in refused:
        fail(f"--{dest.replace('_', '-')}", after,
             f"the checkpoint in {root} (iteration {iteration}) was saved with {dest} {before}; {why}")


def _check_checkpointing(args):
    """Sets `args.load_iteration` (the checkpoint to resume from: the tracker's, or the newest
    older one that verifies) and `args.load_notes`."""
    args.load_iteration, args.load_notes = None, []
    if args.save is not None and args.save_interval is None:
        fail("--save", args.save, "needs --save-interval (as in Megatron-LM)")
    if args.ckpt_format != "torch_dist":
        fail("--ckpt-format", args.ckpt_format, "this entry point writes and reads Megatron-Core's distributed "
             "checkpoints with its own manifest (training/checkpoint.py) only; valid: torch_dist")
    if args.dist_ckpt_strictness not in DIST_CKPT_STRICTNESS:
        fail("--dist-ckpt-strictness", args.dist_ckpt_strictness,
             f"unknown value; valid: {', '.join(DIST_CKPT_STRICTNESS)}")
    if args.dist_ckpt_strictness.startswith("return_"):
        fail("--dist-ckpt-strictness", args.dist_ckpt_strictness, "it makes the load return the mismatched keys to "
             "Megatron-LM's own loader, which logs them; here use log_unexpected or log_all for the same report")
    if args.finetune:
        if args.load is None:
            fail("--finetune", True, "loads a checkpoint's model to start from; add --load DIR")
        # Megatron-LM: the model only, from iteration 0, a fresh optimizer, schedule and RNG
        args.no_load_optim = args.no_load_rng = True
    if args.load is None:
        return
    # --save D --load D is how a job that may be preempted is written (launch/submit.py does): the
    # first job finds D missing or empty and starts fresh, every later one resumes
    resumes_own_save = args.save is not None and Path(args.load).resolve() == Path(args.save).resolve()
    valid = ("valid: a directory this script saved checkpoints to, or the --save directory (then "
             "training starts fresh until a checkpoint exists)")
    if not Path(args.load).is_dir():
        if resumes_own_save:
            return
        fail("--load", args.load, f"directory not found; {valid}")
    try:
        tracked = checkpoint_dirs.latest_iteration(args.load)
        if tracked is not None:
            args.load_iteration, args.load_notes = checkpoint_dirs.choose(args.load, tracked)
    except (ValueError, OSError) as error:
        fail("--load", args.load, f"{error}; {valid}")
    if tracked is None:
        if not resumes_own_save:
            fail("--load", args.load, f"holds no checkpoint (no {checkpoint_dirs.TRACKER_FILE}); {valid}")
        return
    _compare_with_checkpoint(args, Path(args.load), args.load_iteration)
    if args.train_iters <= args.load_iteration and not args.finetune:
        # the loop would run no iteration and report a NaN loss
        fail("--train-iters", args.train_iters,
             f"the checkpoint in {args.load} is at iteration {args.load_iteration}, so there is nothing left to "
             f"train; valid: more than {args.load_iteration}")
