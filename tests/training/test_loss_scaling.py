"""fp16 loss scaling across expert parallelism, and the activation memory recompute saves, on 4
gloo ranks (one spawn serves every check).

Megatron-Core reduces each sub-optimizer's found-inf flag over its own gradient-statistics group
only, so an overflow in one EP rank's expert gradient would skip the step on that rank alone
(which is why Megatron-LM refuses --fp16 with EP). compat.mcore.WorldLossScaling makes the
decision world-wide: an inf injected into rank 2's expert gradient must make *every* rank skip
the step, halve the one loss scale, and leave every model and main weight unchanged; the next
clean step must succeed everywhere. Without loss scaling (fp32, bf16 with the distributed
optimizer) compat.mcore.WorldFiniteCheck does the same for a NaN or an infinity: Megatron alone
would step it into every weight through the clipping coefficient.

Recompute: the bytes autograd keeps for the backward (every saved tensor's storage, counted once)
of one training forward must be lower with full and with selective recompute than without.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.mp import run_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, MICRO_BATCH = 128, 16, 2


def _args(*extra: str):
    from megatron_patches.training.arguments import parse_args
    from megatron_patches.training.validation import validate_args

    flags = [
        "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--num-experts", "8",
        "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2", "--vocab-size", str(VOCAB), "--mock-data",
        "--cpu", "--expert-model-parallel-size", "4", "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(MICRO_BATCH * 4), "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "0.01", "--seed", "1234", "--train-iters", "200", "--lr-decay-style", "cosine", *extra,
    ]  # fmt: skip
    return validate_args(parse_args(flags), dist.get_world_size())


def _batch(step: int):
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    return tokens, torch.arange(SEQ).expand(MICRO_BATCH, SEQ), labels


def _build(args):
    from megatron_patches.compat import mcore
    from megatron_patches.training.model import build_model

    torch.manual_seed(args.seed)
    mcore.seed_model_parallel_rng(args.seed)
    (model,), config = build_model(args, VOCAB, on_gpu=False)
    (ddp,) = mcore.wrap_ddp(config, [mcore.half_precision(config, model)], args)
    return model, ddp, config, mcore.optimizer(args, [ddp])


def _backward(ddp, config, step: int) -> None:
    ddp.zero_grad_buffer()
    tokens, positions, labels = _batch(step)
    loss = ddp(tokens, positions, None, labels=labels).float().mean()
    config.grad_scale_func(loss).backward()  # as the pipeline schedules scale it
    config.finalize_model_grads_func([ddp])


def _injected_step_checks(*flags: str, value: float) -> dict:
    """A clean step, a step with `value` in one expert gradient of rank 2, another clean step."""
    from megatron_patches.compat import mcore

    args = _args(*flags)
    model, ddp, config, optimizer = _build(args)
    _backward(ddp, config, 0)
    first_ok, _, _ = optimizer.step()
    scale_before = mcore.loss_scale(optimizer)
    weights = [p.detach().clone() for p in model.parameters()]
    mains = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]

    _backward(ddp, config, 1)
    if dist.get_rank() == 2:  # one expert gradient of one rank overflows
        expert = next(p for name, p in model.named_parameters() if "local_experts" in name)
        expert.main_grad.view(-1)[0] = value
    injected_ok, _, _ = optimizer.step()
    unchanged = all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    mains_unchanged = all(torch.equal(a, p) for a, p in zip(mains, (p for g in optimizer.param_groups for p in g["params"])))
    scale_after = mcore.loss_scale(optimizer)

    _backward(ddp, config, 2)
    clean_ok, _, _ = optimizer.step()
    expert_moved = any(not torch.equal(a, p) for (name, p), a in zip(model.named_parameters(), weights) if "local_experts" in name)
    return {
        "first_ok": bool(first_ok),
        "injected_ok": bool(injected_ok),
        "weights_unchanged": unchanged,
        "main_weights_unchanged": mains_unchanged,
        "scales": [scale_before, scale_after],
        "scalers_shared": len({id(getattr(sub, "grad_scaler", None)) for sub in optimizer.chained_optimizers}) == 1,
        "clean_ok": bool(clean_ok),
        "expert_moved": expert_moved,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


def _saved_bytes(*recompute: str) -> int:
    """Bytes autograd keeps for the backward of one training forward (storages counted once)."""
    _, ddp, _, _ = _build(_args(*recompute))
    tokens, positions, labels = _batch(0)
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = ddp(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    return sum(storages.values())


def world4_checks() -> dict:
    from megatron_patches.compat import mcore, prepare_megatron

    prepare_megatron(use_cuda=False)
    mcore.initialize_model_parallel(1, 1, 4, 1)
    return {
        "overflow": _injected_step_checks("--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", value=float("inf")),
        # no loss scaling: the world-wide non-finite check (compat.mcore.WorldFiniteCheck)
        "nan_fp32": _injected_step_checks(value=float("nan")),
        "inf_bf16": _injected_step_checks("--bf16", "--use-distributed-optimizer", value=float("-inf")),
        "saved_bytes": {
            "none": _saved_bytes(),
            "full": _saved_bytes("--recompute-granularity", "full", "--recompute-method", "uniform",
                                 "--recompute-num-layers", "1"),
            "selective": _saved_bytes("--recompute-granularity", "selective", "--recompute-modules",
                                      "core_attn", "layernorm"),
        },
    }


@pytest.fixture(scope="module")
def world4():
    return run_ranks(4, __file__, "world4_checks", timeout=300)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(world4):
    for rank in world4:
        result = rank["overflow"]
        assert result["param_dtypes"] == ["torch.float16"]
        assert result["scalers_shared"] and result["first_ok"]
        assert not result["injected_ok"], result
        assert result["weights_unchanged"] and result["main_weights_unchanged"], result
        assert result["scales"] == [1024.0, 512.0]  # hysteresis 1: the first overflow halves it
        assert result["clean_ok"] and result["expert_moved"]


@pytest.mark.parametrize("case, dtype", [("nan_fp32", "torch.float32"), ("inf_bf16", "torch.bfloat16")])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(world4, case, dtype):
    for rank in world4:
        result = rank[case]
        assert result["param_dtypes"] == [dtype]
        assert result["first_ok"] and not result["injected_ok"], result
        assert result["weights_unchanged"] and result["main_weights_unchanged"], result
        assert result["scales"] == [1.0, 1.0]
        assert result["clean_ok"] and result["expert_moved"]


def test_recompute_keeps_fewer_activation_bytes(world4):
    saved = world4[0]["saved_bytes"]
    assert saved["full"] < saved["none"] / 2, saved
    assert saved["selective"] < saved["none"], saved
