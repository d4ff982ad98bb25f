"""Model configurations: the YAML files under configs/models/, their loader, and parameter counts.

A model YAML holds Megatron-LM training flags by their argparse destination names
(`num_layers`, `hidden_size`, `moe_router_topk`, ...) plus `model_family`, so that the same
file can be passed as `--config FILE.yaml` to the training script. It describes the model
only: nothing run-specific (batch sizes, learning rates, parallel sizes) belongs in it.

`count_parameters` reproduces, parameter for parameter, what Megatron-Core 0.16.1 builds for
such a config with the local (non-Transformer-Engine) layer spec: `GPTModel` with
`get_gpt_decoder_block_spec`, or `BertModel` with the BERT local layer spec whose MLP is the
MoE block. The YAML files state their arithmetic in comments; tests check those numbers
against this function and against the published model sizes.

This module is pure Python (plus PyYAML): no torch, no Megatron import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml

__all__ = [
    "ConfigError",
    "ModelConfig",
    "MODELS_DIR",
    "available_models",
    "load_model_config",
    "model_config_from_dict",
    "moe_layer_pattern",
    "padded_vocab_size",
    "vocab_padding_multiple",
    "count_parameters",
    "expert_parameter_count",
]

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The repository's configs/ folder (the package is installed in editable mode)."""
MODELS_DIR = CONFIGS_DIR / "models"
"""Where `load_model_config(name)` looks for `<name>.yaml`."""


class ConfigError(ValueError):
    """A model or cluster config is malformed; the message names the key, the value and what would be valid."""


MODEL_FAMILIES = ("gpt", "bert")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


@dataclass(frozen=True)
class ModelConfig:
    """One GPT or BERT MoE model, described by Megatron-LM flag names.

    Optional sizes left as None take Megatron-LM's defaults after loading (see
    `__post_init__`), so a loaded config is always fully resolved.
    """

    num_layers: int
    """Transformer layers (`--num-layers`)."""
    hidden_size: int
    """Model width d_model (`--hidden-size`)."""
    num_attention_heads: int
    """Attention heads (`--num-attention-heads`); must divide hidden_size unless kv_channels is given."""
    seq_length: int
    """Training sequence length in tokens (`--seq-length`)."""
    vocab_size: int
    """Unpadded vocabulary the parameter count assumes (`--vocab-size`); training takes the
    tokenizer's vocabulary, padded by `padded_vocab_size`."""
    model_family: str = "gpt"
    """"gpt" (causal GPTModel) or "bert" (BertModel with MoE MLPs) (`--model-family`)."""
    ffn_hidden_size: int | None = None
    """Width of the dense MLP in non-MoE layers (`--ffn-hidden-size`); None = Megatron-LM's
    default: 4 x hidden, or int(4 x hidden x 2/3 / 64) x 64 with swiglu."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table (`--max-position-embeddings`); None = seq_length.
    With rope it only bounds the usable sequence length and adds no parameters."""
    kv_channels: int | None = None
    """Per-head projection width (`--kv-channels`); None = hidden_size / num_attention_heads."""
    group_query_attention: bool = False
    """Use grouped-query attention with `num_query_groups` key/value heads (`--group-query-attention`)."""
    num_query_groups: int | None = None
    """Key/value head groups under GQA (`--num-query-groups`); must divide num_attention_heads."""
    position_embedding_type: str = "learned_absolute"
    """"learned_absolute" (a max_position_embeddings x hidden table), "rope" or "none"
    (`--position-embedding-type`)."""
    rotary_base: int = 10000
    """RoPE base (`--rotary-base`); only used with rope."""
    rotary_percent: float = 1.0
    """Share of each head's channels that RoPE rotates (`--rotary-percent`); rope only."""
    rotary_interleaved: bool = False
    """Rotate interleaved channel pairs instead of the two halves (`--rotary-interleaved`); rope only."""
    rotary_seq_len_interpolation_factor: int | None = None
    """Divide positions by this factor, for sequences longer than trained on
    (`--rotary-seq-len-interpolation-factor`); rope only."""
    qk_layernorm: bool = False
    """A norm on each head's queries and keys (`--qk-layernorm`): two norms of kv_channels per
    layer. GPT only (Megatron-Core's BERT layer spec has none)."""
    add_qkv_bias: bool = False
    """A bias on the QKV projection even with add_bias_linear false (`--add-qkv-bias`); with
    add_bias_linear the QKV projection has one anyway (Megatron-LM then sets this true)."""
    normalization: str = "LayerNorm"
    """"LayerNorm" (weight + bias) or "RMSNorm" (weight only) (`--normalization`)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm (`--norm-epsilon`)."""
    swiglu: bool = False
    """Gated SiLU MLPs: fc1 produces 2 x ffn columns (`--swiglu`)."""
    add_bias_linear: bool = True
    """Biases on linear layers, the router included; False = `--disable-bias-linear`."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output projection instead of reusing the word embeddings
    (`--untie-embeddings-and-output-weights`). Megatron's default is tied."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding unit, multiplied by the TP size (`--make-vocab-size-divisible-by`)."""
    bert_binary_head: bool = True
    """BERT only: sentence-order head, pooler and 2 token types; False = `--bert-no-binary-head`."""
    num_experts: int | None = None
    """Experts per MoE layer (`--num-experts`); None = a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (`--moe-router-topk`); at most num_experts."""
    moe_ffn_hidden_size: int | None = None
    """Width of one expert's MLP (`--moe-ffn-hidden-size`); None = ffn_hidden_size."""
    moe_expert_capacity_factor: float | None = None
    """Per-expert capacity as a multiple of the even share (`--moe-expert-capacity-factor`);
    None = dropless."""
    moe_layer_freq: Union[int, tuple[int, ...]] = 1
    """Which layers are MoE (`--moe-layer-freq`): an int k makes layers 0, k, 2k, ... MoE; a
    list gives one 0 (dense) / 1 (MoE) per layer."""

    def __post_init__(self) -> None:
        _check_model(self)
        if self.ffn_hidden_size is None:
            default = 4 * self.hidden_size
            if self.swiglu:
                default = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            object.__setattr__(self, "ffn_hidden_size", default)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))

    @property
    def query_groups(self) -> int:
        """Key/value heads actually built: num_query_groups under GQA, else one per attention head."""
        if self.group_query_attention:
            return self.num_query_groups
        return self.num_attention_heads

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """One flag per layer, True where the layer is MoE (Megatron's moe_layer_freq rule)."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        return tuple(bool(x) for x in moe_layer_pattern(self.moe_layer_freq, self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        """How many layers carry experts."""
        return sum(self.moe_layer_pattern)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as YAML-able flag values (lists, not tuples)."""
        out = dataclasses.asdict(self)
        if isinstance(out["moe_layer_freq"], tuple):
            out["moe_layer_freq"] = list(out["moe_layer_freq"])
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
_REQUIRED = tuple(n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING)


def moe_layer_pattern(moe_layer_freq: Union[int, list, tuple], num_layers: int) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (Megatron's --moe-layer-freq rule: an
    int k makes layers 0, k, 2k, ... MoE; a list gives one 0/1 per layer)."""
    if isinstance(moe_layer_freq, int):
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    return list(moe_layer_freq)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(key: str, value, valid: str) -> None:
    raise ConfigError(f"model config: {key}={value!r} is invalid; {valid}")


def _check_model(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first invalid field of `cfg` and what would be valid."""
    positive = ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                "make_vocab_size_divisible_by", "moe_router_topk", "rotary_base"]
    optional_positive = ["ffn_hidden_size", "max_position_embeddings", "kv_channels",
                         "num_query_groups", "num_experts", "moe_ffn_hidden_size"]
    for key in positive:
        value = getattr(cfg, key)
        if not _is_int(value) or value < 1:
            _fail(key, value, "expected a positive integer")
    for key in optional_positive:
        value = getattr(cfg, key)
        if value is not None and (not _is_int(value) or value < 1):
            _fail(key, value, "expected a positive integer or null")
    for key in ("group_query_attention", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights",
                "bert_binary_head", "rotary_interleaved", "qk_layernorm", "add_qkv_bias"):
        if not isinstance(getattr(cfg, key), bool):
            _fail(key, getattr(cfg, key), "expected true or false")
    if cfg.model_family not in MODEL_FAMILIES:
        _fail("model_family", cfg.model_family, f"expected one of {list(MODEL_FAMILIES)}")
    if cfg.normalization not in NORMALIZATIONS:
        _fail("normalization", cfg.normalization, f"expected one of {list(NORMALIZATIONS)}")
    if cfg.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        _fail("position_embedding_type", cfg.position_embedding_type,
              f"expected one of {list(POSITION_EMBEDDING_TYPES)}")
    if isinstance(cfg.layernorm_epsilon, bool) or not isinstance(cfg.layernorm_epsilon, (int, float)) \
            or not 0 < cfg.layernorm_epsilon < 1:
        _fail("layernorm_epsilon", cfg.layernorm_epsilon, "expected a number in (0, 1)")
    if isinstance(cfg.rotary_percent, bool) or not isinstance(cfg.rotary_percent, (int, float)) \
            or not 0 < cfg.rotary_percent <= 1:
        _fail("rotary_percent", cfg.rotary_percent, "expected a share in (0, 1]")
    factor = cfg.rotary_seq_len_interpolation_factor
    if factor is not None and (not _is_int(factor) or factor < 1):
        _fail("rotary_seq_len_interpolation_factor", factor, "expected a positive integer or null")
    rotary = {"rotary_percent": (cfg.rotary_percent, 1.0), "rotary_interleaved": (cfg.rotary_interleaved, False),
              "rotary_seq_len_interpolation_factor": (factor, None)}
    for key, (value, default) in rotary.items():
        if value != default and cfg.position_embedding_type != "rope":
            _fail(key, value, f"it shapes rotary embeddings, which position_embedding_type="
                  f"{cfg.position_embedding_type!r} does not use; set position_embedding_type: rope, or leave it out")
    if cfg.qk_layernorm and cfg.model_family == "bert":
        _fail("qk_layernorm", True, "Megatron-Core's BERT layer spec has no query/key norm; valid: false with bert")
    if cfg.model_family == "bert" and cfg.position_embedding_type == "none":
        _fail("position_embedding_type", "none", "BertModel supports only 'learned_absolute' or 'rope'")
    if cfg.kv_channels is None and cfg.hidden_size % cfg.num_attention_heads:
        _fail("num_attention_heads", cfg.num_attention_heads,
              f"it must divide hidden_size={cfg.hidden_size} (or set kv_channels)")
    if cfg.group_query_attention:
        if cfg.num_query_groups is None:
            _fail("num_query_groups", None, "group_query_attention needs num_query_groups")
        if cfg.num_attention_heads % cfg.num_query_groups:
            _fail("num_query_groups", cfg.num_query_groups,
                  f"it must divide num_attention_heads={cfg.num_attention_heads}")
    elif cfg.num_query_groups is not None:
        _fail("num_query_groups", cfg.num_query_groups,
              "Megatron-LM ignores it without group_query_attention: true; set both or neither")
    max_pos = cfg.max_position_embeddings
    if cfg.position_embedding_type == "learned_absolute" and max_pos is not None and max_pos < cfg.seq_length:
        _fail("max_position_embeddings", max_pos,
              f"a learned position table needs at least seq_length={cfg.seq_length} rows")
    if cfg.num_experts is not None and cfg.moe_router_topk > cfg.num_experts:
        _fail("moe_router_topk", cfg.moe_router_topk, f"it must be at most num_experts={cfg.num_experts}")
    cap = cfg.moe_expert_capacity_factor
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or not math.isfinite(cap) or cap <= 0):
        _fail("moe_expert_capacity_factor", cap, "expected a positive number, or null for dropless")
    freq = cfg.moe_layer_freq
    if _is_int(freq):
        if not 1 <= freq <= cfg.num_layers:
            _fail("moe_layer_freq", freq, f"expected an integer in [1, num_layers={cfg.num_layers}]")
    elif isinstance(freq, (list, tuple)):
        if len(freq) != cfg.num_layers or any(x not in (0, 1) or isinstance(x, bool) for x in freq):
            _fail("moe_layer_freq", freq, f"a per-layer pattern must list num_layers={cfg.num_layers} values, each 0 or 1")
        if cfg.num_experts is not None and 1 not in freq:
            _fail("moe_layer_freq", freq, "an MoE model needs at least one 1 (MoE layer) in the pattern")
    else:
        _fail("moe_layer_freq", freq, "expected an integer or a list of 0/1 per layer")


def model_config_from_dict(values: dict[str, Any], source: str = "<dict>") -> ModelConfig:
    """Build and validate a ModelConfig from flag values; `source` names the file in errors."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: a model config must be a mapping of flag names to values, got {type(values).__name__}")
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; valid keys are {sorted(_FIELDS)}")
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {missing}")
    try:
        return ModelConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def model_config_from_args(args) -> ModelConfig:
    """The ModelConfig a validated training namespace describes (its fields are flag dest names;
    `--num-query-groups` counts only with `--group-query-attention`, as Megatron-LM reads it)."""
    values = {name: getattr(args, name) for name in _FIELDS}
    if not args.group_query_attention:
        values["num_query_groups"] = None
    return model_config_from_dict(values, source="training flags")


def available_models() -> list[str]:
    """Names (file stems) of the model configs under configs/models, sorted."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def resolve_config_path(path_or_name: Union[str, Path], folder: Path, names: list[str], kind: str) -> Path:
    """A YAML path as given, or `folder/<name>.yaml` for a bare name; ConfigError listing `names` if neither exists."""
    text = str(path_or_name)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.parent != Path("."):
        if not path.is_file():
            raise ConfigError(f"{kind} config file {text!r} does not exist")
        return path
    path = folder / f"{text}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown {kind} config {text!r}; available: {names} (or pass a path to a .yaml file)")
    return path


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Parse a YAML file that must hold one mapping; ConfigError naming the file otherwise."""
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(values).__name__}")
    return values


def load_model_config(path_or_name: Union[str, Path]) -> ModelConfig:
    """Load and validate a model YAML, given as a path or as a name under configs/models (e.g. "tiny")."""
    path = resolve_config_path(path_or_name, MODELS_DIR, available_models(), "model")
    return model_config_from_dict(read_yaml_mapping(path), source=str(path))


def vocab_padding_multiple(divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """What Megatron-LM pads the vocabulary to a multiple of: divisible_by x TP."""
    return divisible_by * tensor_parallel_size


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """Megatron-LM's padded vocabulary: round up to a multiple of divisible_by x TP (50257 -> 50304)."""
    multiple = vocab_padding_multiple(divisible_by, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple


def expert_parameter_count(cfg: ModelConfig) -> int:
    """Parameters of one expert: fc1 (hidden -> moe_ffn, x2 with swiglu) and fc2, with biases when enabled."""
    if cfg.num_experts is None:
        raise ConfigError("model config: num_experts=None; a dense model has no experts to count")
    return _mlp_params(cfg, cfg.moe_ffn_hidden_size)


def _mlp_params(cfg: ModelConfig, ffn: int) -> int:
    h = cfg.hidden_size
    fc1_out = 2 * ffn if cfg.swiglu else ffn
    bias = cfg.add_bias_linear
    return fc1_out * h + (fc1_out if bias else 0) + h * ffn + (h if bias else 0)


def count_parameters(cfg: ModelConfig, tensor_parallel_size: int = 1) -> dict[str, int]:
    """Parameter count of the Megatron-Core model this config builds, by component, plus totals.

    Matches `sum(p.numel() for p in model.parameters())` of Megatron-Core 0.16.1's GPTModel
    (local spec) or BertModel (local spec, MoE MLPs) built at TP = PP = EP = 1, i.e. the
    whole model. `tensor_parallel_size` only changes the vocabulary padding.

    Keys: embeddings (word + position + BERT token types), attention (QKV + output projection + query/key norms),
    router, experts, dense_mlp (MLPs of non-MoE layers), norms (per-layer, final and BERT head
    norms), output_layer (untied output projection, BERT output bias), bert_heads (BERT LM-head
    dense, pooler, binary head), non_embedding (total minus embeddings and output_layer) and total.
    """
    h = cfg.hidden_size
    vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tensor_parallel_size)
    bias = cfg.add_bias_linear
    # torch LayerNorm has weight and bias, torch RMSNorm only a weight.
    norm = 2 * h if cfg.normalization == "LayerNorm" else h

    query_width = cfg.kv_channels * cfg.num_attention_heads
    qkv_out = query_width + 2 * cfg.kv_channels * cfg.query_groups
    qkv_bias = bias or cfg.add_qkv_bias
    attention_per_layer = qkv_out * h + (qkv_out if qkv_bias else 0) + h * query_width + (h if bias else 0)
    if cfg.qk_layernorm:
        # one norm over each head's queries and one over its keys, kv_channels wide
        attention_per_layer += 2 * (2 * cfg.kv_channels if cfg.normalization == "LayerNorm" else cfg.kv_channels)

    pattern = cfg.moe_layer_pattern
    moe_layers = sum(pattern)
    dense_layers = cfg.num_layers - moe_layers
    router = 0
    experts = 0
    if moe_layers:
        router = moe_layers * (cfg.num_experts * h + (cfg.num_experts if bias else 0))
        experts = moe_layers * cfg.num_experts * expert_parameter_count(cfg)
    dense_mlp = dense_layers * _mlp_params(cfg, cfg.ffn_hidden_size)

    # Two norms per layer (input, pre-MLP) and the final norm of the block.
    norms = (2 * cfg.num_layers + 1) * norm

    embeddings = vocab * h
    if cfg.position_embedding_type == "learned_absolute":
        embeddings += cfg.max_position_embeddings * h
    output_layer = vocab * h if cfg.untie_embeddings_and_output_weights else 0
    bert_heads = 0
    if cfg.model_family == "bert":
        # BertLMHead: dense h x h with bias, then a LayerNorm; the output layer always has a bias.
        bert_heads += h * h + h
        norms += norm
        output_layer += vocab
        if cfg.bert_binary_head:
            embeddings += 2 * h  # token-type embeddings (2 types)
            bert_heads += h * h + h  # pooler
            bert_heads += 2 * h + 2  # binary (sentence-order) head
    attention = cfg.num_layers * attention_per_layer

    total = embeddings + attention + router + experts + dense_mlp + norms + output_layer + bert_heads
    return {
        "embeddings": embeddings,
        "attention": attention,
        "router": router,
        "experts": experts,
        "dense_mlp": dense_mlp,
        "norms": norms,
        "output_layer": output_layer,
        "bert_heads": bert_heads,
        "non_embedding": total - embeddings - output_layer,
        "total": total,
    }
