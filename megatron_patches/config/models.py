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
from typing import Any, Callable, Union

import yaml

from megatron_patches.config.flags import divisors

__all__ = [
    "ConfigError",
    "ModelConfig",
    "MODELS_DIR",
    "available_models",
    "load_model_config",
    "model_config_from_dict",
    "moe_layer_numbers",
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
    moe_router_score_function: str = "softmax"
    """How the router scores experts (`--moe-router-score-function`): softmax, or sigmoid
    (DeepSeek-V3's, with the expert bias)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (`--moe-router-enable-expert-bias`, DeepSeek-V3): a per-expert bias,
    a buffer rather than a parameter, added to the scores for the top-k choice only and moved each
    step towards balance; sigmoid scores only."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the selected experts' weights (`--moe-router-topk-scaling-factor`; DeepSeek-V3's
    routed scaling factor 2.5); None = 1."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (`--moe-router-num-groups`): the experts split into this many equal
    groups (DeepSeek-V3: one per node of its EP 64 layout); None = no groups."""
    moe_router_group_topk: int | None = None
    """Group-limited routing (`--moe-router-group-topk`): the groups each token may use, picked by
    the sum of their top-(topk / group_topk) scores."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the shared expert every token of an MoE layer also passes through
    (`--moe-shared-expert-intermediate-size`; n shared experts of width f are one of n x f);
    None = none. A dense, data-parallel MLP without biases (Megatron-Core has none there)."""
    moe_shared_expert_gate: bool = False
    """A learned sigmoid gate (one h-wide weight row) scaling the shared expert's output
    (`--moe-shared-expert-gate`)."""
    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3, `--multi-latent-attention`): queries, keys and values
    projected through low-rank latents; kv_channels and query groups are then unused. GPT only."""
    q_lora_rank: int | None = None
    """MLA: the query latent's width (`--q-lora-rank`); None = queries projected directly."""
    kv_lora_rank: int = 32
    """MLA: the key/value latent's width (`--kv-lora-rank`)."""
    qk_head_dim: int = 128
    """MLA: each head's query/key width without the rotary part (`--qk-head-dim`)."""
    qk_pos_emb_head_dim: int = 64
    """MLA: each head's rotary query/key width (`--qk-pos-emb-head-dim`), shared by the heads for keys."""
    v_head_dim: int = 128
    """MLA: each head's value width (`--v-head-dim`)."""
    rope_type: str | None = None
    """MLA's rotary embedding: "yarn" (None: MLA's default) or "rope" (`--rope-type`); other
    attention takes only "rope"."""
    rotary_scaling_factor: float = 1.0
    """MLA's YaRN scaling factor (`--rotary-scaling-factor`)."""
    mscale: float = 1.0
    """MLA's YaRN attention-scale term (`--mscale`)."""
    mscale_all_dim: float = 0.0
    """MLA's YaRN attention-scale term over all dimensions (`--mscale-all-dim`)."""
    mtp_num_layers: int | None = None
    """Multi-token prediction depth (`--mtp-num-layers`): each MTP layer (two norms, a 2h -> h
    projection, one transformer layer like the decoder's last, a final norm) predicts one token
    further, sharing the embedding and output layer; None = none. GPT only."""

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


def moe_layer_numbers(moe_layer_freq: Union[int, list, tuple], num_layers: int, mtp_num_layers: int | None = None) -> list[int]:
    """Megatron's (1-based, global) layer numbers of the MoE layers: the decoder's, then the
    multi-token-prediction layers' (num_layers + 1, ...), which repeat the decoder's last layer and
    so are MoE when it is."""
    pattern = moe_layer_pattern(moe_layer_freq, num_layers)
    mtp = list(range(num_layers + 1, num_layers + 1 + (mtp_num_layers or 0))) if pattern[-1] else []
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe] + mtp


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
    _check_routing(cfg)
    _check_modern(cfg)
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


ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_FIELDS = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                 "moe_router_num_groups", "moe_router_group_topk")
"""The router's architecture fields of ModelConfig (the rest of the routing flags are run settings)."""


def _check_routing(cfg: ModelConfig) -> None:
    """The router's architecture fields: types, then the rules."""
    if cfg.moe_router_score_function not in ROUTER_SCORE_FUNCTIONS:
        _fail("moe_router_score_function", cfg.moe_router_score_function,
              f"expected one of {list(ROUTER_SCORE_FUNCTIONS)}")
    if not isinstance(cfg.moe_router_enable_expert_bias, bool):
        _fail("moe_router_enable_expert_bias", cfg.moe_router_enable_expert_bias, "expected true or false")
    for key in ("moe_router_num_groups", "moe_router_group_topk"):
        value = getattr(cfg, key)
        if value is not None and (not _is_int(value) or value < 1):
            _fail(key, value, "expected a positive integer or null")
    factor = cfg.moe_router_topk_scaling_factor
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
        _fail("moe_router_topk_scaling_factor", factor, "expected a positive number or null")
    if cfg.num_experts is None:
        for key in ROUTER_FIELDS:
            if getattr(cfg, key) != _FIELDS[key].default:
                _fail(key, getattr(cfg, key), "it shapes the router of MoE layers, which a dense model (num_experts: "
                      "null) has none of; set num_experts, or leave it out")
        return
    check_routing_rules(cfg, _fail)


def check_routing_rules(cfg, fail: Callable[[str, Any, str], None]) -> None:
    """Megatron-Core 0.16.1's rules for the router's options (transformer_config.py __post_init__,
    moe/moe_utils.py group_limited_topk). `cfg`: a ModelConfig or the training flags (the same
    names); `fail(key, value, why)` raises in the caller's words (a config key, or the flag of that dest)."""
    experts = cfg.num_experts
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        fail("moe_router_enable_expert_bias", True, "Megatron-Core's expert bias (aux-loss-free balancing) needs "
             f"--moe-router-score-function sigmoid (is {cfg.moe_router_score_function})")
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        given, missing = ("moe_router_num_groups", "--moe-router-group-topk") if group_topk is None else \
            ("moe_router_group_topk", "--moe-router-num-groups")
        fail(given, groups if group_topk is None else group_topk,
             f"group-limited routing needs both it and {missing} (Megatron-Core reads the groups only with "
             "a group top-k)")
    if groups is not None:
        if groups < 1 or experts % groups != 0:
            fail("moe_router_num_groups", groups, f"must divide --num-experts={experts}; valid: {divisors(experts)}")
        if not 1 <= group_topk <= groups:
            fail("moe_router_group_topk", group_topk, f"valid: 1..--moe-router-num-groups={groups}")
        per_group = experts // groups
        if not group_topk <= cfg.moe_router_topk <= group_topk * per_group:
            # Megatron-Core ranks the groups by their top-(topk // group-topk) scores and then picks
            # the top-k experts inside the chosen groups
            fail("moe_router_group_topk", group_topk,
                 f"needs group-topk <= --moe-router-topk={cfg.moe_router_topk} <= group-topk x experts per "
                 f"group ({per_group}); valid: "
                 f"{[g for g in range(1, groups + 1) if g <= cfg.moe_router_topk <= g * per_group]}")
    factor = cfg.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0.0:
        fail("moe_router_topk_scaling_factor", factor, "must be positive (leave it out to switch it off)")


MLA_ONLY = {"q_lora_rank": None, "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""MLA's fields whose values only MLA reads, with their defaults (Megatron-LM's; the widths
kv_lora_rank ... v_head_dim keep Megatron-LM's non-None defaults and are simply unused without MLA)."""
ROPE_TYPES = ("rope", "yarn")


def _check_modern(cfg: ModelConfig) -> None:
    """Shared experts, multi-latent attention and multi-token prediction: types, then the rules."""
    for key in ("q_lora_rank", "mtp_num_layers", "moe_shared_expert_intermediate_size"):
        value = getattr(cfg, key)
        if value is not None and (not _is_int(value) or value < 1):
            _fail(key, value, "expected a positive integer or null")
    for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if not _is_int(getattr(cfg, key)) or getattr(cfg, key) < 1:
            _fail(key, getattr(cfg, key), "expected a positive integer")
    for key in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail(key, value, "expected a number")
    for key in ("moe_shared_expert_gate", "multi_latent_attention"):
        if not isinstance(getattr(cfg, key), bool):
            _fail(key, getattr(cfg, key), "expected true or false")
    check_modern_rules(cfg, _fail)


def check_modern_rules(cfg, fail: Callable[[str, Any, str], None]) -> None:
    """The rules Megatron-Core 0.16.1 and Megatron-LM set for shared experts, multi-latent attention
    and multi-token prediction (transformer_config.py, moe/shared_experts.py, Megatron-LM's
    arguments.py). `cfg`: a ModelConfig or the training flags (the same names); `fail(key, value,
    why)` raises in the caller's words (a config key, or the flag of that dest)."""
    if cfg.rope_type is not None and cfg.rope_type not in ROPE_TYPES:
        fail("rope_type", cfg.rope_type, f"unknown value; valid: {', '.join(ROPE_TYPES)}, or leave it out")
    shared = cfg.moe_shared_expert_intermediate_size
    if shared is not None and cfg.num_experts is None:
        fail("moe_shared_expert_intermediate_size", shared, "a shared expert belongs to an MoE layer; it needs experts")
    if shared is not None and cfg.add_bias_linear:
        fail("moe_shared_expert_intermediate_size", shared, "Megatron-Core's shared expert has no biases "
             "(moe/shared_experts.py refuses add_bias_linear); it needs --disable-bias-linear (add_bias_linear: "
             "false), as the published shared-expert recipes give")
    if shared is None and cfg.moe_shared_expert_gate:
        fail("moe_shared_expert_gate", True, "it gates the shared expert; it needs a shared expert size "
             "(--moe-shared-expert-intermediate-size)")
    if cfg.multi_latent_attention:
        if cfg.model_family != "gpt":
            fail("multi_latent_attention", True, "Megatron-Core builds multi-latent attention in GPT layers only")
        if cfg.group_query_attention:
            fail("multi_latent_attention", True, "group-query attention is mutually exclusive with multi-latent "
                 "attention (Megatron-LM's rule); drop --group-query-attention")
    else:
        if cfg.rope_type not in (None, "rope"):
            fail("rope_type", cfg.rope_type, "attention other than MLA takes only rope (Megatron-LM's rule); valid: "
                 "rope, or multi-latent attention")
        for key, default in MLA_ONLY.items():
            if getattr(cfg, key) != default:
                fail(key, getattr(cfg, key), "it shapes multi-latent attention, which this model does not use "
                     f"(Megatron-LM ignores it there); add --multi-latent-attention (multi_latent_attention: true), or leave it out "
                     f"(default {default})")
    if cfg.mtp_num_layers is not None and cfg.model_family != "gpt":
        fail("mtp_num_layers", cfg.mtp_num_layers, "multi-token prediction is built for GPT models only "
             "(Megatron-Core's GPTModel)")


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


def _router_params(cfg: ModelConfig) -> int:
    return cfg.num_experts * cfg.hidden_size + (cfg.num_experts if cfg.add_bias_linear else 0) if cfg.num_experts else 0


def _shared_expert_params(cfg: ModelConfig) -> int:
    """The shared expert of one MoE layer: an MLP without biases, and the gate's weight row."""
    if cfg.moe_shared_expert_intermediate_size is None:
        return 0
    return _mlp_params(cfg, cfg.moe_shared_expert_intermediate_size) + (cfg.hidden_size if cfg.moe_shared_expert_gate else 0)


def _attention_params(cfg: ModelConfig) -> int:
    """One layer's self-attention: projections, their biases and the query/key norms."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    bias = cfg.add_bias_linear

    def norm(width: int) -> int:
        return 2 * width if cfg.normalization == "LayerNorm" else width

    if cfg.multi_latent_attention:
        # Megatron-Core 0.16.1's MLASelfAttention: only the output projection has a bias; the
        # query and key/value latents carry the norms (with qk_layernorm).
        q_head = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        if cfg.q_lora_rank is None:
            query = h * heads * q_head
        else:
            query = h * cfg.q_lora_rank + cfg.q_lora_rank * heads * q_head
            query += norm(cfg.q_lora_rank) if cfg.qk_layernorm else 0
        key_value = h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_head_dim + cfg.v_head_dim)
        key_value += norm(cfg.kv_lora_rank) if cfg.qk_layernorm else 0
        return query + key_value + heads * cfg.v_head_dim * h + (h if bias else 0)
    query_width = cfg.kv_channels * heads
    qkv_out = query_width + 2 * cfg.kv_channels * cfg.query_groups
    qkv_bias = bias or cfg.add_qkv_bias
    params = qkv_out * h + (qkv_out if qkv_bias else 0) + h * query_width + (h if bias else 0)
    if cfg.qk_layernorm:
        params += 2 * norm(cfg.kv_channels)  # one norm over each head's queries and one over its keys
    return params


def count_parameters(cfg: ModelConfig, tensor_parallel_size: int = 1) -> dict[str, int]:
    """Parameter count of the Megatron-Core model this config builds, by component, plus totals.

    Matches `sum(p.numel() for p in model.parameters())` of Megatron-Core 0.16.1's GPTModel
    (local spec) or BertModel (local spec, MoE MLPs) built at TP = PP = EP = 1, i.e. the
    whole model. `tensor_parallel_size` only changes the vocabulary padding.

    Keys: embeddings (word + position + BERT token types), attention (QKV or MLA's latent
    projections + output projection + query/key norms), router, experts, shared_experts,
    dense_mlp (MLPs of non-MoE layers), norms (per-layer, final and BERT head norms), mtp (the
    multi-token-prediction layers, their experts included), output_layer (untied output
    projection, BERT output bias), bert_heads (BERT LM-head dense, pooler, binary head),
    non_embedding (total minus embeddings and output_layer) and total.
    """
    h = cfg.hidden_size
    vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tensor_parallel_size)
    # torch LayerNorm has weight and bias, torch RMSNorm only a weight.
    norm = 2 * h if cfg.normalization == "LayerNorm" else h

    attention_per_layer = _attention_params(cfg)
    pattern = cfg.moe_layer_pattern
    moe_layers = sum(pattern)
    dense_layers = cfg.num_layers - moe_layers
    router = moe_layers * _router_params(cfg)
    experts = moe_layers * cfg.num_experts * expert_parameter_count(cfg) if moe_layers else 0
    shared_experts = moe_layers * _shared_expert_params(cfg)
    dense_mlp = dense_layers * _mlp_params(cfg, cfg.ffn_hidden_size)

    # Two norms per layer (input, pre-MLP) and the final norm of the block.
    norms = (2 * cfg.num_layers + 1) * norm

    # Each MTP layer: its two input norms and final norm, the 2h -> h projection (no bias) and one
    # transformer layer built from the decoder's last layer's spec (Megatron-Core 0.16.1,
    # transformer/multi_token_prediction.py); the embedding and output layer are the model's.
    mtp = 0
    if cfg.mtp_num_layers:
        last_mlp = (_router_params(cfg) + cfg.num_experts * expert_parameter_count(cfg) + _shared_expert_params(cfg)
                    if pattern[-1] else _mlp_params(cfg, cfg.ffn_hidden_size))
        mtp = cfg.mtp_num_layers * (3 * norm + 2 * h * h + attention_per_layer + 2 * norm + last_mlp)

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

    total = embeddings + attention + router + experts + shared_experts + dense_mlp + norms + output_layer + bert_heads + mtp
    return {
        "embeddings": embeddings,
        "attention": attention,
        "router": router,
        "experts": experts,
        "shared_experts": shared_experts,
        "dense_mlp": dense_mlp,
        "mtp": mtp,
        "norms": norms,
        "output_layer": output_layer,
        "bert_heads": bert_heads,
        "non_embedding": total - embeddings - output_layer,
        "total": total,
    }
