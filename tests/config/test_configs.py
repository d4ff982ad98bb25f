"""Model and cluster configs: every YAML loads and validates, the arithmetic stated in its
comments is what `count_parameters` computes, the counts match the published model sizes and a
real Megatron-Core build, and malformed configs fail with messages that name the problem."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from megatron_patches.config import (
    ConfigError,
    available_clusters,
    available_models,
    cluster_config_from_dict,
    count_parameters,
    expert_parameter_count,
    load_cluster_config,
    load_model_config,
    model_config_from_dict,
    padded_vocab_size,
)
from megatron_patches.config.models import MODELS_DIR, ROUTER_FIELDS
from megatron_patches.config.clusters import CLUSTERS_DIR
from megatron_patches.placement.types import Topology

# Published sizes (docs/design.md section 7) and which count of ours reproduces each: the FSSDP and
# zebra papers count the transformer layers without the embedding tables; the replication paper
# gives the dense base model (its MLPs not yet turned into experts).
PUBLISHED = {
    "gpt_moe_s": ("1.84B", "non_embedding"),
    "gpt_moe_l": ("7.36B", "non_embedding"),
    "bert_moe": ("3.27B", "non_embedding"),
    "bert_moe_deep": ("6.54B", "non_embedding"),
    "gpt_small": ("125M", "dense_base_total"),
    "gpt_medium": ("350M", "dense_base_total"),
    "gpt_large": ("760M", "dense_base_total"),
    "mixtral_w1": ("2.2B", "non_embedding"),
    "mixtral_w2": ("4.3B", "non_embedding"),
    "mixtral_d1": ("2.1B", "non_embedding"),
    "mixtral_d2": ("1.2B", "non_embedding"),
    "mixtral_d3": ("3.5B", "non_embedding"),
    # today's MoE models (issue 43): the reports' and model cards' totals; DeepSeek-V3's 671B is
    # its main model, without the MTP module
    "deepseek_v3": ("671B", "without_mtp"),
    "deepseek_v2_lite": ("15.7B", "total"),
    "qwen3_30b_a3b": ("30.5B", "total"),
    "mixtral_8x7b": ("46.7B", "total"),
}
TINY_VARIANTS = ("deepseek_v3_tiny", "deepseek_v2_lite_tiny", "qwen3_30b_a3b_tiny", "mixtral_8x7b_tiny")
"""The same architectures at toy sizes, for CPU runs (tests/training/test_model_configs_train.py)."""
TOLERANCE = 0.03  # "within a few percent"; the FFN size of the zebra models is our choice
REPLICATION_MODELS = ("gpt_small", "gpt_medium", "gpt_large")
FSSDP_MODELS = ("gpt_moe_s", "gpt_moe_l", "bert_moe", "bert_moe_deep")


def published_value(text: str) -> float:
    return float(text[:-1]) * (1e9 if text.endswith("B") else 1e6)


def our_counts(name: str) -> dict[str, int]:
    """count_parameters of a config, plus the dense base (num_experts null) total."""
    cfg = load_model_config(name)
    counts = count_parameters(cfg)
    router_defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name in ROUTER_FIELDS}
    dense = dataclasses.replace(cfg, num_experts=None, moe_shared_expert_intermediate_size=None, **router_defaults)
    counts["dense_base_total"] = count_parameters(dense)["total"]
    counts["without_mtp"] = counts["total"] - counts["mtp"]
    return counts


def comment_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("#")]


# ---------------------------------------------------------------------------------------------
# Model configs
# ---------------------------------------------------------------------------------------------

def test_every_published_model_has_a_config():
    assert set(available_models()) == set(PUBLISHED) | {"tiny", *TINY_VARIANTS}


@pytest.mark.parametrize("name", available_models())
def test_model_yaml_loads_and_round_trips(name):
    cfg = load_model_config(name)
    assert cfg == load_model_config(MODELS_DIR / f"{name}.yaml")
    assert model_config_from_dict(cfg.to_dict()) == cfg
    # Only model flags: the file must not pin anything run-specific.
    raw = yaml.safe_load((MODELS_DIR / f"{name}.yaml").read_text())
    assert not {"micro_batch_size", "global_batch_size", "lr", "train_iters"} & set(raw)
    assert cfg.num_experts is not None and cfg.num_moe_layers >= 1


@pytest.mark.parametrize("name", available_models())
def test_stated_parameter_arithmetic_is_exact(name):
    """Every `#   <key>   <number>` row of the file's parameter block equals our count."""
    counts = our_counts(name)
    rows = {}
    for line in comment_lines(MODELS_DIR / f"{name}.yaml"):
        m = re.match(r"^#\s+(\w+)\s+([\d,]+)(\s|$)", line)
        if m and m.group(1) in counts:
            rows[m.group(1)] = int(m.group(2).replace(",", ""))
    assert {"embeddings", "attention", "router", "experts", "norms", "total"} <= set(rows), rows
    wrong = {k: (v, counts[k]) for k, v in rows.items() if v != counts[k]}
    assert not wrong, f"{name}: stated vs computed {wrong}"
    assert sum(counts[k] for k in ("embeddings", "attention", "router", "experts", "shared_experts", "dense_mlp",
                                   "mtp", "norms", "output_layer", "bert_heads")) == counts["total"]


def test_parameter_counts_match_published_sizes():
    table = []
    failures = []
    for name, (published, key) in PUBLISHED.items():
        ours = our_counts(name)[key]
        rel = (ours - published_value(published)) / published_value(published)
        table.append(f"{name:<14} {key:<17} {ours:>15,} published {published:>6}  {100 * rel:+.2f}%")
        if abs(rel) > TOLERANCE:
            failures.append(name)
    assert not failures, f"parameter counts off by more than {TOLERANCE:.0%}:\n" + "\n".join(table)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_stated_published_comparison_matches(name):
    """The file's `published` row quotes the same figure, count and deviation as the test table."""
    published, key = PUBLISHED[name]
    pattern = r"^#\s+published\s+([\d.]+[MB])\s+(\w+) is ([+-][\d.]+)% off"
    rows = [m for m in (re.match(pattern, l) for l in comment_lines(MODELS_DIR / f"{name}.yaml")) if m]
    assert len(rows) == 1, f"{name}: expected one published row, found {len(rows)}"
    m = rows[0]
    assert (m.group(1), m.group(2)) == (published, key)
    rel = 100 * (our_counts(name)[key] - published_value(published)) / published_value(published)
    assert float(m.group(3)) == pytest.approx(rel, abs=0.051)


def test_tiny_count_by_hand():
    """Worked example: tiny = 2 layers, hidden 64, 4 heads, seq 128, 8 experts of width 128."""
    counts = count_parameters(load_model_config("tiny"))
    assert counts["embeddings"] == 50304 * 64 + 128 * 64
    assert counts["attention"] == 2 * ((64 * 192 + 192) + (64 * 64 + 64))
    assert counts["router"] == 2 * (8 * 64 + 8)
    assert counts["experts"] == 2 * 8 * ((64 * 128 + 128) + (128 * 64 + 64))
    assert counts["norms"] == 5 * 2 * 64
    assert counts["output_layer"] == 0  # tied by default, as in Megatron GPT
    assert counts["total"] == 3_527_824
    # The embedding table dominates the tiny model (GPT-2 vocabulary).
    assert counts["embeddings"] / counts["total"] > 0.9


def test_gpt_moe_s_count_by_hand():
    counts = count_parameters(load_model_config("gpt_moe_s"))
    h, f, e = 768, 1536, 64
    assert counts["experts"] == 12 * e * (2 * h * f + f + h)
    assert counts["attention"] == 12 * (4 * h * h + 4 * h)
    assert counts["non_embedding"] == 1_842_686_208


def test_mixtral_style_count_by_hand():
    """SwiGLU (fc1 doubled), no biases, RMSNorm, GQA with 8 groups of 128, untied output, rope."""
    cfg = load_model_config("mixtral_w1")
    counts = count_parameters(cfg)
    h, f = 2048, 7168
    assert expert_parameter_count(cfg) == 3 * h * f
    assert counts["attention"] == 4 * (h * (2048 + 2 * 8 * 128) + 2048 * h)
    assert counts["router"] == 4 * 12 * h
    assert counts["norms"] == 9 * h
    assert counts["embeddings"] == counts["output_layer"] == 32000 * h


@pytest.mark.parametrize("name", FSSDP_MODELS)
def test_sixteen_gpu_variant_with_32_experts(name):
    """The FSSDP configs state the 32-expert override's expert count; check that arithmetic."""
    cfg = load_model_config(name)
    lines = [l for l in comment_lines(MODELS_DIR / f"{name}.yaml") if "With 32 experts" in l]
    assert len(lines) == 1
    m = re.search(r"(\d+) x 32 x ([\d,]+) = ([\d,]+) expert parameters", lines[0])
    assert m, lines[0]
    layers, per_expert, product = (int(g.replace(",", "")) for g in m.groups())
    e32 = dataclasses.replace(cfg, num_experts=32)
    assert layers == cfg.num_moe_layers
    assert per_expert == expert_parameter_count(cfg)
    assert product == layers * 32 * per_expert == count_parameters(e32)["experts"]


@pytest.mark.parametrize("name", REPLICATION_MODELS)
def test_stated_tokens_per_batch(name):
    cfg = load_model_config(name)
    text = "\n".join(comment_lines(MODELS_DIR / f"{name}.yaml"))
    m = re.search(r"global batch (\d+) x seq (\d+) = ([\d,]+) tokens", text)
    assert m, f"{name}: no tokens-per-batch statement"
    batch, seq, tokens = (int(g.replace(",", "")) for g in m.groups())
    assert (batch, seq) == (64, 512) == (batch, cfg.seq_length)
    assert tokens == batch * seq == 32_768
    assert cfg.moe_router_topk == 1 and cfg.moe_expert_capacity_factor == 1.0 and cfg.num_experts == 16


def test_published_model_shapes():
    expect = {  # name: (layers, hidden, experts, topk, seq)
        "gpt_moe_s": (12, 768, 64, 2, 2048), "gpt_moe_l": (12, 1536, 64, 2, 2048),
        "bert_moe": (12, 1024, 64, 2, 512), "bert_moe_deep": (24, 1024, 64, 2, 512),
        "mixtral_w1": (4, 2048, 12, 2, 4096), "mixtral_w2": (4, 2048, 24, 2, 4096),
        "mixtral_d1": (8, 1024, 24, 2, 4096), "mixtral_d2": (6, 1024, 18, 2, 4096),
        "mixtral_d3": (8, 1024, 40, 2, 4096),
    }
    for name, shape in expect.items():
        cfg = load_model_config(name)
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_router_topk, cfg.seq_length) == shape, name
    for name in FSSDP_MODELS:
        cfg = load_model_config(name)
        assert cfg.moe_ffn_hidden_size == 2 * cfg.hidden_size, name
    assert load_model_config("bert_moe").model_family == "bert"


def test_padded_vocab_size():
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(50257, tensor_parallel_size=2) == 50432  # multiple of 256
    assert padded_vocab_size(32000) == 32000
    assert padded_vocab_size(32000, tensor_parallel_size=3) == 32256  # multiple of 384
    assert padded_vocab_size(128) == 128 and padded_vocab_size(129) == 256


def test_moe_layer_pattern_follows_megatron():
    cfg = load_model_config("gpt_small")
    assert cfg.moe_layer_freq == 2
    assert cfg.moe_layer_pattern == tuple(i % 2 == 0 for i in range(12))
    listed = dataclasses.replace(cfg, num_layers=3, moe_layer_freq=[0, 1, 1])
    assert listed.moe_layer_pattern == (False, True, True) and listed.num_moe_layers == 2


def test_megatron_defaults_are_resolved():
    cfg = model_config_from_dict(dict(num_layers=2, hidden_size=96, num_attention_heads=3, seq_length=32,
                                      vocab_size=1000, num_experts=4))
    assert cfg.ffn_hidden_size == 384 and cfg.moe_ffn_hidden_size == 384
    assert cfg.max_position_embeddings == 32 and cfg.kv_channels == 32
    assert cfg.moe_router_topk == 2 and cfg.moe_expert_capacity_factor is None
    swiglu = model_config_from_dict(dict(num_layers=2, hidden_size=96, num_attention_heads=3, seq_length=32,
                                         vocab_size=1000, swiglu=True))
    assert swiglu.ffn_hidden_size == 256  # int(4 * 96 * 2 / 3 / 64) * 64


# A script run in a fresh interpreter (torch.distributed state stays out of the test process):
# it builds each config with Megatron-Core's local specs at world size 1 and prints the numel.
BUILD_SCRIPT = textwrap.dedent("""
    import copy, json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.nn.functional as F
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_patches.config import model_config_from_dict, padded_vocab_size
    numels = []
    for values in json.loads(sys.stdin.read()):
        cfg = model_config_from_dict(values)
        moe = cfg.num_experts is not None
        freq = list(cfg.moe_layer_freq) if isinstance(cfg.moe_layer_freq, tuple) else cfg.moe_layer_freq
        tc = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
            num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels,
            num_query_groups=cfg.num_query_groups if cfg.group_query_attention else None,
            normalization=cfg.normalization, add_bias_linear=cfg.add_bias_linear,
            add_qkv_bias=cfg.add_qkv_bias or cfg.add_bias_linear, qk_layernorm=cfg.qk_layernorm,
            gated_linear_unit=cfg.swiglu, activation_func=F.silu if cfg.swiglu else F.gelu,
            bias_activation_fusion=False, num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size if moe else None, moe_layer_freq=freq,
            use_cpu_initialization=True)
        vocab = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
        tied = not cfg.untie_embeddings_and_output_weights
        if cfg.model_family == "gpt":
            spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization=cfg.normalization)
            model = GPTModel(tc, spec, vocab_size=vocab, max_sequence_length=cfg.max_position_embeddings,
                             share_embeddings_and_output_weights=tied,
                             position_embedding_type=cfg.position_embedding_type)
        else:
            spec = copy.deepcopy(bert_layer_local_spec)
            if moe:
                spec.submodules.mlp = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts)
            model = BertModel(tc, num_tokentypes=2 if cfg.bert_binary_head else 0, transformer_layer_spec=spec,
                              vocab_size=vocab, max_sequence_length=cfg.max_position_embeddings,
                              share_embeddings_and_output_weights=tied,
                              position_embedding_type=cfg.position_embedding_type,
                              add_binary_head=cfg.bert_binary_head)
        numels.append(sum(p.numel() for p in model.parameters()))
    print(json.dumps(numels))
""")


def test_count_matches_a_real_megatron_build(tmp_path):
    """count_parameters equals sum(p.numel()) of Megatron-Core models built from the configs."""
    tiny = load_model_config("tiny").to_dict()
    small = dict(tiny, num_experts=4, moe_ffn_hidden_size=96, ffn_hidden_size=80, vocab_size=1000)
    mixtral = load_model_config("mixtral_d1").to_dict()
    mixtral.update(num_layers=2, hidden_size=128, num_attention_heads=4, kv_channels=32, num_query_groups=2,
                   ffn_hidden_size=192, moe_ffn_hidden_size=160, num_experts=6, vocab_size=500)
    bert = load_model_config("bert_moe").to_dict()
    bert.update(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, ffn_hidden_size=128,
                moe_ffn_hidden_size=128, num_experts=4, vocab_size=1000, seq_length=64, max_position_embeddings=80)
    variants = [
        tiny,
        dict(small, untie_embeddings_and_output_weights=True),
        dict(small, num_layers=4, moe_layer_freq=2),
        dict(small, num_layers=3, moe_layer_freq=[0, 1, 1], add_bias_linear=False),
        mixtral,
        dict(mixtral, qk_layernorm=True),  # RMSNorm over queries and keys
        dict(small, qk_layernorm=True, add_bias_linear=False, add_qkv_bias=True),
        bert,
        dict(bert, bert_binary_head=False, untie_embeddings_and_output_weights=True, add_bias_linear=False),
    ]
    port = str(29500 + (os.getpid() % 1000) + 200)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    result = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, port], input=json.dumps(variants),
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    built = json.loads(result.stdout.strip().splitlines()[-1])
    ours = [count_parameters(model_config_from_dict(v))["total"] for v in variants]
    assert built == ours


# ---------------------------------------------------------------------------------------------
# Model config validation
# ---------------------------------------------------------------------------------------------

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=50257,
            num_experts=8, moe_router_topk=2)


@pytest.mark.parametrize("change, words", [
    (dict(hidden_size=-64), ["hidden_size=-64", "positive integer"]),
    (dict(num_layers=0), ["num_layers=0", "positive integer"]),
    (dict(num_experts=0), ["num_experts=0", "positive integer or null"]),
    (dict(hidden_size=True), ["hidden_size=True"]),
    (dict(hidden_size=64.0), ["hidden_size=64.0"]),
    (dict(num_attention_heads=5), ["num_attention_heads=5", "divide hidden_size=64"]),
    (dict(moe_router_topk=9), ["moe_router_topk=9", "num_experts=8"]),
    (dict(max_position_embeddings=32), ["max_position_embeddings=32", "seq_length=64"]),
    (dict(model_family="t5"), ["model_family='t5'", "gpt", "bert"]),
    (dict(normalization="ScaleNorm"), ["normalization='ScaleNorm'", "RMSNorm"]),
    (dict(moe_expert_capacity_factor=0), ["moe_expert_capacity_factor=0", "null for dropless"]),
    (dict(moe_layer_freq=3), ["moe_layer_freq=3", "num_layers=2"]),
    (dict(moe_layer_freq=[1, 0, 1]), ["moe_layer_freq=[1, 0, 1]", "num_layers=2"]),
    (dict(moe_layer_freq=[0, 0]), ["moe_layer_freq=[0, 0]", "at least one 1"]),
    (dict(num_query_groups=2), ["num_query_groups=2", "group_query_attention"]),
    (dict(group_query_attention=True, num_query_groups=3), ["num_query_groups=3", "num_attention_heads=4"]),
    (dict(swiglu="yes"), ["swiglu='yes'", "true or false"]),
    # the router's architecture: Megatron-Core's rules, shared with the training flags
    (dict(moe_router_score_function="relu"), ["moe_router_score_function='relu'", "sigmoid"]),
    (dict(moe_router_enable_expert_bias=True), ["moe_router_enable_expert_bias=True", "sigmoid (is softmax)"]),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), ["moe_router_num_groups=3", "[1, 2, 4, 8]"]),
    (dict(moe_router_num_groups=4), ["moe_router_num_groups=4", "--moe-router-group-topk"]),
    (dict(moe_router_num_groups=4, moe_router_group_topk=3), ["moe_router_group_topk=3", "valid: [1, 2]"]),
    (dict(moe_router_topk_scaling_factor=0), ["moe_router_topk_scaling_factor=0", "must be positive"]),
    (dict(num_experts=None, moe_router_score_function="sigmoid"), ["moe_router_score_function='sigmoid'",
                                                                    "dense model"]),
])
def test_bad_model_values_are_named(change, words):
    with pytest.raises(ConfigError) as err:
        model_config_from_dict(dict(TINY, **change), source="bad.yaml")
    message = str(err.value)
    assert message.startswith("bad.yaml: ")
    for word in words:
        assert word in message, message


def test_unknown_model_key_names_it_and_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        model_config_from_dict(dict(TINY, hiden_size=64, global_batch_size=8))
    message = str(err.value)
    assert "['global_batch_size', 'hiden_size']" in message
    assert "valid keys are" in message and "'hidden_size'" in message and "'moe_router_topk'" in message


def test_missing_required_model_key():
    values = dict(TINY)
    del values["seq_length"]
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['seq_length'\]"):
        model_config_from_dict(values)


def test_model_files_and_names(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown model config 'gpt_moe_xl'; available: \[.*'gpt_moe_s'"):
        load_model_config("gpt_moe_xl")
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config(tmp_path / "missing.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text("- num_layers: 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_model_config(listed)
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(dict(TINY, num_expert=8)))
    with pytest.raises(ConfigError, match=r"typo.yaml: unknown key\(s\) \['num_expert'\]"):
        load_model_config(typo)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(TINY))
    assert load_model_config(good).num_experts == 8


# ---------------------------------------------------------------------------------------------
# Cluster configs
# ---------------------------------------------------------------------------------------------

# name: [(gpu type, devices)] in device order, as published (docs/design.md section 7).
CLUSTERS = {
    "cluster_a": [("V100-SXM2-32GB", 32)],
    "cluster_b": [("A100-SXM4-40GB", 32)],
    "replication_a100": [("A100-PCIe-80GB", 16)],
    "zebra_o1": [("A40-48GB", 6), ("V100-SXM2-16GB", 6)],
    "zebra_o2": [("A40-48GB", 4), ("V100-SXM2-16GB", 8)],
    "zebra_o3": [("A40-48GB", 6), ("V100-SXM2-16GB", 3)],
    "zebra_c1": [("L40S-48GB", 2), ("T4-16GB", 6)],
    "zebra_c2": [("L40S-48GB", 2), ("T4-16GB", 8)],
    "local_cpu": [("cpu-rank", 4)],
    "h100_dgx": [("H100-SXM5-80GB", 2048)],
    "h200_hgx": [("H200-SXM-141GB", 8)],
}
INTER_NODE_GBPS = {"cluster_a": 100, "cluster_b": 400, "replication_a100": 100, "zebra_o1": 100,
                   "zebra_o2": 100, "zebra_o3": 100, "zebra_c1": 200, "zebra_c2": 200, "h100_dgx": 3200,
                   "h200_hgx": 3200}


def test_every_cluster_has_a_config():
    assert set(available_clusters()) == set(CLUSTERS)


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_cluster_loads_with_published_devices(name):
    cluster = load_cluster_config(name)
    assert cluster.name == name
    expected_types = tuple(t for t, n in CLUSTERS[name] for _ in range(n))
    assert cluster.device_types == expected_types
    assert cluster.num_devices == len(expected_types)
    for gpu in cluster.gpu_types.values():
        assert gpu.source.strip() and gpu.memory_gb > 0 and gpu.peak_fp16_tflops > 0
    if name in INTER_NODE_GBPS:
        assert {g.inter_node_gbps for g in cluster.nodes} == {INTER_NODE_GBPS[name]}
    # Memory in the type name agrees with memory_gb.
    for type_name, gpu in cluster.gpu_types.items():
        m = re.search(r"(\d+)GB$", type_name)
        if m:
            assert gpu.memory_gb == int(m.group(1))


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_cluster_to_topology(name):
    cluster = load_cluster_config(name)
    topo = cluster.to_topology()
    assert isinstance(topo, Topology)
    assert topo.num_devices == cluster.num_devices
    assert topo.nodes == cluster.num_nodes
    assert topo.device_types == cluster.device_types
    assert topo.inter_node_bw == min(g.inter_node_gbps for g in cluster.nodes) * 1e9 / 8
    assert topo.intra_node_bw == min(g.intra_node_bw_gb_s for g in cluster.nodes) * 1e9
    # Each node holds one GPU type (the zebra pools never share a node).
    for node in range(topo.nodes):
        assert len({topo.device_types[d] for d in topo.devices_on_node(node)}) == 1


def test_cluster_figures_by_hand():
    a = load_cluster_config("cluster_a")
    topo = a.to_topology()
    assert (topo.nodes, topo.devices_per_node) == (4, 8)
    assert topo.intra_node_bw == 150e9  # NVLink 2.0: 300 GB/s both directions
    assert topo.inter_node_bw == 12.5e9  # 100 Gbit/s
    v100 = a.device_gpu(31)
    assert (v100.memory_gb, v100.peak_fp16_tflops, v100.hbm_gb_s, v100.flash_attention) == (32, 125, 900, False)
    b = load_cluster_config("cluster_b").to_topology()
    assert (b.intra_node_bw, b.inter_node_bw) == (300e9, 50e9)
    r = load_cluster_config("replication_a100").to_topology()
    assert (r.nodes, r.devices_per_node) == (16, 1)
    o2 = load_cluster_config("zebra_o2")
    assert o2.device_gpu(3).name == "A40-48GB" and o2.device_gpu(4).name == "V100-SXM2-16GB"
    assert o2.device_gpu(0).flash_attention and not o2.device_gpu(11).flash_attention
    # HeterMoE's 4K-32K sequences on 16 GB V100s / T4s: a memory-efficient kernel; the FSSDP paper's V100s keep scores
    assert o2.device_gpu(11).memory_efficient_attention and not v100.memory_efficient_attention
    assert load_cluster_config("zebra_c1").device_gpu(7).memory_efficient_attention
    c2 = load_cluster_config("zebra_c2")
    assert c2.device_gpu(0).peak_fp16_tflops == 362.05 and c2.device_gpu(9).memory_gb == 16
    with pytest.raises(ConfigError, match=r"device 12 is not in \[0, 12\)"):
        o2.device_gpu(12)


# ---------------------------------------------------------------------------------------------
# Cluster config validation
# ---------------------------------------------------------------------------------------------

def cluster_dict(name="cluster_a"):
    return yaml.safe_load((CLUSTERS_DIR / f"{name}.yaml").read_text())


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["nodes"][0].update(gpus=8), ["nodes[0]", "unknown key(s) ['gpus']", "gpus_per_node"]),
    (lambda d: d["nodes"][0].pop("inter_node_gbps"), ["nodes[0]", "missing key(s) ['inter_node_gbps']"]),
    (lambda d: d["nodes"][0].update(gpu="V100"), ["gpu='V100'", "V100-SXM2-32GB"]),
    (lambda d: d["nodes"][0].update(count=0), ["count=0", "positive integer"]),
    (lambda d: d["nodes"][0].update(intra_node_bw_gb_s=-1), ["intra_node_bw_gb_s=-1", "positive number"]),
    (lambda d: d["gpu_types"]["V100-SXM2-32GB"].update(flash_attention="no"), ["flash_attention='no'"]),
    (lambda d: d["gpu_types"]["V100-SXM2-32GB"].update(source=""), ["source=''", "non-empty"]),
    (lambda d: d["gpu_types"]["V100-SXM2-32GB"].update(tflops=1), ["unknown key(s) ['tflops']"]),
    (lambda d: d["gpu_types"].update({"A100": d["gpu_types"]["V100-SXM2-32GB"]}), ["['A100']", "not used"]),
    (lambda d: d.update(nodes=[]), ["nodes must be a non-empty list"]),
    (lambda d: d.update(network="ib"), ["unknown key(s) ['network']"]),
])
def test_bad_cluster_values_are_named(mutate, words):
    values = cluster_dict()
    mutate(values)
    with pytest.raises(ConfigError) as err:
        cluster_config_from_dict(values, source="bad.yaml")
    message = str(err.value)
    assert message.startswith("bad.yaml")
    for word in words:
        assert word in message, message


def test_unequal_nodes_cannot_become_a_topology():
    values = cluster_dict("zebra_o2")
    values["nodes"] = [dict(values["nodes"][0], count=1, gpus_per_node=4),
                       dict(values["nodes"][1], count=1, gpus_per_node=8)]
    cluster = cluster_config_from_dict(values)
    assert cluster.num_devices == 12  # the cluster itself is fine
    with pytest.raises(ConfigError, match=r"same gpus_per_node.*1 x 4 A40-48GB, 1 x 8 V100-SXM2-16GB"):
        cluster.to_topology()


def test_unknown_cluster_name_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"unknown cluster config 'cluster_z'; available: \[.*'cluster_a'"):
        load_cluster_config("cluster_z")
