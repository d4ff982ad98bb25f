"""Zebra mode on the shared training loop (DESIGN 4.7, 4.8): the ModeRuntime steps that hand
each iteration to the ZebraEngine.

    from_args        the ZP layout of this world (zebra.pools.zebra_layout)
    wrap             the engine over the whole GPTModel (TP = PP = EP = 1): every rank keeps its
                     role's parameters; its optimizer behind Megatron's step interface
    data_parallel    only attention ranks read data (R micro-batches each per iteration)
    forward_backward the zig-zag schedule over this rank's R micro-batches (or its F tasks only)
    end_iteration    the engine's measured all-to-all rows and bytes; the timeline of the last
                     iteration (--zebra-timeline); every --zebra-replan-interval iterations an
                     Asym-EA re-plan from the loads measured since the last one
                     (placement/zebra/replan.py), the experts moved when it pays
    save/load        checkpoints in ep's form (zebra/checkpoint.py)

Everything else (logging, evaluation, the non-finite stop, the stall watchdog, metrics, the load
trace) is the shared loop's.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.compat import mcore
from megatron_patches.data import datasets
from megatron_patches.mode.adam import AdamSettings
from megatron_patches.mode.runtime import ModeRuntime, StepResult, traffic_scalars
from megatron_patches.placement.zebra import expert_owners
from megatron_patches.placement.zebra.replan import replan
from megatron_patches.zebra import checkpoint
from megatron_patches.zebra.config import ZebraConfig
from megatron_patches.zebra.engine import ZebraEngine, ZebraEngineError
from megatron_patches.zebra.ownership import MixedPrecision, ZebraOwnership
from megatron_patches.zebra.pools import ZebraLayout


class ZebraOptimizer:
    """The engine's unscaling, gradient-norm clipping and AdamW step on fp32 main weights behind
    the interface the training loop calls on Megatron's optimizer."""

    def __init__(self, engine: ZebraEngine):
        self.engine = engine
        self.ownership: ZebraOwnership = engine.ownership
        self.param_groups = self.ownership.optimizer.param_groups
        """torch AdamW's groups with Megatron's keys (max_lr, min_lr, lr_mult, wd_mult): the LR
        schedule sets lr and weight_decay in them."""

    def zero_grad(self) -> None:
        self.ownership.zero_grad()

    def step(self) -> tuple[bool, float, int]:
        """(update successful, grad norm before clipping, zeros: 0 here, counted by
        `ZebraRuntime.outside_zeros_in_grad`, since every weight is outside Megatron's optimizer).
        The step is skipped on every rank when the loss or the norm is not finite (both world-wide
        values)."""
        grad_norm, stepped = self.ownership.step(skip=not math.isfinite(self.engine.last_loss))
        return stepped, grad_norm, 0

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor([self.ownership.loss_scale()])

    def reload_model_params(self) -> None:
        """After the model was loaded without optimizer state: main weights from the parameters."""
        self.ownership.reload_main_weights()


class ZebraRuntime(ModeRuntime):
    """--moe-parallel-mode zebra (see the module docstring)."""

    name = "zebra"
    owners_are_ep = False  # the common record's positions are zebra's own ranks (attention, then experts)

    def __init__(self, config: ZebraConfig, layout: ZebraLayout, adam: AdamSettings, train_iters: int):
        super().__init__()
        self.config = config
        self.layout = layout
        self.adam = adam
        self.train_iters = train_iters
        self.rank = dist.get_rank()
        self.attention = layout.roles[self.rank] == "attention"
        self.engine: ZebraEngine | None = None
        self._loads_LE = np.zeros((layout.asym_ea.shape.num_layers, layout.asym_ea.shape.num_experts), dtype=np.int64)
        """Routed token copies per layer and expert since the last re-plan (--zebra-replan-interval)."""

    @classmethod
    def from_args(cls, args, moe_layer_numbers: list[int], on_gpu: bool) -> "ZebraRuntime":
        config = ZebraConfig.from_args(args)
        layout = config.layout(dist.get_world_size(), len(moe_layer_numbers), args.num_experts)
        return cls(config, layout, AdamSettings.from_args(args), args.train_iters)

    # ---- building ----------------------------------------------------------------------------

    def wrap(self, models: list, config, args) -> tuple[list, object]:
        """The engine over the model (one chunk: zebra refuses pipeline parallelism; no DDP: it
        sums gradients over its own groups), cast to bf16
        or fp16 by Megatron's Float16Module as in ep (the engine calls the modules inside it); the
        parameters of the other role are released here. Gradients accumulate in fp32 with
        --accumulate-allreduce-grads-in-fp32 (bf16 always), fp16 scales the loss with Megatron's
        scaler."""
        (model,) = models
        mcore.half_precision(config, model)  # casts in place; the engine runs the modules directly
        grad_dtype = torch.float32 if (args.accumulate_allreduce_grads_in_fp32 or not (args.bf16 or args.fp16)) else (
            next(model.parameters()).dtype)
        precision = MixedPrecision(grad_dtype=grad_dtype, grad_scaler=mcore.grad_scaler(args))
        self.engine = ZebraEngine(model, self.config, self.layout, self.adam, precision=precision)
        layout = self.layout
        self._log.append(
            f"zebra: {layout.num_groups} ZP group(s) of M={layout.attention_ranks} attention + N={layout.expert_ranks} "
            f"expert ranks ({layout.attention_device_type} / {layout.expert_device_type}); R={self.config.microbatches} "
            f"micro-batches per attention rank; Asym-EA offload chunks per layer {list(layout.asym_ea.offload_chunks_L)}"
            + (f"; re-planned from the loads every {self.config.replan_interval} iterations"
               if self.config.replan_interval else "")
        )
        return [model], ZebraOptimizer(self.engine)

    def data_parallel(self) -> tuple[int, int]:
        """Attention ranks of every ZP group read data; expert ranks read none (index 0)."""
        group = self.layout.attention_dp_group
        return (group.index(self.rank) if self.attention else 0), len(group)

    # ---- per iteration -----------------------------------------------------------------------

    def params_norm(self, optimizer) -> float:
        """Every main weight (all of them are zebra's own), each counted once world-wide; each
        tensor's norm taken in fp32 as Megatron's optimizer takes ep's (its per-tensor torch.norm),
        so the two modes log the same figure (a float64 sum of squares differs by ~5e-5 relative
        on the 3.2 M-element embedding and output weights)."""
        return math.sqrt(self.engine.ownership.counted_once(lambda main: torch.norm(main).double() ** 2))

    def outside_zeros_in_grad(self) -> int:
        """Zero elements of every main gradient of the last step, each counted once world-wide."""
        return int(self.engine.ownership.counted_once(lambda main: (main.grad == 0).sum()))

    def zero_grad(self, chunks: list, optimizer) -> None:
        optimizer.zero_grad()

    def forward_backward(self, megatron_forward_backward, iterator, forward_only: bool) -> float:
        """This attention rank's R micro-batches through the zebra schedule (expert ranks take none):
        forward and backward with the gradient sums, or the forward tasks only."""
        batches = ([datasets.gpt_batch(next(iterator)) for _ in range(self.config.microbatches)]
                   if self.attention else None)
        if forward_only:
            return self.engine.evaluate(batches)
        return self.engine.forward_backward(batches)

    def end_iteration(self, step: StepResult) -> dict:
        """The measured all-to-all traffic of the iteration (collective); the timeline of the last
        training iteration to --zebra-timeline."""
        self._remote_rows, sent = self.engine.last_run_counts()
        if self.config.timeline is not None and step.iteration == self.train_iters:
            self.engine.write_timeline(self.config.timeline)
            self._log.append(f"zebra: wrote the timeline of iteration {step.iteration} to {self.config.timeline} "
                             "(tools/plot_timeline.py draws it)")
        layout = self.layout
        record = {
            "attention_ranks": layout.attention_ranks,
            "expert_ranks": layout.expert_ranks,
            "zp_groups": layout.num_groups,
            "microbatches": self.config.microbatches,
            "offload_chunks": list(self.engine.plan.offload_chunks_L),
            "bytes": {f"a2a_{stream}": value for stream, value in sent.items()},
        }
        interval = self.config.replan_interval
        if interval:
            self._loads_LE += step.routed_LE
            if step.iteration % interval == 0:
                record["replan"] = self._replan(step.iteration)
        return record

    def _replan(self, iteration: int) -> dict:
        """Re-plan Asym-EA from the loads since the last re-plan; move the experts when it pays
        (collective: every rank decides alike from the world's loads)."""
        engine = self.engine
        started = time.perf_counter()
        decision = replan(self.layout.profile, engine.plan, self._loads_LE, self.config.microbatches,
                          horizon=self.config.replan_interval, bytes_per_expert=engine.ownership.move_bytes_per_expert(),
                          link_bytes_per_s=self.layout.link_bytes_per_s)
        entry = {"adopted": decision.adopted, "predicted_s": [decision.current_s, decision.best_s],
                 "moved_experts": decision.moved_experts, "predicted_move_bytes": decision.move_bytes,
                 "predicted_move_s": decision.move_s, "plan_s": time.perf_counter() - started}
        self._loads_LE[:] = 0
        # every rank decides from the same loads with the same arithmetic; checked, since ranks that
        # disagreed would wait on each other's transfers forever
        decided = [None] * dist.get_world_size()
        dist.all_gather_object(decided, decision.plan.owners_LE if decision.adopted else None)
        if any(other != decided[0] for other in decided):
            differ = next(r for r, other in enumerate(decided) if other != decided[0])
            raise ZebraEngineError(f"re-plan at iteration {iteration}: ranks 0 and {differ} decided differently "
                                   f"({decided[0]} vs {decided[differ]}); no expert moved")
        line = f"zebra: re-plan at iteration {iteration}: {decision.summary()}"
        if decision.adopted:
            started = time.perf_counter()
            sent, received = engine.adopt_plan(decision.plan)
            device = engine.ownership.device
            if device.type == "cuda":
                torch.cuda.synchronize()
            busiest = torch.tensor([max(sent, received)], dtype=torch.int64, device=device)
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
            entry.update(move_bytes=int(busiest[0]), move_s=time.perf_counter() - started,
                         offload_chunks=list(decision.plan.offload_chunks_L))
            line += f"; moved in {entry['move_s'] * 1e3:.1f} ms, {entry['move_bytes']} B on the busiest rank"
        self._log.append(line)
        return entry

    # ---- metrics -----------------------------------------------------------------------------

    def owner_positions_LE(self, num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
        """Positions 0..M-1 are the attention ranks (owners of Asym-EA's offloaded experts),
        M..M+N-1 the expert ranks."""
        return np.stack([expert_owners(self.engine.plan, layer) for layer in range(num_layers)])

    def a2a_remote_copies(self, loads) -> int:
        """Token rows the forward dispatch sent to another rank (all ranks, layers, micro-batches):
        every routed copy except those of experts Asym-EA placed on the sending attention rank."""
        return self._remote_rows

    def progress(self, record: dict) -> tuple[str, float]:
        zebra = record[self.name]
        return f" (zebra M={zebra['attention_ranks']} N={zebra['expert_ranks']} R={zebra['microbatches']})", 1.0

    def tensorboard_scalars(self, record: dict) -> dict[str, float]:
        sent = record[self.name]["bytes"]
        return traffic_scalars(self.name, {kind: {"sent": value} for kind, value in sent.items()}, {}, "seconds")

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, model_chunks, optimizer, common: dict) -> None:
        """ep's form (zebra/checkpoint.py): each rank writes what it owns."""
        checkpoint.save(directory, self.engine.ownership, common)

    def load_checkpoint(self, directory: str, model_chunks, optimizer, template: dict, load_optim: bool,
                        strictness: str) -> tuple[dict, list[str]]:
        """Any ep-form checkpoint (zebra, ep with EP > 1, fssdp, replicate) into this run's layout."""
        return checkpoint.load(directory, self.engine.ownership, template, load_optim, strictness)
