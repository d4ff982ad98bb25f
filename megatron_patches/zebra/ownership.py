"""What a zebra rank trains: its parameters under the current Asym-EA plan, their gradients, the
fp32 main weights and Megatron's AdamW step over them, and the moves of a re-plan (DESIGN 4.7, 4.8).

Every rank builds the whole GPTModel from the same seeds and keeps only what it owns:

- attention ranks: the embedding, every layer's norms, self-attention and router, the final norm
  and the output layer (data-parallel over all attention ranks of all ZP groups), and under
  Asym-EA the experts offloaded to them;
- expert ranks: the experts of every layer (``placement.zebra.expert_owners``).

The other parameters are released right after construction (their storage is replaced by an
empty tensor), so an offloaded expert's weights "move" by construction and its Adam state is
created where it lives. A re-plan during the run (``adopt_plan``) moves each expert whose owner
changes with its fp32 main weights and Adam state, and the ownership follows.

Gradients: every backward adds a parameter's gradient into its ``main_grad`` (the precision's
gradient dtype) and drops it, as Megatron's DDP accumulates into its buffers. After the schedule
the dense gradients are summed over the attention ranks and each expert's over the ranks of all
ZP groups that hold it; the losses were scaled by 1 / (R * attention ranks), so the sums are the
gradients of the mean micro-batch loss, as ep's DDP averages them. The optimizer is torch's AdamW
on fp32 main weights with Megatron's parameter groups (no weight decay for biases and 1-D
parameters; the keys OptimizerParamScheduler sets) and Megatron's global-norm clipping over all
parameters, each counted once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_patches.comm.exchange import exchange
from megatron_patches.compat import activations, moe
from megatron_patches.mode.adam import AdamSettings
from megatron_patches.placement.zebra import AsymEAPlan, expert_owners
from megatron_patches.zebra.pools import ZebraLayout

__all__ = ["MixedPrecision", "ZebraOwnership"]


@dataclass(frozen=True)
class MixedPrecision:
    """How zebra keeps gradients and weights (Megatron's mixed-precision rules): with bf16 or fp16
    parameters Adam steps fp32 main weights, copied back into the parameters after each step."""

    grad_dtype: torch.dtype = torch.float32
    """dtype gradients are accumulated over micro-batches and summed over ranks in: fp32 with
    --accumulate-allreduce-grads-in-fp32 (always in bf16, as Megatron-LM sets it), else the
    parameters' dtype."""
    grad_scaler: object | None = None
    """Megatron's loss scaler (fp16: dynamic or constant); None: no loss scaling (bf16, fp32)."""


def _accumulate_main_grad(param: torch.Tensor) -> None:
    """After autograd accumulated into param.grad: move it into param.main_grad."""
    param.main_grad.add_(param.grad)
    param.grad = None


class ZebraOwnership:
    """This rank's parameters, main weights, AdamW and the expert owners of the current plan (see
    the module docstring). ``layers``: the model's transformer layers; ``dense_dp`` /
    ``expert_dp``: the groups this rank sums dense / its experts' gradients over (None: no dense
    parameters here)."""

    def __init__(self, model, layers: list, layout: ZebraLayout, rank: int, adam: AdamSettings,
                 precision: MixedPrecision, dense_dp, expert_dp) -> None:
        self.model = model
        self.layers = layers
        self.layout = layout
        self.rank = rank
        per_group = layout.attention_ranks + layout.expert_ranks
        self.zp_group, self.group_rank = divmod(rank, per_group)
        self.role = layout.roles[rank]
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        """The parameters' (and the exchanged tokens') dtype: fp32, or bf16/fp16 after Megatron's Float16Module cast."""
        self.precision = precision
        self.half = self.dtype != torch.float32
        self.adam = adam

        every_expert_param = [p for layer in layers for expert in layer.mlp.experts.local_experts
                              for p in expert.parameters()]
        self._expert_shapes = {id(p): p.shape for p in every_expert_param}
        """Every expert parameter's shape (a released parameter has none; a moved-in one gets it back)."""
        # ep's parameter groups and sharded state dict, taken while every parameter still has its
        # shape: the optimizer steps them with ep's hyper-parameters and the checkpoints keep ep's form.
        self._groups = moe.ep_param_groups(model, adam.lr, adam.min_lr, every_expert_param)
        self._sharded_entries = self._sharded_state_entries(model)
        self.dense_params: list[torch.nn.Parameter] = [
            p for p in model.parameters() if id(p) not in self._expert_shapes and self.role == "attention"]
        self.expert_params: list[torch.nn.Parameter] = []
        """The experts' parameters this rank owns under the current plan, in the model's order."""
        self.main: dict[int, torch.Tensor] = {}
        """Per owned parameter (by id): the fp32 weight Adam steps (the parameter itself in fp32)."""
        self._hooked: set[int] = set()
        self.set_plan(layout.asym_ea)
        owned = {id(p) for p in self.dense_params + self._owned_expert_params()}
        for p in model.parameters():
            if id(p) not in owned:
                self._release(p)
        for p in self.dense_params + self._owned_expert_params():
            self._own(p, p.detach().float().clone() if self.half else p)
        self._update_param_lists()

        self._reductions = ((self.dense_params, dense_dp, len(layout.attention_dp_group)),
                            (self.expert_params, expert_dp, layout.num_groups))
        # Norm: dense parameters counted on the first attention rank only, experts on ZP group 0.
        self._norm_counts_dense = rank == layout.attention_dp_group[0]
        self._norm_counts_experts = self.zp_group == 0
        self.optimizer = torch.optim.AdamW(
            [dict(params=[self.main[id(p)] for p in params], **fields) for fields, params in self.param_groups],
            lr=adam.lr, weight_decay=adam.weight_decay, betas=adam.betas, eps=adam.eps,
        )
        """torch AdamW over this rank's main weights (its parameters in fp32) in ep's groups, with
        Megatron's fields: Megatron's OptimizerParamScheduler drives it (it sets lr and weight_decay
        per group)."""
        self.steps = 0
        """Adam steps taken (skipped iterations not counted): the step count every rank shares."""

    def _sharded_state_entries(self, model) -> list[tuple[str, object, bool, frozenset[int]]]:
        """Megatron's sharded state dict of the model: (key, entry, whether an expert's, the ids of
        the parameters it holds; empty: an attention rank's, as the routers' expert bias, a buffer)."""
        params = {id(p) for p in model.parameters()}
        entries = []
        for key, value in model.sharded_state_dict().items():
            if isinstance(value, ShardedTensor):
                ids = frozenset({id(value.data)}) & params
            else:  # a module's `_extra_state` object: its module's
                ids = frozenset(id(p) for p in model.get_submodule(key.rsplit(".", 1)[0]).parameters())
            entries.append((key, value, bool(ids & self._expert_shapes.keys()), ids))
        return entries

    # ------------------------------------------------------------------------------------------
    # Ownership under the current Asym-EA plan
    # ------------------------------------------------------------------------------------------

    def set_plan(self, plan: AsymEAPlan) -> None:
        """The owners of every layer's experts (ZP-group-local ranks) and this rank's experts under ``plan``."""
        self.plan = plan
        self.owners_LE = [expert_owners(plan, layer) for layer in range(len(self.layers))]
        self.owner_order_LE = [torch.from_numpy(np.argsort(o, kind="stable")).to(self.device) for o in self.owners_LE]
        """Per layer: expert ids sorted by owner rank (stable): the column order tokens are dispatched in."""
        self.my_experts_L = [[int(e) for e in np.flatnonzero(o == self.group_rank)] for o in self.owners_LE]
        self.has_experts_L = [bool(e) for e in self.my_experts_L]

    def _owned_expert_params(self) -> list[torch.nn.Parameter]:
        return [p for layer, mine in zip(self.layers, self.my_experts_L) for e in mine
                for p in layer.mlp.experts.local_experts[e].parameters()]

    def _own(self, param: torch.nn.Parameter, main: torch.Tensor) -> None:
        """Train ``param`` here: a gradient buffer, the hook that fills it, its fp32 main weight
        (``param`` itself in fp32)."""
        param.requires_grad_(True)
        param.main_grad = torch.zeros_like(param, dtype=self.precision.grad_dtype)
        if id(param) not in self._hooked:  # hooks stay registered while a parameter is away
            param.register_post_accumulate_grad_hook(_accumulate_main_grad)
            self._hooked.add(id(param))
        self.main[id(param)] = main

    def _release(self, param: torch.nn.Parameter) -> None:
        """Another rank owns ``param``: drop its storage, gradient buffer, main weight and Adam state."""
        main = self.main.pop(id(param), None)
        if main is not None:
            self.optimizer.state.pop(main, None)
            activations.released([param, main])
            del param.main_grad
        param.requires_grad_(False)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _update_param_lists(self) -> None:
        """expert_params and param_groups from the current ownership, both in the model's order, so
        ranks that hold the same experts reduce their gradients in one order."""
        owned = {id(p) for p in self._owned_expert_params()}
        self.expert_params[:] = [p for p in self.model.parameters() if id(p) in owned]
        owned.update(id(p) for p in self.dense_params)
        self.param_groups = [(fields, [p for p in params if id(p) in owned]) for fields, params in self._groups]
        """ep's parameter groups in Megatron's order (`is_expert_parallel` tells which of ep's two
        optimizers holds a group), each with this rank's parameters of it (possibly none):
        (Megatron's group fields, parameters)."""

    @property
    def owned_sharded_state(self) -> dict[str, tuple[object, bool]]:
        """Megatron's sharded state dict of the model restricted to what this rank owns now, key ->
        (entry, whether an expert's): the checkpoints' template (zebra/checkpoint.py)."""
        owned = {id(p) for p in self.dense_params + self.expert_params}
        return {key: (value, expert) for key, value, expert, ids in self._sharded_entries
                if (ids & owned if ids else self.role == "attention")}

    # ------------------------------------------------------------------------------------------
    # Re-plans: experts move with their optimizer state
    # ------------------------------------------------------------------------------------------

    def _moved_state(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        """What moves with an expert's parameter, in order: [the parameter (bf16/fp16 only),] the
        fp32 main weight, Adam's exp_avg and exp_avg_sq (``_moved_values`` tensors)."""
        state = self.adam_state(param)
        return ([param] if self.half else []) + [self.main[id(param)], state["exp_avg"], state["exp_avg_sq"]]

    @property
    def _moved_values(self) -> int:
        """fp32 values that move per element of an expert's parameter (``_moved_state``)."""
        return 4 if self.half else 3

    def move_bytes_per_expert(self) -> int:
        """Bytes that move with one expert (fp32 values: _moved_state's tensors)."""
        expert = self.layers[0].mlp.experts.local_experts[0]
        return 4 * self._moved_values * sum(self._expert_shapes[id(p)].numel() for p in expert.parameters())

    @torch.no_grad()
    def adopt_plan(self, plan: AsymEAPlan) -> tuple[int, int]:
        """Move experts to the owners of ``plan`` (Asym-EA re-planned from the loads), between
        iterations. Collective over the world: every rank passes the same plan (the runtime checks
        that they agree before any rank calls this).

        Inside every ZP group, each expert whose owner changes goes from its old owner to its new
        one by point-to-point (``comm.exchange``: one message per pair of ranks, the experts'
        parameters' _moved_state as fp32, in (layer, expert) order);
        the receiver takes the weights, the fp32 main weights and Adam's moments with the shared
        step count, so training goes on as if the expert had always lived there. Returns the
        bytes this rank (sent, received)."""
        owners_LE = [expert_owners(plan, layer) for layer in range(len(self.layers))]
        group = self.layout.zp_groups[self.zp_group]
        values = self._moved_values
        payloads: dict[int, list[torch.Tensor]] = {}  # global peer rank -> leaving experts' state, in order
        arriving: dict[int, list[list[torch.nn.Parameter]]] = {}  # global peer rank -> arriving experts' parameters
        leaving = []
        for layer, (old_E, new_E) in enumerate(zip(self.owners_LE, owners_LE)):
            for e in np.flatnonzero(old_E != new_E):
                params = list(self.layers[layer].mlp.experts.local_experts[e].parameters())
                if old_E[e] == self.group_rank:
                    payloads.setdefault(group[new_E[e]], []).append(
                        torch.cat([t.reshape(-1).float() for p in params for t in self._moved_state(p)]))
                    leaving += params
                elif new_E[e] == self.group_rank:
                    arriving.setdefault(group[old_E[e]], []).append(params)
        recvs = {peer: torch.empty(values * sum(self._expert_shapes[id(p)].numel() for params in experts for p in params),
                                   dtype=torch.float32, device=self.device) for peer, experts in arriving.items()}
        sent, received = exchange(None, {peer: torch.cat(parts) for peer, parts in payloads.items()}, recvs)
        for param in leaving:
            self._release(param)
        for peer, experts in arriving.items():
            buffer, offset = recvs[peer], 0
            for p in (p for params in experts for p in params):
                shape = self._expert_shapes[id(p)]
                moved = buffer[offset : offset + values * shape.numel()].view(values, *shape)
                offset += values * shape.numel()
                p.data = moved[0].to(self.dtype).clone()
                main = moved[1].clone() if self.half else p
                self._own(p, main)
                self.optimizer.state[main] = {"step": torch.tensor(float(self.steps), dtype=torch.float32),
                                              "exp_avg": moved[-2].clone(), "exp_avg_sq": moved[-1].clone()}
                activations.persistent([p, main])
        self.set_plan(plan)
        self._update_param_lists()
        for (_, params), group in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            group["params"] = [self.main[id(p)] for p in params]
        return sent, received

    # ------------------------------------------------------------------------------------------
    # Gradients and the optimizer step
    # ------------------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        for p in self.dense_params + self.expert_params:
            p.main_grad.zero_()
        self.optimizer.zero_grad(set_to_none=True)

    def gradient(self, param: torch.Tensor) -> torch.Tensor:
        """The accumulated (after reduce_gradients: summed over ranks) gradient of an owned parameter."""
        return param.main_grad

    def reduce_gradients(self) -> None:
        """Sum the gradients over the ranks that hold the same parameters (see the module docstring)."""
        for params, group, size in self._reductions:
            if group is None or size == 1 or not params:
                continue
            flat = torch.cat([p.main_grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=group)
            offset = 0
            for p in params:
                p.main_grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def step(self, skip: bool = False) -> tuple[float | None, bool]:
        """Unscaling (fp16), global-norm clipping (Megatron's rule) and the AdamW step on the main
        weights, copied back into half-precision parameters; (the norm before clipping, whether the
        step was taken). Skipped, leaving every weight as it was, when `skip` (a non-finite loss) or
        the norm is not finite (an fp16 overflow backs the loss scale off; the norm is then None, as
        Megatron reports it): both are world-wide values, so every rank of both roles decides alike."""
        owned = self.dense_params + self.expert_params
        scaler = self.precision.grad_scaler
        for p in owned:
            main = self.main[id(p)]
            main.grad = p.main_grad.float()  # the buffer itself when it is fp32
            if scaler is not None:
                main.grad.mul_(scaler.inv_scale.to(main.grad.device))
        grad_norm = self.counted_once(lambda main: torch.norm(main.grad).double() ** 2) ** 0.5
        overflow = not math.isfinite(grad_norm)
        if scaler is not None:
            scaler.update(overflow)
            if overflow:
                return None, False
        if skip or overflow:
            return grad_norm, False
        if self.adam.clip_grad > 0:
            clip_coeff = self.adam.clip_grad / (grad_norm + 1.0e-6)
            if clip_coeff < 1.0:
                for p in owned:
                    self.main[id(p)].grad.mul_(clip_coeff)
        self.optimizer.step()
        self.steps += 1
        if self.half:
            with torch.no_grad():
                for p in owned:
                    p.copy_(self.main[id(p)])
        return grad_norm, True

    def counted_once(self, value) -> float:
        """sum(value(main weight)) over every weight of the model, each counted once world-wide
        (dense weights on the first attention rank, experts in ZP group 0): `step`'s grad norm,
        --log-params-norm and --log-num-zeros-in-grad; a collective on every rank of both roles."""
        total = torch.zeros(1, dtype=torch.float64, device=self.device)  # NCCL: device tensors
        for params, counted in ((self.dense_params, self._norm_counts_dense),
                                (self.expert_params, self._norm_counts_experts)):
            if counted:
                for p in params:
                    total += value(self.main[id(p)]).double()
        dist.all_reduce(total)
        return float(total[0])

    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        scaler = self.precision.grad_scaler
        return 1.0 if scaler is None else float(scaler.scale)

    # ------------------------------------------------------------------------------------------
    # Checkpoints: Megatron's optimizer-state form
    # ------------------------------------------------------------------------------------------

    def reload_main_weights(self) -> None:
        """Half precision: the main weights from the parameters (after they were loaded)."""
        if self.half:
            with torch.no_grad():
                for p in self.dense_params + self.expert_params:
                    self.main[id(p)].copy_(p)

    def adam_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The optimizer's tensors of an owned parameter, by the names of Megatron's checkpoint form:
        Adam's "exp_avg", "exp_avg_sq" (zeros before the first step, as Adam starts them) and, in
        bf16/fp16, the fp32 main weights "fp32_param". The live tensors: loading copies into them."""
        main = self.main[id(param)]
        state = self.optimizer.state[main]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(main),
                         exp_avg_sq=torch.zeros_like(main))
        tensors = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        if self.half:
            tensors["fp32_param"] = main
        return tensors

    @torch.no_grad()
    def load_optimizer_state(self, tensors: dict, step: float | None, group_values: list[dict],
                             grad_scaler_state: dict | None) -> None:
        """Adopt loaded optimizer state: `tensors` parameter -> {name: tensor} as `adam_state`
        names them (every owned parameter), the shared step (None: saved before any step), the
        saved groups' values in `param_groups` order (where this run's groups have the same key, the
        saved value wins, as in torch's load_state_dict: Adam's hyper-parameters, Megatron's fields),
        the fp16 loss scaler's state."""
        steps = 0 if step is None else int(step)
        for param in self.dense_params + self.expert_params:
            for name, live in self.adam_state(param).items():
                live.copy_(tensors[param][name])
            self.optimizer.state[self.main[id(param)]]["step"] = torch.tensor(float(steps), dtype=torch.float32)
        for group, values in zip(self.optimizer.param_groups, group_values, strict=True):
            group.update({k: v for k, v in values.items() if k in group and k != "params"})
        self.steps = steps
        scaler = self.precision.grad_scaler
        if scaler is not None and grad_scaler_state is not None:
            scaler.load_state_dict(grad_scaler_state)
