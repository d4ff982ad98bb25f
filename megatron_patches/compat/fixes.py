"""Fixes for device-independent Megatron-Core 0.16.1 bugs (applied on CPU and GPU alike).

Each fix is documented with the Megatron file:line it corrects, why the stock behaviour is
wrong, and is covered by a test that fails without it (tests/compat/test_compat_fixes.py and the
multi-rank equivalence tests). They are version-specific on purpose: `mcore.py` refuses to
run with any other megatron-core version.
"""

from __future__ import annotations

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings


# ----------------------------------------------------------------------------------------
# Fix 1: expert fc2 bias with ETP=1 and EP=1 fails ("view modified inplace", mlp.py:247)
# ----------------------------------------------------------------------------------------
# RowParallelLinear (tensor_parallel/layers.py:1294) passes its output through
# reduce_from_tensor_model_parallel_region even when the group has one rank; the autograd
# Function then returns its input unchanged, which autograd marks as a view, and
# MLP.forward (transformer/mlp.py:247) adds the expert bias to it in place:
# "Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace".
# An all-reduce over one rank is the identity in forward and backward, so we skip the
# Function entirely for single-rank groups: same values, same gradients, no view.


def _reduce_from_tensor_model_parallel_region(input_, group=None):
    group = mappings.get_tensor_model_parallel_group_if_none(group)
    if group.size() == 1:
        return input_
    return mappings._ReduceFromModelParallelRegion.apply(input_, group)


def _fix_single_rank_reduce() -> None:
    tp_layers.reduce_from_tensor_model_parallel_region = _reduce_from_tensor_model_parallel_region


# ----------------------------------------------------------------------------------------
# Fix 2: expert fc2 bias tagged sequence-parallel (tensor_parallel/layers.py:1227)
# ----------------------------------------------------------------------------------------
# RowParallelLinear tags its bias `sequence_parallel = config.sequence_parallel`, experts
# included. finalize_model_grads (distributed/finalize_model_grads.py:354) then all-reduces
# every such grad over the *attention* TP group. With expert-tensor-parallel size 1 the
# ranks of that group host *different* experts, so the reduction sums the biases of
# unrelated experts. An expert's fc2 bias grad is already complete on its rank when ETP=1,
# so the tag must be cleared. (ETP>1 with biases is refused by argument validation.)


def untag_expert_bias_sequence_parallel(model_chunks) -> int:
    """Clears `sequence_parallel` on expert fc2 biases when ETP=1; returns how many."""
    if parallel_state.get_expert_tensor_parallel_world_size() != 1:
        return 0
    untagged = 0
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in name and name.endswith("linear_fc2.bias"):
                if getattr(param, "sequence_parallel", False):
                    param.sequence_parallel = False
                    untagged += 1
    return untagged


# ----------------------------------------------------------------------------------------
# Fix 3: the expert optimizer gets the attention TP group (optimizer/__init__.py:469-473)
# ----------------------------------------------------------------------------------------
# `_get_megatron_optimizer_based_on_param_groups` sets `optimizer.tp_group` to the attention
# tensor-parallel group for the expert optimizer too. The grad norm (optimizer.py:157) keeps
# a parameter without a tensor-parallel attribute only on TP rank 0 of that group, so expert
# fc2 biases of experts living on attention-TP rank > 0 silently vanish from the norm (and
# from clipping). The expert optimizer must use the expert-tensor-parallel group.


def use_expert_tp_group_for_expert_optimizer(optimizer) -> bool:
    """Points the expert sub-optimizer's `tp_group` at the expert-TP group; True if found."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(sub, "param_groups", None) or []
        if groups and all(g.get("is_expert_parallel", False) for g in groups):
            sub.tp_group = parallel_state.get_expert_tensor_parallel_group()
            return True
    return False


# ----------------------------------------------------------------------------------------
# Fix 4: loading a distributed-optimizer checkpoint with plain torch Adam (no Apex / TE)
# ----------------------------------------------------------------------------------------
# DistributedOptimizer.load_state_dict (optimizer/distrib_optimizer.py:817-825) gives every
# parameter the *same* `step` tensor; torch Adam increments `state["step"]` in place per
# parameter, so after a resume the shared counter advances once per parameter per iteration
# and the bias correction is wrong (resumed losses drift). Then
# load_parameter_state_from_fully_reshardable skips "step" in the source tensors
# (:2101) while _set_main_param_and_optimizer_states copies every key of the destination
# state (:940): KeyError 'step'. We keep each parameter's own step through the copy and
# give every parameter a private step tensor after loading.


def _fix_torch_adam_step_on_load() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(set_states, "_megatron_patches_fix", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = dict(tensors, step=step)
        return set_states(self, model_param, tensors)

    load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict_with_private_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()

    _set_main_param_and_optimizer_states._megatron_patches_fix = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict_with_private_steps


# ----------------------------------------------------------------------------------------
# Fix 5: selective recompute of layernorm / moe_act fails without Transformer Engine
# ----------------------------------------------------------------------------------------
# CheckpointWithoutOutput.__init__(fp8=False) sets `self.fp8 = fp8 is not None`
# (tensor_parallel/random.py:634), i.e. True for the default False, so its forward calls
# FP8GlobalStateManager (:589), which is imported only with Transformer Engine (:25-32):
# NameError "FP8GlobalStateManager is not defined" at the first forward of
# --recompute-modules layernorm (transformer_layer.py:577, :672) or moe_act (moe/experts.py:227).
# With Transformer Engine the call asks whether fp8 autocast is on, which it cannot be without
# it; so without Transformer Engine the flag is False, which is the stock result there.


def _fix_checkpoint_without_output_fp8() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    init = tp_random.CheckpointWithoutOutput.__init__
    if tp_random.HAVE_TE or getattr(init, "_megatron_patches_fix", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False  # fp8 needs Transformer Engine, which is not installed

    __init__._megatron_patches_fix = True
    tp_random.CheckpointWithoutOutput.__init__ = __init__


# ----------------------------------------------------------------------------------------
# Fix 6: the router's gating GEMM refers to te_general_gemm without Transformer Engine
# ----------------------------------------------------------------------------------------
# moe_utils binds `te_general_gemm` only inside its `try: from transformer_engine ...` block
# (moe_utils.py:30-39), but RouterGatingLinearFunction.forward tests `te_general_gemm is not
# None` unconditionally (moe_utils.py:1192): without Transformer Engine every router forward
# raises NameError, on CPU and on GPU alike (seen on an H200 with PyTorch 2.11 and no TE).
# Binding the name to None takes the function's own torch path (the same GEMM in torch).


def _fix_te_general_gemm_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ----------------------------------------------------------------------------------------
# Fix 7: BERT masking draws its random replacement tokens from a per-process vocabulary order
# ----------------------------------------------------------------------------------------
# BERTMaskedWordPieceDataset takes `token_lookup = list(tokenizer.inv_vocab.keys())`
# (datasets/bert_dataset.py:57) and replaces 10% of the masked tokens by
# token_lookup[rng.randint(len)] (:189) with a per-sample seeded RNG. A HuggingFace fast
# tokenizer's vocabulary comes from a Rust hash map whose iteration order is randomised per
# process, so the same seed gives other replacement tokens in every run and on every rank:
# measured, two identical BERT runs differed at iteration 1 (loss 9.6891 vs 9.6797, one rank)
# and ep vs fssdp by 4e-4. Sorting the ids makes the draw a function of the seed alone.


def _fix_bert_token_lookup_order() -> None:
    from megatron.core.datasets import bert_dataset

    init = bert_dataset.BERTMaskedWordPieceDataset.__init__
    if getattr(init, "_megatron_patches_fix", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.token_lookup = sorted(self.token_lookup)

    __init__._megatron_patches_fix = True
    bert_dataset.BERTMaskedWordPieceDataset.__init__ = __init__


# ----------------------------------------------------------------------------------------
# Fix 8: multi-latent attention believes Transformer Engine is installed when it is not
# ----------------------------------------------------------------------------------------
# multi_latent_attention.py:53-65 sets HAVE_TE = True when `megatron.core.extensions.
# transformer_engine` imports, which it does without Transformer Engine too (that module then
# binds its TE classes to MagicMock stand-ins and its own HAVE_TE to False, :60-77). The first
# MLASelfAttention then runs `isinstance(self.linear_proj, TELinear)` (:185) against a MagicMock
# instance: TypeError "isinstance() arg 2 must be a type", so MLA cannot be built without TE
# (seen on CPU). The extension module's own flag is the truth.


def _fix_mla_te_detection() -> None:
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


# ----------------------------------------------------------------------------------------
# Fix 9: the grad norm without Apex / Transformer Engine reads every gradient's norm on the host
# ----------------------------------------------------------------------------------------
# Without either library clip_grads.py:35-43 takes utils.local_multi_tensor_l2_norm
# (utils.py:1200-1208), which builds `torch.tensor(l2)` from a list of device tensors: one
# device-to-host read per parameter tensor, then `float(l2_reduced)` once more. Seen by the
# device kit's sync stage on an H200 (2026-11-29): 89 host synchronisations per iteration for the
# tiny model, a stall behind the whole backward each. The norms are stacked on the device
# instead: the same float32 values (the per-tensor norms, then the norm of those), no host read;
# get_grad_norm_fp32 reads the total once (clip_grads.py:133), as with Apex.


def _device_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """utils.local_multi_tensor_l2_norm's contract (a 1-element float32 norm, None) on the device."""
    norms = [torch.linalg.vector_norm(t).float() for tensors in tensor_lists for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)).view(1), None


def _fix_grad_norm_host_reads() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _device_multi_tensor_l2_norm


def apply_global_fixes() -> None:
    """Install the module-level fixes (1 and 4-9). Fixes 2-3 apply per model / optimizer."""
    _fix_single_rank_reduce()
    _fix_torch_adam_step_on_load()
    _fix_checkpoint_without_output_fp8()
    _fix_te_general_gemm_without_te()
    _fix_bert_token_lookup_order()
    _fix_mla_te_detection()
    _fix_grad_norm_host_reads()


__all__ = [
    "apply_global_fixes",
    "untag_expert_bias_sequence_parallel",
    "use_expert_tp_group_for_expert_optimizer",
]
