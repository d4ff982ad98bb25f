"""Command-line arguments of the training script: Megatron-LM flag names, YAML configs, validation.

Megatron-Core ships no `megatron.training`, so this module re-creates the part of Megatron-LM's
`megatron/training/arguments.py` that a GPT/BERT MoE pre-training run needs. Flag names, dest
names, types, defaults and meanings are Megatron-LM's; where a default differs (to make the
no-flag run a short CPU job, or because this product needs it) the flag's help says so. The
product's own flags (--config, --model-family, --moe-parallel-mode, --log-json, --moe-log-loads,
--cpu) sit beside them.

Everything here runs before any process group exists:

    args = parse_args()                 # parser defaults < --config YAML files < explicit CLI flags
    args = validate_args(args, world)   # derived values; ArgumentError for impossible combinations
    print(describe_args(args))          # rank 0 prints every value, grouped by concern

docs/flags.md is generated from the parser (a test keeps it in sync):

    python -m megatron_patches.training.arguments > docs/flags.md
"""

import argparse
import ast
import difflib
import importlib.util
import math
from pathlib import Path

import yaml

import megatron_patches
from megatron_patches.zebra.config import add_zebra_args

REPO_ROOT = Path(megatron_patches.__file__).resolve().parents[1]

# Loaded when no --config is given: the tiny GPT-MoE model that trains on CPU in seconds.
DEFAULT_CONFIG = REPO_ROOT / "configs" / "models" / "tiny.yaml"

# How MoE experts are placed and synchronised (--moe-parallel-mode). 'ep' is stock Megatron-Core
# expert parallelism, the baseline; 'fssdp' fully sharded sparse data parallelism; 'replicate'
# per-iteration adaptive expert replication; 'zebra' attention/expert disaggregation.
MOE_PARALLEL_MODES = ("ep", "fssdp", "replicate", "zebra")

# --moe-load-window when not given: FSSDP predicts from the mean of 5 iterations (DESIGN 4.1);
# replicate mode places the next iteration from the last one's popularity (DESIGN 4.6).
DEFAULT_LOAD_WINDOW = {"fssdp": 5, "replicate": 1}

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

# Values that validate_args() adds to the namespace (not flags); describe_args() lists them
# in their own group.
DERIVED_VALUES = {
    "world_size": "number of ranks, as given to validate_args",
    "data_parallel_size": "world size / (TP x PP); in zebra mode the number of attention ranks",
    "expert_data_parallel_size": "world size / (PP x ETP x EP)",
    "num_micro_batches": "global batch / (micro batch x data-parallel size)",
    "params_dtype": "torch dtype of the parameters: float32, or bfloat16/float16 with --bf16/--fp16",
    "use_cuda": "True when CUDA is available and --cpu is not given",
}


class ArgumentError(ValueError):
    """An impossible or inconsistent flag value; the message names the flag, its value and what
    would be valid. Raised by parse_args (bad YAML) and validate_args, before any process group."""


# ----------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------


def moe_layer_freq(value):
    """--moe-layer-freq as Megatron-LM reads it: an int N (every N-th layer is MoE), or a 0/1
    pattern per layer given as a list or as a list expression such as "([1]*3+[0]*1)*3".

    The expression is evaluated over list displays, ints, + and * only (no eval), and a pattern
    longer than 100,000 layers is refused so that a typo cannot exhaust memory."""
    if isinstance(value, bool):
        raise ValueError(f"not a layer frequency: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise ValueError(f"a layer pattern holds integers 0/1, got {value!r}")
        return list(value)
    if not isinstance(value, str):
        raise ValueError(f"not a layer frequency: {value!r}")
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an int or a list expression: {value!r}") from error
    pattern = _eval_pattern(tree.body, value)
    if not isinstance(pattern, list):
        raise ValueError(f"a layer pattern must evaluate to a list, got {pattern!r}")
    return moe_layer_freq(pattern)


def _eval_pattern(node, source: str):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_eval_pattern(item, source) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left, source), _eval_pattern(node.right, source)
        if isinstance(node.op, ast.Mult):
            sizes = [len(x) * y for x, y in ((left, right), (right, left))
                     if isinstance(x, list) and isinstance(y, int)]
            if sizes and sizes[0] > 100_000:
                raise ValueError(f"layer pattern {source!r} is longer than 100,000 layers")
        try:
            return left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError as error:
            raise ValueError(f"cannot evaluate layer pattern {source!r}: {error}") from error
    raise ValueError(f"layer pattern {source!r} may only use lists, integers, + and *")



def build_parser() -> argparse.ArgumentParser:
    """The training script's parser, argument groups in the order describe_args() prints them."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt_moe.py",
        description="GPT/BERT MoE pre-training on Megatron-Core with load-adaptive expert "
        "placement. Flags use Megatron-LM's names; YAML configs (--config) use the dest names.",
        allow_abbrev=False,
    )
    _add_config_args(parser)
    _add_model_args(parser)
    _add_moe_args(parser)
    _add_fssdp_args(parser)
    _add_replicate_args(parser)
    add_zebra_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_regularization_args(parser)
    _add_mixed_precision_args(parser)
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
        "all files. Without --config, configs/models/tiny.yaml is loaded.",
    )


def _add_model_args(parser):
    group = parser.add_argument_group(title="model")
    group.add_argument(
        "--model-family", type=str, default="gpt",
        help=f"Model family: {' or '.join(MODEL_FAMILIES)} (GPTModel, causal LM; BertModel, "
        "masked LM). New flag.",
    )
    group.add_argument("--num-layers", type=int, default=None,
                       help="Number of transformer layers. Required (the default config sets it).")
    group.add_argument("--hidden-size", type=int, default=None,
                       help="Transformer hidden size. Required (the default config sets it).")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Transformer Feed-Forward Network hidden size. "
                       "This is set to 4*hidden-size if not provided (with --swiglu, "
                       "int(4*hidden-size*2/3/64)*64, as Megatron-LM does).")
    group.add_argument("--num-attention-heads", type=int, default=None,
                       help="Number of transformer attention heads. Required "
                       "(the default config sets it).")
    group.add_argument("--seq-length", type=int, default=None,
                       help="Maximum sequence length to process. Required "
                       "(the default config sets it).")
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
    group.add_argument("--normalization", type=str, default="LayerNorm",
                       help=f"Which normalization technique to use: {', '.join(NORMALIZATIONS)}.")
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
    group.add_argument("--init-method-std", type=float, default=0.02,
                       help="Standard deviation of the zero mean normal distribution used for "
                       "weight initialization.")
    group.add_argument("--seed", type=int, default=1234,
                       help="Random seed used for python, numpy, pytorch, and cuda.")


def _add_moe_args(parser):
    group = parser.add_argument_group(title="moe")
    group.add_argument("--num-experts", type=int, default=None,
                       help="Number of Experts in MoE (None or 0 means no MoE).")
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
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="The hidden size of each expert's feed-forward network (ffn). "
                       "If not specified, defaults to the ffn_hidden_size.")
    group.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                       help="Scaling coefficient for the aux loss: a starting value of 1e-2 is "
                       "recommended. One value (Megatron-LM also takes one per balancing type).")
    group.add_argument(
        "--moe-router-load-balancing-type", type=str, default="aux_loss",
        help="Determines the load balancing strategy for the router: "
        f"{', '.join(LOAD_BALANCING_TYPES)}. aux_loss is GShard/Switch's loss, seq_aux_loss "
        "DeepSeekV2's per-sample loss, sinkhorn S-BASE's balancing, none no balancing. One value "
        "(Megatron-LM also takes a list).",
    )
    group.add_argument(
        "--moe-token-dispatcher-type", type=str, default="alltoall",
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
                       "grouped GEMM. Needs CUDA and --bf16 (as in Megatron-LM); on CPU the "
                       "experts run one after another.")
    group.add_argument(
        "--moe-parallel-mode", type=str, default="ep",
        help="How expert parameters are placed and synchronised. ep = stock Megatron-Core "
        f"expert parallelism (the baseline). Valid: {', '.join(MOE_PARALLEL_MODES)}. New flag.",
    )


def _auto_or_int(value: str):
    """`auto` or a non-negative integer (--fssdp-overlap-degree, --fssdp-memory-capacity)."""
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither auto nor an integer") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative; valid: auto or an integer >= 0")
    return number


def _add_fssdp_args(parser):
    group = parser.add_argument_group(title="fssdp (--moe-parallel-mode fssdp)")
    group.add_argument(
        "--fssdp-overlap-degree", type=_auto_or_int, default="auto",
        help="t: expert copies a device may receive per layer while attention runs. auto: "
        "measured in the first iteration (run without copies) from the non-MoE time of a layer, "
        "the point-to-point bandwidth and the bytes of one expert. New flag.",
    )
    group.add_argument(
        "--fssdp-memory-capacity", type=_auto_or_int, default="auto",
        help="m: extra expert copies a device may hold per layer. auto: free memory per MoE layer "
        "whose copies are alive over the bytes of one expert (GPU: 90%% of free memory; CPU: "
        "--fssdp-memory-budget-mb). New flag.",
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
        "--fssdp-calibrate", action="store_true",
        help="After the gate, re-plan the copies with the actual loads and gather once more when the "
        "cost model says it pays off. New flag.",
    )
    group.add_argument(
        "--moe-load-window", type=int, default=None,
        help=f"Iterations averaged to predict the next iteration's expert loads (default "
        f"{DEFAULT_LOAD_WINDOW['fssdp']} in fssdp mode, {DEFAULT_LOAD_WINDOW['replicate']} in replicate mode). New flag.",
    )


def _add_replicate_args(parser):
    group = parser.add_argument_group(title="replicate (--moe-parallel-mode replicate)")
    group.add_argument(
        "--replicate-slots-per-rank", type=int, default=4,
        help="s: expert instances each rank runs per MoE layer; every iteration the ranks x s "
        "instances are shared out among the experts by popularity. With "
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
        "ranks x s / experts instances (DeepSpeed-style baseline); flexmoe: new counts every "
        "--replicate-rebalance-interval iterations, moving optimizer state with the experts "
        "(FlexMoE-style baseline). New flag.",
    )
    group.add_argument(
        "--replicate-rebalance-interval", type=int, default=10,
        help="With --replicate-policy flexmoe: iterations between re-placements (10, 50 and 100 in "
        "the comparison). New flag.",
    )


def _add_parallel_args(parser):
    group = parser.add_argument_group(title="parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1,
                       help="Degree of tensor model parallelism.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="Degree of pipeline model parallelism.")
    group.add_argument(
        "--expert-model-parallel-size", type=int, default=None,
        help="Degree of expert model parallelism. Default (Megatron-LM: 1): the largest divisor "
        "of --num-experts for which world-size/PP is divisible by ETP x EP; with ETP = TP that is "
        "the largest divisor of --num-experts that divides the data-parallel size, so "
        "`torchrun --nproc-per-node 4` with 8 experts uses EP=4 and a single process EP=1.",
    )
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
    group.add_argument("--cpu", action="store_true",
                       help="Run on CPU (gloo) even when CUDA is available. Default: use CUDA "
                       "when available. New flag.")


def _add_training_args(parser):
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=4,
                       help="Batch size per model instance (local batch size). Global batch size "
                       "is local batch size times data parallel size times number of micro "
                       "batches. Default 4 (Megatron-LM: none, required) so the no-flag run works.")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Training batch size; must be a multiple of micro-batch-size times "
                       "data-parallel-size. Default: micro-batch-size x data-parallel-size "
                       "(one micro-batch per iteration), as Megatron-LM does when it is not given.")
    group.add_argument("--train-iters", type=int, default=200,
                       help="Total number of iterations to train over all training runs. "
                       "Default 200 (Megatron-LM: none, required): a short CPU run of the tiny "
                       "model that still shows the loss falling.")


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=1e-3,
                       help="Initial learning rate. Depending on decay style and initial warmup, "
                       "the learning rate at each iteration would be different. Default 1e-3 "
                       "(Megatron-LM: none, required): a usual peak rate for a model this small.")
    group.add_argument("--min-lr", type=float, default=0.0,
                       help="Minimum value for learning rate. The scheduler clips values below "
                       "this threshold.")
    group.add_argument("--lr-decay-style", type=str, default="cosine",
                       help=f"Learning rate decay function: {', '.join(LR_DECAY_STYLES)}. "
                       "Default cosine (Megatron-LM: linear).")
    group.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="Number of iterations to linearly warmup learning rate over.")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Number of iterations to decay learning rate over. If None defaults "
                       "to --train-iters.")


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
    group.add_argument("--hidden-dropout", type=float, default=0.1,
                       help="Dropout probability for hidden state transformer.")
    group.add_argument("--attention-dropout", type=float, default=0.1,
                       help="Post attention dropout probability.")


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--bf16", action="store_true", help="Run model in bfloat16 mode.")
    group.add_argument("--fp16", action="store_true", help="Run model in fp16 mode.")


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
    group.add_argument("--num-workers", type=int, default=0,
                       help="Dataloader number of workers. Default 0 (Megatron-LM: 2): the "
                       "memory-mapped dataset is read in the training process, because on CPU "
                       "machines worker processes compete with the ranks for the few cores.")


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
    group.add_argument("--save-interval", type=int, default=None,
                       help="Number of iterations between checkpoint saves. Required with --save "
                       "(as in Megatron-LM).")
    group.add_argument("--load", type=str, default=None,
                       help="Directory containing a model checkpoint. Must exist, unless it is "
                       "the --save directory (--save DIR --load DIR resumes when DIR holds a "
                       "checkpoint and starts fresh otherwise).")
    group.add_argument("--no-load-optim", action="store_true",
                       help="Do not load optimizer when loading checkpoint.")
    group.add_argument("--no-load-rng", action="store_true",
                       help="Do not load rng state when loading checkpoint.")


def _add_validation_args(parser):
    group = parser.add_argument_group(title="evaluation")
    group.add_argument("--eval-interval", type=int, default=100,
                       help="Interval between running evaluation on validation set. Default 100 "
                       "(Megatron-LM: 1000): two evaluations in the default 200-iteration run.")
    group.add_argument("--eval-iters", type=int, default=5,
                       help="Number of iterations to run for evaluation (0 skips evaluation). "
                       "Default 5 (Megatron-LM: 100): keeps evaluation short on CPU.")


def _add_logging_args(parser):
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-interval", type=int, default=10,
                       help="Report loss and timing interval. Default 10 (Megatron-LM: 100): a "
                       "progress line every 10 iterations, 20 in the default run.")
    group.add_argument("--tensorboard-dir", type=str, default=None,
                       help="Write TensorBoard logs to this directory.")
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

    Command-line syntax errors exit through argparse (status 2); YAML problems raise
    ArgumentError naming the file, the key and what would be valid."""
    parser = build_parser()
    config_files = parser.parse_args(argv).config or [DEFAULT_CONFIG]
    values = {}
    for path in config_files:
        values.update(_load_yaml(Path(path), parser))
    # Config values become the parser's defaults, so only flags present in argv override them.
    parser.set_defaults(**values)
    args = parser.parse_args(argv)
    args.config = [str(path) for path in config_files]
    return args


def _load_yaml(path: Path, parser: argparse.ArgumentParser) -> dict:
    """The flag values in one YAML file, checked and converted to each flag's type."""
    if not path.is_file():
        raise ArgumentError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ArgumentError(f"--config {path}: not valid YAML: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(
            f"--config {path}: the file must be a mapping of flag dest names to values "
            f"(e.g. `num_layers: 2`), not a {type(data).__name__}"
        )
    actions = {action.dest: action for action in _flag_actions(parser) if action.dest != "config"}
    values = {}
    for key, value in data.items():
        if key not in actions:
            raise ArgumentError(_unknown_key_message(path, key, actions))
        values[key] = _coerce(actions[key], key, value, path)
    return values


def _flag_actions(parser: argparse.ArgumentParser) -> list:
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def _unknown_key_message(path: Path, key, actions: dict) -> str:
    message = f"--config {path}: unknown key {key!r}."
    if key == "config":
        return message + " A config file cannot include other files; pass several --config flags."
    # A key spelled like a flag whose dest differs (disable_bias_linear -> add_bias_linear).
    for dest, action in actions.items():
        for option in action.option_strings:
            if str(key).replace("-", "_") == option.lstrip("-").replace("-", "_") and dest != key:
                value = "false" if action.const is False else "true"
                return message + f" Flag {option} stores into {dest!r}: write `{dest}: {value}`."
    close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(actions), n=3, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else " No valid key is close."
    return (message + hint + " Keys are the flags' dest names (--num-layers -> num_layers); "
            "see docs/flags.md for all of them.")


def _is_bool_flag(action) -> bool:
    return action.nargs == 0 and isinstance(action.const, bool)


def _type_name(action) -> str:
    if _is_bool_flag(action):
        return "bool"
    if action.type is moe_layer_freq:
        return "int or list of 0/1"
    name = (action.type or str).__name__
    return f"list of {name}" if action.nargs in ("*", "+") else name


def _coerce(action, key: str, value, path: Path):
    """`value` converted to the type the flag's dest holds, or ArgumentError."""
    def wrong():
        return ArgumentError(
            f"--config {path}: key {key!r} has value {value!r} ({type(value).__name__}); "
            f"expected {_type_name(action)} (flag {action.option_strings[0]})"
        )

    if value is None:
        if action.default is None:
            return None
        raise wrong()
    if _is_bool_flag(action):
        if isinstance(value, bool):
            return value
        raise wrong()
    if action.type is moe_layer_freq:
        try:
            return moe_layer_freq(value)
        except ValueError:
            raise wrong() from None
    if action.nargs in ("*", "+"):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise wrong()
        converted = [_coerce_scalar(action.type or str, item) for item in items]
        if any(item is None for item in converted):
            raise wrong()
        return converted
    converted = _coerce_scalar(action.type or str, value)
    if converted is None:
        raise wrong()
    return converted


def _coerce_scalar(kind, value):
    """`value` as `kind` (int, float or str), or None when it is not one."""
    if isinstance(value, (bool, list, dict)):
        return None
    if kind is int:
        return value if isinstance(value, int) else None
    if kind is float:
        if isinstance(value, (int, float)):
            return float(value)
        # YAML 1.1 (PyYAML) reads `1e-3` without a dot as a string.
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    # Text flags take unquoted YAML numbers too (`split: 100`, data-path weights).
    return str(value) if isinstance(value, (str, int, float)) else None


# ----------------------------------------------------------------------------------------------
# Validation and derived values
# ----------------------------------------------------------------------------------------------


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Resolve derived values and refuse impossible combinations, before any process group.

    Mutates and returns `args`; running it twice gives the same namespace. Raises ArgumentError
    naming the flag, its value and what would be valid."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"world size {world_size!r}: must be a positive integer")
    args.world_size = world_size
    _check_sizes(args)
    _check_choices(args)
    _resolve_parallel_layout(args, world_size)
    _resolve_model_shape(args)
    _resolve_moe(args)
    _resolve_mode_flags(args)
    _resolve_batch(args)
    _resolve_learning_rate(args)
    _check_intervals(args)
    _resolve_device(args)
    _check_precision(args)
    _resolve_data(args)
    _resolve_tokenizer(args)
    _check_checkpointing(args)
    return args


def _fail(flag: str, value, message: str):
    raise ArgumentError(f"{flag}={value}: {message}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_sizes(args):
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, dest) is None:
            raise ArgumentError(
                f"--{dest.replace('_', '-')} is not set: give it on the command line or in a "
                "--config YAML (configs/models/*.yaml set it)"
            )
    positive = (
        "num_layers", "hidden_size", "num_attention_heads", "seq_length", "ffn_hidden_size",
        "max_position_embeddings", "moe_ffn_hidden_size", "moe_router_topk", "micro_batch_size",
        "global_batch_size", "train_iters", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "make_vocab_size_divisible_by", "vocab_size",
        "lr_decay_iters", "tiktoken_num_special_tokens", "kv_channels", "num_query_groups",
        "rotary_base",
    )
    for dest in positive:
        value = getattr(args, dest)
        if value is not None and value <= 0:
            _fail(f"--{dest.replace('_', '-')}", value, "must be a positive integer")
    non_negative = ("lr_warmup_iters", "num_workers", "eval_iters")
    for dest in non_negative:
        value = getattr(args, dest)
        if value < 0:
            _fail(f"--{dest.replace('_', '-')}", value, "must be 0 or more")
    if args.num_experts is not None and args.num_experts < 0:
        _fail("--num-experts", args.num_experts, "must be a positive integer (0 means no MoE)")
    if args.num_experts == 0:
        # Megatron-LM treats 0 experts as a dense model.
        args.num_experts = None
    for dest in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, dest)
        if not 0.0 <= value < 1.0:
            _fail(f"--{dest.replace('_', '-')}", value, "must be a probability in [0, 1)")
    for dest in ("adam_beta1", "adam_beta2"):
        value = getattr(args, dest)
        if not 0.0 <= value < 1.0:
            _fail(f"--{dest.replace('_', '-')}", value, "must be in [0, 1)")
    for dest in ("adam_eps", "init_method_std"):
        value = getattr(args, dest)
        if not value > 0.0:
            _fail(f"--{dest.replace('_', '-')}", value, "must be positive")
    for dest in ("weight_decay", "clip_grad", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if not value >= 0.0:
            _fail(f"--{dest.replace('_', '-')}", value, "must be 0 or more")


def _check_choices(args):
    choices = (
        ("--model-family", args.model_family, MODEL_FAMILIES),
        ("--normalization", args.normalization, NORMALIZATIONS),
        ("--position-embedding-type", args.position_embedding_type, POSITION_EMBEDDING_TYPES),
        ("--moe-parallel-mode", args.moe_parallel_mode, MOE_PARALLEL_MODES),
        ("--lr-decay-style", args.lr_decay_style, LR_DECAY_STYLES),
        ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type, TOKEN_DISPATCHER_TYPES),
        ("--moe-router-load-balancing-type", args.moe_router_load_balancing_type,
         LOAD_BALANCING_TYPES),
    )
    for flag, value, valid in choices:
        if value not in valid:
            _fail(flag, value, f"unknown value; valid: {', '.join(valid)}")
    optional_choices = (
        ("--tokenizer-type", args.tokenizer_type, TOKENIZER_TYPES,
         " (the types megatron.core's build_tokenizer supports)"),
        ("--distributed-backend", args.distributed_backend, DISTRIBUTED_BACKENDS, ""),
        ("--transformer-impl", args.transformer_impl, TRANSFORMER_IMPLS, ""),
    )
    for flag, value, valid, note in optional_choices:
        if value is not None and value not in valid:
            _fail(flag, value, f"unknown value; valid: {', '.join(valid)}{note}")


def _resolve_parallel_layout(args, world_size):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        _fail("--tensor-model-parallel-size", tp,
              f"TP x --pipeline-model-parallel-size = {tp} x {pp} = {tp * pp} does not divide "
              f"the world size {world_size}; valid: TP x PP in {_divisors(world_size)}")
    args.data_parallel_size = world_size // (tp * pp)
    if args.num_layers % pp != 0:
        _fail("--num-layers", args.num_layers,
              f"not divisible by --pipeline-model-parallel-size={pp}; valid PP: "
              f"{_divisors(args.num_layers)}")
    if args.num_attention_heads % tp != 0:
        _fail("--num-attention-heads", args.num_attention_heads,
              f"not divisible by --tensor-model-parallel-size={tp}; valid TP: "
              f"{_divisors(args.num_attention_heads)}")
    if tp == 1:
        # As Megatron-LM does: with TP 1 there is no sequence to split, and the flag would
        # only change numerics.
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % tp != 0:
        _fail("--seq-length", args.seq_length,
              f"--sequence-parallel splits the sequence over --tensor-model-parallel-size={tp} "
              f"ranks; valid: a multiple of {tp}")
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        _fail("--overlap-param-gather", True,
              "needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)")


def _resolve_model_shape(args):
    tp, heads = args.tensor_model_parallel_size, args.num_attention_heads
    if args.kv_channels is None:
        if args.hidden_size % heads != 0:
            _fail("--hidden-size", args.hidden_size,
                  f"not divisible by --num-attention-heads={heads}; valid: multiples of {heads}, "
                  "or give --kv-channels")
        args.kv_channels = args.hidden_size // heads
    if args.group_query_attention:
        groups = args.num_query_groups
        if heads % groups != 0:
            _fail("--num-query-groups", groups,
                  f"does not divide --num-attention-heads={heads}; valid: {_divisors(heads)}")
        if groups % tp != 0:
            _fail("--num-query-groups", groups,
                  f"not divisible by --tensor-model-parallel-size={tp} (key/value heads are split "
                  f"over TP ranks); valid: multiples of {tp} that divide {heads}")
    if args.ffn_hidden_size is None:
        # Megatron-LM's defaults; with SwiGLU, two thirds of 4h keep the parameter count.
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.ffn_hidden_size % tp != 0:
        _fail("--ffn-hidden-size", args.ffn_hidden_size,
              f"not divisible by --tensor-model-parallel-size={tp} (the FFN is split over TP "
              f"ranks); valid: multiples of {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        _fail("--seq-length", args.seq_length,
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
    if experts is None:
        if args.expert_model_parallel_size not in (None, 1):
            _fail("--expert-model-parallel-size", args.expert_model_parallel_size,
                  "needs --num-experts (a dense model has no experts to distribute); valid: 1")
        args.expert_model_parallel_size = 1
        if args.moe_ffn_hidden_size is not None:
            _fail("--moe-ffn-hidden-size", args.moe_ffn_hidden_size,
                  "needs --num-experts; valid: unset for a dense model")
    if ranks_per_stage % etp != 0:
        _fail("--expert-tensor-parallel-size", etp,
              f"does not divide world size / --pipeline-model-parallel-size = {world} / {pp} = "
              f"{ranks_per_stage}; valid ETP: {_divisors(ranks_per_stage)}")
    if experts is None:
        args.expert_data_parallel_size = ranks_per_stage // etp
        return

    valid_ep = [ep for ep in _divisors(experts) if ranks_per_stage % (etp * ep) == 0]
    if args.expert_model_parallel_size is None:
        # zebra builds the whole model on every rank and runs its own expert parallelism.
        args.expert_model_parallel_size = 1 if args.moe_parallel_mode == "zebra" else max(valid_ep)
    ep = args.expert_model_parallel_size
    if experts % ep != 0:
        _fail("--expert-model-parallel-size", ep,
              f"--num-experts={experts} is not divisible by it; valid EP here: {valid_ep}")
    if ranks_per_stage % (etp * ep) != 0:
        _fail("--expert-model-parallel-size", ep,
              f"ETP x EP = {etp} x {ep} = {etp * ep} does not divide world size / "
              f"--pipeline-model-parallel-size = {world} / {pp} = {ranks_per_stage} (Megatron-Core "
              f"builds the expert grid ETP x EP x expert-DP x PP over the same ranks); valid EP "
              f"here: {valid_ep}")
    args.expert_data_parallel_size = ranks_per_stage // (etp * ep)

    freq = args.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        _fail("--moe-layer-freq", freq, "must be 1 or more (1 = every layer is MoE)")
    if isinstance(freq, list) and (len(freq) != args.num_layers
                                   or any(x not in (0, 1) for x in freq) or 1 not in freq):
        _fail("--moe-layer-freq", freq,
              f"a layer pattern needs one 0 (dense) or 1 (MoE) per layer, {args.num_layers} in "
              "all, with at least one 1")
    if args.model_family == "bert" and freq != 1:
        _fail("--moe-layer-freq", freq,
              "with --model-family bert every layer must be MoE: Megatron-Core's BertModel takes one "
              "layer spec for all layers; valid: 1")
    if args.moe_router_topk > experts:
        _fail("--moe-router-topk", args.moe_router_topk,
              f"exceeds --num-experts={experts}; valid: 1..{experts}")
    if args.moe_router_topk == 1:
        args.moe_router_pre_softmax = True
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.moe_ffn_hidden_size % etp != 0:
        _fail("--moe-ffn-hidden-size", args.moe_ffn_hidden_size,
              f"not divisible by --expert-tensor-parallel-size={etp} (each expert's FFN is split "
              f"over ETP ranks); valid: multiples of {etp}")
    if tp > 1 and not args.sequence_parallel:
        _fail("--tensor-model-parallel-size", tp,
              "MoE with tensor parallelism needs --sequence-parallel: Megatron-Core's MoELayer "
              "refuses to train with TP > 1 without it; add --sequence-parallel or use "
              "--tensor-model-parallel-size=1")
    if args.add_bias_linear and etp > 1:
        _fail("--expert-tensor-parallel-size", etp,
              "Megatron-Core 0.16.1 supports MoE biases only with ETP=1 (transformer_config.py:1591 "
              "asserts it; ETP defaults to TP); "
              "use --expert-tensor-parallel-size=1 or --disable-bias-linear")
    capacity = args.moe_expert_capacity_factor
    if capacity is not None and not capacity > 0:
        _fail("--moe-expert-capacity-factor", capacity,
              "must be positive (e.g. 1.0 = each expert takes its even share of tokens); leave it "
              "unset for no token dropping")
    if args.moe_pad_expert_input_to_capacity and capacity is None:
        _fail("--moe-pad-expert-input-to-capacity", True,
              "needs --moe-expert-capacity-factor (padding is to the expert capacity)")
    if capacity is not None and args.moe_router_load_balancing_type == "sinkhorn":
        _fail("--moe-router-load-balancing-type", "sinkhorn",
              "Megatron-Core drops tokens by capacity only with aux_loss, seq_aux_loss, "
              "global_aux_loss or none; valid with --moe-expert-capacity-factor: those four")
    if args.moe_token_dispatcher_type == "flex" and tp * ep == 1:
        _fail("--moe-token-dispatcher-type", "flex",
              "Megatron-Core's flex dispatcher needs TP x EP > 1; valid here: alltoall, allgather")


def _resolve_mode_flags(args):
    """Every mode's own flags are refused in the other modes (compared with the parser defaults)."""
    mode = args.moe_parallel_mode
    parser = build_parser()
    for prefix, owner in (("fssdp_", "fssdp"), ("replicate_", "replicate"), ("zebra_", "zebra")):
        if mode == owner:
            continue
        for dest in (d for d in vars(args) if d.startswith(prefix)):
            if getattr(args, dest) != parser.get_default(dest):
                _fail(f"--{dest.replace('_', '-')}", getattr(args, dest),
                      f"only applies with --moe-parallel-mode {owner} (mode is {mode})")
    if mode == "zebra":
        _resolve_zebra(args)
    if mode not in DEFAULT_LOAD_WINDOW:
        if args.moe_load_window is not None:
            _fail("--moe-load-window", args.moe_load_window,
                  f"only applies with --moe-parallel-mode {' or '.join(DEFAULT_LOAD_WINDOW)} (mode is {mode}; "
                  "ep places experts statically)")
        return
    if args.moe_load_window is None:
        args.moe_load_window = DEFAULT_LOAD_WINDOW[mode]
    if args.moe_load_window < 1:
        _fail("--moe-load-window", args.moe_load_window, "must be at least 1 iteration")
    if args.num_experts is None:
        _fail("--moe-parallel-mode", mode, "needs --num-experts (a dense model has no experts to place)")
    expert_group = args.world_size // (args.pipeline_model_parallel_size * args.expert_tensor_parallel_size)
    refusals = (
        ("--expert-model-parallel-size", args.expert_model_parallel_size, args.expert_model_parallel_size < 2,
         f"{mode} places expert instances on the other ranks of the expert-parallel group, so it needs at "
         "least 2 (launch several ranks, e.g. torchrun --nproc-per-node 4); with one rank use "
         "--moe-parallel-mode ep"),
        ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type, args.moe_token_dispatcher_type != "alltoall",
         f"{mode} routes token copies with (a subclass of) the alltoall dispatcher; valid: alltoall"),
        ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size, args.expert_tensor_parallel_size != 1,
         f"{mode} copies whole experts; valid: 1"),
        ("--expert-model-parallel-size", args.expert_model_parallel_size, args.expert_data_parallel_size != 1,
         f"the {mode} group is the expert-parallel group and must span all data-parallel replicas "
         f"(expert-data-parallel size is {args.expert_data_parallel_size}); valid: world size / "
         f"(--pipeline-model-parallel-size x --expert-tensor-parallel-size) = {expert_group}"),
        ("--moe-grouped-gemm", True, args.moe_grouped_gemm,
         f"{mode} runs each expert instance with Megatron's MLP module; drop --moe-grouped-gemm"),
        ("--moe-pad-expert-input-to-capacity", True, args.moe_pad_expert_input_to_capacity,
         f"padding is per expert rank, instances make it per instance; not supported in {mode} mode"),
        ("--overlap-grad-reduce", True, args.overlap_grad_reduce,
         f"{mode} handles the expert gradients after the backward; not supported together with DDP's "
         "overlapped reduce yet"),
        ("--overlap-param-gather", True, args.overlap_param_gather,
         f"not supported in {mode} mode (it needs --overlap-grad-reduce)"),
    )
    for flag, value, refused, why in refusals:
        if refused:
            _fail(flag, value, why)
    if mode == "fssdp":
        _resolve_fssdp(args)
    else:
        _resolve_replicate(args)


def _resolve_fssdp(args):
    if args.fssdp_reshard_interval < 0:
        _fail("--fssdp-reshard-interval", args.fssdp_reshard_interval, "must be >= 0 (0 = never re-shard)")
    if not args.fssdp_memory_budget_mb > 0:
        _fail("--fssdp-memory-budget-mb", args.fssdp_memory_budget_mb, "must be positive")


def _resolve_replicate(args):
    from megatron_patches.replicate.config import POLICIES

    slots, ep, experts = args.replicate_slots_per_rank, args.expert_model_parallel_size, args.num_experts
    if slots < 1:
        _fail("--replicate-slots-per-rank", slots, "must be at least 1")
    if experts > ep * slots:
        _fail("--replicate-slots-per-rank", slots,
              f"every expert needs at least one instance: --num-experts={experts} > ranks x slots = {ep} x {slots}; "
              f"valid: >= {-(-experts // ep)}")
    if args.replicate_policy not in POLICIES:
        _fail("--replicate-policy", args.replicate_policy, f"valid: {', '.join(POLICIES)}")
    if args.replicate_rebalance_interval < 1:
        _fail("--replicate-rebalance-interval", args.replicate_rebalance_interval, "must be at least 1 iteration")
    if args.replicate_policy != "flexmoe" and args.replicate_rebalance_interval != build_parser().get_default("replicate_rebalance_interval"):
        _fail("--replicate-rebalance-interval", args.replicate_rebalance_interval,
              f"only applies with --replicate-policy flexmoe (policy is {args.replicate_policy})")
    for flag, value in (("--save", args.save), ("--load", args.load)):
        if value is not None and args.use_distributed_optimizer:
            _fail(flag, value, "replicate mode writes and reads checkpoints in ep's form for Megatron's plain optimizer "
                  "(fp32 or bf16/fp16 master weights), not --use-distributed-optimizer's; drop one of the two")


def _resolve_zebra(args):
    """Zebra: every refusal before any process group, including the pool checks of
    zebra.pools.zebra_layout (world divisible by M + N, experts by N, Asym-EA shape, GPU types,
    profile memory bounds); the data-parallel size becomes the number of attention ranks."""
    from megatron_patches.zebra.config import ZebraConfig, ZebraConfigError
    from megatron_patches.zebra.pools import PoolError, pool_cluster, zebra_layout

    for flag, dest in (("--zebra-attention-ranks", "zebra_attention_ranks"), ("--zebra-expert-ranks", "zebra_expert_ranks"),
                       ("--zebra-microbatches", "zebra_microbatches")):
        if getattr(args, dest) is None:
            _fail(flag, None, "required with --moe-parallel-mode zebra (an integer >= 1)")
    if args.num_experts is None:
        _fail("--moe-parallel-mode", "zebra", "needs --num-experts (a dense model has no experts to disaggregate)")
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
        ("--moe-layer-freq", args.moe_layer_freq, args.moe_layer_freq != 1,
         "zebra needs every layer to be MoE (expert ranks hold the experts of every layer); valid: 1"),
        ("--moe-expert-capacity-factor", args.moe_expert_capacity_factor, args.moe_expert_capacity_factor is not None,
         "zebra mode is dropless; leave it unset"),
        ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, args.moe_aux_loss_coeff != 0,
         "the auxiliary loss needs the token statistics of all attention ranks, not implemented in zebra; valid: 0"),
        ("--moe-grouped-gemm", True, args.moe_grouped_gemm, "zebra runs each expert's MLP module; drop it"),
        ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type, args.moe_token_dispatcher_type != "alltoall",
         "zebra runs its own bipartite all-to-all between attention and expert ranks; valid: alltoall (the default)"),
        ("--fp16", True, args.fp16, "zebra's optimizer steps the model's own parameters without master weights or "
         "loss scaling; train in float32 (drop --fp16)"),
        ("--bf16", True, args.bf16, "zebra's optimizer steps the model's own parameters without master weights; "
         "train in float32 (drop --bf16)"),
        ("--use-distributed-optimizer", True, args.use_distributed_optimizer,
         "zebra has its own optimizer (AdamW over each rank's own parameters); drop it"),
        ("--overlap-grad-reduce", True, args.overlap_grad_reduce, "zebra reduces gradients after its schedule; drop it"),
        ("--overlap-param-gather", True, args.overlap_param_gather, "not supported in zebra mode"),
        ("--moe-log-loads", args.moe_log_loads, args.moe_log_loads is not None,
         "load traces record Megatron's router in ep, fssdp and replicate modes; not recorded in zebra mode"),
        ("--save", args.save, args.save is not None, "checkpoints are not supported in zebra mode yet"),
        ("--load", args.load, args.load is not None, "checkpoints are not supported in zebra mode yet"),
    )
    for flag, value, refused, why in refusals:
        if refused:
            _fail(flag, value, why)
    try:
        config = ZebraConfig.from_args(args)
        layout = zebra_layout(pool_cluster(config.cluster, args.world_size), config.attention_ranks,
                              config.expert_ranks, args.world_size, num_layers=args.num_layers,
                              num_experts=args.num_experts, asym_ea=config.asym_ea, profile=config.profile)
    except (ZebraConfigError, PoolError) as err:
        raise ArgumentError(str(err)) from None
    # Only attention ranks read data: one global batch = micro batch x R x attention ranks.
    args.data_parallel_size = len(layout.attention_dp_group)
    expected = args.micro_batch_size * config.microbatches * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = expected
    if args.global_batch_size != expected:
        _fail("--global-batch-size", args.global_batch_size,
              f"zebra runs --zebra-microbatches={config.microbatches} micro-batches of --micro-batch-size="
              f"{args.micro_batch_size} on each of its {args.data_parallel_size} attention ranks; valid: {expected} "
              "(or leave it unset)")


def _resolve_batch(args):
    dp, micro = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = micro * dp
    if args.global_batch_size % (micro * dp) != 0:
        _fail("--global-batch-size", args.global_batch_size,
              f"not a multiple of --micro-batch-size x data-parallel size = {micro} x {dp} = "
              f"{micro * dp}; valid: multiples of {micro * dp}, e.g. {micro * dp} or "
              f"{2 * micro * dp}")
    args.num_micro_batches = args.global_batch_size // (micro * dp)


def _resolve_learning_rate(args):
    if not args.lr >= 0.0:
        _fail("--lr", args.lr, "must be 0 or more")
    if not args.min_lr >= 0.0:
        _fail("--min-lr", args.min_lr, "must be 0 or more")
    if args.min_lr > args.lr:
        _fail("--min-lr", args.min_lr, f"exceeds --lr={args.lr}; valid: 0 <= min-lr <= lr")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        _fail("--lr-warmup-iters", args.lr_warmup_iters,
              f"must be below --lr-decay-iters={args.lr_decay_iters} (Megatron-Core's scheduler "
              f"requires warmup < decay); valid: 0..{args.lr_decay_iters - 1}")


def _check_intervals(args):
    for dest in ("log_interval", "eval_interval", "save_interval"):
        value = getattr(args, dest)
        if value is not None and value <= 0:
            _fail(f"--{dest.replace('_', '-')}", value, "must be a positive number of iterations")


def _resolve_device(args):
    # Imported here so that building the parser and the docs stays torch-free.
    import torch

    # --cpu must not touch CUDA at all: the entry point hides the GPUs after validation, which
    # only works while the CUDA runtime has not been initialised.
    args.use_cuda = not args.cpu and torch.cuda.is_available()
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.use_cuda else "gloo"
    if args.distributed_backend == "nccl" and not args.use_cuda:
        _fail("--distributed-backend", "nccl",
              "NCCL needs CUDA, which is unavailable or disabled by --cpu; valid here: gloo")
    have_te = importlib.util.find_spec("transformer_engine") is not None
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if args.use_cuda and have_te else "local"
    if args.transformer_impl == "transformer_engine" and not (args.use_cuda and have_te):
        _fail("--transformer-impl", "transformer_engine",
              "needs CUDA and the transformer-engine package (pip install "
              "'megatron-patches[gpu]'); valid here: local")
    if args.moe_grouped_gemm and not args.use_cuda:
        _fail("--moe-grouped-gemm", True,
              "grouped GEMM kernels need CUDA; on CPU leave it off (experts then run one after "
              "another)")
    if args.moe_token_dispatcher_type == "flex" and not args.use_cuda:
        _fail("--moe-token-dispatcher-type", "flex",
              "the flex dispatcher needs CUDA (DeepEP/HybridEP kernels); valid on CPU: alltoall, "
              "allgather")


def _check_precision(args):
    import torch

    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are mutually exclusive; choose one (or neither for "
                            "float32)")
    if args.fp16 and args.expert_model_parallel_size > 1:
        _fail("--expert-model-parallel-size", args.expert_model_parallel_size,
              "Megatron-LM does not support expert parallelism with --fp16; use --bf16 or EP=1")
    if args.moe_grouped_gemm and not args.bf16:
        _fail("--moe-grouped-gemm", True, "needs --bf16 (as in Megatron-LM)")
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def _data_prefixes(data_path: list[str]) -> list[str]:
    """The dataset prefixes in Megatron-LM's --data-path forms: one prefix, `weight prefix ...`
    pairs, or a list of prefixes (megatron.core.datasets.utils.get_blend_from_list)."""
    if not data_path:
        _fail("--data-path", "(empty)", "give at least one dataset prefix")
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
        _fail("--data-path", " ".join(data_path),
              "mixes weight/prefix pairs with bare prefixes; valid: `prefix`, `w1 p1 w2 p2 ...` "
              "or `p1 p2 ...`")
    for weight, raw in zip(parsed, weights):
        if not (math.isfinite(weight) and weight > 0):
            _fail("--data-path", " ".join(data_path),
                  f"blend weight {raw} must be a positive number")
    return list(data_path[1::2])


def _resolve_data(args):
    if args.mock_data and args.data_path is not None:
        _fail("--data-path", " ".join(args.data_path),
              "given together with --mock-data; valid: one data source, --data-path or "
              "--mock-data")
    if args.data_path is not None:
        for prefix in _data_prefixes(args.data_path):
            missing = [f"{prefix}{suffix}" for suffix in (".bin", ".idx")
                       if not Path(f"{prefix}{suffix}").is_file()]
            if missing:
                _fail("--data-path", prefix,
                      f"missing {' and '.join(missing)}; each prefix must name a Megatron indexed "
                      "dataset <prefix>.bin + <prefix>.idx (tools/prepare_data.py builds one)")
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
        _fail("--split", args.split,
              "valid: 1 to 3 comma-separated non-negative proportions for train,validation,test "
              f"with a positive sum, e.g. {DEFAULT_SPLIT} or 90,5,5")


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
            _fail(flag, path, "file not found")
    kind = args.tokenizer_type
    if kind in TOKENIZERS_NEEDING_MODEL and args.tokenizer_model is not None:
        # A HuggingFace tokenizer may also be a hub name; only local files can be checked.
        if kind != "HuggingFaceTokenizer" and not Path(args.tokenizer_model).exists():
            _fail("--tokenizer-model", args.tokenizer_model, "file not found")
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
        _fail("--tokenizer-type", kind, f"needs {' and '.join(missing)}")


def _check_checkpointing(args):
    if args.save is not None and args.save_interval is None:
        _fail("--save", args.save, "needs --save-interval (as in Megatron-LM)")
    if args.load is not None and not Path(args.load).is_dir():
        resumes_own_save = args.save is not None and Path(args.load).resolve() == Path(
            args.save).resolve()
        if not resumes_own_save:
            _fail("--load", args.load,
                  "directory not found; valid: an existing checkpoint directory, or the --save "
                  "directory (then training starts fresh until a checkpoint exists)")


# ----------------------------------------------------------------------------------------------
# Printing and documentation
# ----------------------------------------------------------------------------------------------


def describe_args(args: argparse.Namespace) -> str:
    """Every value in `args`, sorted within the parser's groups, then derived and other values."""
    parser = build_parser()
    dests_by_group = []
    seen = set()
    for group in parser._action_groups:
        dests = sorted(action.dest for action in group._group_actions
                       if action.dest != "help" and hasattr(args, action.dest))
        if dests:
            dests_by_group.append((group.title, dests))
            seen.update(dests)
    derived = sorted(dest for dest in DERIVED_VALUES if hasattr(args, dest))
    seen.update(derived)
    other = sorted(dest for dest in vars(args) if dest not in seen)
    if derived:
        dests_by_group.append(("derived (validate_args)", derived))
    if other:
        dests_by_group.append(("other", other))

    lines = ["------------------------ arguments ------------------------"]
    for title, dests in dests_by_group:
        lines.append(f"{title}:")
        for dest in dests:
            lines.append(f"  {dest} {'.' * max(2, 40 - len(dest))} {_show(getattr(args, dest))}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(str(item) for item in value)
    return str(value)


def flag_reference_markdown() -> str:
    """The Markdown flag reference (docs/flags.md), generated from build_parser()."""
    parser = build_parser()
    lines = [
        "# Flag reference",
        "",
        "Generated from the parser by `megatron_patches.training.arguments.flag_reference_markdown()`;",
        "do not edit by hand. Regenerate with",
        "`python -m megatron_patches.training.arguments > docs/flags.md`.",
        "",
        "Flags keep Megatron-LM's names, types, defaults and meanings; where a default differs,",
        "the description says so. Values are layered: parser defaults, then the `--config`",
        "YAML files in order (without `--config`, `configs/models/tiny.yaml`), then the flags",
        "given on the command line. YAML keys are the dest names in the second column.",
        "`validate_args` then resolves the derived values and refuses impossible combinations",
        "before any process group starts.",
    ]
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if action.dest != "help"]
        if not actions:
            continue
        lines += ["", f"## {group.title}", "", "| Flag | YAML key | Type | Default | Meaning |",
                  "|---|---|---|---|---|"]
        for action in actions:
            yaml_key = "—" if action.dest == "config" else f"`{action.dest}`"
            kind = "path, repeatable" if action.dest == "config" else _type_name(action)
            cells = [", ".join(f"`{option}`" for option in action.option_strings), yaml_key, kind,
                     _default_cell(action), action.help.replace("%%", "%")]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", "## Derived values", "",
              "Set by `validate_args(args, world_size)` and printed by `describe_args`:", "",
              "| Name | Meaning |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in DERIVED_VALUES.items()]
    return "\n".join(lines) + "\n"


def _default_cell(action) -> str:
    default = action.default
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, list):
        return "`" + " ".join(str(item) for item in default) + "`"
    return f"`{default}`"


if __name__ == "__main__":
    print(flag_reference_markdown(), end="")
