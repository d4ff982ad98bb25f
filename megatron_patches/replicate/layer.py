"""The replicate-mode MoE layer: Megatron's MoELayer running its experts on replicated slots.

Forward of one MoE layer, one micro-batch:

    route (Megatron's router)  -> route_to_instances: the runtime all-reduces the per-source
                                  counts, spreads every rank's tokens over the instances of
                                  their class under the capacity (`placement.replicate.
                                  spread_tokens`), drops what will not fit, and returns this
                                  source's split -> virtual routing map
    dispatch (Megatron a2a)    -> compute_instances: Megatron's expert MLP on each slot's row
    combine (Megatron a2a)

The slot rows are views of the runtime's slot buffer [s, N] (a leaf tensor outside the
module), so the experts' weight gradients accumulate per slot; the runtime reduces them after
the backward. Megatron's own local experts stay in the module frozen: they are the source of
the initial weights and the checkpoint form, not trained here.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_patches.comm.virtual import virtual_routing
from megatron_patches.mode.layer import InstanceMoELayer

__all__ = ["ReplicateMoELayer", "drop_routes"]


class ReplicateMoELayer(InstanceMoELayer):
    """Megatron MoELayer whose experts run on the slots the replicate runtime placed."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, runtime=None):
        if runtime is None:
            raise ValueError("ReplicateMoELayer needs the replicate runtime (pass it through the layer spec's params)")
        super().__init__(config, submodules, layer_number, pg_collection, grouped_gemm=runtime.config.grouped_gemm)
        # Frozen before DDP wraps the model: no grad buffer, no optimizer state for them.
        self.experts.requires_grad_(False)
        self.runtime = runtime
        runtime.register_layer(self)

    def route_to_instances(self, routing_map_TE, probs_TE):
        counts_E = routing_map_TE.sum(dim=0).to(torch.int64)
        tokens_ED = self.runtime.route(self, counts_E)
        kept_E = tokens_ED.sum(axis=1)
        if not np.array_equal(kept_E, counts_E.cpu().numpy()):
            routing_map_TE, probs_TE = drop_routes(routing_map_TE, probs_TE, kept_E)
        return virtual_routing(routing_map_TE, probs_TE, tokens_ED)

    def compute_instances(self, tokens_ND, tokens_per_expert_E, probs_N):
        slots = self.runtime.experts[self.layer_number].slots
        slot_expert_S = slots.slot_expert_S
        counts_E = tokens_per_expert_E.cpu().numpy()
        slot_G, count_G = [], []
        for expert in np.flatnonzero(counts_E):
            slot_J = np.flatnonzero(slot_expert_S == expert)
            if slot_J.size == 0:
                raise RuntimeError(
                    f"rank {slots.rank} received {counts_E[expert]} tokens of expert {expert} in layer "
                    f"{self.layer_number} but none of its slots holds it (dispatch and placement disagree)"
                )
            # The class's tokens split evenly over its slots here: each instance stays within its capacity.
            sizes_J = np.full(slot_J.size, counts_E[expert] // slot_J.size)
            sizes_J[: counts_E[expert] % slot_J.size] += 1
            slot_G.extend(slot_J[sizes_J > 0])
            count_G.extend(sizes_J[sizes_J > 0])
        return self.run_instances(slots.slots_SN, np.asarray(slot_G, dtype=np.int64),
                                  np.asarray(count_G, dtype=np.int64), tokens_ND, probs_N)


def drop_routes(routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, kept_E: np.ndarray):
    """Keep the first kept_E[e] routed tokens of every expert e (token order); drop the rest.

    A dropped (token, expert) pair leaves the routing map and its probability becomes 0, so
    the token gets no output from that expert and passes through the residual, as a token
    over capacity does in Megatron.
    """
    rank_TE = routing_map_TE.to(torch.int64).cumsum(dim=0) - 1
    keep_TE = routing_map_TE & (rank_TE < torch.from_numpy(kept_E).to(rank_TE.device))
    return keep_TE, probs_TE * keep_TE
