"""Replicate mode's checkpoints, in ep mode's form (ReplicateRuntime.save_checkpoint /
load_checkpoint call these).

Before saving, every expert's current weights go into the frozen Megatron local expert that EP's
layout gives it (so the model's own sharded state dict writes them under ep's keys) and its fp32
master weights and Adam moments go under ep's expert-optimizer keys
(`compat.moe.ep_optimizer_sharded_state_dict`: Megatron's plain optimizers' form, or with
--use-distributed-optimizer its DistributedOptimizer's). An ep, fssdp or replicate checkpoint therefore
loads in any of the three modes. Loading in replicate mode fills the slices and the slots from
the loaded experts; expert moments absent from the checkpoint start at zero (logged). The
replicate placement (slots per layer, popularity history) is common state under "replicate".
"""

from __future__ import annotations

import torch

from megatron_patches.compat import mcore, moe


def save(directory: str, model_chunks, optimizer, common: dict, replicate) -> None:
    """Writes the replicate run in ep's form (see the module docstring)."""
    expert_state, step = replicate.export_experts()
    groups = moe.frozen_expert_param_groups(model_chunks, optimizer, replicate.expert_params())
    model_sd = mcore.model_sharded_state(model_chunks)
    mcore.prepare_optimizer_state(optimizer, is_loading=False)
    state = {
        **model_sd,
        "optimizer": moe.ep_optimizer_sharded_state_dict(optimizer, model_sd, groups, expert_state, step, is_loading=False),
        "replicate": replicate.placement_state_dict(),
        **common,
    }
    mcore.save_sharded(state, directory)


def load(directory: str, model_chunks, optimizer, template: dict, load_optim: bool, strictness: str, replicate,
         notes: list[str]) -> dict:
    """Loads an ep-form checkpoint into replicate mode: dense parts as ep, experts into the slices."""
    model_sd = mcore.model_sharded_state(model_chunks)
    state = {**model_sd, **template}
    groups, with_experts = None, False
    if load_optim:
        mcore.prepare_optimizer_state(optimizer, is_loading=True)
        groups = moe.frozen_expert_param_groups(model_chunks, optimizer, replicate.expert_params())
        wanted = moe.expert_checkpoint_keys(optimizer, model_sd, groups)
        available = mcore.saved_tensor_keys(directory)
        missing = sorted(k for keys in wanted.values() for k in keys if k not in available)
        with_experts = not missing
        buffers = {
            p: {name: torch.empty(p.shape, dtype=torch.float32, device=p.device) for name in wanted}
            for _, params in groups
            for p in params
        }
        state["optimizer"] = moe.ep_optimizer_sharded_state_dict(optimizer, model_sd, groups, buffers, None, is_loading=True)
        if not with_experts:
            del state["optimizer"][moe.EXPERT_INDEX]
            notes.append(f"replicate: the experts' optimizer state is not in the checkpoint ({len(missing)} keys missing, "
                         f"e.g. {missing[0]}); their Adam moments start at zero")
    loaded = mcore.load_sharded(state, directory, strictness)
    mcore.load_model_state(model_chunks, loaded)
    expert_state, step = {}, None
    if load_optim:
        expert_state, step = moe.load_ep_optimizer_state(optimizer, loaded.pop("optimizer"), groups, with_experts)
    if "replicate" in loaded:
        notes.extend(replicate.load_placement_state_dict(loaded["replicate"]))
    else:
        notes.append("replicate: the checkpoint holds no replicate placement (saved in another mode); starting from static replication")
    replicate.import_experts(expert_state if with_experts else None, step)
    if with_experts:
        notes.append(f"replicate: experts' master weights and Adam moments loaded (step {step:g})")
    return loaded
