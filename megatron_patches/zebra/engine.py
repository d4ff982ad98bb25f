"""Zebra engine: one training iteration of a GPT-MoE model split over attention and expert ranks.

DESIGN 4.7 / 4.8. The model is Megatron's own GPTModel, built on every rank exactly as ep mode
builds it with TP = PP = EP = 1 (``training.model.build_model``: non-expert weights from
Megatron's initialisation, experts from (seed, layer, global expert id)); the engine is a new
forward/backward schedule over its modules, not a new model:

- attention ranks (the first M of each ZP group) keep the embedding, every layer's norms,
  self-attention and router, the final norm and the output layer; data-parallel over all
  attention ranks of all ZP groups;
- expert ranks (the next N) keep the experts of every layer (``placement.zebra.expert_owners``:
  expert rank r holds a contiguous block of n/N experts); under Asym-EA the last o*n2 experts of
  every block of a layer with o chunks belong to the attention ranks instead. Every rank keeps
  only what it owns: the other parameters are released right after construction (their storage
  is replaced by an empty tensor), so the weights of an offloaded expert "move" by construction
  (every rank built the same model from the same seeds) and its Adam state is created where it
  lives.

One iteration runs R micro-batches per attention rank through the Theorem-1 task order of
``placement.zebra.task_order`` (per role: one compute queue, one dispatch queue, one combine
queue). Per layer l and micro-batch j:

    A_F(l,j)  attention rank: [combine of layer l-1: un-permute the returned expert outputs, add
              the residual | embedding for l = 0] -> input norm -> self-attention -> residual add
              -> pre-MLP norm -> router -> permute the normed tokens by owner rank then expert
    D_F(l,j)  all-gather of the per-expert token counts over the ZP group, then two all-to-alls
              (tokens, probabilities) with uneven splits: attention ranks -> owners of the experts
    E_F(l,j)  owner: sort the received rows by local expert (Megatron's sort_chunks_by_idxs
              order), run each expert MLP (probabilities applied inside, as SequentialMLP does)
    C_F(l,j)  all-to-all of the expert outputs back to the attention ranks
    A_F(L,j)  head: combine of layer L-1, final norm, output layer, loss; A_B(L,j) right after
    C_B(l,j)  all-to-all of the gradient of the expert outputs (produced by A_B(l+1,j))
    E_B(l,j)  owner: expert backward -> gradients of the received tokens and probabilities
    D_B(l,j)  all-to-all of those gradients back to the attention ranks
    A_B(l,j)  one autograd backward of segment A_F(l,j) from the gradient of its residual output
              (from A_B(l+1,j)) together with the returned gradients of the dispatched tokens and
              probabilities: the expert-input gradient meets the gate-branch gradient inside the
              same backward, so no weight gets its backward twice.

Every A_F segment starts from detached leaves (the previous segment's residual output and the
received expert outputs), so a backward stops at the attention output of each layer and resumes
only in the next A_B task.

Execution: a single host thread walks the three queues in order. A collective is launched when
it is at the head of its queue and its local producer has run (a receiver posts it as soon as it
reaches the head); it is complete when all its async works are. A compute task runs when it is at
the head of the compute queue and its local inputs are complete; while nothing can progress the
thread polls again after a short sleep (never blocking on one collective, so every stream stays
live). Dispatch and combine use two process
groups per ZP group (one each), and on GPU two CUDA streams (``comm.streams.CommStream``) ordered
against the compute stream by events; on CPU they are async gloo works. The GPU path has not run
on a GPU yet.

After the schedule: the dense gradients are summed over the attention ranks, each expert's over
the ranks of all ZP groups that hold it; the losses were scaled by 1 / (R * attention ranks), so
the sums are the gradients of the mean micro-batch loss, as ep mode's DDP averages them. The
optimizer is torch's AdamW on each rank's own parameters with Megatron's parameter groups (no
weight decay for biases and 1-D parameters; the keys OptimizerParamScheduler sets) and Megatron's
global-norm clipping over all parameters, each counted once.

Equivalence with ep mode holds without dropout (the schedule draws dropout masks in another
order); with a capacity factor too (Megatron's routers on the attention ranks drop, and pad,
what ep's drop on the same micro-batches), and with the routers' auxiliary loss (aux_loss,
seq_aux_loss), whose backward is scaled as the head's loss.

Asym-EA can be re-planned during the run (``adopt_plan``: the runtime's --zebra-replan-interval):
the experts whose owner changes move with their fp32 main weights and Adam state, and the
ownership (parameter lists, optimizer groups, checkpoint template, task order) follows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from megatron_patches.comm.streams import CommStream
from megatron_patches.compat import activations, mcore, moe
from megatron_patches.mode.layer import set_aux_loss_scale
from megatron_patches.placement.zebra import AsymEAPlan, Task, expert_owners, task_order
from megatron_patches.zebra.config import GLOBAL_AUX_LOSS, ZebraConfig, recompute_refusals
from megatron_patches.zebra.pools import ZebraLayout
from megatron_patches.zebra.timeline import RankTimeline, TaskSpan, gather_timeline, write_timeline

__all__ = ["SCHEDULES", "AdamSettings", "IterationResult", "Precision", "ZebraEngine", "ZebraEngineError", "masked_mean_loss",
           "naive_order", "permute_routed"]

SCHEDULES = ("zebra", "naive")
"""zebra: Theorem-1 order (placement.zebra.task_order); naive: one micro-batch at a time (its whole
forward and backward before the next one starts), the no-overlap baseline of tools/bench_zebra.py."""

# Backoff of the host thread while every stream waits on other ranks.
_MIN_IDLE_S = 20e-6
_MAX_IDLE_S = 1e-3

# Routing probabilities travel in fp32: Megatron's router computes them in fp32 or the router
# dtype, which fp32 holds exactly; the receiver casts back to the dtype it needs.
_PROBS_DTYPE = torch.float32


class ZebraEngineError(ValueError):
    """A model or setting the zebra engine cannot run; the message names the value and what is valid."""


def masked_mean_loss(losses_BS: torch.Tensor, batch: dict) -> torch.Tensor:
    """ep mode's GPT loss of one micro-batch: the mean token loss over batch["loss_mask"]."""
    mask_BS = batch["loss_mask"].float()
    return (losses_BS.float() * mask_BS).sum() / mask_BS.sum().clamp(min=1.0)


def _accumulate_main_grad(param: torch.Tensor) -> None:
    """After autograd accumulated into param.grad: move it into param.main_grad."""
    param.main_grad.add_(param.grad)
    param.grad = None


@dataclass(frozen=True)
class AdamSettings:
    """Adam hyper-parameters, as Megatron-LM's flags name them (the scheduler sets lr and wd later)."""

    lr: float
    """--lr: peak learning rate (max_lr of every parameter group)."""
    min_lr: float
    """--min-lr: floor of the learning-rate schedule."""
    weight_decay: float
    """--weight-decay: decoupled (AdamW) weight decay of non-bias, non-1-D parameters."""
    beta1: float
    """--adam-beta1."""
    beta2: float
    """--adam-beta2."""
    eps: float
    """--adam-eps."""
    clip_grad: float
    """--clip-grad: global gradient-norm clipping threshold; 0 disables clipping."""

    @classmethod
    def from_args(cls, args) -> "AdamSettings":
        return cls(args.lr, args.min_lr, args.weight_decay, args.adam_beta1, args.adam_beta2, args.adam_eps,
                   args.clip_grad)


@dataclass(frozen=True)
class Precision:
    """How the engine keeps gradients and weights (Megatron's mixed-precision rules): with bf16 or
    fp16 parameters Adam steps fp32 main weights, copied back into the parameters after each step."""

    grad_dtype: torch.dtype = torch.float32
    """dtype gradients are accumulated over micro-batches and summed over ranks in: fp32 with
    --accumulate-allreduce-grads-in-fp32 (always in bf16, as Megatron-LM sets it), else the
    parameters' dtype."""
    grad_scaler: object | None = None
    """Megatron's loss scaler (fp16: dynamic or constant); None: no loss scaling (bf16, fp32)."""


@dataclass(frozen=True)
class IterationResult:
    """What one training iteration returns (the same on every rank)."""

    loss: float
    """Mean micro-batch loss over all micro-batches of all attention ranks."""
    grad_norm: float
    """Global gradient norm before clipping (every parameter counted once)."""
    update_successful: bool = True
    """False when the loss or the gradient norm was not finite: the step was skipped on every rank."""


@dataclass
class _Exchange:
    """Split sizes of one (layer, micro-batch)'s four all-to-alls on this rank, from D_F's counts."""

    send_splits: list[int]
    """Rows this rank dispatches to each rank of its ZP group (as a token source)."""
    recv_splits: list[int]
    """Rows this rank receives from each rank of its ZP group (as an expert owner)."""
    counts_SK: np.ndarray
    """[group ranks, local experts] rows per (source rank, local expert), int64 (host values)."""


@dataclass
class _Segment:
    """What A_F(l, j) keeps for its backward A_B(l, j) and for the combine in A_F(l+1, j)."""

    inputs: list[torch.Tensor]
    """Leaves the segment started from: [] for layer 0; else [residual of layer l-1, received outputs]."""
    hidden_SBH: torch.Tensor
    """The residual stream after self-attention (the input of the MoE residual add)."""
    sent_XH: torch.Tensor
    """Dispatched tokens, sorted by owner rank, then expert, then token."""
    sent_probs_X: torch.Tensor
    """Their routing probabilities."""
    sorted_indices: torch.Tensor
    """permute's token index of every dispatched row (for unpermute)."""
    routing_map_TE: torch.Tensor
    """Routing map with columns in owner-major expert order (for unpermute)."""
    counts_E: torch.Tensor
    """Tokens per expert in expert-id order, int64 (what D_F gathers)."""


class _Collective:
    """One all-to-all task in flight on this rank: the async works of its current stage, and the
    stages still to launch (each launched once the previous one's works have completed)."""

    def __init__(self, task: Task, works: list, next_stages: Sequence[Callable[[], list]], finish: Callable[[], None]):
        self.task = task
        self.works = works
        self.next_stages = deque(next_stages)
        self.finish = finish

    def poll(self) -> bool:
        """True when every stage has completed; launches the next stage as soon as the current
        one has (never blocks)."""
        while all(work.is_completed() for work in self.works):
            for work in self.works:
                work.wait()
            if not self.next_stages:
                return True
            self.works = self.next_stages.popleft()()
        return False


class _Arrival:
    """A host copy in flight, as a work: completed once the copy's values are in host memory."""

    def __init__(self, arrived: Callable[[], bool]):
        self.is_completed = arrived

    def wait(self) -> None:
        """Only called once is_completed() said so: nothing left to wait for."""


def permute_routed(tokens_TH: torch.Tensor, routing_TE: torch.Tensor, probs_TE: torch.Tensor,
                   rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's permute (moe_utils.permute, unfused, no padding) without reading device values:
    the routed (token, expert) pairs grouped by expert, tokens in order within an expert, as
    (tokens [rows, H], their probabilities [rows], their token indices [rows]). ``rows`` is the
    routed count, a host value when nothing is dropped (tokens x top-k); Megatron's masked_select
    finds it by copying it to the host, on a GPU a synchronisation per call. Here a stable sort of
    the expert-major map puts the routed pairs first, in masked_select's order."""
    unrouted_X = (~routing_TE.T.reshape(-1)).to(torch.int8)  # expert-major [E * T]: 0 = routed
    picked_X = torch.argsort(unrouted_X, stable=True)[:rows]
    sorted_indices_X = picked_X % routing_TE.shape[0]
    return tokens_TH.index_select(0, sorted_indices_X), probs_TE.T.reshape(-1).index_select(0, picked_X), sorted_indices_X


def naive_order(num_layers: int, num_microbatches: int, role: str, offloaded_layers: Sequence[int] = ()) -> dict[str, list[Task]]:
    """Per stream, micro-batch after micro-batch: the one-micro-batch Theorem-1 order repeated R
    times (so a rank never works on two micro-batches at once)."""
    single = task_order(num_layers, 1, role, offloaded_layers)

    def relabel(task: Task, mb: int) -> Task:
        return dataclasses.replace(task, microbatch=mb, deps=tuple(d.replace(",0)", f",{mb})") for d in task.deps))

    return {stream: [relabel(t, mb) for mb in range(num_microbatches) for t in tasks] for stream, tasks in single.items()}


class ZebraEngine:
    """Runs training iterations of ``model`` in zebra mode on this rank (see the module docstring).

    ``model``: the unwrapped GPTModel of ``training.model.build_model`` under Megatron parallel
    state TP = PP = EP = ETP = 1, every layer MoE, on every rank of the world. ``layout``: the
    rank roles (``zebra.pools.zebra_layout`` for this world and model). Creates its process
    groups (a collective over the whole world: every rank constructs its engine in the same order).
    """

    def __init__(
        self,
        model,
        config: ZebraConfig,
        layout: ZebraLayout,
        adam: AdamSettings,
        *,
        precision: Precision = Precision(),
        loss_fn: Callable[[torch.Tensor, dict], torch.Tensor] = masked_mean_loss,
        schedule: str = "zebra",
        emulated_expert_slowdown: float = 1.0,
    ) -> None:
        self.config = config
        self.layout = layout
        self.model = model
        self.loss_fn = loss_fn
        if schedule not in SCHEDULES:
            raise ZebraEngineError(f"schedule={schedule!r} is invalid; valid: {list(SCHEDULES)}")
        if not emulated_expert_slowdown >= 1.0:
            raise ZebraEngineError(f"emulated_expert_slowdown={emulated_expert_slowdown!r} is invalid; valid: >= 1.0")
        self.emulated_expert_slowdown = emulated_expert_slowdown
        """Benchmark-only emulation of slower expert GPUs (tools/bench_zebra.py; no training flag
        sets it): after each expert task an expert rank sleeps (factor - 1) x the task's time."""
        self._check(model, config, layout)
        self.rank = dist.get_rank()
        per_group = layout.attention_ranks + layout.expert_ranks
        self.zp_group = self.rank // per_group
        self.group_rank = self.rank % per_group
        self.role = layout.roles[self.rank]
        self.layers = mcore.transformer_layers(model)
        self.num_layers = len(self.layers)
        self.num_experts = model.config.num_moe_experts
        self.hidden = model.config.hidden_size
        self.device = next(model.parameters()).device
        cfg = model.config
        full = cfg.recompute_granularity == "full"
        self.recomputed_layers = set(range(self.num_layers if cfg.recompute_method == "uniform" else cfg.recompute_num_layers)) if full else set()
        """Layers whose attention segments (A_F) and expert tasks (E_F) keep only their inputs and run
        again in the backward (--recompute-granularity full: uniform 1 = every layer, block N = the first N)."""

        # Process groups: every rank creates every group, in one order.
        self._dispatch_groups = [dist.new_group(list(g)) for g in layout.zp_groups]
        self._combine_groups = [dist.new_group(list(g)) for g in layout.zp_groups]
        attention_dp = dist.new_group(list(layout.attention_dp_group))
        expert_dp = [dist.new_group(list(g)) for g in layout.expert_dp_groups]
        offloaded_dp = [dist.new_group(list(g)) for g in layout.offloaded_expert_dp_groups]
        self.dispatch_group = self._dispatch_groups[self.zp_group]
        self.combine_group = self._combine_groups[self.zp_group]

        # Keep what this rank owns, release the rest (Asym-EA re-plans move experts: adopt_plan).
        every_expert_param = [p for layer in self.layers for expert in layer.mlp.experts.local_experts
                              for p in expert.parameters()]
        self._expert_shapes = {id(p): p.shape for p in every_expert_param}
        """Every expert parameter's shape (a released parameter has none; a moved-in one gets it back)."""
        # ep's parameter groups (taken while every parameter still has its shape): the optimizer
        # steps them with ep's hyper-parameters and the checkpoints keep ep's form.
        self._groups = moe.ep_param_groups(model, adam.lr, adam.min_lr, every_expert_param)
        sharded = model.sharded_state_dict()
        self.dtype = next(model.parameters()).dtype
        """The parameters' (and the exchanged tokens') dtype: fp32, or bf16/fp16 after Megatron's Float16Module cast."""
        self.dense_params: list[torch.nn.Parameter] = [
            p for p in model.parameters() if id(p) not in self._expert_shapes and self.role == "attention"]
        self.expert_params: list[torch.nn.Parameter] = []
        """The experts' parameters this rank owns under the current plan, in the model's order."""
        self.main: dict[int, torch.Tensor] = {}
        """Per owned parameter (by id): the fp32 weight Adam steps (the parameter itself in fp32)."""
        self._hooked: set[int] = set()
        self._schedule = schedule
        self._set_plan(layout.asym_ea)
        owned = {id(p) for p in self.dense_params + self._owned_expert_params()}
        for p in model.parameters():
            if id(p) not in owned:
                self._release(p)
        self._sharded_entries: list[tuple[str, object, bool, frozenset[int]]] = []
        """Megatron's sharded state dict of the model, taken while every parameter had its shape: (key,
        entry, whether an expert's, the ids of the parameters it holds; empty: an attention rank's)."""
        for key, value in sharded.items():
            if isinstance(value, ShardedTensor):
                ids = frozenset({id(value.data)})
            else:  # a module's `_extra_state` object: its module's
                ids = frozenset(id(p) for p in model.get_submodule(key.rsplit(".", 1)[0]).parameters())
            self._sharded_entries.append((key, value, bool(ids & self._expert_shapes.keys()), ids))
        # Gradient reduction groups: dense over all attention ranks; experts over the same
        # group-local rank of every ZP group (they hold the same experts).
        self._dense_dp = attention_dp if self.role == "attention" else None
        if self.role == "expert":
            self._expert_dp = expert_dp[self.group_rank - layout.attention_ranks]
        else:
            self._expert_dp = offloaded_dp[self.group_rank]
        self._dp_sizes = (len(layout.attention_dp_group), layout.num_groups)
        # Norm: dense parameters counted on the first attention rank only, experts on ZP group 0.
        self._norm_counts_dense = self.rank == layout.attention_dp_group[0]
        self._norm_counts_experts = self.zp_group == 0

        # Gradients: every backward's parameter gradient is added into `main_grad` (grad_dtype) and
        # dropped, as Megatron's DDP accumulates into its buffers; in bf16/fp16 Adam steps fp32
        # main weights (`self.main`), copied back into the parameters after each step.
        self.precision = precision
        self.half = self.dtype != torch.float32
        for p in self.dense_params + self._owned_expert_params():
            self._own(p, p.detach().float().clone() if self.half else p)
        self._update_param_lists()
        self.adam = adam
        self.optimizer = torch.optim.AdamW(
            [dict(params=[self.main[id(p)] for p in params], **fields) for fields, params in self.param_groups],
            lr=adam.lr, weight_decay=adam.weight_decay, betas=(adam.beta1, adam.beta2), eps=adam.eps,
        )
        """torch AdamW over this rank's main weights (its parameters in fp32) in ep's groups, with
        Megatron's fields: Megatron's OptimizerParamScheduler drives it (it sets lr and weight_decay
        per group)."""
        self.steps = 0
        """Adam steps taken (skipped iterations not counted): the step count every rank shares."""

        self._streams = {"dispatch": CommStream(self.device), "combine": CommStream(self.device)}
        self._use_cuda = self.device.type == "cuda"
        self.timeline: RankTimeline | None = None
        """The last recorded iteration's executed tasks (when ``record_timeline`` is on)."""
        self.record_timeline = config.timeline is not None
        """Record task times (a barrier starts each iteration's clock)."""
        self.last_loss = float("nan")
        """The mean loss of the last forward_backward (the optimizer step skips a non-finite one)."""

    # ------------------------------------------------------------------------------------------
    # Checks
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _check(model, config: ZebraConfig, layout: ZebraLayout) -> None:
        if not dist.is_initialized():
            raise ZebraEngineError("the zebra engine needs torch.distributed initialised (one process per rank)")
        if dist.get_world_size() != layout.world_size:
            raise ZebraEngineError(f"the layout is for {layout.world_size} ranks, the world has {dist.get_world_size()}")
        if (layout.attention_ranks, layout.expert_ranks) != (config.attention_ranks, config.expert_ranks):
            raise ZebraEngineError(
                f"layout M={layout.attention_ranks}, N={layout.expert_ranks} differs from the config's "
                f"--zebra-attention-ranks={config.attention_ranks}, --zebra-expert-ranks={config.expert_ranks}"
            )
        sizes = {
            "--tensor-model-parallel-size": parallel_state.get_tensor_model_parallel_world_size(),
            "--pipeline-model-parallel-size": parallel_state.get_pipeline_model_parallel_world_size(),
            "--expert-model-parallel-size": parallel_state.get_expert_model_parallel_world_size(),
            "--expert-tensor-parallel-size": parallel_state.get_expert_tensor_parallel_world_size(),
        }
        for flag, size in sizes.items():
            if size != 1:
                raise ZebraEngineError(f"{flag}={size}: zebra mode builds the whole model on every rank; valid: 1")
        if not hasattr(model, "decoder") or not hasattr(model, "output_layer"):
            raise ZebraEngineError(f"zebra mode runs GPT models; got {type(model).__name__} (valid: --model-family gpt)")
        cfg = model.config
        refusals = (
            ("--num-experts", cfg.num_moe_experts, not cfg.num_moe_experts, "zebra needs an MoE model"),
            ("--moe-router-load-balancing-type", cfg.moe_router_load_balancing_type,
             bool(cfg.moe_aux_loss_coeff) and cfg.moe_router_load_balancing_type == "global_aux_loss", GLOBAL_AUX_LOSS),
            ("moe_shared_expert_intermediate_size", cfg.moe_shared_expert_intermediate_size,
             cfg.moe_shared_expert_intermediate_size is not None, "shared experts are not supported in zebra mode"),
            ("--moe-grouped-gemm", cfg.moe_grouped_gemm, cfg.moe_grouped_gemm,
             "zebra runs each expert's MLP module; drop --moe-grouped-gemm"),
            ("moe_router_padding_for_quantization", cfg.moe_router_padding_for_quantization,
             cfg.moe_router_padding_for_quantization, "not supported in zebra mode"),
            *recompute_refusals(cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers,
                                list(cfg.recompute_modules or [])),
        )
        for flag, value, refused, why in refusals:
            if refused:
                raise ZebraEngineError(f"{flag}={value!r}: {why}")
        layers = mcore.transformer_layers(model)
        dense = [i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "router")]
        if dense:
            raise ZebraEngineError(
                f"layers {dense} are dense (--moe-layer-freq); zebra needs every layer to be MoE (valid: 1)"
            )
        if layout.asym_ea.shape.num_layers != len(layers) or layout.asym_ea.shape.num_experts != cfg.num_moe_experts:
            raise ZebraEngineError(
                f"the layout was made for {layout.asym_ea.shape.num_layers} layers x "
                f"{layout.asym_ea.shape.num_experts} experts, the model has {len(layers)} x {cfg.num_moe_experts}"
            )

    # ------------------------------------------------------------------------------------------
    # Ownership: which experts this rank holds under the current Asym-EA plan
    # ------------------------------------------------------------------------------------------

    def _set_plan(self, plan: AsymEAPlan) -> None:
        """The owners of every layer's experts (ZP-group-local ranks), this rank's experts and its
        role's task order under ``plan``."""
        self.plan = plan
        self.owners_LE = [expert_owners(plan, layer) for layer in range(self.num_layers)]
        self.owner_order_LE = [torch.from_numpy(np.argsort(o, kind="stable")).to(self.device) for o in self.owners_LE]
        self.my_experts_L = [[int(e) for e in np.flatnonzero(o == self.group_rank)] for o in self.owners_LE]
        self.has_experts_L = [bool(e) for e in self.my_experts_L]
        self.order = (task_order if self._schedule == "zebra" else naive_order)(
            self.num_layers, self.config.microbatches, self.role,
            [layer for layer, o in enumerate(plan.offload_chunks_L) if o > 0],
        )
        """The planned task order of this rank's role: {"compute" | "dispatch" | "combine": [Task]}."""

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
        self.expert_params = [p for p in self.model.parameters() if id(p) in owned]
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
        one by point-to-point (one message per expert: its parameters' _moved_state as fp32);
        the receiver takes the weights, the fp32 main weights and Adam's moments with the shared
        step count, so training goes on as if the expert had always lived there. Returns the
        bytes this rank (sent, received)."""
        owners_LE = [expert_owners(plan, layer) for layer in range(self.num_layers)]
        group = self.layout.zp_groups[self.zp_group]
        values = self._moved_values
        ops, arriving, leaving = [], [], []
        sent = received = 0
        for layer, (old_E, new_E) in enumerate(zip(self.owners_LE, owners_LE)):
            for e in np.flatnonzero(old_E != new_E):
                params = list(self.layers[layer].mlp.experts.local_experts[e].parameters())
                if old_E[e] == self.group_rank:
                    payload = torch.cat([t.reshape(-1).float() for p in params for t in self._moved_state(p)])
                    ops.append(dist.P2POp(dist.isend, payload, group[new_E[e]]))
                    leaving += params
                    sent += payload.numel() * 4
                elif new_E[e] == self.group_rank:
                    size = values * sum(self._expert_shapes[id(p)].numel() for p in params)
                    buffer = torch.empty(size, dtype=torch.float32, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buffer, group[old_E[e]]))
                    arriving.append((params, buffer))
                    received += size * 4
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for param in leaving:
            self._release(param)
        for params, buffer in arriving:
            offset = 0
            for p in params:
                shape = self._expert_shapes[id(p)]
                moved = buffer[offset : offset + values * shape.numel()].view(values, *shape)
                offset += values * shape.numel()
                p.data = moved[0].to(self.dtype).clone()
                main = moved[1].clone() if self.half else p
                self._own(p, main)
                self.optimizer.state[main] = {"step": torch.tensor(float(self.steps), dtype=torch.float32),
                                              "exp_avg": moved[-2].clone(), "exp_avg_sq": moved[-1].clone()}
                activations.persistent([p, main])
        self._set_plan(plan)
        self._update_param_lists()
        for (_, params), group in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            group["params"] = [self.main[id(p)] for p in params]
        return sent, received

    # ------------------------------------------------------------------------------------------
    # One iteration
    # ------------------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        for p in self.dense_params + self.expert_params:
            p.main_grad.zero_()
        self.optimizer.zero_grad(set_to_none=True)

    def gradient(self, param: torch.Tensor) -> torch.Tensor:
        """The accumulated (after forward_backward: summed over ranks) gradient of an owned parameter."""
        return param.main_grad

    def train_step(self, microbatches: Sequence[dict] | None) -> IterationResult:
        """One training iteration: zero gradients, R micro-batches forward and backward through
        the zebra schedule, gradient sums, clipping and the Adam step.

        ``microbatches``: on attention ranks the R micro-batches of this data-parallel rank
        (dicts with "tokens", "labels", "loss_mask", "position_ids" [b, s] and "attention_mask"
        as ``data.datasets.gpt_batch`` returns them); ignored on expert ranks (pass None).
        """
        self.zero_grad()
        loss = self.forward_backward(microbatches)
        grad_norm, stepped = self.step(skip=not math.isfinite(loss))
        return IterationResult(loss=loss, grad_norm=grad_norm, update_successful=stepped)

    def forward_backward(self, microbatches: Sequence[dict] | None) -> float:
        """Run the schedule and sum the gradients over the data-parallel groups; the mean loss.
        Gradients accumulate into ``.grad`` (``zero_grad`` first); same arguments as ``train_step``."""
        self._take_batches(microbatches)
        if self.model.config.moe_aux_loss_coeff:
            # the routers' auxiliary loss backward is scaled as the head's loss (`_head_backward`), as
            # Megatron's schedule scales it for ep (1 / micro-batches there; DDP then averages over DP)
            scale = torch.ones(1, device=self.device) / (len(self.layout.attention_dp_group) * self.config.microbatches)
            if self.precision.grad_scaler is not None:
                scale = scale * self.precision.grad_scaler.scale.to(self.device)
            set_aux_loss_scale(scale)
        self._run_schedule(self.order)
        self._reduce_gradients()
        self.last_loss = self._mean_loss()
        return self.last_loss

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[dict] | None) -> float:
        """Forward only (the F tasks of the same order, no gradients): the mean loss, as
        ``forward_backward`` computes it. Same arguments as ``train_step``."""
        self._take_batches(microbatches)
        forward = {stream: [t for t in tasks if t.phase == "F"] for stream, tasks in self.order.items()}
        self._run_schedule(forward)
        return self._mean_loss()

    def _take_batches(self, microbatches: Sequence[dict] | None) -> None:
        R = self.config.microbatches
        if self.role == "attention":
            if microbatches is None or len(microbatches) != R:
                got = None if microbatches is None else len(microbatches)
                raise ZebraEngineError(f"attention rank {self.rank} got {got} micro-batches; --zebra-microbatches is {R}")
            self._batches = [self._prepare(batch) for batch in microbatches]
        else:
            self._batches = None

    def _mean_loss(self) -> float:
        """Mean micro-batch loss over every attention rank (a collective over the world)."""
        total = torch.zeros(1, dtype=torch.float64, device=self.device)  # NCCL: device tensors
        for loss in self._losses:  # on the device: one read per iteration, after the all-reduce
            total += loss.double()
        dist.all_reduce(total)
        return float(total[0]) / (len(self.layout.attention_dp_group) * self.config.microbatches)

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
        squares = torch.zeros(1, dtype=torch.float64, device=self.device)  # NCCL: device tensors
        for params, counted in ((self.dense_params, self._norm_counts_dense),
                                (self.expert_params, self._norm_counts_experts)):
            if counted:
                for p in params:
                    squares += torch.norm(self.main[id(p)].grad).double() ** 2
        dist.all_reduce(squares)
        grad_norm = float(squares[0]) ** 0.5
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

    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        scaler = self.precision.grad_scaler
        return 1.0 if scaler is None else float(scaler.scale)

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

    def last_run_counts(self) -> tuple[int, dict[str, int]]:
        """Collective: of the last schedule run (train_step or evaluate), summed over the world:
        the token rows the forward dispatch sent to another rank, and the all-to-all bytes sent to
        other ranks per stream ({"dispatch", "combine"}; the count all-gather not included)."""
        streams = ("dispatch", "combine")
        packed = torch.tensor([self._remote_rows, *(self._bytes_sent[s] for s in streams)], dtype=torch.int64,
                              device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(packed)
        rows, *sent = packed.tolist()
        return rows, dict(zip(streams, sent))

    def write_timeline(self, path: str) -> None:
        """Collective: write the last iteration's timeline of every rank to ``path`` (rank 0 writes)."""
        if self.timeline is None:
            raise ZebraEngineError("no timeline was recorded (construct with --zebra-timeline or set record_timeline)")
        header = {
            "num_layers": self.num_layers,
            "microbatches": self.config.microbatches,
            "attention_ranks": self.layout.attention_ranks,
            "expert_ranks": self.layout.expert_ranks,
            "offload_chunks": list(self.plan.offload_chunks_L),
            "device": self.device.type,
        }
        gathered = gather_timeline(self.timeline, header)
        if gathered is not None:
            write_timeline(path, gathered)

    # ------------------------------------------------------------------------------------------
    # Schedule execution
    # ------------------------------------------------------------------------------------------

    def _state_reset(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._kept: dict[int, dict[int, int]] = {}  # micro-batch -> the storages its forward keeps (activations.measure)
        self._bytes_sent = {"dispatch": 0, "combine": 0}
        self._remote_rows = 0
        self._exchange: dict[tuple[int, int], _Exchange] = {}
        self._segments: dict[tuple[int, int], _Segment] = {}
        self._head_loss: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._received: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_hidden: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_received: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_sent: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._expert_in: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._expert_out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._grad_expert_out: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_expert_in: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _local_deps_done(self, task: Task, done: set[str]) -> bool:
        """Inputs produced on this rank (its own compute tasks, all-to-alls) have completed; tasks
        of the other role are reached only through an all-to-all."""
        other = "expert:" if self.role == "attention" else "attention:"
        if task.role == "group" and (task.kind, task.phase) != ("D", "F") and f"D_F({task.layer},{task.microbatch})" not in done:
            return False  # its split sizes come from the counts that D_F(l, j) gathered
        return all(dep in done for dep in task.deps if not dep.startswith(other))

    def _run_schedule(self, order: dict[str, list[Task]]) -> None:
        self._state_reset()
        self._recording = self.record_timeline
        self._marks: list[tuple] = []
        if self._recording:
            dist.barrier()  # one start for every rank's clock
        self._t0 = self._mark("compute")
        queues = {stream: deque(tasks) for stream, tasks in order.items()}
        in_flight: dict[str, _Collective] = {}
        starts: dict[str, object] = {}
        done: set[str] = set()
        idle_s = _MIN_IDLE_S
        while any(queues.values()):
            progressed = False
            for stream in ("dispatch", "combine"):
                queue = queues[stream]
                if not queue:
                    continue
                task = queue[0]
                collective = in_flight.get(stream)
                if collective is None and self._local_deps_done(task, done):
                    starts[task.id] = self._mark(stream)
                    in_flight[stream] = self._launch(task)
                    progressed = True
                elif collective is not None and collective.poll():
                    self._complete(stream, collective, starts.pop(task.id), done)
                    queue.popleft()
                    del in_flight[stream]
                    progressed = True
            queue = queues["compute"]
            if queue and self._local_deps_done(queue[0], done):
                task = queue.popleft()
                start = self._mark("compute")
                self._compute(task)
                self._emulate_slow_expert(task, start)
                self._record("compute", task, start, self._mark("compute"))
                done.add(task.id)
                progressed = True
            if progressed:
                idle_s = _MIN_IDLE_S
            else:
                idle_s = self._idle(in_flight, queues, idle_s)
        self._resolve_timeline()

    def _emulate_slow_expert(self, task: Task, start) -> None:
        if self.emulated_expert_slowdown == 1.0 or task.kind != "E" or self.role != "expert":
            return
        if self._use_cuda:
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(self._mark("compute")) / 1e3
        else:
            elapsed = time.perf_counter() - start
        time.sleep((self.emulated_expert_slowdown - 1.0) * elapsed)

    def _idle(self, in_flight: dict[str, "_Collective"], queues: dict[str, deque], idle_s: float) -> float:
        """Nothing could progress: sleep briefly and poll again (the next backoff is returned).

        Polling instead of blocking on one collective keeps every stream live: a completed
        collective must let its stream launch the next one (and a count gather its token
        exchange) at once, since the other ranks may need that to complete the awaited one."""
        if not in_flight:
            heads = {stream: q[0].id for stream, q in queues.items() if q}
            raise RuntimeError(f"zebra schedule stuck on rank {self.rank}: no collective in flight, heads {heads}")
        time.sleep(idle_s)
        return min(2 * idle_s, _MAX_IDLE_S)

    def _complete(self, stream: str, collective: _Collective, start, done: set[str]) -> None:
        with self._streams[stream].finish():
            collective.finish()
            end = self._mark(stream)
        self._record(stream, collective.task, start, end)
        done.add(collective.task.id)

    # ------------------------------------------------------------------------------------------
    # Timeline clock: host time on CPU, CUDA events on GPU (resolved after the iteration)
    # ------------------------------------------------------------------------------------------

    def _mark(self, stream: str):
        if not self._use_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        cuda_stream = self._streams[stream].cuda_stream if stream != "compute" else torch.cuda.current_stream()
        event.record(cuda_stream)
        return event

    def _record(self, stream: str, task: Task, start, end) -> None:
        if self._recording:
            self._marks.append((stream, task.label, start, end))

    def _resolve_timeline(self) -> None:
        if not self._recording:
            return
        if self._use_cuda:
            torch.cuda.synchronize()

            def seconds(mark):
                return self._t0.elapsed_time(mark) / 1e3
        else:

            def seconds(mark):
                return mark - self._t0

        self.timeline = RankTimeline(
            rank=self.rank, role=self.role, zp_group=self.zp_group,
            spans=[TaskSpan(stream, label, seconds(start), seconds(end)) for stream, label, start, end in self._marks],
        )

    # ------------------------------------------------------------------------------------------
    # Compute tasks
    # ------------------------------------------------------------------------------------------

    def _prepare(self, batch: dict) -> dict:
        missing = {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"} - set(batch)
        if missing:
            raise ZebraEngineError(f"a micro-batch lacks {sorted(missing)} (data.datasets.gpt_batch gives all five)")
        prepared = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        if self.model.position_embedding_type == "rope":
            prepared["rotary_pos_emb"] = self.model.rotary_pos_emb(prepared["tokens"].shape[1])
        else:
            prepared["rotary_pos_emb"] = None
        return prepared

    def _compute(self, task: Task) -> None:
        if task.phase == "F":
            # what this micro-batch's forward tasks keep for their backward, summed over its tasks
            with activations.measure(self._kept.setdefault(task.microbatch, {})):
                self._compute_task(task)
        else:
            self._compute_task(task)

    def _compute_task(self, task: Task) -> None:
        key = (task.layer, task.microbatch)
        if task.kind == "A" and task.phase == "F":
            if task.layer == self.num_layers:
                self._head_forward(task.microbatch)
            else:
                self._attention_forward(*key)
        elif task.kind == "A":
            if task.layer == self.num_layers:
                self._head_backward(task.microbatch)
            else:
                self._attention_backward(*key)
        elif task.phase == "F":
            self._experts_forward(*key)
        else:
            self._experts_backward(*key)

    def _combine_leaves(self, layer: int, mb: int) -> list[torch.Tensor]:
        """The detached leaves a segment after layer ``layer`` starts from: [its residual stream,
        the returned expert outputs], so the backward of the caller's segment stops here."""
        residual_SBH = self._segments[(layer, mb)].hidden_SBH.detach().requires_grad_()
        return [residual_SBH, self._received.pop((layer, mb)).requires_grad_()]

    def _combine(self, layer: int, mb: int, residual_SBH: torch.Tensor, received_XH: torch.Tensor) -> torch.Tensor:
        """The output of layer ``layer``: un-permute the returned expert outputs, add the residual."""
        segment = self._segments[(layer, mb)]
        moe_TH = unpermute(
            received_XH,
            segment.sorted_indices,
            restore_shape=(residual_SBH.shape[0] * residual_SBH.shape[1], self.hidden),
            routing_map=segment.routing_map_TE,
        )
        transformer_layer = self.layers[layer]
        return transformer_layer.mlp_bda(transformer_layer.training, transformer_layer.config.bias_dropout_fusion)(
            (moe_TH.view(residual_SBH.shape), None), residual_SBH, transformer_layer.hidden_dropout
        )

    def _attention_forward(self, layer: int, mb: int) -> None:
        """A_F(layer, mb): [combine of layer-1 | embedding] -> attention -> router -> permute. Under
        full recompute everything after the embedding is one checkpointed segment whose inputs are
        the leaves (layer 0: the embedding's output)."""
        batch = self._batches[mb]
        if layer == 0:
            inputs: list[torch.Tensor] = []
            starts = [self.model.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])]
        else:
            inputs = starts = self._combine_leaves(layer - 1, mb)
        tl = self.layers[layer]
        order_E = self.owner_order_LE[layer]
        routed: dict[str, torch.Tensor] = {}

        def segment(*start):
            hidden_SBH = start[0] if layer == 0 else self._combine(layer - 1, mb, *start)
            attention = tl.self_attention(
                tl.input_layernorm(hidden_SBH), attention_mask=batch["attention_mask"],
                rotary_pos_emb=batch["rotary_pos_emb"],
            )
            mid_SBH = tl.self_attn_bda(tl.training, tl.config.bias_dropout_fusion)(attention, hidden_SBH, tl.hidden_dropout)
            normed_SBH = tl.pre_mlp_layernorm(mid_SBH)
            probs_TE, routing_TE = tl.mlp.router(normed_SBH)
            routing_ord_TE = routing_TE[:, order_E]
            if self.model.config.moe_expert_capacity_factor is None:
                # dropless: every token goes to top-k experts (a host value, so no read of routing_TE)
                sent_XH, sent_probs_X, sorted_indices = permute_routed(
                    normed_SBH.view(-1, self.hidden), routing_ord_TE, probs_TE[:, order_E],
                    rows=routing_TE.shape[0] * self.model.config.moe_router_topk,
                )
            else:  # token dropping: the kept count is data-dependent; Megatron's permute reads it (masked_select)
                sent_XH, sent_probs_X, sorted_indices = permute(
                    normed_SBH.view(-1, self.hidden), routing_ord_TE, probs=probs_TE[:, order_E])
            routed.update(routing_TE=routing_TE, routing_ord_TE=routing_ord_TE, sorted_indices=sorted_indices)
            return mid_SBH, sent_XH, sent_probs_X

        if layer in self.recomputed_layers:
            mid_SBH, sent_XH, sent_probs_X = mcore.checkpointed(segment, *starts)
        else:
            mid_SBH, sent_XH, sent_probs_X = segment(*starts)
        self._segments[(layer, mb)] = _Segment(
            inputs=inputs, hidden_SBH=mid_SBH, sent_XH=sent_XH, sent_probs_X=sent_probs_X,
            sorted_indices=routed["sorted_indices"], routing_map_TE=routed["routing_ord_TE"],
            counts_E=routed["routing_TE"].sum(dim=0).to(torch.int64),
        )

    def _head_forward(self, mb: int) -> None:
        batch = self._batches[mb]
        inputs = self._combine_leaves(self.num_layers - 1, mb)
        hidden_SBH = self.model.decoder.final_layernorm(self._combine(self.num_layers - 1, mb, *inputs))
        weight = self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights else None
        logits_SBV, _ = self.model.output_layer(hidden_SBH, weight=weight)
        losses_BS = self.model.compute_language_model_loss(batch["labels"], logits_SBV)
        loss = self.loss_fn(losses_BS, batch)
        self._losses.append(loss.detach())
        self._head_loss[mb] = (loss, inputs)

    def _head_backward(self, mb: int) -> None:
        loss, inputs = self._head_loss.pop(mb)
        scaled = loss / (len(self.layout.attention_dp_group) * self.config.microbatches)
        if self.precision.grad_scaler is not None:
            scaled = scaled * self.precision.grad_scaler.scale.to(scaled.device)
        scaled.backward()
        self._store_input_grads(self.num_layers - 1, mb, inputs)

    def _store_input_grads(self, layer: int, mb: int, inputs: list[torch.Tensor]) -> None:
        """Gradients of a segment's leaves: the residual's goes to A_B(layer), the received
        outputs' to C_B(layer)."""
        residual, received = inputs
        self._grad_hidden[(layer, mb)] = residual.grad if residual.grad is not None else torch.zeros_like(residual)
        self._grad_received[(layer, mb)] = received.grad if received.grad is not None else torch.zeros_like(received)

    def _attention_backward(self, layer: int, mb: int) -> None:
        segment = self._segments.pop((layer, mb))
        grad_sent_XH, grad_sent_probs_X = self._grad_sent.pop((layer, mb))
        outputs = [segment.hidden_SBH, segment.sent_XH, segment.sent_probs_X]
        grads = [self._grad_hidden.pop((layer, mb)), grad_sent_XH, grad_sent_probs_X.to(segment.sent_probs_X.dtype)]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if segment.inputs:
            self._store_input_grads(layer - 1, mb, segment.inputs)

    def _expert_major(self, counts_SK: np.ndarray) -> torch.Tensor:
        """Row index that turns received rows (source-major, then local expert) into expert-major
        order (local expert, then source), Megatron's sort_chunks_by_idxs order; from host counts."""
        offsets_SK = (np.cumsum(counts_SK.reshape(-1)) - counts_SK.reshape(-1)).reshape(counts_SK.shape)
        sources, experts = counts_SK.shape
        pieces = [np.arange(offsets_SK[s, k], offsets_SK[s, k] + counts_SK[s, k]) for k in range(experts) for s in range(sources)]
        return torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64))

    def _experts_forward(self, layer: int, mb: int) -> None:
        tokens_XH, probs_X = self._expert_in.pop((layer, mb))
        tokens_XH.requires_grad_()
        probs_X.requires_grad_()
        mine = self.my_experts_L[layer]
        if not mine:
            self._expert_out[(layer, mb)] = (tokens_XH, probs_X, tokens_XH.new_zeros((0, self.hidden)))
            return
        counts_SK = self._exchange[(layer, mb)].counts_SK
        index = self._expert_major(counts_SK).to(tokens_XH.device)
        per_expert = counts_SK.sum(axis=0).tolist()
        experts = self.layers[layer].mlp.experts.local_experts
        apply_probs_on_input = self.model.config.moe_apply_probs_on_input

        def compute(tokens_XH: torch.Tensor, probs_X: torch.Tensor) -> torch.Tensor:
            sorted_XH, sorted_probs_X = tokens_XH[index], probs_X[index]
            if apply_probs_on_input:
                # SequentialMLP: scale the input instead, probabilities reset to 1.
                sorted_XH = (sorted_probs_X.unsqueeze(-1) * sorted_XH).to(tokens_XH.dtype)
                sorted_probs_X = torch.ones_like(sorted_probs_X)
            outputs = [
                experts[e](chunk_XH, chunk_probs_X)[0]
                for e, chunk_XH, chunk_probs_X in zip(mine, sorted_XH.split(per_expert), sorted_probs_X.split(per_expert))
            ]
            return torch.cat(outputs)[torch.argsort(index)]

        # full recompute: only the received tokens and probabilities are kept for the backward
        output_XH = mcore.checkpointed(compute, tokens_XH, probs_X) if layer in self.recomputed_layers else compute(
            tokens_XH, probs_X)
        self._expert_out[(layer, mb)] = (tokens_XH, probs_X, output_XH)

    def _experts_backward(self, layer: int, mb: int) -> None:
        tokens_XH, probs_X, output_XH = self._expert_out.pop((layer, mb))
        grad_output_XH = self._grad_expert_out.pop((layer, mb))
        if output_XH.requires_grad and output_XH.numel():
            output_XH.backward(grad_output_XH)
        grad_tokens = tokens_XH.grad if tokens_XH.grad is not None else torch.zeros_like(tokens_XH)
        grad_probs = probs_X.grad if probs_X.grad is not None else torch.zeros_like(probs_X)
        self._grad_expert_in[(layer, mb)] = (grad_tokens, grad_probs)

    # ------------------------------------------------------------------------------------------
    # All-to-all tasks
    # ------------------------------------------------------------------------------------------

    def _a2a(self, stream: str, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]):
        group = self.dispatch_group if stream == "dispatch" else self.combine_group
        received = send.new_empty((sum(recv_splits), *send.shape[1:]))
        row_bytes = send.element_size() * int(np.prod(send.shape[1:]))  # 1 for a vector
        self._bytes_sent[stream] += (sum(send_splits) - send_splits[self.group_rank]) * row_bytes
        with self._streams[stream].launch(send, received):
            work = dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=group,
                                          async_op=True)
        return received, work

    def _launch(self, task: Task) -> _Collective:
        key = (task.layer, task.microbatch)
        stream = "dispatch" if task.kind == "D" else "combine"
        empty_XH = torch.zeros((0, self.hidden), dtype=self.dtype, device=self.device)
        if (task.kind, task.phase) == ("D", "F"):
            return self._launch_dispatch(task, empty_XH)
        exchange = self._exchange[key]
        if (task.kind, task.phase) == ("C", "F"):
            send = self._expert_out[key][2].detach() if key in self._expert_out else empty_XH
            received, work = self._a2a(stream, send, exchange.recv_splits, exchange.send_splits)

            def finish():
                if self.role == "attention":
                    self._received[key] = received

            return _Collective(task, [work], [], finish)
        if (task.kind, task.phase) == ("C", "B"):
            send = self._grad_received.pop(key) if self.role == "attention" else empty_XH
            received, work = self._a2a(stream, send, exchange.send_splits, exchange.recv_splits)

            def finish():
                if key in self._expert_out:
                    self._grad_expert_out[key] = received

            return _Collective(task, [work], [], finish)
        # D_B: gradients of the expert inputs back to the token sources.
        if key in self._grad_expert_in:
            grad_tokens, grad_probs = self._grad_expert_in.pop(key)
        else:
            grad_tokens, grad_probs = empty_XH, torch.zeros(0, dtype=torch.float32, device=self.device)
        tokens, work_tokens = self._a2a(stream, grad_tokens, exchange.recv_splits, exchange.send_splits)
        probs, work_probs = self._a2a(stream, grad_probs.to(_PROBS_DTYPE), exchange.recv_splits,
                                      exchange.send_splits)

        def finish():
            if self.role == "attention":
                self._grad_sent[key] = (tokens, probs)

        return _Collective(task, [work_tokens, work_probs], [], finish)

    def _launch_dispatch(self, task: Task, empty_XH: torch.Tensor) -> _Collective:
        """D_F: gather the per-expert counts of every rank of the ZP group, copy them to the host
        (asynchronously, on the dispatch stream), then send the tokens and probabilities with the
        split sizes the counts give. The all-to-all needs its split sizes on the host, so this is
        the one read of device values per (layer, micro-batch); it waits for the copy's event in
        the poll loop, never for the compute stream."""
        key = (task.layer, task.microbatch)
        segment = self._segments.get(key) if self.role == "attention" else None
        counts_E = segment.counts_E if segment is not None else torch.zeros(self.num_experts, dtype=torch.int64)
        counts_E = counts_E.to(self.device)
        group_size = self.layout.attention_ranks + self.layout.expert_ranks
        gathered_GE = counts_E.new_empty(group_size * self.num_experts)  # flat: gloo's layout
        with self._streams["dispatch"].launch(counts_E, gathered_GE):
            work = dist.all_gather_into_tensor(gathered_GE, counts_E, group=self.dispatch_group, async_op=True)
        result: dict[str, torch.Tensor] = {}

        def copy_counts() -> list:
            host_GE, arrived = self._streams["dispatch"].to_host(gathered_GE)
            result["counts_GE"] = host_GE.view(group_size, self.num_experts)
            return [_Arrival(arrived)]

        def send_tokens() -> list:
            self._exchange[key] = self._split_sizes(task.layer, result["counts_GE"])
            tokens = segment.sent_XH.detach() if segment is not None else empty_XH
            probs = (segment.sent_probs_X.detach() if segment is not None
                     else torch.zeros(0, dtype=_PROBS_DTYPE, device=self.device)).to(_PROBS_DTYPE)
            exchange = self._exchange[key]
            result["tokens"], work_tokens = self._a2a("dispatch", tokens, exchange.send_splits, exchange.recv_splits)
            result["probs"], work_probs = self._a2a("dispatch", probs, exchange.send_splits, exchange.recv_splits)
            return [work_tokens, work_probs]

        def finish():
            if self.role == "expert" or self.has_experts_L[task.layer]:
                self._expert_in[key] = (result["tokens"], result["probs"])

        return _Collective(task, [work], [copy_counts, send_tokens], finish)

    def _split_sizes(self, layer: int, counts_GE: torch.Tensor) -> _Exchange:
        """The all-to-all split sizes of one (layer, micro-batch) from the host copy of the ZP
        group's counts [group ranks, experts]."""
        counts_GE_np = counts_GE.numpy()
        owners_E = self.owners_LE[layer]
        group_size = counts_GE_np.shape[0]
        send_splits = [int(counts_GE_np[self.group_rank, owners_E == d].sum()) for d in range(group_size)]
        counts_SK = counts_GE_np[:, self.my_experts_L[layer]]
        self._remote_rows += sum(send_splits) - send_splits[self.group_rank]
        return _Exchange(send_splits, counts_SK.sum(axis=1).tolist(), counts_SK)

    # ------------------------------------------------------------------------------------------
    # Gradient sums
    # ------------------------------------------------------------------------------------------

    def _reduce_gradients(self) -> None:
        for params, group, size in ((self.dense_params, self._dense_dp, self._dp_sizes[0]),
                                    (self.expert_params, self._expert_dp, self._dp_sizes[1])):
            if group is None or size == 1 or not params:
                continue
            flat = torch.cat([p.main_grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=group)
            offset = 0
            for p in params:
                p.main_grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
