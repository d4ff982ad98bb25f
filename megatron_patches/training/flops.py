"""Model FLOPs per iteration, as Megatron-LM counts them for --log-throughput (TFLOP/s per GPU).

Megatron-LM's `num_floating_point_operations` (megatron/training/training.py at core_v0.16.1) for
the transformers this entry point builds (multi-head or grouped-query attention, dense and MoE
MLPs; no MLA, MTP, shared experts or linear attention yet): every GEMM counted three times
(forward, weight gradient, input gradient) at 2 FLOPs per multiply-add, the causal attention
scores at half the square, the routed experts at top-k MLPs per token, the logit layer once.
Model FLOPs: a recomputed forward is not counted, so throughput / peak is the MFU.
"""

from __future__ import annotations

from megatron_patches.config.models import moe_layer_pattern


def model_flops_per_iteration(args, padded_vocab_size: int) -> float:
    """FLOPs of one iteration of `args.global_batch_size` sequences of `args.seq_length`."""
    moe_layers = sum(moe_layer_pattern(args.moe_layer_freq, args.num_layers))
    dense_layers = args.num_layers - moe_layers
    query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    passes_x_fma = 3 * 2  # forward + two backward GEMMs, 2 FLOPs per multiply-add
    ffn_gemms = 3 if args.swiglu else 2  # h -> (2 x) ffn and ffn -> h
    query = args.kv_channels * args.num_attention_heads
    key_value = 2 * args.kv_channels * query_groups
    attention = passes_x_fma * (
        args.hidden_size * (query + key_value)  # QKV projection
        + query * args.seq_length / 2 * 2  # QK^T and (QK^T)V, half of them under the causal mask
        + query * args.hidden_size  # output projection
    )
    mlp = passes_x_fma * args.hidden_size * (
        args.ffn_hidden_size * ffn_gemms * dense_layers
        + args.moe_ffn_hidden_size * args.moe_router_topk * ffn_gemms * moe_layers
    )
    logits = passes_x_fma * args.hidden_size * padded_vocab_size
    return float(args.global_batch_size * args.seq_length * (mlp + attention * args.num_layers + logits))

