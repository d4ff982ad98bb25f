"""Token copies to the instance holders a plan chose, as Megatron routing over virtual experts.

`compat.moe.InstanceTokenDispatcher` runs Megatron's all-to-all over virtual experts
v = d * E + e ("expert e, processed on rank d"). A mode decides per source how many token
copies of each expert go to each rank (`tokens_from_source` of a `placement` DispatchPlan);
`virtual_routing` turns that split into the [T, D*E] routing map and probabilities Megatron's
dispatcher consumes. Used by fssdp and replicate alike.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_patches.placement.types import DispatchPlan

__all__ = ["tokens_from_source", "virtual_routing"]


def tokens_from_source(plan: DispatchPlan, source: int, tokens_K: np.ndarray | None = None) -> np.ndarray:
    """Tokens `source` sends per (expert, destination device) under `plan`; int64 [E, D].

    tokens_K replaces the plan's token counts per entry (e.g. `TokenSpread.kept_K`, the part
    of each transfer that survives the receiver's capacity).
    """
    tokens_K = plan.tokens_K if tokens_K is None else tokens_K
    mine = plan.source_K == source
    tokens_ED = np.zeros((plan.num_experts, plan.num_devices), dtype=np.int64)
    np.add.at(tokens_ED, (plan.expert_K[mine], plan.dest_K[mine]), tokens_K[mine])
    return tokens_ED


def virtual_routing(routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, tokens_ED: np.ndarray):
    """Routing map and probs over virtual experts v = d*E + e from a per-expert destination split.

    The token copies of expert e, in token order, go to the destinations in ascending device
    order: the first tokens_ED[e, 0] to device 0, the next tokens_ED[e, 1] to device 1, ...

    Args:
        routing_map_TE: bool [T, E], Megatron's routing map on this source.
        probs_TE: float [T, E], the routing probabilities (0 where not routed).
        tokens_ED: int [E, D], this source's tokens per (expert, destination); row sums must
            equal routing_map_TE's column sums.
    Returns:
        (routing_map_TV bool [T, D*E], probs_TV [T, D*E]).
    """
    T, E = routing_map_TE.shape
    D = tokens_ED.shape[1]
    counts_E = routing_map_TE.sum(dim=0).cpu().numpy()
    if not np.array_equal(tokens_ED.sum(axis=1), counts_E):
        raise RuntimeError(f"dispatch plan sends {tokens_ED.sum(axis=1).tolist()} tokens per expert, routed {counts_E.tolist()}")
    device = routing_map_TE.device
    # dest_of_copy[offset_E[e] + i] = destination of the i-th routed token of expert e
    dest_of_copy = torch.from_numpy(np.repeat(np.tile(np.arange(D), E), tokens_ED.ravel())).to(device)
    offset_E = torch.from_numpy(np.cumsum(counts_E) - counts_E).to(device)
    rank_TE = routing_map_TE.to(torch.int64).cumsum(dim=0) - 1
    token_K, expert_K = routing_map_TE.nonzero(as_tuple=True)
    dest_K = dest_of_copy[offset_E[expert_K] + rank_TE[token_K, expert_K]]
    column_K = dest_K * E + expert_K
    routing_map_TV = torch.zeros((T, D * E), dtype=torch.bool, device=device)
    routing_map_TV[token_K, column_K] = True
    probs_TV = probs_TE.new_zeros((T, D * E))
    probs_TV[token_K, column_K] = probs_TE[token_K, expert_K]
    return routing_map_TV, probs_TV
