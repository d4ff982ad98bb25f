"""Token copies to the instance holders a plan chose, as Megatron routing over virtual experts.

`mode.layer.InstanceTokenDispatcher` runs Megatron's all-to-all over virtual experts
v = d * E + e ("expert e, processed on rank d"). A mode decides per source how many token
copies of each expert go to each rank (`tokens_from_source` of a `placement` DispatchPlan);
`virtual_routing` turns that split into a `VirtualRouting`: the routed (token, expert) copies
in the order Megatron's permutation puts them (by virtual expert, tokens ascending within
one), with their probabilities and the count per virtual expert. That is O(tokens x top-k);
Megatron's own form, a dense [T, D*E] routing map, would be 2 GB per layer at 8192 tokens,
D = 1024 and E = 256. Used by fssdp and replicate alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_patches.placement.types import DispatchPlan

__all__ = ["VirtualRouting", "tokens_from_source", "virtual_routing"]


def tokens_from_source(plan: DispatchPlan, source: int, tokens_K: np.ndarray | None = None) -> np.ndarray:
    """Tokens `source` sends per (expert, destination device) under `plan`; int64 [E, D].

    tokens_K replaces the plan's token counts per entry (e.g. `TokenSpread.kept_K`, the part
    of each transfer that survives the receiver's capacity).
    """
    tokens_ED = np.zeros((plan.num_experts, plan.num_devices), dtype=np.int64)
    if tokens_K is None:
        expert_K, dest_K, mine_K = plan.source_row(source)
    else:
        mine = plan.source_K == source
        expert_K, dest_K, mine_K = plan.expert_K[mine], plan.dest_K[mine], tokens_K[mine]
    np.add.at(tokens_ED, (expert_K, dest_K), mine_K)
    return tokens_ED


@dataclass(frozen=True)
class VirtualRouting:
    """One source's routed token copies over virtual experts v = d*E + e, sparse.

    K = routed (token, expert) pairs = T x top-k in dropless routing (fewer after drops).
    """

    num_tokens: int
    """T, tokens on this source."""
    token_K: torch.Tensor
    """Token of each copy, int64 [K], sorted by (virtual expert, token): exactly the
    `sorted_indices` Megatron's `permute` derives from a dense routing map."""
    virtual_K: torch.Tensor
    """Virtual expert of each copy, int64 [K], ascending."""
    probs_K: torch.Tensor
    """Routing probability of each copy, [K] (gradients flow back to the router's probs)."""
    counts_V: torch.Tensor
    """Copies per virtual expert, int64 [D*E]."""

    def size(self, dim: int) -> int:
        """Shape of the dense routing map this stands for, [T, D*E] (what Megatron's dispatcher
        reads of a routing map besides its column sums; `mode.layer.InstanceTokenDispatcher`)."""
        return (self.num_tokens, self.counts_V.numel())[dim]

    def sum(self, dim: int) -> torch.Tensor:
        """Column sums of the dense routing map: copies per virtual expert (dim must be 0)."""
        if dim != 0:
            raise ValueError(f"VirtualRouting sums over tokens only (dim 0), got dim={dim}")
        return self.counts_V


def virtual_routing(routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, tokens_ED: np.ndarray) -> VirtualRouting:
    """Routing over virtual experts v = d*E + e from a per-expert destination split.

    The token copies of expert e, in token order, go to the destinations in ascending device
    order: the first tokens_ED[e, 0] to device 0, the next tokens_ED[e, 1] to device 1, ...

    Args:
        routing_map_TE: bool [T, E], Megatron's routing map on this source.
        probs_TE: float [T, E], the routing probabilities (0 where not routed).
        tokens_ED: int [E, D], this source's tokens per (expert, destination); row sums must
            equal routing_map_TE's column sums.
    """
    T, E = routing_map_TE.shape
    D = tokens_ED.shape[1]
    counts_E = routing_map_TE.sum(dim=0).cpu().numpy()
    if not np.array_equal(tokens_ED.sum(axis=1), counts_E):
        raise RuntimeError(f"dispatch plan sends {tokens_ED.sum(axis=1).tolist()} tokens per expert, routed {counts_E.tolist()}")
    device = routing_map_TE.device
    # expert-major copies: token_K ascending within each expert, so the i-th copy of expert e is
    # its i-th routed token
    expert_K, token_K = routing_map_TE.T.nonzero(as_tuple=True)
    # dest_K[k] = destination of copy k (expert e's copies split over devices in ascending order)
    dest_K = torch.from_numpy(np.repeat(np.tile(np.arange(D), E), tokens_ED.ravel())).to(device)
    virtual_K = dest_K * E + expert_K
    order_K = torch.argsort(virtual_K, stable=True)  # by virtual expert, token order kept within one
    token_K, expert_K, virtual_K = token_K[order_K], expert_K[order_K], virtual_K[order_K]
    counts_V = torch.from_numpy(tokens_ED.T.reshape(-1).copy()).to(device)
    return VirtualRouting(T, token_K, virtual_K, probs_TE[token_K, expert_K], counts_V)
