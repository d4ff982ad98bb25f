"""Megatron-Core's state-dict and optimizer formats for the placement modes' experts
(version-sensitive, like mcore.py).

The modes keep expert weights and their optimizer state in other places than Megatron's EP
layout (fssdp's held experts after a re-shard, replicate's and zebra's own optimizers). These
functions write and read them in Megatron's own checkpoint and optimizer forms, so every mode's
checkpoint loads in every other (training/checkpoint.py). The modes' shared MoE layer
(`InstanceMoELayer`, its dispatcher, `ExpertLayout`) is `mode/layer.py`.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding, replace_prefix_for_sharding
from megatron.core.optimizer import OptimizerConfig, _get_param_groups
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group


__all__ = [
    "ADAM_STATE_NAMES",
    "DENSE_INDEX",
    "EXPERT_INDEX",
    "OptimizerShard",
    "OptimizerStateMissing",
    "chained_sharded_state_dict",
    "dense_optimizer",
    "distributed_optimizer_sharded_state_dict",
    "ep_optimizer_sharded_state_dict",
    "ep_param_groups",
    "expert_checkpoint_keys",
    "expert_optimizer_shard",
    "frozen_expert_param_groups",
    "held_experts_sharded_state_dict",
    "load_ep_optimizer_state",
    "optimizer_sharded_state_dict",
    "param_shardings",
    "read_distributed_optimizer_state",
    "read_optimizer_state",
    "sharded_entries",
    "shards_over_data_parallel",
]


# ----------------------------------------------------------------------------------------
# Expert modules holding another (layer, expert) than Megatron's layout says (re-sharding)
# ----------------------------------------------------------------------------------------


def held_experts_sharded_state_dict(experts, prefix: str, sharded_offsets: tuple, metadata, held) -> dict:
    """SequentialMLP.sharded_state_dict (experts.py:935 in 0.16.1) for an explicit list of experts.

    Megatron derives each local expert's global id from the EP rank (contiguous layout) and
    keys it under the local module's own path. A mode that moves experts between ranks and
    layers (FSSDP's re-sharding) lets any expert MLP module hold any expert of its stage, so
    here the caller says which modules hold this layer's experts: the sharded keys and
    offsets are Megatron's for (this layer, global id), exactly what ep mode writes, so
    checkpoints stay placement-independent; the state-dict keys are the modules' own paths,
    so loading fills the module that holds the expert. The optimizer's sharded state follows
    by parameter identity (optimizer.py `get_param_id_to_sharded_param_map`).

    Args:
        experts: this layer's SequentialMLP (for its EP / expert-DP groups and local count).
        prefix: this layer's experts prefix as Megatron passes it ("...layers.K.mlp.experts.").
        sharded_offsets, metadata: as passed to SequentialMLP.sharded_state_dict.
        held: (state-dict prefix of the module, e.g. "...layers.J.mlp.experts.local_experts.I.",
            expert MLP module, global expert id in this layer) for every expert of this layer
            held on this rank.
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    num_global_experts = experts.ep_group.size() * experts.num_local_experts
    singleton_local_shards = metadata.get("singleton_local_shards", False)
    sharded = {}
    for module_prefix, expert, expert_global_idx in held:
        if singleton_local_shards:
            expert_sharded_prefix = f"{prefix}experts.{expert_global_idx}."
            expert_sharded_offsets = sharded_offsets
        else:
            expert_sharded_prefix = f"{prefix}experts."
            expert_sharded_offsets = (*sharded_offsets, (len(sharded_offsets), expert_global_idx, num_global_experts))
        expert_state = expert.sharded_state_dict(module_prefix, expert_sharded_offsets, metadata)
        replace_prefix_for_sharding(expert_state, module_prefix, expert_sharded_prefix)
        for sharded_tensor in expert_state.values():
            # replication along DP modulo EP, as Megatron sets it
            sharded_tensor.replica_id = (*sharded_tensor.replica_id[:2], experts.dp_group.rank())
        sharded.update(expert_state)
    return sharded


class OptimizerStateMissing(ValueError):
    """The optimizer has not created a parameter's state yet (no optimizer step has been taken:
    Megatron's optimizers create it lazily, at the first step that is not skipped)."""


@dataclasses.dataclass(frozen=True)
class OptimizerShard:
    """The elements of one parameter that this rank's optimizer keeps, and its tensors for them."""

    start: int
    """First element of the (flattened) parameter covered; 0 unless a distributed optimizer
    shards it over the data-parallel (for experts: expert-data-parallel) ranks."""
    tensors: tuple[torch.Tensor, ...]
    """The fp32 main copy when it has its own memory (mixed precision), then every per-element
    optimizer state (Adam's exp_avg, exp_avg_sq) by name; each flattened, all of one length,
    covering elements [start, start + length)."""


def expert_optimizer_shard(optimizer, param: torch.nn.Parameter) -> OptimizerShard | None:
    """What Megatron's optimizer keeps for `param` on this rank, element for element, besides
    `param` itself; None when a distributed optimizer keeps none of its elements here (its shard
    of the parameter's buffer ends before or starts after it). Not the step count (a scalar,
    equal for all parameters). Version-sensitive: Float16OptimizerWithFloat16Params keys the
    state by `param.main_param` (optimizer.py:683), FP32Optimizer by the parameter,
    DistributedOptimizer via `_get_main_param_and_optimizer_states` and its range map
    (distrib_optimizer.py:610, :883; a parameter absent from `model_param_gbuf_map` has no element
    in this rank's shard).

    Raises ValueError if no sub-optimizer holds `param`, OptimizerStateMissing if its state does
    not exist yet (before the first step that is not skipped).
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer):
            if param not in sub.model_param_gbuf_map:
                if any(param in buffer.param_index_map for buffer in sub.buffers):
                    return None
                continue
            tensors = dict(sub._get_main_param_and_optimizer_states(param))
            main = tensors.pop("param")
            state, start = tensors, sub._get_model_param_range_map(param)["param"].start
        else:
            key = getattr(param, "main_param", param)
            if not any(p is key for group in sub.optimizer.param_groups for p in group["params"]):
                continue
            main, state, start = key, sub.optimizer.state.get(key, {}), 0
        per_element = {name: value for name, value in state.items() if torch.is_tensor(value) and value.dim() > 0}
        if not per_element:
            raise OptimizerStateMissing(
                f"the optimizer has no state for an expert parameter of shape {tuple(param.shape)} yet "
                "(it is created by the first optimizer step)"
            )
        own_memory = main.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
        out = ([main] if own_memory else []) + [per_element[name] for name in sorted(per_element)]
        return OptimizerShard(start, tuple(tensor.view(-1) for tensor in out))
    raise ValueError(f"no optimizer holds the expert parameter of shape {tuple(param.shape)}")


def shards_over_data_parallel(optimizer, param: torch.nn.Parameter) -> bool:
    """Whether a distributed optimizer over more than one rank holds `param`'s state (each rank
    then keeps a range of its elements; see `expert_optimizer_shard`)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer) and any(param in buffer.param_index_map for buffer in sub.buffers):
            return sub.data_parallel_group.size() > 1
    return False


# ----------------------------------------------------------------------------------------
# Megatron's optimizer checkpoint form for parameters its optimizer does not hold
# (replicate's experts; every parameter of zebra, whose optimizer is its own)
# ----------------------------------------------------------------------------------------

ADAM_STATE_NAMES = ("exp_avg", "exp_avg_sq")
"""Adam's per-element state, keyed in a checkpoint as `optimizer.state.<name>.<model param key>`."""

# ep mode's optimizer is a ChainedOptimizer of two: get_megatron_optimizer (optimizer/__init__.py
# in 0.16.1) builds the dense parameters' optimizer first and the expert-parallel ones' second,
# and ChainedOptimizer.sharded_state_dict (optimizer.py:1184) prefixes each one's keys with
# chained_<index>. when it has several. With --expert-model-parallel-size 1 the experts are
# dense parameters to Megatron (their `allreduce` attribute) and the optimizer is one.
DENSE_INDEX, EXPERT_INDEX = 0, 1


def optimizer_sharded_state_dict(groups, model_sd, param_state, step, fp32_main: bool, grad_scaler_state,
                                 is_loading: bool) -> dict:
    """One of Megatron's (non-distributed) sub-optimizers in its checkpoint form, for parameters
    held outside Megatron's optimizer: FP32Optimizer's form, or with `fp32_main`
    Float16OptimizerWithFloat16Params' (optimizer.py:800 in 0.16.1: the fp32 master weights
    under `fp32_from_fp16_params`, the scaler's state beside them). The same keys, offsets and
    common structure as Megatron writes, so Megatron's optimizer loads it and it loads from
    Megatron's.

    Args:
        groups: one (values, params) per parameter group in Megatron's order (every group, also
            one without parameters on this rank: the common structure is the same on every
            rank): the group's values as Megatron's optimizer keeps them (torch Adam's
            hyper-parameters and Megatron's fields, no "params"), and the group's parameters on
            this rank.
        model_sd: the model's sharded state dict; its tensors of the parameters give the keys,
            offsets and replica ids.
        param_state: parameter -> {name: tensor of the parameter's shape} for `ADAM_STATE_NAMES`
            and, with `fp32_main`, "fp32_param". Saving: the values; loading: the buffers.
        step: Adam's step count (saving; Megatron keeps it as the common `common_step`).
        fp32_main: the Float16OptimizerWithFloat16Params form (bf16 / fp16).
        grad_scaler_state: the loss scaler's state dict (fp16), else None.
        is_loading: a template to load into (no step: it comes from the checkpoint).
    """
    sharded_of = param_shardings(model_sd)
    state, param_groups, fp32_groups, next_id = {}, [], [], 0
    for values, params in groups:
        ids = list(range(next_id, next_id + len(params)))
        next_id += len(params)
        param_groups.append({**values, "params": LocalNonpersistentObject(ids)})
        fp32_row = []
        for i, param in zip(ids, params):
            if id(param) not in sharded_of:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in the model's sharded state dict")
            tensors = param_state[param]
            state[i] = {
                name: make_sharded_optimizer_tensor(sharded_of[id(param)], tensors[name], prefix=f"optimizer.state.{name}")
                for name in ADAM_STATE_NAMES
            }
            if fp32_main:
                fp32_row.append(make_sharded_optimizer_tensor(sharded_of[id(param)], tensors["fp32_param"],
                                                              prefix="optimizer.state.fp32_param"))
        fp32_groups.append(fp32_row)
    if not is_loading:
        state["common_step"] = torch.tensor(float(step), dtype=torch.float32)
    inner = {"state": state, "param_groups": param_groups}
    if not fp32_main:
        return inner
    if any(fp32_groups) and not all(fp32_groups):
        raise ValueError(f"this rank holds parameters of {sum(map(bool, fp32_groups))} of the sub-optimizer's "
                         f"{len(fp32_groups)} groups: Megatron's checkpoint merges its per-group lists of fp32 master "
                         "weights by position, so a rank holds parameters of every group or of none")
    if not any(fp32_groups):
        # a rank holding none of these parameters (zebra's expert ranks have no dense ones): its
        # empty lists would enter the common state (rank 0's) and fail to merge with another
        # rank's full ones; kept local instead
        fp32_groups = LocalNonpersistentObject(fp32_groups)
    out = {"optimizer": inner, "fp32_from_fp16_params": fp32_groups}
    if grad_scaler_state is not None:
        out["grad_scaler"] = grad_scaler_state
    return out


DISTRIBUTED_STATE_NAMES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""A DistributedOptimizer's checkpoint names of a parameter's state -> the names this module's
callers use (`optimizer_sharded_state_dict`'s)."""


def distributed_optimizer_sharded_state_dict(groups, model_sd, param_state, step, grad_scaler_state,
                                             is_loading: bool) -> dict:
    """A DistributedOptimizer in its `fully_reshardable` checkpoint form, for parameters held
    outside Megatron's optimizer (replicate's experts with --use-distributed-optimizer).

    Megatron's form (distrib_optimizer.py in 0.16.1: `state_dict` and
    `sharded_param_state_fully_reshardable`): the inner optimizer's param groups without "params"
    and with the common "step", the loss scaler's state (fp16), and per parameter its whole fp32
    master weights and Adam moments in model space under `optimizer.state.{param, exp_avg,
    exp_avg_sq}.<model param key>`, with the model parameter's replica id. The master weights are
    written in fp32 training too (Megatron's `param`). Which index a parameter has in
    `param_state` does not reach the files (tensors are stored by key); the order here is the
    parameters' order in `groups`.

    Args: as `optimizer_sharded_state_dict`; `param_state` names the master weights "fp32_param"
    (the plain optimizers' name), written as Megatron's "param".
    """
    sharded_of = param_shardings(model_sd)
    param_groups, by_index = [], {}
    for values, params in groups:
        param_groups.append({**values} if is_loading else {**values, "step": step})
        for param in params:
            if id(param) not in sharded_of:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in the model's sharded state dict")
            tensors = param_state[param]
            by_index[len(by_index)] = {
                name: make_sharded_optimizer_tensor(sharded_of[id(param)], tensors[source], prefix=f"optimizer.state.{name}")
                for name, source in DISTRIBUTED_STATE_NAMES.items()
            }
    out = {"optimizer": {"param_groups": param_groups}}
    if grad_scaler_state is not None:
        out["grad_scaler"] = grad_scaler_state
    return {**out, "param_state": by_index, "param_state_sharding_type": "fully_reshardable"}


def read_optimizer_state(loaded: dict, groups, fp32_main: bool) -> tuple[dict, float | None, list[dict]]:
    """The parts of a loaded `optimizer_sharded_state_dict` (template `groups`, `fp32_main` as
    built): (parameter -> {name: loaded tensor}, the step (None: the checkpoint has none, i.e. it
    was saved before any step), the saved groups' values (no "params"))."""
    inner = loaded["optimizer"] if fp32_main else loaded
    out, next_id = {}, 0
    for g, (_, params) in enumerate(groups):
        for j, param in enumerate(params):
            out[param] = {name: inner["state"][next_id][name] for name in ADAM_STATE_NAMES}
            if fp32_main:
                out[param]["fp32_param"] = loaded["fp32_from_fp16_params"][g][j]
            next_id += 1
    step = inner["state"].get("common_step")
    values = [{k: v for k, v in group.items() if k != "params"} for group in inner["param_groups"]]
    return out, None if step is None else float(step), values


def read_distributed_optimizer_state(loaded: dict, groups) -> tuple[dict, float | None]:
    """The parts of a loaded `distributed_optimizer_sharded_state_dict` (template `groups`):
    (parameter -> {"fp32_param", "exp_avg", "exp_avg_sq": loaded tensor}, the step, None when the
    checkpoint has none)."""
    out, index = {}, 0
    for _, params in groups:
        for param in params:
            tensors = loaded["param_state"][index]
            out[param] = {source: tensors[name] for name, source in DISTRIBUTED_STATE_NAMES.items()}
            index += 1
    steps = {group["step"] for group in loaded["optimizer"]["param_groups"] if "step" in group}
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's expert optimizer groups disagree on Adam's step: {sorted(steps)}")
    return out, float(steps.pop()) if steps else None


def ep_param_groups(model, lr: float, min_lr: float, expert_params) -> list[tuple[dict, list]]:
    """Megatron's parameter groups of `model` as ep mode with expert parallelism (EP > 1) makes
    them, for a model built with EP = 1 (zebra: the whole model on every rank): one (fields,
    params) per group in Megatron's order, `fields` Megatron's (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr, default_config, max_lr, min_lr).

    Megatron tells expert-parallel parameters by their `allreduce` attribute, which the expert
    layers set only when EP > 1 (experts.py:203); `expert_params` get it for the call. Every
    parameter must still have its shape (the no-decay rule reads it). Collective over the world
    (Megatron aligns the groups' keys across ranks)."""
    before = [(p, p.__dict__.get("allreduce")) for p in expert_params]
    for p, _ in before:
        p.allreduce = False
    try:
        groups = _get_param_groups([model], OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr), None)
    finally:
        for p, value in before:
            if value is None:
                del p.allreduce
            else:
                p.allreduce = value
    return [({k: v for k, v in group.items() if k != "params"}, group["params"]) for group in groups]


def dense_optimizer(optimizer):
    """The single sub-optimizer of Megatron's optimizer for a model whose experts are frozen.

    Supported: FP32Optimizer (fp32 training), Float16OptimizerWithFloat16Params (bf16 / fp16) and
    DistributedOptimizer (--use-distributed-optimizer, any precision); their checkpoint forms
    are what `ep_optimizer_sharded_state_dict` reproduces for the experts.
    """
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if len(subs) != 1:
        raise ValueError(
            f"expected one optimizer over the non-expert parameters (the experts are frozen), got {len(subs)}: "
            f"{[type(s).__name__ for s in subs]}"
        )
    sub = subs[0]
    if type(sub) not in (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer):
        raise ValueError(
            f"checkpoints of frozen-expert modes support FP32Optimizer, Float16OptimizerWithFloat16Params and "
            f"DistributedOptimizer, got {type(sub).__name__}"
        )
    return sub


def frozen_expert_param_groups(model_chunks, optimizer, expert_params) -> list[tuple[dict, list]]:
    """The frozen expert parameters grouped and ordered as ep mode's expert optimizer holds them.

    Megatron groups trainable parameters only (`_get_param_groups`, optimizer/__init__.py:108):
    the experts become trainable for the call (no autograd runs meanwhile) and frozen again.
    Collective over the world (Megatron aligns the group keys across ranks).

    Returns one (fields, params) per expert group in ep's order: `fields` are Megatron's group
    fields (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr, default_config, max_lr,
    min_lr), `params` the group's expert parameters in model order.
    """
    dense = dense_optimizer(optimizer)
    wanted = {id(p) for p in expert_params}
    thawed = [p for p in expert_params if not p.requires_grad]
    for p in thawed:
        p.requires_grad_(True)
    try:
        groups = _get_param_groups(model_chunks, dense.config, None)
    finally:
        for p in thawed:
            p.requires_grad_(False)
    out = []
    for group in groups:
        if not group["is_expert_parallel"]:
            continue
        params = [p for p in group["params"] if id(p) in wanted]
        out.append(({k: v for k, v in group.items() if k != "params"}, params))
    found = sum(len(params) for _, params in out)
    if found != len(wanted):
        raise ValueError(f"{len(wanted)} expert parameters given, {found} of them in Megatron's expert-parallel groups")
    return out


def _group_key(group: dict) -> tuple:
    # MegatronOptimizer._filter_and_reorder_param_groups matches groups by these fields.
    return tuple(group[k] for k in ("wd_mult", "lr_mult", "is_decoupled_lr"))


def ep_optimizer_sharded_state_dict(optimizer, model_sd, expert_groups, expert_state, step, is_loading: bool) -> dict:
    """ep mode's optimizer sharded state dict, for a model whose experts the optimizer does not hold.

    {0: the dense optimizer's own sharded state dict, 1: the expert optimizer's, built as
    Megatron builds it for ep (`optimizer_sharded_state_dict`, or with a DistributedOptimizer
    `distributed_optimizer_sharded_state_dict`; the dense groups' Adam values)},
    each under ep's chained_<index>. prefix: the same keys, offsets and common structure as an ep
    checkpoint, so ep loads it and it loads from ep's.

    Args:
        optimizer: Megatron's optimizer over the non-expert parameters (see `dense_optimizer`).
        model_sd: the model's sharded state dict; its tensors of the expert parameters give the
            keys and offsets (ep's: Megatron's for each global expert id).
        expert_groups: `frozen_expert_param_groups`.
        expert_state: expert parameter -> {name: tensor of the parameter's shape} for
            `ADAM_STATE_NAMES` and, with Float16OptimizerWithFloat16Params or
            DistributedOptimizer, "fp32_param" (the fp32 master weights). Saving: the values;
            loading: buffers of the right dtype.
        step: the experts' Adam step count (saving only; a loaded one comes from the checkpoint).
        is_loading: a template to load into (the dense optimizer creates its state for it).
    """
    dense = dense_optimizer(optimizer)
    dense_sd = dense.sharded_state_dict(model_sd, is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    hyper = {_group_key(g): g for g in dense.optimizer.param_groups}
    groups = []
    for fields, params in expert_groups:
        if _group_key(fields) not in hyper:
            raise ValueError(
                f"no dense parameter group has the expert group's (wd_mult, lr_mult, is_decoupled_lr) = "
                f"{_group_key(fields)}: its learning rate and weight decay are unknown"
            )
        values = {k: v for k, v in hyper[_group_key(fields)].items() if k != "params"}
        groups.append(({**values, **fields}, params))
    scaler = dense.grad_scaler.state_dict() if getattr(dense, "grad_scaler", None) else None
    if isinstance(dense, DistributedOptimizer):
        expert_sd = distributed_optimizer_sharded_state_dict(groups, model_sd, expert_state, step, scaler, is_loading)
    else:
        fp32_main = isinstance(dense, Float16OptimizerWithFloat16Params)
        expert_sd = optimizer_sharded_state_dict(groups, model_sd, expert_state, step, fp32_main, scaler, is_loading)
    return chained_sharded_state_dict([dense_sd, expert_sd])


def chained_sharded_state_dict(parts: list[dict]) -> dict:
    """Megatron's ChainedOptimizer form of its sub-optimizers' sharded state dicts (in place):
    {index: part}, each part's keys under chained_<index>. (optimizer.py:1184 in 0.16.1)."""
    for index, part in enumerate(parts):
        add_prefix_for_sharding(part, f"chained_{index}.")
    return dict(enumerate(parts))


def expert_checkpoint_keys(optimizer, model_sd, expert_groups) -> dict[str, list[str]]:
    """The checkpoint keys of the experts' optimizer tensors in ep's form: {name: [key, ...]} for
    `ADAM_STATE_NAMES` and, with Float16OptimizerWithFloat16Params or DistributedOptimizer,
    "fp32_param" (the names are the callers'; a DistributedOptimizer's keys say "param")."""
    dense = dense_optimizer(optimizer)
    if isinstance(dense, DistributedOptimizer):
        stored = {source: name for name, source in DISTRIBUTED_STATE_NAMES.items()}
    else:
        names = ADAM_STATE_NAMES + (("fp32_param",) if isinstance(dense, Float16OptimizerWithFloat16Params) else ())
        stored = {name: name for name in names}
    sharded_of = param_shardings(model_sd)
    keys = {name: [] for name in stored}
    for _, params in expert_groups:
        for param in params:
            for name, key_name in stored.items():
                keys[name].append(f"chained_{EXPERT_INDEX}.optimizer.state.{key_name}.{sharded_of[id(param)].key}")
    return {name: sorted(set(k)) for name, k in keys.items()}


def load_ep_optimizer_state(optimizer, loaded: dict, expert_groups, with_experts: bool):
    """Loads the dense part of a loaded ep-form optimizer state dict into the dense optimizer.

    Returns (expert parameter -> {name: loaded tensor}, the experts' step count) when
    `with_experts` (the template had the expert part), else ({}, None).
    """
    dense = dense_optimizer(optimizer)
    dense.load_state_dict(loaded[DENSE_INDEX])
    if not with_experts:
        return {}, None
    if isinstance(dense, DistributedOptimizer):
        return read_distributed_optimizer_state(loaded[EXPERT_INDEX], expert_groups)
    out, step, _ = read_optimizer_state(loaded[EXPERT_INDEX], expert_groups,
                                        isinstance(dense, Float16OptimizerWithFloat16Params))
    return out, step


def param_shardings(model_sd) -> dict:
    """id(parameter) -> its ShardedTensor in the model's sharded state dict, or its
    ShardedTensorFactory (a SwiGLU fc1 weight: Megatron saves its two halves separately,
    transformer/mlp.py apply_swiglu_sharded_factory); `make_sharded_optimizer_tensor` takes either."""
    return {id(value.data): value for value in sharded_entries(model_sd)}


def sharded_entries(sharded_state_dict) -> list:
    """Every ShardedTensor and ShardedTensorFactory in a nested sharded state dict."""
    return [v for v in nested_values(sharded_state_dict) if isinstance(v, (ShardedTensor, ShardedTensorFactory))]

