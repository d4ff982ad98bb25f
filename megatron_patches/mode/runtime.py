"""ModeRuntime: the steps the training loop calls on the selected MoE mode, in its order.

    runtime = Runtime.from_args(args, moe_layer_numbers, on_gpu)   after process groups + seed
    config  = runtime.transformer_config(config)                   building the model
    spec    = runtime.moe_spec(megatron_moe_layer_spec)            building the model
    chunks, optimizer = runtime.wrap(models, config, args)         precision wrapper, DDP, optimizer
    runtime.data_parallel()                                        the ranks that read data
    runtime.attach(models, config, optimizer)                      after model, DDP, optimizer
    runtime.load_checkpoint(...)                                   --load
    per iteration:
        runtime.zero_grad(chunks, optimizer)
        runtime.begin_iteration(iteration)                         before the first forward
        loss = runtime.forward_backward(megatron_fb, iterator, forward_only)
        (the optimizer's step: Megatron's, or the one `wrap` returned)
        record = runtime.end_iteration(step)                       after the step
        runtime.owner_positions_LE(...)                            the common per-layer records
        runtime.a2a_remote_copies(loads), runtime.memory_report()  metrics
        runtime.progress(record), runtime.tensorboard_scalars(record)  rank 0's sinks
        runtime.take_log()                                         lines for rank 0's log
    runtime.save_checkpoint(...)                                   --save

The implementation here is stock Megatron-Core expert parallelism (`ep`): Megatron's MoE layer,
its DDP and optimizer, its checkpoint; every hook passes through. A mode overrides the steps
it changes and nothing else. Every rank calls every step in the same order; a step that
communicates says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from megatron.core import parallel_state

from megatron_patches.compat import mcore


class CheckpointRefused(ValueError):
    """A checkpoint the mode cannot resume from, found by `load_checkpoint` before it changed any
    state; the message names the checkpoint and what would do instead."""


@dataclass(frozen=True)
class StepResult:
    """What one training iteration produced, as end_iteration receives it."""

    iteration: int
    """The iteration that just ran (1-based)."""
    update_ok: bool
    """Megatron's step result (False: skipped, e.g. an fp16 overflow)."""
    grad_norm: float | None
    """The total grad norm Megatron's step returned (None without clipping or a norm)."""
    lr: float
    """The learning rate the step used."""
    clip_grad: float
    """--clip-grad (0: no clipping)."""
    routed_LE: np.ndarray
    """Global routed token copies per MoE layer of the whole model and expert (before dropping)."""
    processed_LE: np.ndarray
    """Global processed token copies per MoE layer and expert (after Megatron's dropping)."""


class ModeRuntime:
    """One MoE mode for the MoE layers of this pipeline stage; this class is `ep`."""

    name = "ep"
    """--moe-parallel-mode value; also the key of the mode's record in the JSON-lines metrics."""

    owners_are_ep = True
    """Whether `owner_positions_LE` is Megatron's EP layout (each expert on the rank that owns it
    in ep), so the common record's imbalance is what ep would have had on the same routing."""

    def __init__(self) -> None:
        self._log: list[str] = []

    @classmethod
    def from_args(cls, args, moe_layer_numbers: list[int], on_gpu: bool) -> "ModeRuntime":
        """Built after Megatron's process groups and RNG exist, before the model.

        Args:
            args: the validated namespace (training/validation.py).
            moe_layer_numbers: 1-based global numbers of every MoE layer of the model (all
                stages: load statistics cover the whole model).
            on_gpu: whether the model lives on CUDA.
        """
        return cls()

    # ---- building ----------------------------------------------------------------------------

    def transformer_config(self, config):
        """Megatron's TransformerConfig for this mode (ep: unchanged)."""
        return config

    def moe_spec(self, moe_layer_spec):
        """The layer spec of an MoE transformer layer (ep: Megatron's MoELayer)."""
        return moe_layer_spec

    def wrap(self, models: list, config, args) -> tuple[list, object]:
        """The model chunks the loop trains (one per virtual pipeline stage, else one) and their
        optimizer. ep: Megatron's Float16Module (half precision), then Megatron's DDP, per chunk,
        and Megatron's optimizer over all chunks (one world-wide loss scale).
        A mode that returns its own optimizer gives it Megatron's step interface: `step()` ->
        (update successful, grad norm, zeros), `zero_grad()`, `param_groups` (the LR schedule's
        keys), `get_loss_scale()`, `reload_model_params()`."""
        chunks = mcore.wrap_ddp(config, [mcore.half_precision(config, model) for model in models], args)
        return chunks, mcore.optimizer(args, chunks)

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's index, their number) among the ranks that read training data. ep: Megatron's
        data-parallel group."""
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def attach(self, models: list, config, optimizer) -> None:
        """Hook the built stage: its unwrapped model chunks (`compat.mcore.transformer_layers` of
        each, in order, are the stage's layers in layer order), the TransformerConfig Megatron's
        schedules read (finalize_model_grads_func lives there) and Megatron's optimizer."""

    # ---- per iteration -----------------------------------------------------------------------

    def zero_grad(self, chunks: list, optimizer) -> None:
        """Before the iteration: clear the gradients (ep: DDP's buffers and the optimizer's)."""
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()

    def begin_iteration(self, iteration: int) -> None:
        """Before the iteration's first forward (plans for the iteration)."""

    def forward_backward(self, megatron_forward_backward: Callable[[object, bool], float], iterator,
                         forward_only: bool) -> float:
        """One iteration's micro-batches from `iterator`, forward (and backward unless
        `forward_only`); returns the world's mean micro-batch loss. ep: Megatron's pipeline
        schedule, `megatron_forward_backward(iterator, forward_only)`. Communicates."""
        return megatron_forward_backward(iterator, forward_only)

    def end_iteration(self, step: StepResult) -> dict | None:
        """After Megatron's optimizer step: the mode's own updates; returns the mode's record for
        the metrics (None: nothing beyond the common record). May communicate."""
        return None

    def owner_positions_LE(self, num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
        """int [MoE layers, experts]: the position, within one expert group, of the rank that owns
        each expert (the common record's device_tokens and imbalance are per position, over the
        positions that own an expert). ep: Megatron's contiguous blocks of E / EP experts."""
        return np.tile(np.arange(num_experts) // (num_experts // ep_size), (num_layers, 1))

    def a2a_remote_copies(self, loads) -> int:
        """Token copies the iteration's dispatch sent to another rank (all layers, sources and
        micro-batches). ep: the tokens routed to experts another EP rank owns."""
        return loads.remote_copies

    def memory_report(self) -> dict | None:
        """Bytes per rank the mode keeps (at log intervals); None: nothing to report. May communicate."""
        return None

    def placed_layers(self, record: dict | None) -> list[dict] | None:
        """Per MoE layer of every stage, the tokens per rank after the mode placed copies by load
        (`device_tokens`, `imbalance`), from the mode's record (`end_iteration`'s); None when what
        ran is the owners' layout (the common record's). ep: None."""
        return None

    def progress(self, record: dict) -> tuple[str, float]:
        """The mode's part of rank 0's progress line, from the iteration's metrics record: the text
        after the imbalance (the owners' and the placed one), and the token survival to print. ep: nothing, and
        the lowest survival over layers after Megatron's capacity dropping. No communication."""
        return "", min((layer["survival"] for layer in record["moe_layers"]), default=1.0)

    def tensorboard_scalars(self, record: dict) -> dict[str, float]:
        """The mode's TensorBoard scalars (tag -> value) from the iteration's metrics record, beside
        the common ones (training/metrics.py). ep: none. No communication."""
        return {}

    def params_norm(self, optimizer) -> float:
        """--log-params-norm: the L2 norm of every weight the optimizers step, each counted once
        world-wide. A collective on every rank, after the step. ep: Megatron's optimizer's, plus
        `outside_params_norm_sq`."""
        return mcore.params_norm(optimizer, self.outside_params_norm_sq())

    def outside_params_norm_sq(self) -> float:
        """Squared norm of the weights the mode steps outside Megatron's optimizer, each counted
        once world-wide (a collective on every rank). ep: none."""
        return 0.0

    def outside_zeros_in_grad(self) -> int:
        """Zero elements among the gradients the mode keeps outside Megatron's optimizer, each
        counted once world-wide (--log-num-zeros-in-grad adds them to Megatron's count). A
        collective on every rank, after Megatron's step and before `end_iteration`. ep: none."""
        return 0

    def take_log(self) -> list[str]:
        """Decisions since the last call, for rank 0's log (emptied by the call)."""
        lines, self._log = self._log, []
        return lines

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, model_chunks, optimizer, common: dict) -> None:
        """Write model, optimizer and `common` (loop state, scheduler) as one torch_dist checkpoint."""
        mcore.save_checkpoint(directory, model_chunks, optimizer, common)

    def load_checkpoint(self, directory: str, model_chunks, optimizer, template: dict, load_optim: bool,
                        strictness: str) -> tuple[dict, list[str]]:
        """Read a checkpoint into the model (and the optimizer with `load_optim`); returns the
        loaded common entries named by `template` and notes for the log. Raises
        CheckpointRefused for a checkpoint the mode cannot use. `strictness`: --dist-ckpt-strictness,
        how the read from storage treats keys the template and the checkpoint do not share."""
        loaded = mcore.load_checkpoint(directory, model_chunks, optimizer if load_optim else None, template, strictness)
        return loaded, []


def traffic_scalars(mode: str, traffic: dict, seconds: dict, seconds_name: str) -> dict[str, float]:
    """TensorBoard scalars of a mode's bytes per kind and link class and its seconds per kind."""
    scalars = {f"{mode}/bytes_{kind}_{where}": value for kind, link in traffic.items() for where, value in link.items()}
    scalars.update({f"{mode}/{seconds_name}_{kind}": value for kind, value in seconds.items()})
    return scalars
