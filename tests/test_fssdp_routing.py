"""The FSSDP layer's per-token routing to expert instances (`comm.virtual.virtual_routing`, used by the fssdp and replicate layers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("seed", range(20))
def test_every_token_copy_goes_to_exactly_one_instance_in_token_order(seed):
    rng = np.random.default_rng(seed)
    T, E, D, topk = int(rng.integers(1, 60)), int(rng.integers(2, 9)), int(rng.integers(1, 6)), 2
    topk = min(topk, E)
    routing_TE, probs_TE, tokens_ED = random_case(rng, T, E, D, topk)
    routing_TV, probs_TV = virtual_routing(routing_TE, probs_TE, tokens_ED)
    assert routing_TV.shape == (T, D * E) and probs_TV.shape == (T, D * E)
    routing_TDE = routing_TV.view(T, D, E)
    # one instance per routed (token, expert), none for the others
    assert torch.equal(routing_TDE.sum(dim=1), routing_TE.to(torch.int64))
    # the split per (expert, device) is the plan's
    assert np.array_equal(routing_TDE.sum(dim=0).numpy().T, tokens_ED)
    # probabilities move with their token copy, unchanged
    assert torch.equal(probs_TV.view(T, D, E).sum(dim=1), probs_TE)
    assert torch.all(probs_TV[~routing_TV] == 0)
    # within an expert, tokens go to destinations in ascending device order
    for e in range(E):
        dest_of_token = routing_TDE[:, :, e].to(torch.int64).argmax(dim=1)[routing_TE[:, e]]
        assert torch.all(dest_of_token[1:] >= dest_of_token[:-1])


def test_plan_that_disagrees_with_the_routing_is_refused():
    rng = np.random.default_rng(0)
    routing_TE, probs_TE, tokens_ED = random_case(rng, 16, 4, 2, 2)
    tokens_ED[0, 0] += 1
    with pytest.raises(RuntimeError, match="dispatch plan sends"):
        virtual_routing(routing_TE, probs_TE, tokens_ED)
