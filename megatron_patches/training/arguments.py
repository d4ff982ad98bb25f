"""The training script's flags: Megatron-LM's flag table and the parser assembly.

Megatron-Core ships no `megatron.training`, so this module re-creates the part of Megatron-LM's
`megatron/training/arguments.py` flag table that a GPT/BERT MoE pre-training run needs. Flag
names, dest names, types, defaults and meanings are Megatron-LM's; where a default differs (to
make the no-flag run a short CPU job, or because this product needs it) the flag's help says
so. The product's general flags (--config, --model-family, --moe-parallel-mode,
--moe-load-window, --log-json, --moe-log-loads, --cpu) sit beside them. Each MoE mode adds its
own group from its package (`<mode>/config.py`, through the registry in `training/modes.py`).

Everything runs before any process group exists:

    args = parse_args()                 # parser defaults < --config YAML files < explicit CLI flags
                                        # (the YAML layer: training/yaml_config.py)
    args = validate_args(args, world)   # training/validation.py: derived values, ArgumentError
    print(describe_args(args))          # training/flag_docs.py: every value, grouped by concern

docs/flags.md is generated from the parser (a test keeps it in sync):

    python -m megatron_patches.training.flag_docs > docs/flags.md
"""

import argparse
import signal
import sys
from pathlib import Path

import megatron_patches
from megatron_patches.config.flags import ArgumentError, close_names, moe_layer_freq
from megatron_patches.config.models import ROUTER_SCORE_FUNCTIONS
from megatron_patches.config.run import RUN_DEFAULTS
from megatron_patches.placement.loads import LOAD_PREDICTORS
from megatron_patches.training import megatron_lm
from megatron_patches.training.modes import MODES, MOE_PARALLEL_MODES
from megatron_patches.training.yaml_config import load_yaml

REPO_ROOT = Path(megatron_patches.__file__).resolve().parents[1]

# The embedded default job: the tiny GPT-MoE model and a short CPU run of it. Loaded only when
# the command line names no --config and gives none of MODEL_SIZE_FLAGS; its other flags then
# override the job's values.
EMBEDDED_JOB = (REPO_ROOT / "configs" / "models" / "tiny.yaml", REPO_ROOT / "configs" / "tiny_job.yaml")

# Flags that exclude each other (Megatron-LM refuses both): given on the command line, one
# replaces a --config file's value of the other.
EXCLUSIVE_FLAGS = (("--train-iters", "--train-samples"),)

# The flags that size a model. A command line with any of them describes the user's own model:
# every flag it does not give takes Megatron-LM's default and derivation (--ffn-hidden-size 4h,
# --moe-ffn-hidden-size = --ffn-hidden-size, no --num-experts = dense), never a value of the
# embedded tiny model's, which a Megatron-LM script would otherwise inherit silently.
MODEL_SIZE_FLAGS = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--kv-channels",
                    "--num-query-groups", "--num-experts", "--moe-ffn-hidden-size")

MODEL_FAMILIES = ("gpt", "bert")

# Megatron-LM's --normalization choices.
NORMALIZATIONS = ("LayerNorm", "RMSNorm")

# Megatron-LM's --position-embedding-type choices that a GPT/BERT MoE model uses (mrope and
# relative need multimodal / Transformer-Engine-only model code).
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")

# Megatron-LM's --lr-decay-style choices that Megatron-Core's OptimizerParamScheduler implements
# without further flags (WSD needs its own annealing flags and is not offered).
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")

# TransformerConfig.moe_token_dispatcher_type in megatron-core 0.16.1.
TOKEN_DISPATCHER_TYPES = ("alltoall", "allgather", "flex")

# Megatron-Core's recompute_modules that a GPT/BERT MoE model of this product has (mla_up_proj
# needs multi-latent attention, shared_experts needs shared experts).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mlp", "moe", "mla_up_proj", "shared_experts")

# Megatron-LM's --moe-router-score-function, --moe-router-dtype and --moe-token-drop-policy choices.
ROUTER_DTYPES = ("fp32", "fp64")
TOKEN_DROP_POLICIES = ("probs", "position")

# Today's MoE model features and routing options train in every mode: shared experts are dense
# and data-parallel beside the placed routed experts (zebra: on its attention ranks); MLA changes
# only the attention; Megatron's router and its expert bias run unchanged (zebra calls the router
# itself and moves the bias as Megatron's finalize_model_grads does); MTP's layers are placed as
# MoE layers after the decoder's.

# Megatron-LM's --moe-router-load-balancing-type choices.
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")

# The tokenizer types megatron.core's build_tokenizer() accepts
# (megatron/core/tokenizers/text/utils/build_tokenizer.py in megatron-core 0.16.1; a test
# re-reads that file), grouped by the files each one needs.
TOKENIZERS_NEEDING_VOCAB_AND_MERGES = ("GPT2BPETokenizer",)
TOKENIZERS_NEEDING_VOCAB = ("BertWordPieceLowerCase", "BertWordPieceCase")
TOKENIZERS_NEEDING_MODEL = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
)
TOKENIZERS_NEEDING_VOCAB_SIZE = ("NullTokenizer",)
TOKENIZER_TYPES = (
    TOKENIZERS_NEEDING_VOCAB
    + TOKENIZERS_NEEDING_VOCAB_AND_MERGES
    + TOKENIZERS_NEEDING_MODEL
    + TOKENIZERS_NEEDING_VOCAB_SIZE
)

DISTRIBUTED_BACKENDS = ("nccl", "gloo")
TRANSFORMER_IMPLS = ("local", "transformer_engine")

# Megatron-LM's split when --data-path is given without --split.
DEFAULT_SPLIT = "969,30,1"
EMBEDDED_CORPUS_SPLIT = "949,51,0"

# Values that parse_args() and validate_args() add to the namespace (not flags); describe_args() lists them
# in their own group.
DERIVED_VALUES = {
    "world_size": "number of ranks, as given to validate_args",
    "data_parallel_size": "world size / (TP x PP); in zebra mode the number of attention ranks",
    "expert_data_parallel_size": "world size / (PP x ETP x EP)",
    "num_micro_batches": "global batch / (micro batch x data-parallel size)",
    "virtual_pipeline_model_parallel_size": "model chunks per pipeline rank (Megatron-LM's derivation from "
                                            "--num-layers-per-virtual-pipeline-stage or "
                                            "--num-virtual-stages-per-pipeline-rank); None without virtual stages",
    "params_dtype": "torch dtype of the parameters: float32, or bfloat16/float16 with --bf16/--fp16",
    "use_cuda": "True when CUDA is available and --cpu is not given",
    "load_iteration": "the checkpoint a --load resumes from: the tracker's, or the newest older one that verifies "
                      "(training/checkpoint_dirs.py); None when there is none yet",
    "load_notes": "what choosing that checkpoint found (a fallback, a checkpoint without a manifest), logged at the load",
    "train_iters_from_samples": "--train-samples // global batch, the run's --train-iters (sample-based runs only)",
    "lr_warmup_steps": "the scheduler's warm-up in iterations: --lr-warmup-iters, --lr-warmup-samples / global batch, or "
                       "--lr-warmup-fraction x the decay",
    "lr_decay_steps": "the scheduler's decay in iterations: --lr-decay-iters (default --train-iters), or "
                      "--lr-decay-samples (default --train-samples) / global batch",
    "kernel_choices_not_applied": "GPU kernel choices given on a CPU run (listed at start-up, not applied)",
    "flags_without_effect": "Megatron-LM flags given that change nothing here, each with why (listed at start-up)",
    "model_source": "where the model's values came from: --config files, the command line (Megatron-LM's defaults "
                    "for the rest), or the embedded tiny job",
}

__all__ = ["ArgumentError", "MOE_PARALLEL_MODES", "build_parser", "parse_args"]


def signal_name(name: str) -> signal.Signals:
    """--exit-signal's values: Megatron-LM's, a signal's name (SIGTERM, SIGUSR1, ...)."""
    try:
        return signal.Signals[name]
    except KeyError:
        valid = ", ".join(s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2))
        raise argparse.ArgumentTypeError(f"{name!r} is not a signal name; valid: {valid}, ...") from None


# ----------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's errors (an unknown flag, a value of the wrong type) as one line with a hint,
    raised as ArgumentError like every other refusal, instead of its usage text (a hundred lines
    that bury the one naming the problem) and its own exit."""

    def error(self, message: str):
        unknown = [token.split("=")[0] for token in message.split() if token.startswith("--")
                   ] if message.startswith("unrecognized arguments") else []
        # Megatron-LM's own flags that this entry point refuses: the reason and what to do instead
        refusals = [r.message(token) for token in unknown if (r := megatron_lm.refusal(token)) is not None]
        if refusals:
            raise ArgumentError("; ".join(refusals))
        options = [option for action in self._actions for option in action.option_strings]
        hints = [f"{token}: did you mean {', '.join(close)}?" for token in unknown if (close := close_names(token, options))]
        raise ArgumentError("; ".join([message, *hints, "valid flags: pretrain_gpt_moe.py --help, docs/flags.md"]))


def build_parser() -> argparse.ArgumentParser:
    """The training script's parser, argument groups in the order describe_args() prints them."""
    parser = _Parser(
        prog="pretrain_gpt_moe.py",
        description="GPT/BERT MoE pre-training on Megatron-Core with load-adaptive expert "
        "placement. Flags use Megatron-LM's names; YAML configs (--config) use the dest names.",
        allow_abbrev=False,
    )
    _add_config_args(parser)
    _add_model_args(parser)
    _add_latent_attention_args(parser)
    _add_moe_args(parser)
    for mode in MODES.values():
        mode.add_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_regularization_args(parser)
    _add_mixed_precision_args(parser)
    _add_recompute_args(parser)
    _add_kernel_choice_args(parser)
    _add_data_args(parser)
    _add_tokenizer_args(parser)
    _add_checkpointing_args(parser)
    _add_validation_args(parser)
    _add_logging_args(parser)
    return parser


def _add_config_args(parser):
    group = parser.add_argument_group(title="config")
    group.add_argument(
        "--config", action="append", default=None, metavar="FILE.yaml",
        help="YAML file of flag values; keys are the flags' dest names (--num-layers -> "
        "num_layers). May be repeated: later files win, and explicit command-line flags win over "
        "all files. Without --config, and when no model-size flag (--num-layers, --hidden-size, "
        "--ffn-hidden-size, --num-attention-heads, --kv-channels, --num-query-groups, --num-experts, "
        "--moe-ffn-hidden-size) is given, the embedded tiny job is loaded (configs/models/tiny.yaml "
        "and configs/tiny_job.yaml); otherwise unset flags take Megatron-LM's defaults. New flag.",
    )


def _add_model_args(parser):
    group = parser.add_argument_group(title="model")
    group.add_argument(
        "--model-family", type=str, default="gpt",
        help=f"Model family: {' or '.join(MODEL_FAMILIES)} (GPTModel, causal LM; BertModel, "
        "masked LM). New flag.",
    )
    group.add_argument("--num-layers", type=int, default=None,
                       help="Number of transformer layers. Required (the embedded tiny job sets it).")
    group.add_argument("--hidden-size", type=int, default=None,
                       help="Transformer hidden size. Required (the embedded tiny job sets it).")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Transformer Feed-Forward Network hidden size. "
                       "This is set to 4*hidden-size if not provided (with --swiglu, "
                       "int(4*hidden-size*2/3/64)*64, as Megatron-LM does).")
    group.add_argument("--num-attention-heads", type=int, default=None,
                       help="Number of transformer attention heads. Required "
                       "(the embedded tiny job sets it).")
    group.add_argument("--seq-length", type=int, default=None,
                       help="Maximum sequence length to process. Required "
                       "(the embedded tiny job sets it).")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Maximum number of position embeddings to use. This is the size of "
                       "position embedding. Default: --seq-length (Megatron-LM requires it).")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Projection weights dimension in multi-head attention. This is set to "
                       "hidden-size // num-attention-heads if not provided.")
    group.add_argument("--group-query-attention", action="store_true",
                       help="Use group-query attention.")
    group.add_argument("--num-query-groups", type=int, default=1,
                       help="Number of key/value head groups with --group-query-attention.")
    group.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                       help=f"Position embedding type: {', '.join(POSITION_EMBEDDING_TYPES)} "
                       "(Megatron-LM also has mrope and relative, which GPT/BERT MoE models here "
                       "do not use).")
    group.add_argument("--rotary-base", type=int, default=10000,
                       help="Base to use for rotary positional embeddings, default 10000.")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Use rotary positional embeddings or not. Deprecated: use "
                       "--position-embedding-type (it sets --position-embedding-type rope, as in "
                       "Megatron-LM).")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Percent of rotary dimension to use, default 100%%. Refused without rope "
                       "(Megatron-LM ignores it there).")
    group.add_argument("--rotary-interleaved", action="store_true",
                       help="True is rotate pairs of even and odd dimensions (RoFormer style), False is "
                       "rotate pairs of first half and second half (LLaMa style). Default to False. "
                       "Refused without rope.")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Sequence length interpolation factor for rotary embeddings. Refused "
                       "without rope.")
    group.add_argument("--qk-layernorm", action="store_true",
                       help="Whether to apply `normalization` type of normalization to the query and "
                       "key embeddings. GPT only (Megatron-Core's BERT layer spec has no such norm).")
    group.add_argument("--add-qkv-bias", action="store_true",
                       help="Add a bias term only for QKV projections (set with the linear biases, as "
                       "Megatron-LM does; it matters with --disable-bias-linear).")
    group.add_argument("--normalization", type=str, default="LayerNorm",
                       help=f"Which normalization technique to use: {', '.join(NORMALIZATIONS)}.")
    group.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5,
                       help="Epsilon value for any LayerNorm/RMSNorm operations.")
    group.add_argument("--swiglu", action="store_true",
                       help="Use gated linear units and SiLU activation instead of default gelu.")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Untie embeddings and output weights.")
    group.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                       help="Disable BERT binary head (sentence-order prediction).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocab size to be divisible by this value. "
                       "This is added for computational efficiency reasons.")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="Disable bias in the linear layers.")
    group.add_argument("--init-method-std", type=float, default=RUN_DEFAULTS.init_method_std,
                       help="Standard deviation of the zero mean normal distribution used for "
                       "weight initialization.")
    group.add_argument("--use-cpu-initialization", action="store_true", default=None,
                       help="If set, initialize weights on the CPU (every CPU run does). On GPU the "
                       "initial weights are then those of a CPU run with the same seed, so the two "
                       "runs' losses can be compared (tools/device_check.py).")
    group.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models",
                       help="DEPRECATED in Megatron-LM, where Megatron-Core models are the default: the "
                       "only models here. Accepted, and named in the start-up line of flags without effect.")
    group.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                       help="Disable position embedding. Deprecated: use --position-embedding-type. As in "
                       "Megatron-LM, accepted only with rope, where it changes nothing (named in the "
                       "start-up line of flags without effect).")
    group.add_argument("--seed", type=int, default=1234,
                       help="Random seed used for python, numpy, pytorch, and cuda.")


def _add_latent_attention_args(parser):
    group = parser.add_argument_group(title="multi-latent attention and multi-token prediction")
    group.add_argument("--multi-latent-attention", action="store_true",
                       help="Whether to use multi-latent attention (DeepSeek-V2/V3). GPT only; excludes "
                       "--group-query-attention. On CPU through Megatron's local attention. In every mode.")
    group.add_argument("--q-lora-rank", type=int, default=None,
                       help="Rank of Query tensor's low rank representation (MLA; default: none, queries "
                       "projected directly).")
    group.add_argument("--kv-lora-rank", type=int, default=32,
                       help="Rank of Key and Value tensors' low rank representation (MLA).")
    group.add_argument("--qk-head-dim", type=int, default=128,
                       help="Dimension of the head in the QK projection. q_head_dim = qk_head_dim + "
                       "qk_pos_emb_head_dim (MLA).")
    group.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                       help="Dimension of the position embedding in the QK projection (MLA).")
    group.add_argument("--v-head-dim", type=int, default=128,
                       help="Dimension of the head in the V projection (MLA).")
    group.add_argument("--rope-type", type=str, default=None,
                       help="Type of rope to use: rope or yarn. Note that MLA takes yarn by default, and "
                       "common attention takes rope by default (and only rope).")
    group.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                       help="Rotary scaling factor for the rotary embeddings (MLA's YaRN; refused without MLA).")
    group.add_argument("--mscale", type=float, default=1.0,
                       help="Mscale for YaRN RoPE in multi-latent attention (refused without MLA).")
    group.add_argument("--mscale-all-dim", type=float, default=0.0,
                       help="Mscale all dimensions for YaRN RoPE in multi-latent attention (refused without MLA).")
    group.add_argument("--mtp-num-layers", type=int, default=None,
                       help="Number of Multi-Token Prediction (MTP) Layers. Each predicts one token further "
                       "through one transformer layer like the decoder's last, sharing the embedding and "
                       "output layer. GPT only; on the last pipeline stage. In every mode.")
    group.add_argument("--mtp-loss-scaling-factor", type=float, default=RUN_DEFAULTS.mtp_loss_scaling_factor,
                       help="Weighting factor of Multi-Token Prediction (MTP) loss. We compute the average "
                       "of the MTP losses across all depths, and multiply it the scaling factor to obtain "
                       "the overall MTP loss, which serves as an additional training objective.")


def _add_moe_args(parser):
    group = parser.add_argument_group(title="moe")
    group.add_argument("--num-experts", type=int, default=None,
                       help="Number of Experts in MoE. Required: without it (or with 0) the model is "
                       "dense, which Megatron-LM trains with pretrain_gpt.py and this entry point "
                       "refuses, since every --moe-parallel-mode places experts.")
    group.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                       help="Frequency between MoE layers and Dense layers. Accepts either an "
                       "integer N (layers 0, N, 2N, ... are MoE) or a Python list expression of "
                       "0 (dense) / 1 (MoE) per layer, e.g. ([1]*3+[0]*1)*3; in YAML also a plain "
                       "list of 0/1.")
    group.add_argument("--moe-router-topk", type=int, default=2,
                       help="Number of experts to route to for each token. The default is 2.")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="Enable pre-softmax routing for MoE, which means softmax is before the "
                       "top-k selection. Switched on automatically with --moe-router-topk 1 "
                       "(Megatron-Core refuses top-1 without it: a softmax over one selected expert "
                       "is always 1, so the router would get no gradient).")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="Shared expert total ffn hidden size. It should be equal to 'num_shared_experts * "
                       "ffn_size_of_each_shared_expert' if there are multiple shared experts. Every token "
                       "passes through it beside its routed experts; needs --disable-bias-linear. "
                       "In every mode: dense and data-parallel in ep, fssdp and replicate, on the attention "
                       "ranks in zebra.")
    group.add_argument("--moe-shared-expert-gate", action="store_true",
                       help="Enable gate for shared expert. Only effective when "
                       "moe-shared-expert-intermediate-size is set (refused without it).")
    group.add_argument("--moe-router-score-function", type=str, default="softmax",
                       help=f"Score function for MoE routing: {', '.join(ROUTER_SCORE_FUNCTIONS)}.")
    group.add_argument("--moe-router-enable-expert-bias", action="store_true",
                       help="TopK routing with dynamic per-expert bias in the aux-loss-free load balancing "
                       "strategy. The routing decision is based on the sum of the routing scores and the "
                       "expert bias. See https://arxiv.org/abs/2408.15664 for details. Needs "
                       "--moe-router-score-function sigmoid.")
    group.add_argument("--moe-router-bias-update-rate", type=float, default=RUN_DEFAULTS.moe_router_bias_update_rate,
                       help="The expert bias is increased for the experts with less assigned tokens and "
                       "decreased for the experts with more assigned tokens, by this much per iteration. "
                       "The default value 1e-3 is same as that used in DeepSeekV3.")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                       help="Scaling factor for routing score in top-k selection.")
    group.add_argument("--moe-router-num-groups", type=int, default=None,
                       help="Number of groups to divide experts into for group-limited routing: for each "
                       "token, --moe-router-group-topk groups are selected by the sum of their top-(topk / "
                       "group-topk) scores, and the --moe-router-topk experts are chosen from those groups "
                       "(DeepSeek-V2/V3's device- and node-limited routing).")
    group.add_argument("--moe-router-group-topk", type=int, default=None,
                       help="Number of selected groups for group-limited routing.")
    group.add_argument("--moe-router-dtype", type=str, default=None,
                       help="Data type for routing and expert output weighted averaging: fp32 or fp64. "
                       "Using fp32 or fp64 can improve stability especially when the number of experts "
                       "is large (e.g. finegrained-moe). None means no changes for dtype.")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None,
                       help="Scaling coefficient for the z-loss. A starting value of 1e-3 is recommended.")
    group.add_argument("--moe-input-jitter-eps", type=float, default=None,
                       help="Add noise to the input tensor by applying jitter with a specified epsilon "
                       "value.")
    group.add_argument("--moe-token-drop-policy", type=str, default=RUN_DEFAULTS.moe_token_drop_policy,
                       help="The policy to drop tokens with --moe-expert-capacity-factor: probs drops the "
                       "tokens with the lowest probabilities, position the tokens at the end of each batch.")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="The hidden size of each expert's feed-forward network (ffn). "
                       "If not specified, defaults to the ffn_hidden_size.")
    group.add_argument("--moe-aux-loss-coeff", type=float, default=RUN_DEFAULTS.moe_aux_loss_coeff,
                       help="Scaling coefficient for the aux loss: a starting value of 1e-2 is "
                       "recommended. One value (Megatron-LM also takes one per balancing type).")
    group.add_argument(
        "--moe-router-load-balancing-type", type=str, default=RUN_DEFAULTS.moe_router_load_balancing_type,
        help="Determines the load balancing strategy for the router: "
        f"{', '.join(LOAD_BALANCING_TYPES)}. aux_loss is GShard/Switch's loss, seq_aux_loss "
        "DeepSeekV2's per-sample loss, sinkhorn S-BASE's balancing, none no balancing. One value "
        "(Megatron-LM also takes a list).",
    )
    group.add_argument(
        "--moe-token-dispatcher-type", type=str, default=RUN_DEFAULTS.moe_token_dispatcher_type,
        help=f"The type of token dispatcher to use: {', '.join(TOKEN_DISPATCHER_TYPES)}. "
        "Default alltoall (Megatron-LM: allgather, whose help recommends alltoall with expert "
        "parallelism): the all-to-all dispatcher is the EP baseline that this product's placement "
        "modes are compared with. flex needs CUDA (DeepEP/HybridEP kernels).",
    )
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="The capacity factor for each expert, None means no token will be "
                       "dropped.")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                       help="Pads the input for each expert to match the expert capacity length, "
                       "effective only after the --moe-expert-capacity-factor is set.")
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="When there are multiple experts per rank, compute them with one "
                       "grouped GEMM. ep: Megatron's GroupedMLP, needs CUDA and --bf16 (as in "
                       "Megatron-LM). fssdp / replicate: the instances of a layer run as torch "
                       "grouped matmuls over their weight rows, on CPU or GPU in any precision, "
                       "without biases (--disable-bias-linear).")
    group.add_argument(
        "--moe-parallel-mode", type=str, default="ep",
        help="How expert parameters are placed and synchronised: "
        + "; ".join(f"{spec.name}: {spec.summary}" for spec in MODES.values())
        + ". New flag.",
    )
    windows = ", ".join(f"{spec.default_load_window} in {spec.name} mode" for spec in MODES.values()
                        if spec.default_load_window is not None)
    group.add_argument(
        "--moe-load-window", type=int, default=None,
        help=f"Iterations averaged to predict the next iteration's expert loads (default {windows}; "
        "refused by the modes that place experts statically). New flag.",
    )
    group.add_argument(
        "--moe-load-predictor", choices=LOAD_PREDICTORS, default=None,
        help="How the next iteration's expert loads are predicted from the last --moe-load-window "
        "ones. adaptive (default): per layer, the window among 1, 2, 4, ..., --moe-load-window whose "
        "predictions of the recent iterations were closest (short windows follow drifting loads, "
        "long ones smooth noise); mean: the mean of all --moe-load-window iterations (DESIGN 4.1). "
        "Refused by the modes that place experts statically. New flag.",
    )


def _add_parallel_args(parser):
    group = parser.add_argument_group(title="parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1,
                       help="Degree of tensor model parallelism.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="Degree of pipeline model parallelism.")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Number of layers per virtual pipeline stage: each pipeline rank holds "
                       "(layers per stage / this) model chunks and Megatron's interleaved 1F1B schedule runs "
                       "them. Excludes --num-virtual-stages-per-pipeline-rank.")
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                       help="Number of virtual pipeline stages per pipeline parallelism rank (model chunks "
                       "per rank, Megatron's interleaved 1F1B schedule). Excludes "
                       "--num-layers-per-virtual-pipeline-stage.")
    group.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                       dest="microbatch_group_size_per_vp_stage",
                       help="With virtual pipeline stages: micro-batches run at a time for one virtual stage, "
                       "forward and backward. Default: --pipeline-model-parallel-size (a depth-first "
                       "schedule); at least PP and at most the micro-batches of an iteration, whose last group "
                       "must hold none or at least PP of them.")
    group.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                       help="With virtual pipeline stages: send and receive activations in batched calls after "
                       "each chunk's step instead of overlapping them with its compute (Megatron-LM's default "
                       "overlaps; batched needs --pipeline-model-parallel-size > 2). Without virtual stages "
                       "the schedule always batches.")
    group.add_argument(
        "--expert-model-parallel-size", type=int, default=None,
        help="Degree of expert model parallelism. Default (Megatron-LM: 1): the largest divisor "
        "of --num-experts for which world-size/PP is divisible by ETP x EP; with ETP = TP that is "
        "the largest divisor of --num-experts that divides the data-parallel size, so "
        "`torchrun --nproc-per-node 4` with 8 experts uses EP=4 and a single process EP=1.",
    )
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Degree of context parallelism. Only 1 (no context parallelism): Megatron-Core "
                       "0.16.1 splits attention over the sequence only in Transformer Engine's attention, and "
                       "the placement modes plan expert loads per full sequence; not built yet.")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="Degree of tensor model parallelism of the experts. Default is None, "
                       "which will be set to the value of --tensor-model-parallel-size.")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Enable sequence parallel optimization. Required for MoE with "
                       "--tensor-model-parallel-size > 1 (Megatron-Core refuses otherwise); "
                       "turned off when TP is 1, as Megatron-LM does.")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Use distributed optimizer.")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="If set, overlap DDP grad reduce.")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="If set, overlap param all-gather in distributed optimizer. "
                       "Needs --use-distributed-optimizer and --overlap-grad-reduce.")
    group.add_argument(
        "--distributed-backend", type=str, default=None,
        help="Which backend to use for distributed training: nccl or gloo. Default: nccl with "
        "CUDA, gloo on CPU (Megatron-LM: nccl).",
    )
    group.add_argument(
        "--transformer-impl", type=str, default=None,
        help="Which Transformer implementation to use: local or transformer_engine. Default: "
        "transformer_engine when CUDA and Transformer Engine are available, else local "
        "(Megatron-LM: transformer_engine).",
    )
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Default timeout minutes for torch.distributed (a collective that waits "
                       "longer fails). --stall-timeout usually ends a stalled run first.")
    group.add_argument("--cpu", action="store_true",
                       help="Run on CPU (gloo) even when CUDA is available. Default: use CUDA "
                       "when available. New flag.")


def _add_training_args(parser):
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=None,
                       help="Batch size per model instance (local batch size). Global batch size "
                       "is local batch size times data parallel size times number of micro "
                       "batches. Required (the embedded tiny job sets 4).")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Training batch size; must be a multiple of micro-batch-size times "
                       "data-parallel-size. Default: micro-batch-size x data-parallel-size "
                       "(one micro-batch per iteration), as Megatron-LM does when it is not given.")
    group.add_argument("--train-iters", type=int, default=None,
                       help="Total number of iterations to train over all training runs. "
                       "Either it or --train-samples is required (the embedded tiny job sets 200).")
    group.add_argument("--train-samples", type=int, default=None,
                       help="Total number of samples to train over all training runs. Note that "
                       "either train_iters or train_samples should be provided. The run trains "
                       "train-samples // global-batch-size iterations, as Megatron-LM does without "
                       "--rampup-batch-size (which is not built).")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Exit the program after the iteration is divisible by this value: "
                       "save a checkpoint (with --save), then exit with code 0.")
    group.add_argument("--exit-duration-in-mins", type=int, default=None,
                       help="Exit the program after this many minutes of training: the first rank "
                       "past it decides for all, a checkpoint is saved (with --save), exit code 0.")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="Dynamically save the checkpoint and shutdown the training if "
                       "--exit-signal (SIGTERM) is received by any rank: every rank stops after "
                       "the iteration in progress, a checkpoint is saved (with --save), exit code 0. "
                       "launch/submit.py then asks Slurm for that signal before the time limit "
                       "(#SBATCH --signal).")
    group.add_argument("--exit-signal", type=signal_name, default=signal.SIGTERM,
                       help="Signal for the signal handler to detect, by name (SIGTERM, SIGUSR1, ...).")
    group.add_argument("--manual-gc", action="store_true",
                       help="Disable the threshold-based default garbage collector and trigger the "
                       "garbage collection manually, at the same iterations on every rank.")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="Training step interval to trigger manual garbage collection. Values > 0 "
                       "will trigger garbage collections between training steps.")
    group.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="When using manual garbage collection, this controls garbage collection at "
                       "the start and the end of each evaluation run (on by default).")
    group.add_argument("--max-nonfinite-steps", type=int, default=0,
                       help="Steps with a non-finite loss or gradient (NaN or infinity on any "
                       "rank) to skip before the run stops with exit code 3; a skipped step "
                       "leaves every weight as it was, and a stopped run writes no checkpoint "
                       "of the bad state. Default 0: stop at the first. fp16's loss-scale "
                       "overflows are not counted (the loss scale handles them). New flag.")
    group.add_argument("--stall-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="End the job (exit code 4) when a rank stops running, or no rank "
                       "completes an iteration, evaluation or checkpoint, for this long, naming "
                       "the rank, its host and its last completed step "
                       "(training/watchdog.py). 0 disables it. Default 300: above a checkpoint "
                       "save or an evaluation of the paper models; raise it where those take "
                       "longer. New flag.")


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=None,
                       help="Initial learning rate. Depending on decay style and initial warmup, "
                       "the learning rate at each iteration would be different. Required (the "
                       "embedded tiny job sets 1e-3).")
    group.add_argument("--min-lr", type=float, default=0.0,
                       help="Minimum value for learning rate. The scheduler clips values below "
                       "this threshold.")
    group.add_argument("--lr-decay-style", type=str, default="linear",
                       help=f"Learning rate decay function: {', '.join(LR_DECAY_STYLES)}.")
    group.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="Number of iterations to linearly warmup learning rate over.")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Number of iterations to decay learning rate over. If None defaults "
                       "to --train-iters.")
    group.add_argument("--lr-warmup-samples", type=int, default=0,
                       help="Number of samples to linearly warmup learning rate over (with "
                       "--train-samples).")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="Number of samples to decay learning rate over, If None defaults to "
                       "train samples (with --train-samples).")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Fraction of lr-decay-(iters/samples) to use for warmup (as a float), in "
                       "place of --lr-warmup-iters / --lr-warmup-samples.")
    group.add_argument("--lr-warmup-init", type=float, default=0.0,
                       help="Initial value for learning rate warmup. The scheduler starts warmup from "
                       "this value.")
    group.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                       action="store_true",
                       help="Use checkpoint to set the values of the scheduler (learning rate, warmup "
                       "iterations, minimum learning rate, maximum number of iterations, and decay "
                       "style) from checkpoint and ignore input arguments. What a --load does here "
                       "anyway unless --override-opt_param-scheduler is given (the two exclude each "
                       "other, as in Megatron-LM).")


def _add_regularization_args(parser):
    group = parser.add_argument_group(title="regularization and optimizer")
    group.add_argument("--weight-decay", type=float, default=0.01,
                       help="Weight decay coefficient for L2 regularization.")
    group.add_argument("--clip-grad", type=float, default=1.0,
                       help="Gradient clipping based on global L2 norm (0 disables clipping).")
    group.add_argument("--adam-beta1", type=float, default=0.9,
                       help="First coefficient for computing running averages of gradient and "
                       "its square.")
    group.add_argument("--adam-beta2", type=float, default=0.999,
                       help="Second coefficient for computing running averages of gradient and "
                       "its square.")
    group.add_argument("--adam-eps", type=float, default=1e-08,
                       help="Term added to the denominator to improve numerical stability.")
    group.add_argument("--hidden-dropout", type=float, default=RUN_DEFAULTS.hidden_dropout,
                       help="Dropout probability for hidden state transformer.")
    group.add_argument("--attention-dropout", type=float, default=RUN_DEFAULTS.attention_dropout,
                       help="Post attention dropout probability.")


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--bf16", action="store_true",
                       help="Run model in bfloat16 mode: the model's weights, activations and "
                       "gradients in bfloat16, fp32 main weights and Adam state in the optimizer, "
                       "gradients accumulated and all-reduced in fp32.")
    group.add_argument("--fp16", action="store_true",
                       help="Run model in fp16 mode: as --bf16 in float16, with loss scaling "
                       "(dynamic unless --loss-scale). One loss scale and one overflow decision "
                       "for the whole world: a step with an inf/nan in any gradient of any rank "
                       "is skipped by every rank.")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="Static loss scaling, positive power of 2 values can improve fp16 "
                       "convergence. If None, dynamic loss scaling is used.")
    group.add_argument("--initial-loss-scale", type=float, default=2**32,
                       help="Initial loss-scale for dynamic loss scaling.")
    group.add_argument("--min-loss-scale", type=float, default=1.0,
                       help="Minimum loss scale for dynamic loss scaling.")
    group.add_argument("--loss-scale-window", type=float, default=1000,
                       help="Window over which to raise/lower dynamic scale.")
    group.add_argument("--hysteresis", type=int, default=2,
                       help="hysteresis for dynamic loss scaling")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="Gradient accumulation and all-reduce in fp32. Always on with --bf16 "
                       "(as in Megatron-LM); with --fp16 the gradients are accumulated and "
                       "reduced in float16 unless this is set.")
    group.add_argument("--attention-softmax-in-fp32", action="store_true",
                       help="Run attention masking and softmax in fp32.")


def _add_recompute_args(parser):
    group = parser.add_argument_group(title="activation recompute")
    group.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                       help="Checkpoint activations to allow for training with larger models, "
                       "sequences, and batch sizes. It is supported at two granularities 1) full: "
                       "whole transformer layer is recomputed, 2) selective: submodules set in "
                       "--recompute-modules are recomputed, default is core_attn.")
    group.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                       help="1) uniform: uniformly divide the total number of Transformer layers "
                       "and recompute the input activation of each divided chunk at specified "
                       "granularity, 2) block: recompute the input activations of only a set "
                       "number of individual Transformer layers per pipeline stage and do the rest "
                       "without any recomputing at specified granularity. Needed with "
                       "--recompute-granularity full.")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="1) uniform: the number of Transformer layers in each uniformly "
                       "divided recompute unit, 2) block: the number of individual Transformer "
                       "layers to recompute within each pipeline stage. Needed with "
                       "--recompute-granularity full.")
    group.add_argument("--recompute-modules", nargs="*", type=str, default=None,
                       help=f"The submodules to recompute with --recompute-granularity selective, "
                       f"of: {', '.join(RECOMPUTE_MODULES)}. Default: core_attn (Megatron-Core's).")


# Megatron-LM's --attention-backend choices (megatron.core.transformer.enums.AttnBackend).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")

# GPU kernel choices: the same arithmetic by other kernels. On GPU they reach Megatron-Core's
# TransformerConfig (compat.mcore.transformer_config); on CPU, where none of these kernels exists,
# the ones given are listed in one start-up line (validation: args.kernel_choices_not_applied).
KERNEL_CHOICES = ("masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion",
                  "apply_rope_fusion", "gradient_accumulation_fusion", "no_persist_layer_norm", "attention_backend",
                  "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "moe_permute_fusion", "moe_router_fusion",
                  "moe_shared_expert_overlap", "deterministic_mode")


# Megatron-LM flags accepted without effect, each with why (named at start-up with it).
FLAGS_WITHOUT_EFFECT = {
    "deprecated_use_mcore_models": "deprecated in Megatron-LM, no effect there either",
    "add_position_embedding": "deprecated in Megatron-LM, no effect there either with rope",
    "auto_detect_ckpt_format": "the format of --load is always detected here: torch_dist is read, any other "
                               "refused up front naming it",
    "dist_ckpt_optim_fully_reshardable": "the distributed optimizer's state is always saved fully reshardable here, "
                                         "so a checkpoint resumes under another TP, PP, EP, DP or mode",
}


def flag_of_dest() -> dict[str, str]:
    """Each flag's dest -> the option string messages name it by (its first)."""
    return {action.dest: action.option_strings[0] for action in build_parser()._actions if action.option_strings}


def without_effect(flags: list[str]) -> list[str]:
    """Each flag of FLAGS_WITHOUT_EFFECT given (its option string) with why, for the start-up line."""
    reasons = {flag: FLAGS_WITHOUT_EFFECT[dest] for dest, flag in flag_of_dest().items() if dest in FLAGS_WITHOUT_EFFECT}
    return [f"{flag} ({reasons[flag]})" for flag in flags]


def _add_kernel_choice_args(parser):
    group = parser.add_argument_group(title="GPU kernel choices")
    group.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                       help="Disable fusion of query_key_value scaling, masking, and softmax.")
    group.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                       help="Disable bias and gelu fusion (GELU MLPs are not fused here on GPU either).")
    group.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                       help="Disable bias and swiglu fusion, the fusion is available only when using megatron-core.")
    group.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                       help="Disable bias and dropout fusion.")
    group.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                       help="Disable rope fusion, the fusion is available only when using megatron-core (it is "
                       "not asked for here on GPU either).")
    group.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                       help="Disable fusing gradient accumulation to weight gradient computation of linear "
                       "layers (not asked for here on GPU either: it needs Apex's fused kernels).")
    group.add_argument("--no-persist-layer-norm", action="store_true",
                       help="Disable using persistent fused layer norm kernel (Apex; not asked for here "
                       "on GPU either).")
    group.add_argument("--attention-backend", type=str, default="auto",
                       help=f"Attention backend to use ({', '.join(ATTENTION_BACKENDS)}). Defaults to auto.")
    group.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help="Enabled fusion of cross entropy loss calculation.")
    group.add_argument("--cross-entropy-fusion-impl", type=str, default="native",
                       help="Implementation of cross entropy loss calculation: native or te.")
    group.add_argument("--moe-permute-fusion", action="store_true",
                       help="Fuse token rearrangement ops during token dispatching (Transformer Engine).")
    group.add_argument("--moe-router-fusion", action="store_true",
                       help="Enable fusion for MoE TopK routing and aux-loss computation (Transformer "
                       "Engine).")
    group.add_argument("--moe-shared-expert-overlap", action="store_true",
                       help="Enable overlapping between shared expert computations and dispatcher "
                       "communications (a side CUDA stream). Without this, the shared experts execute "
                       "before the router. Needs --moe-shared-expert-intermediate-size; zebra refuses it (no "
                       "all-to-all dispatcher there).")
    group.add_argument("--deterministic-mode", action="store_true",
                       help="Choose code that has deterministic execution (GPU kernels; on CPU every run is "
                       "bit-identical anyway: README, Reproducibility).")


def _add_data_args(parser):
    group = parser.add_argument_group(title="data")
    group.add_argument(
        "--data-path", nargs="*", default=None,
        help="The weight and prefix list for a set of train, validation, and test datasets which "
        "split according to --split. The accepted formats are: (1) a single prefix, (2) a list of "
        "weight prefix pairs e.g. weight1 prefix1 weight2 prefix2, (3) a list of prefixes e.g. "
        "prefix1 prefix2. Each prefix names a Megatron indexed dataset <prefix>.bin + <prefix>.idx. "
        "Default: none; without --data-path and --mock-data the training script uses the local "
        "real-text corpus, preparing it on first use.",
    )
    group.add_argument("--split", type=str, default=None,
                       help="Comma-separated list of proportions for training, validation, and "
                       "test split. For example the split 90,5,5 will use 90 percent of data for "
                       f"training, 5 percent for validation and 5 percent for test. Default "
                       f"{DEFAULT_SPLIT} (Megatron-LM's value when --split is not given).")
    group.add_argument("--mock-data", action="store_true",
                       help="Train on synthetic tokens (Megatron-Core's mock datasets); no "
                       "--data-path needed. The tokenizer defaults to NullTokenizer with "
                       "--vocab-size.")
    group.add_argument("--data-cache-path", default=None,
                       help="Path to a directory to hold cached index files (Megatron-Core's dataset "
                       "indices; default: a cache folder beside the data).")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Reset posistion ids after end-of-document token (GPT).")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Reset self attention mask after end-of-document token (GPT; needs the "
                       "data loader's attention mask).")
    group.add_argument("--eod-mask-loss", action="store_true",
                       help="Mask loss for the end of document tokens (GPT).")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader",
                       help="If set, do not create attention_masks in dataloader (GPT; the model's "
                       "causal mask then applies).")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Disable mmap-ing of .bin files (they are read into memory instead).")
    group.add_argument("--num-workers", type=int, default=0,
                       help="Dataloader number of workers. Only 0 (Megatron-LM's default: 2): the "
                       "memory-mapped dataset is read in the training process; worker processes are "
                       "not built, so a value above 0 is refused.")


def _add_tokenizer_args(parser):
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--tokenizer-type", type=str, default=None,
        help=f"What type of tokenizer to use: {', '.join(TOKENIZER_TYPES)} (the types "
        "megatron.core's build_tokenizer supports). Required with --data-path; with --mock-data "
        "it defaults to NullTokenizer; with neither, the training script uses the tokenizer of "
        "the local corpus.",
    )
    group.add_argument("--vocab-file", type=str, default=None,
                       help="Path to the vocab file (GPT2BPETokenizer, BertWordPiece*).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="Path to the BPE merge file (GPT2BPETokenizer).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Size of vocab before EOD or padding. Used by NullTokenizer "
                       "(--mock-data) and by the model configs' parameter arithmetic; real "
                       "tokenizers report their own size.")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="Tokenizer model: a SentencePiece/TikToken model file, or a "
                       "HuggingFace tokenizer name or directory.")
    group.add_argument("--tokenizer-metadata", type=str, default=None,
                       help="Path to tokenizer metadata in json format.")
    group.add_argument("--tokenizer-special-tokens", type=str, nargs="+", default=None,
                       help="Special tokens to add to the tokenizer.")
    group.add_argument("--tokenizer-hf-use-fast", action="store_true",
                       help="Use the fast (Rust) HuggingFace tokenizer.")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="Include special tokens when a HuggingFace tokenizer encodes text.")
    group.add_argument("--tokenizer-sentencepiece-legacy", action="store_true",
                       help="Use SentencePiece's legacy behaviour.")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="Whether or not to allow PreTrainedTokenizer to execute remote code.")
    group.add_argument("--tiktoken-pattern", type=str, default=None,
                       help="Which tiktoken pattern to use. Options: [v1, v2].")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="Number of special tokens in tiktoken tokenizer.")


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None,
                       help="Output directory to save checkpoints to (torch_dist format).")
    group.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                       help="Number of iterations between checkpoint saves. Required with --save "
                       "(as in Megatron-LM).")
    group.add_argument("--load", type=str, default=None,
                       help="Directory containing a model checkpoint. Must exist, unless it is "
                       "the --save directory (--save DIR --load DIR resumes when DIR holds a "
                       "checkpoint and starts fresh otherwise).")
    group.add_argument("--finetune", action="store_true",
                       help="Load model for finetuning. Do not load optimizer or rng state from checkpoint "
                       "and set iteration to 0 (consumed samples too; the learning-rate schedule starts "
                       "afresh).")
    group.add_argument("--ckpt-format", type=str, default="torch_dist",
                       help="Checkpoint format: torch_dist, Megatron-Core's distributed checkpoint, the "
                       "only one written and read here (Megatron-LM also has torch, torch_dcp, zarr and "
                       "fsdp_dtensor).")
    group.add_argument("--auto-detect-ckpt-format", action="store_true",
                       help="Determine if the checkpoint format is in legacy or distributed format. Here "
                       "the format of --load is always detected: torch_dist is read, any other refused up "
                       "front naming it (accepted without effect).")
    group.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected",
                       help="Determine handling of key mismatch during checkpoint load (dist_checkpointing's "
                       "StrictHandling): assume_ok_unexpected, log_unexpected, log_all, raise_unexpected, "
                       "raise_all, ignore_all (return_unexpected and return_all are refused: they hand the keys "
                       "to Megatron-LM's own loader). It controls only the read from storage.")
    group.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                       help="Make optimizer distributed checkpoint fully reshardable (TP/PP/EP/DP) as opposed to "
                       "plain DP reshardability. Always so here (accepted without effect).")
    group.add_argument("--no-load-optim", action="store_true",
                       help="Do not load optimizer when loading checkpoint.")
    group.add_argument("--no-load-rng", action="store_true",
                       help="Do not load rng state when loading checkpoint.")
    group.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                       help="Reset the learning-rate scheduler's values (lr, min lr, warm-up, decay "
                       "iterations and style, weight decay) to these flags' on --load, instead of "
                       "continuing with the checkpoint's (the default, as in Megatron-LM).")
    group.add_argument("--keep-last-checkpoints", type=int, default=2, metavar="K",
                       help="Keep the K newest checkpoints under --save and remove older ones after "
                       "each save; 0 keeps all. Default 2: the newest, and the one a resume falls "
                       "back to when the newest does not verify (training/checkpoint_dirs.py). "
                       "New flag.")


def _add_validation_args(parser):
    group = parser.add_argument_group(title="evaluation")
    group.add_argument("--eval-interval", type=int, default=None,
                       help="Interval between running evaluation on validation set. Default: none, "
                       "no evaluation while training.")
    group.add_argument("--eval-iters", type=int, default=100,
                       help="Number of iterations to run for evaluation (0 skips evaluation).")


def _add_logging_args(parser):
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-interval", type=int, default=100,
                       help="Report loss and timing interval.")
    group.add_argument("--log-throughput", action="store_true",
                       help="If set, calculate and log throughput per GPU: TFLOP/s of model FLOPs as "
                       "Megatron-LM counts them (routed top-k experts; training/flops.py), in the progress "
                       "line, the JSON records (tflops_per_gpu) and TensorBoard.")
    group.add_argument("--run-dir", type=str, default=None, metavar="DIR",
                       help="Keep the run's outputs in DIR: arguments.txt (every flag value; "
                       "stdout gets a short summary), metrics.jsonl, tensorboard/, loads.npz and "
                       "loss_imbalance.png at the end, unless --log-json, --tensorboard-dir or "
                       "--moe-log-loads name another place. launch/local.sh passes "
                       "runs/local-<time>. New flag.")
    group.add_argument("--tensorboard-dir", type=str, default=None,
                       help="Write TensorBoard logs to this directory.")
    group.add_argument("--tensorboard-log-interval", type=int, default=1,
                       help="Report to tensorboard interval (the training scalars of every this-many-th "
                       "iteration).")
    group.add_argument("--log-timers-to-tensorboard", action="store_true",
                       help="If set, write timers to tensorboard: train/iteration_time_s (the iteration time, "
                       "the one timer of --timing-log-level 0).")
    group.add_argument("--log-memory-to-tensorboard", action="store_true",
                       help="Enable memory logging to tensorboard (memory/<kind>_max_rank: the activation "
                       "memory figures every record holds).")
    group.add_argument("--logging-level", type=int, default=None,
                       help="Set default logging level (Python's logging levels: 10 debug ... 50 critical; "
                       "Megatron-Core logs through Python's logging).")
    group.add_argument("--log-params-norm", action="store_true",
                       help="If set, calculate and log parameters norm (the weights the optimizer steps, each "
                       "counted once; params_norm in the records), in every mode: replicate adds its expert "
                       "slices' master weights, zebra counts its own optimizer's.")
    group.add_argument("--log-num-zeros-in-grad", action="store_true",
                       help="If set, calculate and log the number of zeros in gradient (Megatron's optimizer "
                       "counts them; num_zeros_in_grad in the records), in every mode, as --log-params-norm.")
    group.add_argument("--timing-log-level", type=int, default=0,
                       help="Granularity level to measure and report timing: 0 only, the iteration time of "
                       "every progress line and record (Megatron-LM's levels 1 and 2 time the schedule's "
                       "phases with Megatron-LM's timers, which are not built here).")
    group.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                       help="If set, write validation perplexity to tensorboard (eval/ppl; exp(20) where the "
                       "loss exceeds 20, as Megatron-LM).")
    group.add_argument("--log-json", type=str, default=None, metavar="PATH",
                       help="Append one JSON object per --log-interval to this file (JSON lines: "
                       "iteration, loss, tokens_per_s, moe_layers, bytes, ...). New flag.")
    group.add_argument("--moe-log-loads", type=str, default=None, metavar="PATH",
                       help="Write an expert-load trace to this .npz file: loads int64 "
                       "[iterations, layers, experts], source_loads int64 [iterations, layers, "
                       "ranks, experts] and metadata; the trace format of the placement tools "
                       "and the simulator. New flag.")


# ----------------------------------------------------------------------------------------------
# Parsing: defaults < YAML configs < explicit CLI flags
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `argv` (default sys.argv[1:]) over the values of the --config YAML files.

    Command-line syntax errors (an unknown flag, a value of the wrong type) and YAML problems
    raise ArgumentError naming the flag, file or key and what would be valid."""
    tokens = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    configs = parser.parse_args(tokens).config
    sizes = given_flags(tokens, MODEL_SIZE_FLAGS)
    config_files = configs or ([] if sizes else list(EMBEDDED_JOB))
    values = {}
    for path in config_files:
        values.update(load_yaml(Path(path), parser))
    # Of two flags that exclude each other, the one the command line gives replaces a config's
    # value of the other (the embedded job's --train-iters 200 gives way to --train-samples)
    for pair in EXCLUSIVE_FLAGS:
        if len(given := given_flags(tokens, pair)) == 1:
            other = next(flag for flag in pair if flag not in given)
            values.pop(other.removeprefix("--").replace("-", "_"), None)
    # Config values become the parser's defaults, so only flags present in argv override them.
    parser.set_defaults(**values)
    args = parser.parse_args(tokens)
    args.config = [str(path) for path in config_files]
    if configs:
        args.model_source = f"--config {' '.join(args.config)}"
    elif sizes:
        args.model_source = f"the command line ({', '.join(sizes)}; Megatron-LM's defaults for the flags not given)"
    else:
        args.model_source = (f"the embedded tiny job ({', '.join(str(p.relative_to(REPO_ROOT)) for p in EMBEDDED_JOB)}: "
                             "no --config and no model-size flag given)")
    return args


def given_flags(tokens: list[str], flags) -> list[str]:
    """Those of `flags` that `tokens` give (as --flag VALUE or --flag=VALUE)."""
    return [flag for flag in flags if any(token == flag or token.startswith(flag + "=") for token in tokens)]
