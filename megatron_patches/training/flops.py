"""Model FLOPs per iteration, as Megatron-LM counts them for --log-throughput (TFLOP/s per GPU).

Megatron-LM's `num_floating_point_operations` (megatron/training/training.py at core_v0.16.1) for
the transformers this entry point builds (multi-head, grouped-query or multi-latent attention,
dense and MoE MLPs with shared experts, multi-token prediction; no linear attention): every GEMM
counted three times (forward, weight gradient, input gradient) at 2 FLOPs per multiply-add, the
causal attention scores at half the square, the routed experts at top-k MLPs per token, the
shared expert at its width in every MoE layer, each MTP layer as one more layer of the decoder's
last kind plus its norms, 2h -> h projection and logits. Model FLOPs: a recomputed forward is
not counted, so throughput / peak is the MFU.
"""

from __future__ import annotations

from megatron_patches.config.models import moe_layer_numbers


def _attention_flops(args) -> float:
    """One layer's attention per token, before the 3 x 2 (passes x FMA) factor."""
    heads, h, seq = args.num_attention_heads, args.hidden_size, args.seq_length
    if args.multi_latent_attention:
        q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
        query = h * heads * q_head if args.q_lora_rank is None else args.q_lora_rank * (h + heads * q_head + 1)
        return (query
                + args.kv_lora_rank * (h + heads * (args.qk_head_dim + args.v_head_dim) + 1)  # kv latent, its norm
                + h * args.qk_pos_emb_head_dim  # the keys' rotary part
                + heads * args.v_head_dim * h  # output projection
                + seq * heads * q_head / 2 + seq * heads * args.v_head_dim / 2)  # causal QK^T and (QK^T)V
    query_groups = args.num_query_groups if args.group_query_attention else heads
    query = args.kv_channels * heads
    key_value = 2 * args.kv_channels * query_groups
    return (h * (query + key_value)  # QKV projection
            + query * seq / 2 * 2  # QK^T and (QK^T)V, half of them under the causal mask
            + query * h)  # output projection


def model_flops_per_iteration(args, padded_vocab_size: int) -> float:
    """FLOPs of one iteration of `args.global_batch_size` sequences of `args.seq_length`."""
    mtp_layers = args.mtp_num_layers or 0
    # the decoder's MoE layers and the MTP layers, which repeat the decoder's last layer
    moe_layers = len(moe_layer_numbers(args.moe_layer_freq, args.num_layers, args.mtp_num_layers))
    dense_layers = args.num_layers + mtp_layers - moe_layers
    passes_x_fma = 3 * 2  # forward + two backward GEMMs, 2 FLOPs per multiply-add
    ffn_gemms = 3 if args.swiglu else 2  # h -> (2 x) ffn and ffn -> h
    shared = args.moe_shared_expert_intermediate_size or 0
    mlp = args.hidden_size * (
        args.ffn_hidden_size * ffn_gemms * dense_layers
        + (args.moe_ffn_hidden_size * args.moe_router_topk + shared) * ffn_gemms * moe_layers
    )
    attention = _attention_flops(args) * (args.num_layers + mtp_layers)
    mtp = mtp_layers * (3 * args.hidden_size + 2 * args.hidden_size * args.hidden_size)  # norms, 2h -> h projection
    logits = args.hidden_size * padded_vocab_size * (mtp_layers + 1)
    return float(args.global_batch_size * args.seq_length * passes_x_fma * (mlp + attention + mtp + logits))
