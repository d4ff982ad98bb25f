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


def built(flags: list[str]):
    """In a worker: (args, model, config) of SMALL + `flags` on this rank's groups, seeded as the
    training loop seeds (the same dense weights on every rank)."""
    import torch
    import torch.distributed as dist

    from megatron_patches.compat import mcore, prepare_megatron
    from megatron_patches.training.arguments import parse_args
    from megatron_patches.training.validation import validate_args
    from megatron_patches.training.model import build_model

    args = validate_args(parse_args(SMALL + flags), dist.get_world_size())
    prepare_megatron(use_cuda=False)
    mcore.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.expert_model_parallel_size, args.expert_tensor_parallel_size,
    )
    torch.manual_seed(args.seed)
    mcore.seed_model_parallel_rng(args.seed)
    (model,), config = build_model(args, vocab_size=128, on_gpu=False)
    return args, model, config


def expert_weights(flags: list[str]) -> dict:
    """Worker: build the model on this rank; return its experts' fc1/fc2 shards by global id."""
    from megatron.core import parallel_state

    from megatron_patches.compat import mcore
    from megatron_patches.training.model import moe_layers

    _, model, _ = built(flags)
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


# Megatron-LM's attention and norm flags, each changing the built model (module docstring of
# config/models.py; count_parameters must follow the query/key norms and the QKV bias).
SHAPED = ["--position-embedding-type", "rope", "--rotary-percent", "0.5", "--rotary-interleaved",
          "--rotary-seq-len-interpolation-factor", "2", "--qk-layernorm", "--add-qkv-bias", "--norm-epsilon", "1e-6"]


def shaped_models(flag_sets: list[list[str]]) -> list[dict]:
    """Worker: one spawn for several builds."""
    return [shaped_model(flags) for flags in flag_sets]


def shaped_model(flags: list[str]) -> dict:
    """Build the model with `flags`; what each flag should have changed, and one loss."""
    import torch

    from megatron.core import parallel_state

    from megatron_patches.config.models import count_parameters, model_config_from_args

    args, model, config = built(flags)
    attention = model.decoder.layers[0].self_attention
    tokens = torch.arange(16).reshape(2, 8) % 100
    position_ids = torch.arange(8).expand(2, 8)
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    out = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "counted": count_parameters(model_config_from_args(args))["total"],
        "norm_eps": sorted({m.eps for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))}),
        "q_norm": type(attention.q_layernorm).__name__,
        "qkv_bias": attention.linear_qkv.bias is not None and attention.linear_qkv.bias.numel(),
        "proj_bias": attention.linear_proj.bias is not None,
        "loss_finite": bool(torch.isfinite(loss)),
        "config": [config.layernorm_epsilon, config.qk_layernorm, config.add_qkv_bias, config.rotary_interleaved],
    }
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None:
        out["rotary"] = [2 * rotary.inv_freq.numel(), rotary.seq_len_interpolation_factor]
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.multirank
def test_attention_and_norm_flags_shape_the_built_model():
    plain, shaped = run_ranks(1, __file__, "shaped_models", 120, args=([[], SHAPED],))[0]
    # SMALL: hidden 16, 2 heads (kv_channels 8), --disable-bias-linear
    assert plain["parameters"] == plain["counted"] and shaped["parameters"] == shaped["counted"]
    assert plain["norm_eps"] == [1e-5] and shaped["norm_eps"] == [1e-6]
    assert plain["q_norm"] == "IdentityOp" and shaped["q_norm"] != "IdentityOp"
    assert plain["qkv_bias"] is False and shaped["qkv_bias"] == 3 * 16 and shaped["proj_bias"] is False
    # two norms of kv_channels (LayerNorm: weight and bias) per layer, and the QKV bias
    assert shaped["parameters"] - plain["parameters"] == 2 * (2 * 2 * 8 + 3 * 16) - 8 * 16  # minus the position table
    assert "rotary" not in plain and shaped["rotary"] == [4, 2]  # half of kv_channels 8 rotated
    assert shaped["config"] == [1e-6, True, True, True] and plain["loss_finite"] and shaped["loss_finite"]


# DeepSeek-V3-style routing in ep: sigmoid scores, aux-loss-free expert bias, group-limited top-k
# (4 experts in 2 groups of 2, top-2 from 1 group), a top-k scaling factor, fp32 routing, z-loss.
ROUTING = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-bias-update-rate", "0.01", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
           "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3",
           "--moe-aux-loss-coeff", "0", "--expert-model-parallel-size", "2"]


def routed_model(flags: list[str]) -> dict:
    """Worker: two backward passes and Megatron's finalize_model_grads (which moves the expert
    bias); then the router's choices and probabilities for fixed hidden states."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state

    from megatron_patches.compat import mcore
    from megatron_patches.training.model import moe_layers

    args, model, config = built(flags)
    (ddp,) = mcore.wrap_ddp(config, [mcore.half_precision(config, model)], args)
    generator = torch.Generator().manual_seed(dist.get_rank())
    biases = []
    for _ in range(2):
        ddp.zero_grad_buffer()
        tokens = torch.randint(0, 100, (4, 8), generator=generator)
        ddp(tokens, torch.arange(8).expand(4, 8), None, labels=tokens).float().mean().backward()
        config.finalize_model_grads_func([ddp])
        biases.append([layer.router.expert_bias.tolist() for _, layer in moe_layers(model)])
    router = moe_layers(model)[0][1].router
    hidden_SBH = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(7)).to(config.params_dtype)
    with torch.no_grad():
        probs_TE, routing_TE = router(hidden_SBH)
    out = {
        "expert_bias": biases,
        "groups_used": sorted({len({int(e) // 2 for e in row.nonzero()}) for row in routing_TE}),
        "experts_per_token": sorted({int(row.sum()) for row in routing_TE}),
        "prob_sums": probs_TE.sum(dim=-1).tolist(),
        "probs_dtype": str(probs_TE.dtype),
    }
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.multirank
def test_modern_routing_flags_reach_megatron_s_router_in_ep():
    ranks = run_ranks(2, __file__, "routed_model", 180, args=(ROUTING,))
    bias = np.array(ranks[0]["expert_bias"])  # [step, layer, expert]
    # moved by finalize_model_grads from the world's token counts, the same on both ranks: each step
    # adds rate x sign(mean load - load), so group 0's two experts move together, against group 1's
    assert bias.shape == (2, 2, 4) and ranks[1]["expert_bias"] == ranks[0]["expert_bias"]
    steps = np.diff(np.concatenate([np.zeros((1, 2, 4)), bias]), axis=0) / 0.01
    np.testing.assert_allclose(np.abs(steps), np.round(np.abs(steps)), atol=1e-4)
    assert np.abs(steps[0]).max() == pytest.approx(1) and np.all(steps[..., 0] == steps[..., 1])
    for rank in ranks:
        assert rank["groups_used"] == [1] and rank["experts_per_token"] == [2]  # top-2 inside one group
        np.testing.assert_allclose(rank["prob_sums"], 2.5, rtol=1e-6)  # sigmoid scores normalised, then scaled
        assert rank["probs_dtype"] == "torch.float32"


def params_norms(flag_sets: list[list[str]]) -> list[list[float]]:
    """Worker: (--log-params-norm's value, the norm of every weight counted once) per flag set."""
    import math

    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state

    from megatron_patches.compat import mcore

    out = []
    for flags in flag_sets:
        args, model, config = built(flags)
        (ddp,) = mcore.wrap_ddp(config, [mcore.half_precision(config, model)], args)
        optimizer = mcore.optimizer(args, [ddp])
        # every rank holds the dense weights, each its own experts: dense once, experts summed
        dense = sum(float(p.float().square().sum()) for n, p in model.named_parameters() if "experts" not in n)
        experts = torch.tensor([sum(float(p.float().square().sum()) for n, p in model.named_parameters() if "experts" in n)],
                               dtype=torch.float64)
        dist.all_reduce(experts)
        out.append([mcore.params_norm(optimizer), math.sqrt(dense + float(experts))])
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.multirank
def test_params_norm_counts_every_weight_once():
    """--log-params-norm over EP 2 (experts apart from the dense weights, two chained optimizers), in
    fp32, bf16 (fp32 main weights) and with the distributed optimizer (sharded main weights)."""
    flag_sets = [["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "2", "--bf16"],
                 ["--expert-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer"]]
    ranks = run_ranks(2, __file__, "params_norms", 180, args=(flag_sets,))
    for (ours, reference), again in zip(ranks[0], ranks[1]):
        assert ours == pytest.approx(reference, rel=1e-6) and again[0] == pytest.approx(ours, rel=1e-12)


# Today's MoE models in ep (Megatron-Core's own modules): a gated shared expert, multi-latent
# attention with and without a query latent (its YaRN flags), multi-token prediction, and all
# of them together (DeepSeek-V3's shape, shrunk).
SHARED = ["--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "8", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6", "--qk-layernorm", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--rotary-scaling-factor", "40", "--mscale", "0.707", "--mscale-all-dim", "0.707"]
MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
MODERN = {"shared": SHARED, "mla": MLA, "mla_q_latent": [*MLA, "--q-lora-rank", "12"], "mtp": MTP,
          "all": [*SHARED, *MLA, "--q-lora-rank", "12", *MTP]}


def modern_models(named: dict[str, list[str]]) -> dict[str, dict]:
    """Worker: each model built, one training forward/backward with Megatron's loss mask; its
    parameter count against count_parameters, the modules each flag builds, the MTP losses
    Megatron tracked, and the MTP layers' experts by global id."""
    import torch

    from megatron.core import parallel_state

    from megatron_patches.compat import mcore
    from megatron_patches.config.models import count_parameters, model_config_from_args
    from megatron_patches.training.model import moe_layers

    out = {}
    for name, flags in named.items():
        args, model, config = built(flags)
        tokens = torch.arange(32).reshape(4, 8) % 100
        position_ids = torch.arange(8).expand(4, 8)
        model.train()
        loss = model(tokens, position_ids, None, labels=tokens, loss_mask=torch.ones(4, 8)).float().mean()
        loss.backward()
        layers = mcore.transformer_layers(model)
        shared = getattr(layers[0].mlp, "shared_experts", None)
        out[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "counted": count_parameters(model_config_from_args(args))["total"],
            "config": type(config).__name__,
            "attention": [type(layers[0].self_attention).__name__, type(layers[0].self_attention.core_attention).__name__],
            "shared": None if shared is None else [shared.linear_fc1.weight.shape[0], shared.gate_weight is not None],
            "moe_layers": [number for number, _ in moe_layers(model)],
            "mtp_loss": mcore.take_mtp_losses(args.mtp_num_layers, 1) if args.mtp_num_layers else None,
            "loss_finite": bool(torch.isfinite(loss)),
            "grads_finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None),
            "mtp_experts": {f"{number}:{expert_id}": expert.linear_fc1.weight.detach().tolist()
                            for number, layer in moe_layers(model) if number > args.num_layers
                            for expert_id, expert in mcore.local_experts(layer)},
        }
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.multirank
def test_shared_experts_mla_and_mtp_build_in_ep():
    built_1, = run_ranks(1, __file__, "modern_models", 240, args=(MODERN,))
    for name, model in built_1.items():
        assert model["parameters"] == model["counted"], name
        assert model["loss_finite"] and model["grads_finite"], name
    assert built_1["shared"]["shared"] == [24, True] and built_1["mla"]["shared"] is None
    assert built_1["shared"]["attention"] == ["SelfAttention", "DotProductAttention"]
    assert built_1["mla"]["config"] == "MLATransformerConfig" and built_1["shared"]["config"] == "TransformerConfig"
    assert built_1["mla"]["attention"] == ["MLASelfAttention", "LatentDotProductAttention"]
    # the query latent adds a down projection, an up projection and its norm (RMSNorm, 12 wide)
    q_heads = 2 * (8 + 4)
    assert built_1["mla_q_latent"]["parameters"] - built_1["mla"]["parameters"] == \
        2 * (16 * 12 + 12 * q_heads + 12 - 16 * q_heads)
    # MTP layers repeat the last (MoE) layer: layers 3 and 4 carry experts, one loss per depth
    assert built_1["mtp"]["moe_layers"] == [1, 2, 3, 4] and built_1["shared"]["moe_layers"] == [1, 2]
    assert len(built_1["mtp"]["mtp_loss"]) == 2 and all(4.0 < value < 5.5 for value in built_1["mtp"]["mtp_loss"])
    # the MTP layers' experts are seeded by global id too: the same weights under EP 2
    ep2 = run_ranks(2, __file__, "modern_models", 240, args=({"all": [*MODERN["all"], "--expert-model-parallel-size", "2"]},))
    assert sorted(ep2[0]["all"]["mtp_experts"]) == ["3:0", "3:1", "4:0", "4:1"]
    merged = {**ep2[0]["all"]["mtp_experts"], **ep2[1]["all"]["mtp_experts"]}
    assert merged == built_1["all"]["mtp_experts"]
