"""Tests of megatron_patches/compat/fixes.py: each Megatron-Core 0.16.1 bug shown on the real
Megatron modules (stock behaviour wrong), and the fix shown right.

- Fix 1 (single-rank reduce), in this process at world 1: SequentialMLP experts with biases
  fail with the inplace-view error; fixed, their gradients equal a plain-torch reference.
- Fixes 2-4 on two gloo ranks, all from one spawn (`world2` fixture, `world2_checks`):
  * TP2 + SP + EP2 (ETP1) GPT-MoE with biases: tags of the expert fc2 biases (fix 2), their
    gradients after finalize_model_grads with the stock tag and untagged, the expert
    optimizer's tp_group and the grad norm with the stock and the fixed group (fix 3). The
    reference is the same weights (moved through a dist checkpoint) in a TP1/EP1 layout, where
    every rank holds the whole model and computes exact single-rank gradients.
  * EP2 with the distributed optimizer (dense params sharded over DP2): save -> load with the
    stock Megatron methods and with fix 4, per-parameter `step` tensors, and the next
    optimizer steps against a run that never stopped.
- Fix 6 (the router's gating GEMM without Transformer Engine), fix 7 (BERT masking's replacement
  tokens in a per-process order) and fix 9 (the grad norm without Apex or TE read on the host), in
  this process.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings

from support.mp import run_ranks, single_rank_group
from megatron_patches.compat import fixes

VOCAB = 128
SEQ = 16
MICRO_BATCH = 2
NUM_EXPERTS = 4
NUM_LAYERS = 2


# ----------------------------------------------------------------------------------------
# Fix 1: SequentialMLP experts with biases at world 1 (EP = ETP = 1)
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world1():
    from megatron_patches.compat.cpu import apply_cpu_shims

    apply_cpu_shims()
    with single_rank_group():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


@pytest.fixture
def stock_reduce(monkeypatch):
    """Megatron's own reduce in RowParallelLinear; monkeypatch restores whatever was there."""
    monkeypatch.setattr(tp_layers, "reduce_from_tensor_model_parallel_region", mappings.reduce_from_tensor_model_parallel_region)


def _sequential_experts(num_experts: int = 3, hidden: int = 8, ffn: int = 12):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_attention_heads=2,
        num_moe_experts=num_experts,
        moe_router_topk=2,
        add_bias_linear=True,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )
    experts = SequentialMLP(
        num_experts,
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    with torch.no_grad():
        for param in experts.parameters():  # biases start at zero: give them values
            param.normal_(0.0, 0.5)
    return experts


def _expert_inputs(hidden: int = 8):
    """Tokens already permuted by expert: 2, 3 and 4 tokens for experts 0, 1, 2."""
    generator = torch.Generator().manual_seed(1)
    tokens_per_expert = torch.tensor([2, 3, 4])
    x = torch.randn(int(tokens_per_expert.sum()), hidden, generator=generator)
    probs = torch.rand(int(tokens_per_expert.sum()), generator=generator)
    weights = torch.randn(int(tokens_per_expert.sum()), hidden, generator=generator)
    return x, tokens_per_expert, probs, weights


def test_fix1_stock_expert_bias_add_fails_on_single_rank(world1, stock_reduce):
    experts = _sequential_experts()
    x, tokens_per_expert, probs, _ = _expert_inputs()
    with pytest.raises(RuntimeError, match="_ReduceFromModelParallelRegion is a view and is being modified inplace"):
        experts(x, tokens_per_expert, probs)


def test_fix1_gradients_equal_out_of_place_reference(world1, stock_reduce):
    fixes.apply_global_fixes()  # rebinds the reduce; the fixture restores the previous one
    assert tp_layers.reduce_from_tensor_model_parallel_region is not mappings.reduce_from_tensor_model_parallel_region
    experts = _sequential_experts()
    x, tokens_per_expert, probs, weights = _expert_inputs()
    x.requires_grad_(True)
    probs.requires_grad_(True)
    output, output_bias = experts(x, tokens_per_expert, probs)
    assert output_bias is None
    (output * weights).sum().backward()

    # Reference: each expert in plain torch, fc2 bias added out of place, scaled by the prob
    # like Megatron's MLP does for experts (mlp.py:232-248).
    params = {name: p.detach().clone().requires_grad_(True) for name, p in experts.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    pr = probs.detach().clone().requires_grad_(True)
    outputs = []
    start = 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        w1, b1 = params[f"local_experts.{e}.linear_fc1.weight"], params[f"local_experts.{e}.linear_fc1.bias"]
        w2, b2 = params[f"local_experts.{e}.linear_fc2.weight"], params[f"local_experts.{e}.linear_fc2.bias"]
        tokens, p = xr[start : start + n], pr[start : start + n, None]
        intermediate = torch.nn.functional.gelu(tokens @ w1.T + b1) * p
        outputs.append(intermediate @ w2.T + b2 * p)
        start += n
    reference = torch.cat(outputs)
    (reference * weights).sum().backward()

    torch.testing.assert_close(output, reference)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(probs.grad, pr.grad)
    for name, param in experts.named_parameters():
        torch.testing.assert_close(param.grad, params[name].grad, msg=lambda m: f"{name}: {m}")
        assert param.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------------------
# World 2: the worker (runs on every rank) and its helpers
# ----------------------------------------------------------------------------------------


def _args(tp: int, ep: int, sequence_parallel: bool = False, distributed_optimizer: bool = False):
    """Training arguments of a tiny GPT-MoE with biases (the project's own parser/validation)."""
    from megatron_patches.training.arguments import parse_args
    from megatron_patches.training.validation import validate_args

    dp = dist.get_world_size() // tp
    flags = [
        "--num-layers", str(NUM_LAYERS), "--hidden-size", "32", "--ffn-hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--num-experts", str(NUM_EXPERTS), "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
        "--vocab-size", str(VOCAB), "--mock-data", "--cpu",
        "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
        "--expert-tensor-parallel-size", "1",
        "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(MICRO_BATCH * dp),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--moe-aux-loss-coeff", "0",
        "--lr", "0.01", "--clip-grad", "1.0", "--seed", "1234", "--train-iters", "200", "--lr-decay-style", "cosine",
    ]  # fmt: skip
    if sequence_parallel:
        flags.append("--sequence-parallel")
    if distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    return validate_args(parse_args(flags), dist.get_world_size())


def _model(args):
    from megatron_patches.compat import mcore
    from megatron_patches.training.model import build_model

    mcore.initialize_model_parallel(args.tensor_model_parallel_size, 1, args.expert_model_parallel_size, 1)
    torch.manual_seed(args.seed)
    mcore.seed_model_parallel_rng(args.seed)
    (model,), config = build_model(args, VOCAB, on_gpu=False)
    return model, config


def _batch(step: int, dp_rank: int):
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    return tokens, torch.arange(SEQ).expand(MICRO_BATCH, SEQ), labels


def _loss(model, step: int, dp_rank: int) -> torch.Tensor:
    tokens, positions, labels = _batch(step, dp_rank)
    return model(tokens, positions, None, labels=labels).float().mean()


def _expert_fc2_biases(model) -> dict[str, torch.nn.Parameter]:
    """'layer L expert E' (global expert id) -> that expert's fc2 bias, for the experts of this rank."""
    from megatron_patches.compat import mcore

    biases = {}
    for layer in mcore.transformer_layers(model):
        for expert_id, expert in mcore.local_experts(layer.mlp):
            biases[f"layer {layer.layer_number} expert {expert_id}"] = expert.linear_fc2.bias
    return biases


def _tags(model) -> dict[str, bool | None]:
    return {name: getattr(p, "sequence_parallel", None) for name, p in model.named_parameters()}


def _tp2_sp_ep2_checks(checkpoint_dir: Path) -> dict:
    """Fixes 2 and 3 at TP2 + SP + EP2 (ETP1), against single-rank gradients of the same weights."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_patches.compat import mcore

    out: dict = {}
    args = _args(tp=2, ep=2, sequence_parallel=True)
    model, config = _model(args)
    # Fix 1 must keep the real all-reduce on a two-rank TP group (forward: sum; backward: identity).
    x = torch.full((3,), dist.get_rank() + 1.0, requires_grad=True)
    y = tp_layers.reduce_from_tensor_model_parallel_region(x)
    y.sum().backward()
    out["tp2_reduce"] = {
        "fixed": tp_layers.reduce_from_tensor_model_parallel_region is fixes._reduce_from_tensor_model_parallel_region,
        "value": y.tolist(),
        "grad": x.grad.tolist(),
    }
    biases = _expert_fc2_biases(model)
    out["tags_stock"] = _tags(model)
    (ddp,) = mcore.wrap_ddp(config, [model], args)  # applies fix 2
    out["tags_fixed"] = _tags(model)

    def finalized_bias_grads() -> tuple[float, dict]:
        ddp.zero_grad_buffer()
        loss = _loss(ddp, step=0, dp_rank=0)
        loss.backward()
        finalize_model_grads([ddp])
        return loss.item(), {key: bias.main_grad.tolist() for key, bias in biases.items()}

    for bias in biases.values():
        bias.sequence_parallel = True  # Megatron's own tag (layers.py:1227), as before the fix
    out["loss"], out["bias_grads_stock"] = finalized_bias_grads()
    out["untagged"] = fixes.untag_expert_bias_sequence_parallel([ddp])
    out["untagged_again"] = fixes.untag_expert_bias_sequence_parallel([ddp])
    loss, out["bias_grads_fixed"] = finalized_bias_grads()
    assert loss == out["loss"]

    # Fix 3 on these (correct) gradients: stock optimizer vs the project's.
    stock = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=args.clip_grad), [ddp])
    fixed = mcore.optimizer(args, [ddp])
    stock.prepare_grads()

    def expert_sub(optimizer):
        return next(sub for sub in optimizer.chained_optimizers if all(g.get("is_expert_parallel") for g in sub.param_groups))

    attention_tp = parallel_state.get_tensor_model_parallel_group()
    expert_tp = parallel_state.get_expert_tensor_parallel_group()
    out["stock_expert_tp_group"] = "attention TP" if expert_sub(stock).tp_group is attention_tp else "other"
    out["fixed_expert_tp_group"] = "expert TP" if expert_sub(fixed).tp_group is expert_tp else "other"
    out["expert_tp_size"] = expert_tp.size()
    out["fix3_found"] = fixes.use_expert_tp_group_for_expert_optimizer(fixed)
    out["norm_stock"] = float(stock.get_grad_norm())
    out["norm_fixed"] = float(fixed.get_grad_norm())
    out["bias_sq_sum_local"] = float(sum(bias.main_grad.square().sum() for bias in biases.values()))
    out["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()

    # Reference: the same weights in a TP1/EP1 layout (every rank: the whole model, same batch).
    if dist.get_rank() == 0:
        checkpoint_dir.mkdir(parents=True)
    dist.barrier()
    mcore.save_checkpoint(str(checkpoint_dir), [model], None, {})
    parallel_state.destroy_model_parallel()
    reference, _ = _model(_args(tp=1, ep=1))
    mcore.load_checkpoint(str(checkpoint_dir), [reference], None, {}, "assume_ok_unexpected")
    loss = _loss(reference, step=0, dp_rank=0)
    loss.backward()
    out["reference_loss"] = loss.item()
    out["reference_bias_grads"] = {key: bias.grad.tolist() for key, bias in _expert_fc2_biases(reference).items()}
    out["reference_norm"] = math.sqrt(sum(float(p.grad.double().square().sum()) for p in reference.parameters()))
    parallel_state.destroy_model_parallel()
    return out


def _train(ddp, optimizer, steps) -> list[float]:
    from megatron.core.distributed import finalize_model_grads

    dp_rank = parallel_state.get_data_parallel_rank()
    losses = []
    for step in steps:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _loss(ddp, step, dp_rank)
        loss.backward()
        finalize_model_grads([ddp])
        update_successful, _, _ = optimizer.step()
        assert update_successful
        losses.append(loss.item())
    return losses


def _adam_states(optimizer) -> list[dict]:
    return [state for sub in optimizer.chained_optimizers for state in sub.optimizer.state.values()]


def _distributed_optimizer_round_trip(checkpoint_dir: Path, stock_methods: dict) -> dict:
    """Fix 4: EP2 (dense params sharded over DP2 by the distributed optimizer), save after two
    steps, reload into a fresh model with stock Megatron and with the fix, take two more steps."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_patches.compat import mcore

    out: dict = {}
    args = _args(tp=1, ep=2, distributed_optimizer=True)

    def fresh():
        parallel_state.destroy_model_parallel()
        model, config = _model(args)
        (ddp,) = mcore.wrap_ddp(config, [model], args)
        return model, ddp, mcore.optimizer(args, [ddp])

    model, ddp, optimizer = fresh()
    out["optimizer_types"] = [type(sub).__name__ for sub in optimizer.chained_optimizers]
    out["dp_size"] = parallel_state.get_data_parallel_world_size()
    out["losses_before_save"] = _train(ddp, optimizer, [1, 2])
    if dist.get_rank() == 0:
        checkpoint_dir.mkdir(parents=True)
    dist.barrier()
    mcore.save_checkpoint(str(checkpoint_dir), [ddp], optimizer, {})
    out["losses_uninterrupted"] = _train(ddp, optimizer, [3, 4])
    final_uninterrupted = [p.detach().clone() for p in model.parameters()]

    def resume_with(methods: dict) -> dict:
        """Load into a fresh model with some DistributedOptimizer methods swapped back to stock."""
        fixed_methods = {name: DistributedOptimizer.__dict__[name] for name in methods}
        for name, method in methods.items():
            setattr(DistributedOptimizer, name, method)
        try:
            resumed, ddp_resumed, optimizer_resumed = fresh()
            mcore.load_checkpoint(str(checkpoint_dir), [ddp_resumed], optimizer_resumed, {}, "assume_ok_unexpected")
        except Exception as error:
            return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        finally:
            for name, method in fixed_methods.items():
                setattr(DistributedOptimizer, name, method)
            dist.barrier()  # both ranks leave together, also when one failed
        states = _adam_states(optimizer_resumed)
        result = {
            "error": None,
            "num_states": len(states),
            "distinct_step_tensors": len({id(state["step"]) for state in states}),
            "distinct_step_storages": len({state["step"].untyped_storage().data_ptr() for state in states}),
            "step_values": sorted({float(state["step"]) for state in states}),
            # [states, distinct step tensors] per sub-optimizer (dense, expert)
            "per_optimizer": [
                [len(sub.optimizer.state), len({id(state["step"]) for state in sub.optimizer.state.values()})]
                for sub in optimizer_resumed.chained_optimizers
            ],
            "losses": _train(ddp_resumed, optimizer_resumed, [3, 4]),
        }
        result["max_param_diff"] = max(
            float((a - b.detach()).abs().max()) for a, b in zip(final_uninterrupted, resumed.parameters())
        )
        return result

    # Stock Megatron (both methods as they were before fixes.apply_global_fixes()).
    out["stock"] = resume_with(stock_methods)
    # Only the first half of the fix (per-parameter step kept through the copy), Megatron's
    # load_state_dict that hands every parameter the same step tensor.
    out["shared_step"] = resume_with({"load_state_dict": stock_methods["load_state_dict"]})
    out["fixed"] = resume_with({})
    parallel_state.destroy_model_parallel()
    return out


def world2_checks(directory: str) -> dict:
    """Every world-2 check of this file, on each of the two ranks (results as JSON)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_patches.compat import prepare_megatron

    stock_methods = {
        name: DistributedOptimizer.__dict__[name] for name in ("_set_main_param_and_optimizer_states", "load_state_dict")
    }
    prepare_megatron(use_cuda=False)  # CPU shims and fixes 1 and 4, as the training script does
    root = Path(directory)
    return {
        "rank": dist.get_rank(),
        "tp2_sp_ep2": _tp2_sp_ep2_checks(root / "tp2_sp_ep2_model"),
        "round_trip": _distributed_optimizer_round_trip(root / "distributed_optimizer", stock_methods),
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_ranks(2, __file__, "world2_checks", timeout=300, args=(str(tmp_path_factory.mktemp("world2")),))


@pytest.mark.multirank
def test_fix1_keeps_the_all_reduce_on_two_ranks(world2):
    for rank in world2:
        assert rank["tp2_sp_ep2"]["tp2_reduce"] == {"fixed": True, "value": [3.0, 3.0, 3.0], "grad": [1.0, 1.0, 1.0]}


# ----------------------------------------------------------------------------------------
# Fix 2: expert fc2 bias tagged sequence-parallel
# ----------------------------------------------------------------------------------------


def _is_expert_fc2_bias(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("linear_fc2.bias")


@pytest.mark.multirank
def test_fix2_stock_megatron_tags_expert_fc2_bias_sequence_parallel(world2):
    for rank in world2:
        tags = rank["tp2_sp_ep2"]["tags_stock"]
        expert_biases = [name for name in tags if _is_expert_fc2_bias(name)]
        assert len(expert_biases) == NUM_LAYERS * NUM_EXPERTS // 2
        assert all(tags[name] is True for name in expert_biases)


@pytest.mark.multirank
def test_fix2_untags_expert_fc2_biases_only(world2):
    for rank in world2:
        result = rank["tp2_sp_ep2"]
        stock, fixed = result["tags_stock"], result["tags_fixed"]
        for name, tag in fixed.items():
            expected = False if _is_expert_fc2_bias(name) else stock[name]
            assert tag == expected, name
        # Sequence-parallel params that must keep their tag: norms (the torch-norm shim),
        # the router, and the attention output bias.
        kept = [name for name, tag in fixed.items() if tag]
        assert any("layernorm" in name for name in kept)
        assert any("router" in name for name in kept)
        assert any("linear_proj.bias" in name for name in kept)
        assert result["untagged"] == NUM_LAYERS * NUM_EXPERTS // 2
        assert result["untagged_again"] == 0


@pytest.mark.multirank
def test_world2_reference_has_the_same_loss(world2):
    for rank in world2:
        result = rank["tp2_sp_ep2"]
        assert math.isclose(result["loss"], result["reference_loss"], rel_tol=1e-5), result


def _partner(key: str) -> str:
    """The expert with the same local index on the other rank (2 experts per rank)."""
    layer, expert = key.rsplit(" ", 1)
    return f"{layer} {(int(expert) + NUM_EXPERTS // 2) % NUM_EXPERTS}"


@pytest.mark.multirank
def test_fix2_stock_finalize_sums_biases_of_different_experts(world2):
    for rank in world2:
        result = rank["tp2_sp_ep2"]
        reference = result["reference_bias_grads"]
        for key, stock in result["bias_grads_stock"].items():
            own, other = torch.tensor(reference[key]), torch.tensor(reference[_partner(key)])
            torch.testing.assert_close(torch.tensor(stock), own + other, rtol=1e-4, atol=1e-6)
            assert not torch.allclose(torch.tensor(stock), own, rtol=1e-3, atol=1e-6), key


@pytest.mark.multirank
def test_fix2_expert_bias_grads_equal_single_rank_reference(world2):
    seen = set()
    for rank in world2:
        result = rank["tp2_sp_ep2"]
        for key, fixed in result["bias_grads_fixed"].items():
            torch.testing.assert_close(torch.tensor(fixed), torch.tensor(result["reference_bias_grads"][key]), rtol=1e-4, atol=1e-6)
            seen.add(key)
    assert len(seen) == NUM_LAYERS * NUM_EXPERTS, "the two ranks host every expert once"


# ----------------------------------------------------------------------------------------
# Fix 3: the expert optimizer's tensor-parallel group
# ----------------------------------------------------------------------------------------


@pytest.mark.multirank
def test_fix3_expert_optimizer_gets_the_expert_tp_group(world2):
    for rank in world2:
        result = rank["tp2_sp_ep2"]
        assert result["stock_expert_tp_group"] == "attention TP"
        assert result["fixed_expert_tp_group"] == "expert TP" and result["expert_tp_size"] == 1
        assert result["fix3_found"] is True


@pytest.mark.multirank
def test_fix3_grad_norm_equals_single_rank_norm(world2):
    for rank in world2:
        result = rank["tp2_sp_ep2"]
        assert math.isclose(result["norm_fixed"], result["reference_norm"], rel_tol=1e-5), result


@pytest.mark.multirank
def test_fix3_stock_grad_norm_drops_expert_biases_of_tp_rank_1(world2):
    """Stock: fc2 biases (no tensor-parallel attribute) count only on attention-TP rank 0, so the
    biases of the experts on TP rank 1 vanish: stock^2 = reference^2 - |those bias grads|^2."""
    by_tp_rank = {rank["tp2_sp_ep2"]["tp_rank"]: rank["tp2_sp_ep2"] for rank in world2}
    dropped = by_tp_rank[1]["bias_sq_sum_local"]
    for result in by_tp_rank.values():
        reference = result["reference_norm"]
        assert dropped > 1e-4 * reference**2, "the dropped part must be measurable"
        assert math.isclose(result["norm_stock"] ** 2, reference**2 - dropped, rel_tol=1e-5), result
        assert not math.isclose(result["norm_stock"], reference, rel_tol=1e-5)


# ----------------------------------------------------------------------------------------
# Fix 4: distributed-optimizer checkpoint round trip with torch Adam
# ----------------------------------------------------------------------------------------


@pytest.mark.multirank
def test_fix4_setup_shards_dense_params_over_two_dp_ranks(world2):
    for rank in world2:
        result = rank["round_trip"]
        assert result["dp_size"] == 2
        assert set(result["optimizer_types"]) == {"DistributedOptimizer"}


@pytest.mark.multirank
def test_fix4_stock_load_fails_on_missing_step(world2):
    """distrib_optimizer.py:2101 leaves 'step' out of the loaded tensors, :940 copies every key."""
    for rank in world2:
        stock = rank["round_trip"]["stock"]
        assert stock["error"] == "KeyError: 'step'", stock
        assert "_set_main_param_and_optimizer_states" in stock["traceback"]


@pytest.mark.multirank
def test_fix4_without_private_steps_all_params_share_one_step_and_drift(world2):
    """Megatron's load_state_dict (distrib_optimizer.py:817-825) gives every parameter the same
    step tensor (one per sub-optimizer: dense, expert); torch Adam then advances it once per
    parameter per iteration."""
    for rank in world2:
        result = rank["round_trip"]
        shared = result["shared_step"]
        assert shared["error"] is None, shared
        assert len(shared["per_optimizer"]) == 2
        for num_states, distinct_steps in shared["per_optimizer"]:
            assert num_states > 1 and distinct_steps == 1
        assert shared["losses"][0] == result["losses_uninterrupted"][0], "same weights before the first resumed step"
        assert shared["losses"][1] != result["losses_uninterrupted"][1], "the resumed run drifts"
        assert shared["max_param_diff"] > 0, "the shared step must change the updates"


@pytest.mark.multirank
def test_fix4_every_param_has_its_own_step_after_loading(world2):
    for rank in world2:
        fixed = rank["round_trip"]["fixed"]
        assert fixed["error"] is None, fixed
        assert fixed["num_states"] > 1
        assert fixed["distinct_step_tensors"] == fixed["num_states"]
        assert fixed["distinct_step_storages"] == fixed["num_states"]
        assert fixed["step_values"] == [2.0], "two optimizer steps were taken before saving"


@pytest.mark.multirank
def test_fix4_resumed_steps_match_the_uninterrupted_run(world2):
    for rank in world2:
        result = rank["round_trip"]
        assert result["fixed"]["losses"] == result["losses_uninterrupted"]
        assert result["fixed"]["max_param_diff"] == 0.0


def test_fix6_router_gating_without_transformer_engine(monkeypatch):
    """Stock, without Transformer Engine the router's gating GEMM raises NameError (on CPU and on
    GPU: seen on an H200); with the name bound to None it is torch's x W^T + b, gradients too."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine is installed: the stock path is TE's GEMM")
    x = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(3, 4, requires_grad=True)
    bias = torch.randn(3, requires_grad=True)
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)  # stock: the name is unbound
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(x, weight, bias, torch.float32)
    fixes._fix_te_general_gemm_without_te()
    assert moe_utils.te_general_gemm is None
    moe_utils.router_gating_linear(x, weight, bias, torch.float32).square().sum().backward()
    grads = [t.grad.clone() for t in (x, weight, bias)]
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    (xr @ wr.T + br).square().sum().backward()
    for got, ref in zip(grads, (xr, wr, br)):
        torch.testing.assert_close(got, ref.grad)


def test_fix7_bert_replacement_tokens_follow_the_seed_alone(world1, monkeypatch, tmp_path):
    """Stock, BERT masking draws replacement tokens from the tokenizer's vocabulary in the order
    its hash map gives (randomised per process by the HuggingFace tokenizers library); fixed, in
    id order, so a sample depends on the seed only."""
    from megatron.core.datasets import bert_dataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_patches.data.corpus import ensure_default_corpus
    from megatron_patches.data.tokenizers import build_tokenizer

    corpus = ensure_default_corpus("bert", max_documents=12)
    tokenizer = build_tokenizer(corpus.tokenizer_type, corpus.vocab_file, corpus.merge_file)
    assert list(tokenizer.inv_vocab) != sorted(tokenizer.inv_vocab)  # the order the stock code uses
    config = bert_dataset.BERTMaskedWordPieceDatasetConfig(
        random_seed=1234, sequence_length=64, blend=([str(corpus.data_prefix)], None), split="100,0,0",
        tokenizer=tokenizer, path_to_cache=str(tmp_path), masking_probability=0.15, short_sequence_probability=0.1,
        masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False, classification_head=True,
    )
    monkeypatch.setattr(bert_dataset.BERTMaskedWordPieceDataset, "__init__", bert_dataset.BERTMaskedWordPieceDataset.__init__)
    fixes._fix_bert_token_lookup_order()
    # Megatron's builder asks torch.distributed for the rank: world1's group of one
    train = BlendedMegatronDatasetBuilder(bert_dataset.BERTMaskedWordPieceDataset, [8, 0, 0], lambda: True, config).build()[0]
    assert train.token_lookup == sorted(tokenizer.inv_vocab)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records the calls that read a tensor's values on the host (on a GPU, a synchronisation each)."""

    READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.tolist, torch.tensor}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_fix9_grad_norm_without_apex_or_te_stays_on_the_device():
    """Stock, without Apex and Transformer Engine the grad norm reads every gradient's norm on the
    host (`torch.tensor(list of norms)`, then `float(norm)`: on an H200 89 synchronisations per
    iteration of the tiny model); fixed, the same float32 value bit for bit with no host read."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from megatron_patches.compat.cpu import apply_cpu_shims

    apply_cpu_shims()  # the stock function's literal device="cuda"
    torch.manual_seed(0)
    grads = [torch.randn(shape) * scale for shape, scale in
             (((64, 32), 1e-3), ((32,), 3.0), ((4, 8, 16), 0.5), ((1,), 7.0), ((128, 7), 1e-6))]
    grads.append(torch.randn(9, 5).to(torch.bfloat16))
    with _HostReads() as stock_reads:
        stock, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    with _HostReads() as fixed_reads:
        fixed, none = fixes._device_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert stock_reads.reads and "__float__" in stock_reads.reads
    assert fixed_reads.reads == []
    assert none is None and fixed.shape == stock.shape == (1,) and fixed.dtype == stock.dtype == torch.float32
    assert torch.equal(fixed, stock)
    # each tensor's norm in its own dtype (the bf16 one rounded to bf16), as Megatron takes it
    reference = math.sqrt(sum(float(torch.linalg.vector_norm(g.double()).to(g.dtype)) ** 2 for g in grads))
    assert fixed.item() == pytest.approx(reference, rel=1e-5)
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        fixes._fix_grad_norm_host_reads()
    if clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier:  # neither Apex nor TE
        assert clip_grads.l2_norm_impl is fixes._device_multi_tensor_l2_norm
        params = [torch.nn.Parameter(g.float().clone()) for g in grads]
        for p in params:
            p.grad = p.detach().clone()
        # the module's world-1 group when its fixture holds one, else one of our own
        with contextlib.nullcontext() if dist.is_initialized() else single_rank_group():
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        assert norm == pytest.approx(math.sqrt(sum(float(p.grad.double().square().sum()) for p in params)), rel=1e-5)
