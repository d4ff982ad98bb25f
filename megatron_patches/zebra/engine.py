"""Zebra engine: one training iteration of a GPT-MoE model split over attention and expert ranks.

DESIGN 4.7 / 4.8. The model is Megatron's own GPTModel, built on every rank exactly as ep mode
builds it with TP = PP = EP = 1 (``training.model.build_model``: non-expert weights from
Megatron's initialisation, experts from (seed, layer, global expert id)); the engine is a new
forward/backward schedule over its modules, not a new model. Three parts, one concern each:

- ``zebra.ownership``: what this rank trains (attention ranks the dense parts and Asym-EA's
  offloaded experts, expert ranks the experts), the gradient sums, the AdamW step on fp32 main
  weights and the expert moves of a re-plan;
- ``zebra.tasks``: the attention, expert and head forward/backward tasks and the dispatch and
  combine all-to-alls, over Megatron-Core's modules;
- ``zebra.executor``: the host thread that walks the role's three queues (compute, dispatch,
  combine) of the Theorem-1 order (``placement.zebra.task_order``), and the timeline clock.

One iteration runs R micro-batches per attention rank. Equivalence with ep mode holds without
dropout (the schedule draws dropout masks in another order); with a capacity factor too
(Megatron's routers on the attention ranks drop, and pad, what ep's drop on the same
micro-batches), and with the routers' auxiliary loss (aux_loss, seq_aux_loss), whose backward is
scaled as the head's loss. The README's "CPU and GPU" says which of it has run on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_patches.compat import mcore
from megatron_patches.mode.layer import set_aux_loss_scale
from megatron_patches.placement.zebra import ORDERS, AsymEAPlan
from megatron_patches.zebra.config import GLOBAL_AUX_LOSS, MTP_DENSE, ZebraConfig, recompute_refusals
from megatron_patches.zebra.executor import COMM_STREAMS, ScheduleExecutor
from megatron_patches.mode.adam import AdamSettings
from megatron_patches.zebra.ownership import MixedPrecision, ZebraOwnership
from megatron_patches.zebra.pools import ZebraLayout
from megatron_patches.zebra.tasks import ZebraTasks, masked_mean_loss
from megatron_patches.zebra.timeline import gather_timeline, write_timeline

__all__ = ["IterationResult", "ZebraEngine", "ZebraEngineError"]

BATCH_KEYS = frozenset({"tokens", "labels", "loss_mask", "position_ids", "attention_mask"})
"""What every micro-batch holds (data.datasets.gpt_batch gives all five)."""


class ZebraEngineError(ValueError):
    """A model or setting the zebra engine cannot run; the message names the value and what is valid."""


@dataclass(frozen=True)
class IterationResult:
    """What one training iteration returns (the same on every rank)."""

    loss: float
    """Mean micro-batch loss over all micro-batches of all attention ranks."""
    grad_norm: float
    """Global gradient norm before clipping (every parameter counted once)."""
    update_successful: bool = True
    """False when the loss or the gradient norm was not finite: the step was skipped on every rank."""


class ZebraEngine:
    """Runs training iterations of ``model`` in zebra mode on this rank (see the module docstring).

    ``model``: the unwrapped GPTModel of ``training.model.build_model`` under Megatron parallel
    state TP = PP = EP = ETP = 1, on every rank of the world. ``layout``: the
    rank roles (``zebra.pools.zebra_layout`` for this world and model). ``schedule``: a name of
    ``placement.zebra.ORDERS``. ``emulated_expert_slowdown``: benchmark only (tools/bench_zebra.py).
    Creates its process groups (a collective over the whole world: every rank constructs its engine
    in the same order).
    """

    def __init__(
        self,
        model,
        config: ZebraConfig,
        layout: ZebraLayout,
        adam: AdamSettings,
        *,
        precision: MixedPrecision = MixedPrecision(),
        loss_fn: Callable[[torch.Tensor, dict], torch.Tensor] = masked_mean_loss,
        schedule: str = "zebra",
        emulated_expert_slowdown: float = 1.0,
    ) -> None:
        if schedule not in ORDERS:
            raise ZebraEngineError(f"schedule={schedule!r} is invalid; valid: {list(ORDERS)}")
        if not emulated_expert_slowdown >= 1.0:
            raise ZebraEngineError(f"emulated_expert_slowdown={emulated_expert_slowdown!r} is invalid; valid: >= 1.0")
        self._check(model, config, layout)
        self.config = config
        self.layout = layout
        self.model = model
        self.rank = dist.get_rank()
        self.role = layout.roles[self.rank]
        moe_layers = mcore.moe_transformer_layers(model)
        self.num_layers = len(moe_layers)
        """MoE layers: the schedule's layers (a dense layer runs inside the attention task after it)."""
        self._schedule = schedule
        groups = self._process_groups(layout)
        self.ownership = ZebraOwnership(model, moe_layers, layout, self.rank, adam, precision,
                                        groups["dense_dp"], groups["expert_dp"])
        self.executor = ScheduleExecutor(self.rank, self.role, self.ownership.zp_group, self.ownership.device,
                                         record_timeline=config.timeline is not None,
                                         emulated_expert_slowdown=emulated_expert_slowdown)
        self.loss_divisor = len(layout.attention_dp_group) * config.microbatches
        """Micro-batches of an iteration over all attention ranks: the mean loss divides by it, and
        each head loss's (and the routers' auxiliary loss's) backward is scaled by its inverse."""
        self.tasks = ZebraTasks(model, self.ownership, {"dispatch": groups["dispatch"], "combine": groups["combine"]},
                                self.executor.streams, loss_fn, self.loss_divisor)
        self.order = self._order(layout.asym_ea)
        """The planned task order of this rank's role: {"compute" | "dispatch" | "combine": [Task]}."""
        self.last_loss = float("nan")
        """The mean loss of the last forward_backward (the optimizer step skips a non-finite one)."""

    def _process_groups(self, layout: ZebraLayout) -> dict[str, object]:
        """Every rank creates every group, in one order; this rank's: its ZP group's dispatch and
        combine groups, the attention ranks' data-parallel group (None on expert ranks), and the
        group that holds the same experts as this rank (the same group-local rank of every ZP group)."""
        dispatch = [dist.new_group(list(g)) for g in layout.zp_groups]
        combine = [dist.new_group(list(g)) for g in layout.zp_groups]
        attention_dp = dist.new_group(list(layout.attention_dp_group))
        expert_dp = [dist.new_group(list(g)) for g in layout.expert_dp_groups]
        offloaded_dp = [dist.new_group(list(g)) for g in layout.offloaded_expert_dp_groups]
        zp_group, group_rank = divmod(self.rank, layout.attention_ranks + layout.expert_ranks)
        attention = self.role == "attention"
        return {
            "dispatch": dispatch[zp_group],
            "combine": combine[zp_group],
            "dense_dp": attention_dp if attention else None,
            "expert_dp": offloaded_dp[group_rank] if attention else expert_dp[group_rank - layout.attention_ranks],
        }

    def _order(self, plan: AsymEAPlan):
        offloaded = [layer for layer, o in enumerate(plan.offload_chunks_L) if o > 0]
        return ORDERS[self._schedule](self.num_layers, self.config.microbatches, self.role, offloaded)

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
        if cfg.moe_router_enable_expert_bias and mcore.expert_bias_group_size() != dist.get_world_size():
            raise ZebraEngineError(
                f"the expert bias update sums the token counts over Megatron's data-parallel group "
                f"({mcore.expert_bias_group_size()} ranks), which must be the whole world ({dist.get_world_size()}) "
                "in zebra (TP = PP = CP = 1): only the attention ranks route, the expert ranks add zeros")
        mtp = getattr(model, "mtp", None)
        if mtp is not None and not all(hasattr(layer.transformer_layer.mlp, "router") for layer in mtp.layers):
            raise ZebraEngineError(f"mtp_num_layers={cfg.mtp_num_layers}: {MTP_DENSE}")
        layers = mcore.moe_transformer_layers(model)
        if layout.asym_ea.shape.num_layers != len(layers) or layout.asym_ea.shape.num_experts != cfg.num_moe_experts:
            raise ZebraEngineError(
                f"the layout was made for {layout.asym_ea.shape.num_layers} MoE layers x "
                f"{layout.asym_ea.shape.num_experts} experts, the model has {len(layers)} x {cfg.num_moe_experts}"
            )

    # ------------------------------------------------------------------------------------------
    # Re-plans
    # ------------------------------------------------------------------------------------------

    @property
    def plan(self) -> AsymEAPlan:
        return self.ownership.plan

    def adopt_plan(self, plan: AsymEAPlan) -> tuple[int, int]:
        """Move the experts to ``plan``'s owners (ZebraOwnership.adopt_plan: collective, between
        iterations) and follow it with the task order; the bytes this rank (sent, received)."""
        moved = self.ownership.adopt_plan(plan)
        self.order = self._order(plan)
        return moved

    # ------------------------------------------------------------------------------------------
    # One iteration
    # ------------------------------------------------------------------------------------------

    def train_step(self, microbatches: Sequence[dict] | None) -> IterationResult:
        """One training iteration: zero gradients, R micro-batches forward and backward through
        the zebra schedule, gradient sums, clipping and the Adam step.

        ``microbatches``: on attention ranks the R micro-batches of this data-parallel rank
        (dicts with "tokens", "labels", "loss_mask", "position_ids" [b, s] and "attention_mask"
        as ``data.datasets.gpt_batch`` returns them); ignored on expert ranks (pass None).
        """
        self.ownership.zero_grad()
        loss = self.forward_backward(microbatches)
        grad_norm, stepped = self.ownership.step(skip=not math.isfinite(loss))
        return IterationResult(loss=loss, grad_norm=grad_norm, update_successful=stepped)

    def forward_backward(self, microbatches: Sequence[dict] | None) -> float:
        """Run the schedule and sum the gradients over the data-parallel groups; the mean loss.
        Gradients accumulate into ``main_grad`` (``ownership.zero_grad`` first); same arguments as
        ``train_step``."""
        self.tasks.reset(self._checked_batches(microbatches))
        cfg = self.model.config
        if cfg.moe_aux_loss_coeff or cfg.moe_z_loss_coeff or cfg.mtp_num_layers:
            # the routers' auxiliary loss, z-loss and the MTP losses backward is scaled as the
            # head's loss (ZebraTasks' head backward), as Megatron's schedule scales them for ep
            # (1 / micro-batches there; DDP then averages over DP)
            device = self.ownership.device
            scale = torch.ones(1, device=device) / self.loss_divisor
            scaler = self.ownership.precision.grad_scaler
            if scaler is not None:
                scale = scale * scaler.scale.to(device)
            set_aux_loss_scale(scale)
            mcore.set_mtp_loss_scale(scale)
        self._run(self.order)
        self.ownership.reduce_gradients()
        # the aux-loss-free bias moves from the world's routed counts of this iteration, as ep's
        # finalize_model_grads moves it (the expert ranks route nothing and add zeros)
        mcore.update_expert_bias([layer.mlp.router for layer in self.ownership.layers])
        self.last_loss = self._mean_loss()
        return self.last_loss

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[dict] | None) -> float:
        """Forward only (the F tasks of the same order, no gradients): the mean loss, as
        ``forward_backward`` computes it. Same arguments as ``train_step``."""
        self.tasks.reset(self._checked_batches(microbatches))
        self._run({stream: [t for t in tasks if t.phase == "F"] for stream, tasks in self.order.items()})
        return self._mean_loss()

    def _run(self, order) -> None:
        self.executor.run(order, self.tasks.ready, self.tasks.launch, self.tasks.compute)

    def _checked_batches(self, microbatches: Sequence[dict] | None) -> list[dict]:
        """This attention rank's R micro-batches, checked (none on expert ranks)."""
        if self.role != "attention":
            return []
        R = self.config.microbatches
        if microbatches is None or len(microbatches) != R:
            got = None if microbatches is None else len(microbatches)
            raise ZebraEngineError(f"attention rank {self.rank} got {got} micro-batches; --zebra-microbatches is {R}")
        for batch in microbatches:
            missing = BATCH_KEYS - set(batch)
            if missing:
                raise ZebraEngineError(f"a micro-batch lacks {sorted(missing)} (data.datasets.gpt_batch gives all five)")
        return list(microbatches)

    def _mean_loss(self) -> float:
        """Mean micro-batch loss over every attention rank (a collective over the world)."""
        total = torch.zeros(1, dtype=torch.float64, device=self.ownership.device)  # NCCL: device tensors
        for loss in self.tasks.losses:  # on the device: one read per iteration, after the all-reduce
            total += loss.double()
        dist.all_reduce(total)
        return float(total[0]) / self.loss_divisor

    # ------------------------------------------------------------------------------------------
    # What the last run did
    # ------------------------------------------------------------------------------------------

    def last_run_counts(self) -> tuple[int, dict[str, int]]:
        """Collective: of the last schedule run (train_step or evaluate), summed over the world:
        the token rows the forward dispatch sent to another rank, and the all-to-all bytes sent to
        other ranks per stream ({"dispatch", "combine"}; the count all-gather not included)."""
        packed = torch.tensor([self.tasks.remote_rows, *(self.tasks.bytes_sent[s] for s in COMM_STREAMS)],
                              dtype=torch.int64, device=self.ownership.device)  # NCCL reduces device tensors only
        dist.all_reduce(packed)
        rows, *sent = packed.tolist()
        return rows, dict(zip(COMM_STREAMS, sent))

    def write_timeline(self, path: str) -> None:
        """Collective: write the last iteration's timeline of every rank to ``path`` (rank 0 writes)."""
        timeline = self.executor.timeline
        if timeline is None:
            raise ZebraEngineError("no timeline was recorded (construct with --zebra-timeline or set "
                                   "executor.record_timeline)")
        header = {
            "num_layers": self.num_layers,
            "microbatches": self.config.microbatches,
            "attention_ranks": self.layout.attention_ranks,
            "expert_ranks": self.layout.expert_ranks,
            "offload_chunks": list(self.plan.offload_chunks_L),
            "device": self.ownership.device.type,
        }
        gathered = gather_timeline(timeline, header)
        if gathered is not None:
            write_timeline(path, gathered)
