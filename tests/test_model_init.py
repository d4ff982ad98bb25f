"""Expert weights depend only on (seed, layer, global expert id): never on EP, ETP or rank.

Every parallel mode and checkpoint relies on this (docs/design.md section 2), so it is checked on
real Megatron models built at world sizes 1 and 2 under EP=1, EP=2 and ETP=2.
"""

from __future__ import annotations

import numpy as np
import pytest

from support.mp import run_ranks

SMALL = [
    "--num-layers", "2", "--hidden-size", "16", "--ffn-hidden-size", "32", "--moe-ffn-hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "8", "--max-position-embeddings", "8", "--num-experts", "4", "--moe-router-topk", "2",
    "--mock-data", "--vocab-size", "100", "--disable-bias-linear", "--micro-batch-size", "4", "--train-iters", "200",
    "--lr", "1e-3",
]


def expert_weights(flags: list[str]) -> dict:
    """Worker: build the model on this rank; return its experts' fc1/fc2 shards by global id."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    from megatron_patches.compat import mcore, prepare_megatron
    from megatron_patches.training.arguments import parse_args
    from megatron_patches.training.validation import validate_args
    from megatron_patches.training.model import build_model, moe_layers

    args = validate_args(parse_args(SMALL + flags), dist.get_world_size())
    prepare_megatron(use_cuda=False)
    mcore.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.expert_model_parallel_size, args.expert_tensor_parallel_size,
    )
    mcore.seed_model_parallel_rng(args.seed)
    model, _ = build_model(args, vocab_size=128, on_gpu=False)
    out = {"etp_rank": parallel_state.get_expert_tensor_parallel_rank(), "experts": {}}
    for number, layer in moe_layers(model):
        for expert_id, expert in mcore.local_experts(layer):
            out["experts"][f"{number}:{expert_id}"] = [
                expert.linear_fc1.weight.detach().tolist(),
                expert.linear_fc2.weight.detach().tolist(),
            ]
    parallel_state.destroy_model_parallel()
    return out


def full_experts(results: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Reassemble every expert's full fc1 [ffn, h] and fc2 [h, ffn] from the ranks' shards."""
    shards: dict[str, list] = {}
    for result in sorted(results, key=lambda r: r["etp_rank"]):
        for key, (fc1, fc2) in result["experts"].items():
            shards.setdefault(key, []).append((np.array(fc1), np.array(fc2)))
    return {
        key: (np.concatenate([s[0] for s in parts], axis=0), np.concatenate([s[1] for s in parts], axis=1))
        for key, parts in shards.items()
    }


@pytest.mark.multirank
def test_expert_init_is_placement_independent():
    reference = full_experts(run_ranks(1, __file__, "expert_weights", 120, args=([],)))
    assert sorted(reference) == [f"{layer}:{e}" for layer in (1, 2) for e in range(4)]
    # Distinct experts and layers get distinct weights (the seed really depends on both).
    flat = [reference[key][0].ravel()[:4].tolist() for key in sorted(reference)]
    assert len({tuple(x) for x in flat}) == len(flat)
    fc1, fc2 = reference["1:0"]
    assert fc1.shape == (32, 16) and fc2.shape == (16, 32)
    # Megatron's init distributions: N(0, 0.02) and the scaled N(0, 0.02 / sqrt(2 L)).
    assert np.std(np.concatenate([reference[k][0].ravel() for k in reference])) == pytest.approx(0.02, rel=0.1)
    assert np.std(np.concatenate([reference[k][1].ravel() for k in reference])) == pytest.approx(0.01, rel=0.1)

    ep2 = run_ranks(2, __file__, "expert_weights", 120, args=(["--expert-model-parallel-size", "2"],))
    assert [sorted(r["experts"]) for r in ep2] == [["1:0", "1:1", "2:0", "2:1"], ["1:2", "1:3", "2:2", "2:3"]]
    etp2 = run_ranks(
        2, __file__, "expert_weights", 120,
        args=(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2",
               "--expert-model-parallel-size", "1"],),
    )
    for name, layout in (("ep2", full_experts(ep2)), ("etp2", full_experts(etp2))):
        assert sorted(layout) == sorted(reference), name
        for key in reference:
            np.testing.assert_array_equal(layout[key][0], reference[key][0], err_msg=f"{name} {key} fc1")
            np.testing.assert_array_equal(layout[key][1], reference[key][1], err_msg=f"{name} {key} fc2")
