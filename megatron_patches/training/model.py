"""Model construction: a Megatron-Core GPT or BERT model whose MLPs are MoE blocks.

The layer spec decides which MoE layer is used; a parallel mode injects its own MoELayer
subclass (and its TransformerConfig changes) through its ModeRuntime (megatron_patches/mode). Expert weights are re-initialised from
(seed, layer, global expert id) only, so every mode, world size and placement starts from
the same model and checkpoints are interchangeable (docs/design.md section 2).
"""

from __future__ import annotations

import math
import numpy as np
import torch

from megatron.core import parallel_state

from megatron_patches.compat import mcore
from megatron_patches.config.models import moe_layer_pattern
from megatron_patches.config.run import ParallelConfig, RunSettings
from megatron_patches.mode.runtime import ModeRuntime


def transformer_config(args, on_gpu: bool):
    """Megatron's TransformerConfig of the validated flags (before the mode's changes)."""
    return mcore.transformer_config(args, ParallelConfig.from_args(args), RunSettings.from_args(args), on_gpu)


def build_model(args, vocab_size: int, on_gpu: bool, mode: ModeRuntime | None = None):
    """The (unwrapped) model chunks of this pipeline rank, on the training device, and their
    TransformerConfig: one chunk, or one per virtual pipeline stage (Megatron-LM's get_model:
    chunk i holds the layers Megatron-Core's offset gives virtual stage i, the first stage's first
    chunk the embedding, the last stage's last chunk the output layer and any MTP layers).

    `mode` (default: ep, Megatron's own MoE layer) adapts the config and injects its MoE layer.
    """
    mode = mode or ModeRuntime()
    config = mode.transformer_config(transformer_config(args, on_gpu))
    use_te = args.transformer_impl == "transformer_engine"
    dense_spec, moe_spec = mcore.layer_specs(args.model_family, config, use_te)
    moe_spec = mode.moe_spec(moe_spec)
    # multi-token prediction repeats the decoder's last layer (Megatron-LM's gpt_builders.py)
    last_spec = moe_spec if moe_layer_pattern(args.moe_layer_freq, args.num_layers)[-1] else dense_spec
    chunks = []
    for vp_stage in mcore.virtual_stages():
        # BertModel takes one layer spec for all layers (every layer MoE; arguments enforce it).
        spec = moe_spec if args.model_family == "bert" else mcore.block_spec(config, dense_spec, moe_spec, use_te, vp_stage)
        pre_process, post_process = mcore.pipeline_stage_flags(vp_stage)
        model = mcore.language_model(args, config, spec, vocab_size, pre_process, post_process, last_spec, use_te, vp_stage)
        init_experts_from_global_ids(model, args.seed, args.init_method_std, args.num_layers)
        if on_gpu:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks, config


def expert_seed(seed: int, layer: int, expert: int, tensor: int) -> int:
    """A 63-bit seed from (run seed, global layer number, global expert id, tensor index)."""
    return int(np.random.SeedSequence([seed, layer, expert, tensor]).generate_state(2, np.uint64)[0] >> 1)


def _full_normal(shape, std: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def _column_shard(full_FH: torch.Tensor, rank: int, size: int, gated: bool) -> torch.Tensor:
    """Rank's rows of a column-parallel fc1; a gated fc1 is [gate; up], each split separately."""
    if not gated:
        return full_FH.chunk(size, dim=0)[rank]
    gate, up = full_FH.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)


@torch.no_grad()
def init_experts_from_global_ids(model, seed: int, std: float, num_layers: int) -> None:
    """Re-initialises every local expert from (seed, layer, global expert id).

    Same distributions as Megatron's defaults: fc1 ~ N(0, std), fc2 ~ N(0, std/sqrt(2L))
    (scaled init for output projections), biases zero. The *full* weight is drawn and this
    rank's expert-tensor-parallel shard sliced out, so the model does not depend on ETP.
    """
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    output_std = std / math.sqrt(2.0 * num_layers)
    for layer in mcore.transformer_layers(model):
        if not hasattr(layer.mlp, "experts"):
            continue
        for expert_id, expert in mcore.local_experts(layer.mlp):
            fc1, fc2 = expert.linear_fc1.weight, expert.linear_fc2.weight
            # fc1 is column-parallel (rows split over ETP), fc2 row-parallel (columns split).
            full_fc1 = _full_normal((fc1.shape[0] * etp_size, fc1.shape[1]), std, expert_seed(seed, layer.layer_number, expert_id, 1))
            full_fc2 = _full_normal((fc2.shape[0], fc2.shape[1] * etp_size), output_std, expert_seed(seed, layer.layer_number, expert_id, 2))
            fc1.copy_(_column_shard(full_fc1, etp_rank, etp_size, gated=expert.config.gated_linear_unit))
            fc2.copy_(full_fc2.chunk(etp_size, dim=1)[etp_rank])
            for linear in (expert.linear_fc1, expert.linear_fc2):
                if getattr(linear, "bias", None) is not None:
                    linear.bias.zero_()


def moe_layers(model) -> list:
    """(global layer number, MoE layer module) for the MoE layers on this stage."""
    return [(layer.layer_number, layer.mlp) for layer in mcore.moe_transformer_layers(model)]
