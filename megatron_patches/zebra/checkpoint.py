"""Zebra's checkpoints, in ep mode's form (ZebraRuntime.save_checkpoint / load_checkpoint).

ep's checkpoint is placement-independent: the model's sharded state dict keys every dense tensor
by its layer and every expert by (layer, global expert id), and Megatron's chained optimizer
keeps Adam's moments (and in bf16/fp16 the fp32 main weights) under the same keys, the dense
parameters' under `chained_0.` and the experts' under `chained_1.` (ep with EP > 1; with EP = 1
Megatron's one optimizer holds the experts as dense parameters, another form). Zebra builds the
whole GPTModel on every rank and keeps only its role's parameters, so it writes:

- model: the GPTModel's own sharded state dict under ep's chunk prefix (`module.`: ep trains
  Megatron's DDP around the model), filtered to the tensors this rank owns. One rank writes each
  (replica 0): the dense tensors the first attention rank, every expert its holder in ZP group 0.
- optimizer: zebra's AdamW state in Megatron's form (compat.moe.optimizer_sharded_state_dict):
  the groups are ep's (ZebraOwnership.param_groups), split into ep's two sub-optimizers,
  with the step every rank shares and, in fp16, the one loss scaler's state in both (as ep's
  world-wide scaler keeps it).

Loading builds the same form for this run's layout (other attention/expert rank counts, ZP
groups or Asym-EA plan: each rank asks for the tensors it owns now) and copies the values into
the parameters, the main weights and Adam's state. A checkpoint of ep (EP > 1), fssdp or
replicate has this form and loads; ep, fssdp and replicate load zebra's.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from megatron_patches.compat import mcore, moe
from megatron_patches.mode.runtime import CheckpointRefused
from megatron_patches.zebra.ownership import ZebraOwnership

EP_CHUNK_PREFIX = "module."
"""The prefix of ep's model keys: its model chunk is Megatron's DDP, whose child `module` is the
model (Float16Module passes the prefix through)."""


def _model_sharded_state_dict(owner: ZebraOwnership) -> dict:
    """The model's sharded state this rank owns, under ep's keys, one main replica each (fresh
    copies: a load replaces their data)."""
    attention_index = owner.layout.attention_dp_group.index(owner.rank) if owner.role == "attention" else None
    kept = {}
    for key, (value, expert) in owner.owned_sharded_state.items():
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            raise TypeError(f"the model's sharded state holds {key} as {type(value).__name__}; zebra checkpoints "
                            "know tensors (a SwiGLU fc1 weight: Megatron's factory of its two halves) and modules' "
                            "extra state only")
        # replica 0 writes: the first attention rank the dense parts, ZP group 0 the experts
        replica = (0, 0, owner.zp_group if expert else attention_index)
        kept[key] = dataclasses.replace(value, key=EP_CHUNK_PREFIX + value.key, replica_id=replica)
    return kept


def _parts(owner: ZebraOwnership) -> list[list[int]]:
    """The group indices of ep's two sub-optimizers (dense, expert-parallel), in order."""
    expert = [fields["is_expert_parallel"] for fields, _ in owner.param_groups]
    return [[i for i, e in enumerate(expert) if not e], [i for i, e in enumerate(expert) if e]]


def _optimizer_sharded_state_dict(owner: ZebraOwnership, model_sd: dict, is_loading: bool) -> dict:
    scaler = owner.precision.grad_scaler
    scaler_state = None if scaler is None else scaler.state_dict()
    parts = []
    for indices in _parts(owner):
        groups = [({k: v for k, v in owner.optimizer.param_groups[i].items() if k != "params"}, owner.param_groups[i][1])
                  for i in indices]
        state = {p: owner.adam_state(p) for _, params in groups for p in params}
        parts.append(moe.optimizer_sharded_state_dict(groups, model_sd, state, owner.steps, owner.half, scaler_state,
                                                      is_loading))
    return moe.chained_sharded_state_dict(parts)


def save(directory: str, owner: ZebraOwnership, common: dict) -> None:
    """Writes the model, the optimizer and `common` (loop state, scheduler) in ep's form."""
    model_sd = _model_sharded_state_dict(owner)
    state = {"model": model_sd, "optimizer": _optimizer_sharded_state_dict(owner, model_sd, is_loading=False), **common}
    mcore.save_sharded(state, directory)


def load(directory: str, owner: ZebraOwnership, template: dict, load_optim: bool, strictness: str) -> tuple[dict, list[str]]:
    """Loads an ep-form checkpoint into this run's layout; returns the loaded common entries named
    by `template` and notes for the log."""
    model_sd = _model_sharded_state_dict(owner)
    state = {"model": model_sd, **template}
    if load_optim:
        state["optimizer"] = _optimizer_sharded_state_dict(owner, model_sd, is_loading=True)
    # every rank decides alike (the load is collective): any rank's missing tensor stops all
    available = mcore.saved_tensor_keys(directory)
    missing = sorted(t.key for t in moe.sharded_entries(state) if t.key not in available)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (len(missing), missing[:1]))
    if any(count for count, _ in found):
        count, example = next((count, example[0]) for count, example in found if count)
        raise CheckpointRefused(
            f"--load {directory}: a rank asks for {count} tensors the checkpoint does not hold, e.g. {example} (a "
            "checkpoint of another model, or of ep with --expert-model-parallel-size 1, whose optimizer keeps the "
            "experts with the dense parameters); valid: a checkpoint of this model from zebra, fssdp, replicate or "
            "ep with --expert-model-parallel-size > 1, or --no-load-optim where only the optimizer state differs")
    loaded = mcore.load_sharded(state, directory, strictness)
    weights = loaded.pop("model")
    result = owner.model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise CheckpointRefused(f"--load {directory}: the model has no {result.unexpected_keys[0]}")
    notes = [f"zebra: loaded the {len(weights)} tensors this {owner.role} rank owns"]
    if load_optim:
        parts = loaded.pop("optimizer")
        tensors, values, step = {}, [None] * len(owner.param_groups), None
        for index, indices in enumerate(_parts(owner)):
            groups = [owner.param_groups[i] for i in indices]
            part_tensors, step, part_values = moe.read_optimizer_state(parts[index], groups, owner.half)
            tensors.update(part_tensors)
            for i, value in zip(indices, part_values, strict=True):
                values[i] = value
        # both parts hold the one world-wide scaler's state (fp16; none in bf16 and fp32)
        owner.load_optimizer_state(tensors, step, values, parts[moe.DENSE_INDEX].get("grad_scaler"))
        notes.append(f"zebra: Adam state loaded (step {owner.steps})")
    return loaded, notes
