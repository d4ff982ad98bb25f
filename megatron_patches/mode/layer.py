"""The placement modes' shared MoE layer: Megatron-Core's MoE layer and all-to-all dispatcher
extended for expert *instances* (they subclass Megatron's classes, so they are re-verified with
compat/ on an upgrade: tests/training/test_mode_interface.py, tests/compat/test_grouped_gemm.py).

Megatron's MoE layer sends every token of expert e to the one EP rank that hosts e. The
placement modes (fssdp, replicate) run several instances of an expert on several ranks and
decide per token which instance processes it. Both reuse Megatron's all-to-all dispatcher
unchanged in its mechanics by giving it *virtual experts*:

    virtual expert v = d * E + e   means   "expert e, processed on EP rank d"

Every rank hosts E virtual experts (d = its EP rank), so Megatron's permutation, count
exchange, all-to-all and sorting by local expert route each token copy to the rank the mode
chose, and the tokens arrive grouped by expert id. A mode only routes each (token, expert)
pair to one virtual expert (`comm.virtual.VirtualRouting`, kept sparse: O(T x top-k), where
Megatron's dense routing map would be [T, D*E]; `InstanceTokenDispatcher.dispatch_preprocess`
takes it in the map's place) and computes the experts on the weights it materialized.

`InstanceMoELayer` keeps Megatron's stages (route, preprocess, dispatch, experts, combine,
postprocess) and exposes four hooks for the mode:

- `enter(hidden)`: at the MoE input (forward), may wrap it (backward triggers);
- `route_to_instances(routing_map_TE, probs_TE)`: -> a `comm.virtual.VirtualRouting`;
- `before_dispatch()`: right before the token all-to-all (wait for materialized weights);
- `compute_instances(tokens_ND, tokens_per_expert_E, probs_N)`: the experts on the
  dispatched tokens, sorted by expert id.

Megatron's own experts module (`self.experts`, SequentialMLP) stays in the layer: its local
experts are the parameters this rank *owns* (EP's contiguous layout), which DDP, the
optimizer and the distributed checkpoints handle exactly as in ep mode. Shared experts
(`--moe-shared-expert-intermediate-size`) are Megatron's stage of the layer, unchanged: dense and
data-parallel, on every token of this rank, added to the routed experts' output in
`postprocess`, their gradients reduced by DDP with the other dense parameters.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod

import numpy as np
import torch
from torch.func import functional_call

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_patches.compat import grouped

__all__ = ["ExpertLayout", "InstanceMoELayer", "InstanceTokenDispatcher", "set_aux_loss_scale", "with_moe_layer"]


class InstanceTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher over virtual experts v = rank * E + e (see module doc)."""

    def __init__(self, num_experts: int, config, pg_collection):
        ep_rank, ep_size = pg_collection.ep.rank(), pg_collection.ep.size()
        local = list(range(ep_rank * num_experts, (ep_rank + 1) * num_experts))
        super().__init__(num_experts, local, config=config, pg_collection=pg_collection)
        # Megatron sizes its count exchange and its sort-by-local-expert permutation from
        # num_experts (token_dispatcher.py:390-415 in 0.16.1); rebuild both for D*E columns.
        self.num_experts = ep_size * num_experts
        chunk_idxs = torch.arange(self.num_experts * self.tp_size, device=self.permute_idx_device)
        self.sort_input_by_local_experts = chunk_idxs.reshape(-1, self.num_local_experts).T.ravel()
        self.restore_output_by_local_experts = chunk_idxs.reshape(self.num_local_experts, -1).T.ravel()

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map, probs: torch.Tensor):
        """Megatron's dispatch_preprocess (token_dispatcher.py:592 in 0.16.1) on a sparse
        `comm.virtual.VirtualRouting` instead of a dense [T, D*E] routing map (`probs` are its
        per-copy `probs_K`; compat sits below comm, so the routing is recognised by its fields).
        Megatron's `preprocess` reads a routing map's size(0) and sum(dim=0) only, which the
        routing provides; permutation 1 is the index_select Megatron's `permute` does with
        the sorted indices it derives from the dense map, which the routing holds already
        (`token_K`; tests/fssdp/test_fssdp_routing.py checks the two agree). The combine's unpermute
        uses those indices alone (it reads the map only to apply probs, which it is not given)."""
        if not hasattr(routing_map, "token_K"):
            raise TypeError(f"InstanceTokenDispatcher routes a comm.virtual.VirtualRouting, got {type(routing_map).__name__}")
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        self.reversed_local_input_permutation_mapping = routing_map.token_K
        return hidden_states.index_select(0, routing_map.token_K), probs


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How one expert's parameters pack into a flat row of N elements (one chunk of the sparse collectives)."""

    names: tuple[str, ...]
    """Parameter names inside one expert MLP (e.g. linear_fc1.weight), in packing order."""
    shapes: tuple[torch.Size, ...]
    """Shape of each parameter."""

    @classmethod
    def of(cls, expert: torch.nn.Module) -> "ExpertLayout":
        named = list(expert.named_parameters())
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named))

    @property
    def numel(self) -> int:
        """N, elements per expert."""
        return sum(s.numel() for s in self.shapes)

    def flatten(self, expert: torch.nn.Module) -> torch.Tensor:
        """The expert's parameters as one detached row [N]."""
        params = dict(expert.named_parameters())
        return torch.cat([params[n].detach().reshape(-1) for n in self.names])

    def views(self, row_N: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter name -> view of `row_N` with the parameter's shape."""
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            out[name] = row_N[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        return out

    def stacked(self, rows_RN: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter `name` of every row of `rows_RN` [R, N] as one strided view [R, *shape]
        (no copy: the grouped GEMM reads the rows where they are)."""
        offset = 0
        for own, shape in zip(self.names, self.shapes):
            if own == name:
                return rows_RN[:, offset : offset + shape.numel()].view(rows_RN.shape[0], *shape)
            offset += shape.numel()
        raise KeyError(f"no parameter {name!r} in an expert (has {', '.join(self.names)})")

    def grads_into(self, expert: torch.nn.Module, grad_N: torch.Tensor) -> None:
        """Adds a flat gradient row into the expert's `main_grad` (Megatron DDP's grad buffer)."""
        params = dict(expert.named_parameters())
        for name, view in self.views(grad_N).items():
            params[name].main_grad.add_(view.to(params[name].main_grad.dtype))


class InstanceMoELayer(MoELayer):
    """Megatron's MoELayer with the token dispatch and expert compute of expert instances.

    Subclasses implement the two abstract hooks (and may override `enter` and
    `before_dispatch`, which do nothing here); MoELayer's base class is an ABC, so a subclass
    missing one cannot be built. Refused at construction (the virtual-expert dispatch and the
    instance copies need them off): dispatchers other than alltoall, padding to capacity,
    latent projections, MoE recompute; with grouped GEMM also biases and a GLU
    clamp or offset (Megatron's GroupedMLP has neither). Expert tensor parallelism works
    unchanged: an instance's weights are this rank's ETP shard of the expert (the local
    modules' shapes), Megatron's EP group holds one ETP rank, and the dispatcher's all-gather /
    reduce-scatter over the ETP group runs around the instances as around ep's experts.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, grouped_gemm: bool = False):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection)
        unsupported = {
            f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} (needs 'alltoall')": config.moe_token_dispatcher_type != "alltoall",
            "moe_pad_expert_input_to_capacity": config.moe_pad_expert_input_to_capacity,
            "moe_latent_size": bool(config.moe_latent_size),
            "MoE recompute": self.moe_layer_recompute,
            "grouped GEMM experts (packed weights)": not hasattr(self.experts, "local_experts"),
            "biases with grouped GEMM (as Megatron's GroupedMLP)": grouped_gemm and config.add_bias_linear,
            "GLU clamp or offset with grouped GEMM": grouped_gemm and (
                config.activation_func_clamp_value is not None or config.glu_linear_offset != 0
            ),
        }
        refused = [name for name, on in unsupported.items() if on]
        if refused:
            raise ValueError(f"{type(self).__name__} does not support: {', '.join(refused)}")
        self.num_experts = config.num_moe_experts
        """E, experts of this layer."""
        self.token_dispatcher = InstanceTokenDispatcher(self.num_experts, config, pg_collection)
        self.expert_layout = ExpertLayout.of(self.experts.local_experts[0])
        """Packing of one expert's parameters into a row (same for every expert)."""
        self.grouped_gemm = grouped_gemm
        """Run a pass's instances as one grouped GEMM (`run_instances`), not one MLP each."""

    # ---- hooks for the mode -------------------------------------------------------------

    def enter(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    @abstractmethod
    def route_to_instances(self, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor):
        """Each routed (token, expert) to one instance: a `comm.virtual.VirtualRouting`
        (`comm.virtual.virtual_routing`)."""

    def before_dispatch(self) -> None:
        pass

    @abstractmethod
    def compute_instances(self, tokens_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, probs_N: torch.Tensor):
        """Expert outputs [N, D] for the dispatched tokens, which arrive sorted by expert id."""

    # ---- Megatron's stages, with the hooks ----------------------------------------------

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        return super().forward(self.enter(hidden_states), intermediate_tensors, padding_mask)

    def preprocess(self, hidden_states, probs, routing_map):
        routing = self.route_to_instances(routing_map, probs)
        return super().preprocess(hidden_states, routing.probs_K, routing)

    def dispatch(self, hidden_states, probs):
        self.before_dispatch()
        return super().dispatch(hidden_states, probs)

    def routed_experts_compute(self, hidden_states, probs):
        tokens_ND, tokens_per_expert_E, probs_N = self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
        output_ND = self.compute_instances(tokens_ND, tokens_per_expert_E, probs_N)
        return self.token_dispatcher.combine_preprocess(output_ND), None

    def run_expert(self, row_N: torch.Tensor, tokens_nD: torch.Tensor, probs_n: torch.Tensor) -> torch.Tensor:
        """One expert MLP (Megatron's own module and ops) on the weights packed in `row_N`."""
        output, _ = functional_call(self.experts.local_experts[0], self.expert_layout.views(row_N), (tokens_nD, probs_n))
        return output

    def run_instances(self, rows_RN: torch.Tensor, row_G: np.ndarray, counts_G: np.ndarray,
                      tokens_ND: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        """Expert outputs [N, D] of consecutive token groups: group g (counts_G[g] tokens) runs on
        the weights packed in rows_RN[row_G[g]]; no two groups share a row.

        Per instance: Megatron's MLP module once per group (`run_expert`). Grouped GEMM: two
        grouped matmuls over every row of `rows_RN` (strided views, no weight copy; rows without
        tokens get empty groups), with the groups' tokens first put in row order. A rank without
        tokens still runs (an empty batch), so its backward joins the all-to-alls like the others'.
        """
        if not self.grouped_gemm:
            outputs = [
                self.run_expert(rows_RN[row], tokens_nD, probs_n)
                for row, tokens_nD, probs_n in zip(row_G, torch.split(tokens_ND, counts_G.tolist()),
                                                    torch.split(probs_N, counts_G.tolist()))
                if tokens_nD.shape[0]
            ]
            return torch.cat(outputs) if outputs else self.run_expert(rows_RN[0], tokens_ND, probs_N)
        order_G = np.argsort(row_G, kind="stable")
        counts_R = np.zeros(rows_RN.shape[0], dtype=np.int64)
        counts_R[row_G] = counts_G
        ends_R = torch.as_tensor(np.cumsum(counts_R), dtype=torch.int32, device=tokens_ND.device)
        if np.array_equal(order_G, np.arange(len(row_G))):
            return self._grouped_mlp(rows_RN, tokens_ND, probs_N, ends_R)
        # the groups' token ranges, taken in row order, and the way back
        starts_G = np.cumsum(counts_G) - counts_G
        to_rows_N = torch.as_tensor(
            np.concatenate([np.arange(starts_G[g], starts_G[g] + counts_G[g]) for g in order_G]), device=tokens_ND.device
        )
        back_N = torch.empty_like(to_rows_N)
        back_N[to_rows_N] = torch.arange(to_rows_N.numel(), device=tokens_ND.device)
        output_ND = self._grouped_mlp(rows_RN, tokens_ND.index_select(0, to_rows_N), probs_N.index_select(0, to_rows_N), ends_R)
        return output_ND.index_select(0, back_N)

    def _grouped_mlp(self, rows_RN, tokens_ND, probs_N, ends_R) -> torch.Tensor:
        """Megatron's expert MLP without biases (what its GroupedMLP computes) over all rows:
        fc1, activation (GLU: act(first half) x second half) times the token's probability in the
        activation's dtype, fc2."""
        config = self.config
        fc1_RFH = self.expert_layout.stacked(rows_RN, "linear_fc1.weight")
        fc2_RHF = self.expert_layout.stacked(rows_RN, "linear_fc2.weight")
        hidden_NF = grouped.grouped_mm(tokens_ND, fc1_RFH.transpose(1, 2), ends_R)
        if config.gated_linear_unit:
            gate_NF, linear_NF = torch.chunk(hidden_NF, 2, dim=-1)
            hidden_NF = config.activation_func(gate_NF) * linear_NF
        else:
            hidden_NF = config.activation_func(hidden_NF)
        hidden_NF = (hidden_NF * probs_N.unsqueeze(-1)).to(hidden_NF.dtype)
        return grouped.grouped_mm(hidden_NF, fc2_RHF.transpose(1, 2), ends_R)


def set_aux_loss_scale(scale: torch.Tensor) -> None:
    """The factor the routers' auxiliary-loss gradient gets in the next backward (Megatron's
    schedule sets it per micro-batch; zebra runs its own schedule)."""
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def with_moe_layer(layer_spec, moe_class: type, **params):
    """A copy of a transformer layer spec whose MLP (Megatron's MoELayer) is `moe_class`.

    `params` are passed to `moe_class.__init__` as keyword arguments by Megatron's build_module.
    """
    mlp = layer_spec.submodules.mlp
    if not (isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer)):
        raise ValueError(f"the layer spec's MLP is {mlp.module!r}, not Megatron's MoELayer")
    new_mlp = dataclasses.replace(mlp, module=moe_class, params={**mlp.params, **params})
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=new_mlp))
