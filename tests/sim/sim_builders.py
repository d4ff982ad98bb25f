"""Shared builders for the simulator tests: small clusters, models and traces built in memory."""

import numpy as np

from megatron_patches.config import cluster_config_from_dict, model_config_from_dict
from megatron_patches.placement.trace import Trace

GPU = {
    "memory_gb": 40,
    "peak_fp16_tflops": 100.0,
    "hbm_gb_s": 1000.0,
    "flash_attention": True,
    "source": "test figures",
    "peak_fp32_tflops": 20.0,
    "peak_tf32_tflops": 50.0,
    "bf16": True,
}


def make_cluster(nodes=2, gpus_per_node=4, intra_gb_s=100.0, nic_gbps=80.0, gpu=None, name="test"):
    """A homogeneous cluster: `nodes` x `gpus_per_node` GPUs with round-number figures."""
    return cluster_config_from_dict(
        {
            "name": name,
            "nodes": [
                {
                    "count": nodes,
                    "gpus_per_node": gpus_per_node,
                    "gpu": "G",
                    "intra_node_bw_gb_s": intra_gb_s,
                    "intra_node_link": "test link",
                    "inter_node_gbps": nic_gbps,
                }
            ],
            "gpu_types": {"G": dict(GPU, **(gpu or {}))},
        }
    )


def make_pool(attention=2, expert=2, attention_gpu=None, expert_gpu=None, intra_gb_s=100.0, nic_gbps=80.0,
              one_gpu_nodes=False):
    """A two-type pool, attention GPUs first, one node per type (or one node per GPU, which
    pools of unequal type counts need: a Topology has one GPU count per node)."""
    group = {"intra_node_bw_gb_s": intra_gb_s, "intra_node_link": "test", "inter_node_gbps": nic_gbps}

    def nodes(gpus, gpu):
        return dict(group, count=gpus, gpus_per_node=1, gpu=gpu) if one_gpu_nodes else \
            dict(group, count=1, gpus_per_node=gpus, gpu=gpu)

    return cluster_config_from_dict(
        {
            "name": "pool",
            "nodes": [nodes(attention, "NEW"), nodes(expert, "OLD")],
            "gpu_types": {"NEW": dict(GPU, **(attention_gpu or {})), "OLD": dict(GPU, **(expert_gpu or {}))},
        }
    )


def make_model(layers=2, experts=8, hidden=256, seq=512, heads=4, topk=2, **extra):
    """A small GPT MoE model (every layer MoE, experts with d_ffn = 2 h)."""
    values = {
        "model_family": "gpt",
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "seq_length": seq,
        "vocab_size": 1000,
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": 2 * hidden,
        "ffn_hidden_size": 2 * hidden,
    }
    values.update(extra)
    return model_config_from_dict(values)


def balanced_trace(iterations, layers, experts, ranks, tokens_per_rank_expert):
    """Every rank routes the same number of tokens to every expert."""
    source = np.full((iterations, layers, ranks, experts), tokens_per_rank_expert, dtype=np.int64)
    return Trace(source.sum(axis=2), source, {})


def skewed_trace(iterations, layers, experts, ranks, tokens, seed=0, zipf=1.2):
    from megatron_patches.placement.synthetic import synthetic_trace

    return synthetic_trace(iterations=iterations, layers=layers, experts=experts, tokens=tokens, zipf=zipf,
                           drift=0.1, ranks=ranks, seed=seed)
