"""The fssdp and replicate layers' per-token routing to expert instances (`comm.virtual.virtual_routing`),
checked against Megatron's own permutation of the dense [T, D*E] routing map it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute

from megatron_patches.comm.virtual import virtual_routing


def random_case(rng, T: int, E: int, D: int, topk: int):
    scores = torch.from_numpy(rng.random((T, E)))
    top = scores.topk(topk, dim=1).indices
    routing_TE = torch.zeros((T, E), dtype=torch.bool).scatter_(1, top, True)
    probs_TE = torch.where(routing_TE, scores, torch.zeros_like(scores)).float()
    counts_E = routing_TE.sum(0).numpy()
    # split every expert's tokens over a random subset of devices
    tokens_ED = np.zeros((E, D), dtype=np.int64)
    for e in range(E):
        cuts = np.sort(rng.integers(0, counts_E[e] + 1, size=D - 1))
        tokens_ED[e] = np.diff(np.concatenate([[0], cuts, [counts_E[e]]]))
    return routing_TE, probs_TE, tokens_ED


def dense(routing, E: int):
    """The [T, D*E] routing map and probs the sparse routing stands for (reference only)."""
    T, V = routing.size(0), routing.size(1)
    map_TV = torch.zeros((T, V), dtype=torch.bool)
    map_TV[routing.token_K, routing.virtual_K] = True
    probs_TV = torch.zeros((T, V))
    probs_TV[routing.token_K, routing.virtual_K] = routing.probs_K
    return map_TV, probs_TV


@pytest.mark.parametrize("seed", range(20))
def test_every_token_copy_goes_to_exactly_one_instance_in_megatrons_order(seed):
    rng = np.random.default_rng(seed)
    T, E, D, topk = int(rng.integers(1, 60)), int(rng.integers(2, 9)), int(rng.integers(1, 6)), 2
    topk = min(topk, E)
    routing_TE, probs_TE, tokens_ED = random_case(rng, T, E, D, topk)
    routing = virtual_routing(routing_TE, probs_TE, tokens_ED)
    assert routing.size(0) == T and routing.size(1) == D * E and routing.token_K.numel() == T * topk
    map_TV, probs_TV = dense(routing, E)
    map_TDE = map_TV.view(T, D, E)
    # one instance per routed (token, expert), none for the others
    assert torch.equal(map_TDE.sum(dim=1), routing_TE.to(torch.int64))
    # the split per (expert, device) is the plan's, and so are the counts Megatron's preprocess reads
    assert np.array_equal(map_TDE.sum(dim=0).numpy().T, tokens_ED)
    assert torch.equal(routing.sum(dim=0), map_TV.sum(dim=0))
    # probabilities move with their token copy, unchanged
    assert torch.equal(probs_TV.view(T, D, E).sum(dim=1), probs_TE)
    # within an expert, tokens go to destinations in ascending device order
    for e in range(E):
        dest_of_token = map_TDE[:, :, e].to(torch.int64).argmax(dim=1)[routing_TE[:, e]]
        assert torch.all(dest_of_token[1:] >= dest_of_token[:-1])
    # Megatron's permutation of the dense map takes the copies in exactly this order
    tokens_TH = torch.randn(T, 3)
    permuted, permuted_probs, sorted_indices = permute(tokens_TH, map_TV, probs=probs_TV)
    assert torch.equal(sorted_indices, routing.token_K)
    assert torch.equal(permuted_probs, routing.probs_K)
    assert torch.equal(permuted, tokens_TH.index_select(0, routing.token_K))


def test_gradients_reach_the_router_probabilities():
    rng = np.random.default_rng(1)
    routing_TE, probs_TE, tokens_ED = random_case(rng, 12, 4, 3, 2)
    probs_TE.requires_grad_(True)
    routing = virtual_routing(routing_TE, probs_TE, tokens_ED)
    weights_K = torch.arange(routing.probs_K.numel(), dtype=torch.float32)
    (routing.probs_K * weights_K).sum().backward()
    expected = torch.zeros_like(probs_TE)
    expected[routing.token_K, routing.virtual_K % 4] = weights_K
    assert torch.equal(probs_TE.grad, expected)


def test_plan_that_disagrees_with_the_routing_is_refused():
    rng = np.random.default_rng(0)
    routing_TE, probs_TE, tokens_ED = random_case(rng, 16, 4, 2, 2)
    with pytest.raises(ValueError, match="sums over tokens only"):
        virtual_routing(routing_TE, probs_TE, tokens_ED).sum(dim=1)
    tokens_ED[0, 0] += 1
    with pytest.raises(RuntimeError, match="dispatch plan sends"):
        virtual_routing(routing_TE, probs_TE, tokens_ED)
