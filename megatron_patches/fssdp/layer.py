"""The FSSDP MoE layer: Megatron's MoELayer computing on materialized expert copies.

Forward of MoE layer l, one micro-batch (`LayerPass` holds its state, `LayerCopies` the
copies it computes on):

    TransformerLayer pre-hook  -> start_gather: spAG(l) launched (attention runs meanwhile);
                                  later micro-batches of the iteration reuse the copies
    enter                      -> backward trigger on the MoE input
    route (Megatron's router)  -> route_to_instances: counts all-gathered, dispatch plan,
                                  virtual routing map (token copy -> holder of a copy)
    before_dispatch            -> wait spAG(l): held copies [H, N] (exposed time measured)
    dispatch (Megatron a2a)    -> compute_instances: Megatron's expert MLP on each held row
    combine (Megatron a2a)

Backward of layer l: the experts' weight gradients accumulate into the held buffer's
gradient (`_Materialize`), summed over the iteration's micro-batches; when the gradient of
the last micro-batch reaches the MoE input (`_BackwardTrigger`, i.e. attention backward of l
is about to start) the runtime completes the reduces still in flight, launches spRS(l) and,
with re-materialization, the re-gather of layer l-1, so both run during attention backward.
The points where collectives launch are fixed by the autograd graph and the micro-batch
count, identical on every rank, so every rank launches them in the same order.

Once per iteration: spAG, calibration and spRS run once per layer and iteration, whatever
the number of micro-batches k (gradient accumulation, pipeline schedules): the copies stay
until the last micro-batch's backward. Only the count exchange and the dispatch plan are per
micro-batch (each routes its own tokens, as Megatron's dispatcher exchanges counts per
micro-batch). With re-materialization the copies are freed after every forward, so gather,
re-gather and reduce run per micro-batch (what it saves is the copies and their gradients
between micro-batches).

Activation recompute (`--recompute-granularity full`): a checkpointed layer runs its forward
twice, once without autograd and again inside the backward. The first run gathers and plans as
above and keeps its LayerPass (with its copies, or with re-materialization without them); the
second run replays that pass: the same dispatch, the same copies (re-materialization: the
re-gather the backward needs anyway), and no second spAG, count exchange or calibration.

Re-materialization: the held copies are not kept by autograd; saved-tensor hooks replace
every saved view of them by a marker, and the backward unpacks the marker from the
re-gathered buffer. The stage's last MoE layer keeps its copies (its backward comes first,
there is no attention backward above it to hide a gather behind).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from megatron_patches.comm.timing import nvtx_range
from megatron_patches.comm.virtual import tokens_from_source, virtual_routing
from megatron_patches.compat import activations, mcore
from megatron_patches.compat.moe import held_experts_sharded_state_dict
from megatron_patches.mode.layer import InstanceMoELayer
from megatron_patches.placement import fssdp as planner

__all__ = ["FSSDPMoELayer", "LayerCopies", "LayerPass"]


@dataclass
class LayerCopies:
    """One MoE layer's expert copies and their gradient, shared by the passes that use them.

    By default every micro-batch of an iteration shares one LayerCopies: the first forward
    gathers, later forwards reuse the copies, every backward adds its gradient into one buffer,
    and the backward of the last micro-batch launches the one spRS (so spAG and spRS bytes per
    iteration do not depend on the number of micro-batches). With re-materialization each pass
    has its own (its copies are freed after its forward, so nothing is kept between passes).
    """

    layer: "FSSDPMoELayer"
    plan: object
    """The runtime's FSSDPLayerPlan of this iteration (shard, placement, collectives)."""
    owned_ON: torch.Tensor
    """This rank's owned experts, packed [O, N] (input of the gathers)."""
    passes: int
    """Backwards that add into `grad_HN` before the reduce launches (the micro-batches, or 1)."""
    keeps_copies: bool = True
    """False with re-materialization: the copies are freed after the forward."""
    gather: object = None
    """In-flight spAG handle, until waited."""
    held_HN: torch.Tensor | None = None
    """Materialized copies (owned included), rows = plan.gather.held_chunks."""
    grad_HN: torch.Tensor | None = None
    """Gradient of the held copies, summed over the backwards seen so far."""
    grads: int = 0
    """Backwards whose copies' gradient has arrived (`_Materialize`)."""
    backwards: int = 0
    """Backwards that reached the MoE input (`_BackwardTrigger`)."""
    regather: object = None
    """Re-materializing spAG handle (re-materialization), until waited."""
    calibration: tuple | None = None
    """(plan before calibration, extra SparseAllGather, its in-flight handle) when calibrated."""
    routed: bool = False
    """A pass has routed on these copies: calibration (which changes the plan) is over."""

    def wait_gather(self) -> torch.Tensor:
        """The copies of `plan` (after calibration's extra gather, if any)."""
        if self.held_HN is None:
            timer = self.layer.runtime.timer
            with timer.span("fssdp.wait.spag"):
                held_HN = self.gather.wait()
            self.gather = None
            if self.calibration is not None:
                before, extra_gather, extra = self.calibration
                with timer.span("fssdp.wait.spag_calibrate"):
                    extra_XN = extra.wait()
                held_HN = _merge_rows(self.plan, before, held_HN, extra_XN, extra_gather)
                self.calibration = None
            self.held_HN = held_HN
        return self.held_HN

    def rematerialized(self) -> torch.Tensor:
        """The copies for the backward (re-gathered with re-materialization)."""
        if self.keeps_copies:
            return self.held_HN
        if self.held_HN is None:
            if self.regather is None:
                self.regather = self.layer.runtime.launch_regather(self)
            with self.layer.runtime.timer.span("fssdp.wait.spag_remat"):
                self.held_HN = self.regather.wait()
            self.regather = None
        return self.held_HN

    def add_grad(self, grad_HN: torch.Tensor, dtype: torch.dtype) -> None:
        """Adds one backward's gradient of the copies (in `dtype`, the reduce's)."""
        if self.grad_HN is None:
            # a private buffer when later backwards add into it
            self.grad_HN = grad_HN.to(dtype=dtype, copy=self.passes > 1)
        else:
            self.grad_HN.add_(grad_HN.to(dtype))
        self.grads += 1


@dataclass
class LayerPass:
    """One forward (and its backward) of one MoE layer for one micro-batch."""

    layer: "FSSDPMoELayer"
    copies: LayerCopies
    """The copies this pass computes on (shared with the iteration's other micro-batches)."""
    below: "LayerPass | None" = None
    """The MoE layer below in the same forward pass (whose re-gather this layer launches)."""
    anchor: torch.Tensor | None = None
    """The MoE input; the copies are marked as computed from it so their gradient comes back."""
    copies_HN: torch.Tensor | None = None
    """The copies as the experts use them this forward (through `_Materialize` when training)."""
    tokens_ED: np.ndarray | None = None
    """This rank's tokens per (expert, destination) of the dispatch plan (kept for a replay)."""
    replaying: bool = False
    """The recompute's second forward of this pass (activation recompute)."""

    @property
    def plan(self):
        """The iteration's FSSDPLayerPlan of the copies (calibrated, if calibration gathered)."""
        return self.copies.plan


class _Materialize(torch.autograd.Function):
    """Marks the held copies as produced from the MoE input, so that their gradient [H, N]
    arrives here in the backward (after every expert of the layer has run its backward)."""

    @staticmethod
    def forward(ctx, anchor, held_HN, layer_pass):
        ctx.layer_pass = layer_pass
        return held_HN.view_as(held_HN)

    @staticmethod
    def backward(ctx, grad_HN):
        copies = ctx.layer_pass.copies
        copies.add_grad(grad_HN, copies.layer.runtime.reduce_dtype(grad_HN.dtype))
        return None, None, None


class _BackwardTrigger(torch.autograd.Function):
    """Identity on the MoE input whose backward starts the layer's gradient reduction."""

    @staticmethod
    def forward(ctx, hidden, layer_pass):
        ctx.layer_pass = layer_pass
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden):
        layer_pass = ctx.layer_pass
        layer_pass.layer.runtime.on_layer_backward(layer_pass)
        return grad_hidden, None


class FSSDPMoELayer(InstanceMoELayer):
    """Megatron MoELayer whose experts run on copies materialized by the FSSDP runtime."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, runtime=None):
        if runtime is None:
            raise ValueError("FSSDPMoELayer needs the FSSDP runtime (pass it through the layer spec's params)")
        super().__init__(config, submodules, layer_number, pg_collection, grouped_gemm=runtime.config.grouped_gemm)
        self.runtime = runtime
        self._pass: LayerPass | None = None
        self._replays: list[LayerPass] = []
        """Passes whose forward ran without autograd for activation recompute, oldest first; the
        recompute replays them in the same micro-batch order."""
        runtime.register_layer(self)

    # ---- forward stages ------------------------------------------------------------------

    def start_gather(self) -> None:
        """Launch spAG of this layer (called when the layer's attention starts); the recompute
        of a checkpointed forward takes up that forward's pass instead."""
        if mcore.recomputing() and self._replays:
            self._pass = self._replays.pop(0)
            self._pass.replaying = True
            return
        self._pass = self.runtime.start_pass(self)

    def enter(self, hidden_states):
        if self._pass is None:
            self.start_gather()
        layer_pass = self._pass
        layer_pass.anchor = hidden_states
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            return _BackwardTrigger.apply(hidden_states, layer_pass)
        return hidden_states

    def route_to_instances(self, routing_map_TE, probs_TE):
        layer_pass = self._pass
        if layer_pass.replaying:  # the router is deterministic: the same tokens as the first run
            return virtual_routing(routing_map_TE, probs_TE, layer_pass.tokens_ED)
        counts_E = routing_map_TE.sum(dim=0).to(torch.int64).cpu()
        counts_DE = self.runtime.all_gather_counts(counts_E)
        if self.runtime.config.calibrate and not layer_pass.copies.routed:
            # the first micro-batch's loads decide: later micro-batches compute on the same copies
            self.runtime.calibrate(layer_pass.copies, counts_DE)
        layer_pass.copies.routed = True
        started = time.perf_counter()
        plan = planner.dispatch(layer_pass.plan.placement, counts_DE, self.runtime.topology)
        if self.training:
            self.runtime.stats.planner_s["dispatch"] += time.perf_counter() - started
            self.runtime.stats.add_dispatch(layer_pass.plan.index, plan, counts_DE)
        layer_pass.tokens_ED = tokens_from_source(plan, self.runtime.rank)
        return virtual_routing(routing_map_TE, probs_TE, layer_pass.tokens_ED)

    def dispatch(self, hidden_states, probs):
        with nvtx_range("fssdp.dispatch", self.runtime.device):
            return super().dispatch(hidden_states, probs)

    def combine(self, output):
        with nvtx_range("fssdp.combine", self.runtime.device):
            return super().combine(output)

    def before_dispatch(self):
        layer_pass = self._pass
        copies = layer_pass.copies
        held_HN = copies.rematerialized() if layer_pass.replaying else copies.wait_gather()
        if torch.is_grad_enabled():
            held_HN = _Materialize.apply(layer_pass.anchor, held_HN, layer_pass)
        layer_pass.copies_HN = held_HN

    def compute_instances(self, tokens_ND, tokens_per_expert_E, probs_N):
        layer_pass = self._pass
        held_HN, layer_pass.copies_HN, layer_pass.anchor = layer_pass.copies_HN, None, None
        row_E = layer_pass.plan.held_row_E
        counts_E = tokens_per_expert_E.cpu().numpy()
        expert_G = np.flatnonzero(counts_E)
        missing = expert_G[row_E[expert_G] < 0]
        if missing.size:
            raise RuntimeError(
                f"rank {self.runtime.rank} received {counts_E[missing[0]]} tokens of expert {missing[0]} in layer "
                f"{self.layer_number} but holds no copy of it (dispatch and placement disagree)"
            )
        # Re-materialization frees the copies after the forward; a replay's backward follows at once.
        frees = not layer_pass.copies.keeps_copies and not layer_pass.replaying
        hooks = self._saved_copy_hooks(layer_pass.copies) if frees and torch.is_grad_enabled() else contextlib.nullcontext()
        counted = self.training and not layer_pass.replaying
        with hooks, self.runtime.timer.span("fssdp.experts" if counted else "fssdp.experts.untimed"):
            if held_HN.shape[0]:
                output_ND = self.run_instances(held_HN, row_E[expert_G], counts_E[expert_G], tokens_ND, probs_N)
            else:
                # No copy (re-sharding left this rank none of the layer's experts and the plan
                # gathers none): the empty output stays connected to the dispatched tokens so
                # that the backward's all-to-all still runs here.
                output_ND = tokens_ND * probs_N.unsqueeze(-1).to(tokens_ND.dtype)
        if counted:
            self.runtime.stats.expert_tokens += tokens_ND.shape[0]
        if frees:
            layer_pass.copies.held_HN = None  # freed: the backward (or the recompute) re-gathers
        if self.training and not torch.is_grad_enabled():
            self._replays.append(layer_pass)  # activation recompute runs this forward again
        self._pass = None
        return output_ND

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's, with the experts this rank's slots hold for this layer (after re-sharding
        any slot of the stage may), under the keys ep mode uses for them."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.runtime.table is None:
            return state  # not attached yet: the slots hold Megatron's layout
        experts_prefix = f"{prefix}experts."
        state = {key: value for key, value in state.items() if not key.startswith(experts_prefix)}
        held = self.runtime.held_experts(self, prefix)
        state.update(held_experts_sharded_state_dict(self.experts, experts_prefix, sharded_offsets, metadata, held))
        return state

    @staticmethod
    def _saved_copy_hooks(copies: LayerCopies):
        """Saved-tensor hooks that store views of the copies as markers (re-materialization)."""
        storage = copies.held_HN.untyped_storage().data_ptr()

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() == storage:
                return ("fssdp-copy", copies, tensor.size(), tensor.stride(), tensor.storage_offset())
            activations.note(tensor)  # these hooks hide the measuring ones (only the innermost apply)
            return tensor.detach()  # not the tensor itself: an op's saved output would reference its own grad_fn

        def unpack(packed):
            if isinstance(packed, tuple) and packed and packed[0] == "fssdp-copy":
                _, owner, size, stride, offset = packed
                return owner.rematerialized().as_strided(size, stride, offset)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _merge_rows(plan, before, held_HN: torch.Tensor, extra_XN: torch.Tensor, extra_gather) -> torch.Tensor:
    """Held rows of the calibrated `plan` from the first gather's rows and the extra gather's."""
    merged_HN = held_HN.new_empty((plan.gather.held_chunks.size, held_HN.shape[1]))
    old_chunks = before.gather.held_chunks
    merged_HN[torch.from_numpy(plan.held_row_E[old_chunks])] = held_HN
    new_chunks = extra_gather.held_chunks
    fresh = ~np.isin(new_chunks, old_chunks)
    merged_HN[torch.from_numpy(plan.held_row_E[new_chunks[fresh]])] = extra_XN[torch.from_numpy(np.flatnonzero(fresh))]
    return merged_HN
