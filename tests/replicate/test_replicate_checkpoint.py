"""Replicate-mode checkpoints in ep's form, end to end through `pretrain_gpt_moe.py` on 4 gloo ranks.

Replicate mode saves every expert's current weights into the frozen Megatron local expert that
EP's layout gives it and the experts' fp32 Adam moments under ep's expert-optimizer keys, with
the placement (slots per layer, popularity history) as common state. One spawn runs, in turn
(support/multirun.py; dropless, fp32, adaptive policy, so replicate computes ep's model):

    A  replicate, 2K iterations, saves at K
    B  replicate resumed from A at K            -> A's iterations K+1..2K, placements included
    C  ep resumed from A at K, runs to 3K, saves at 2K -> A's iterations K+1..2K (ep resumes the
                                                   moments: every later loss, not only the first)
    D  replicate resumed from C's ep checkpoint at 2K  -> C's iterations 2K+1..3K

Dropless replicate equals ep within 1e-5 (tests/replicate/test_replicate_training.py); Adam restarted
from zero moments would move the weights differently from the second step after a resume on,
so matching losses over K iterations show the moments crossed the checkpoint.

The runs are fp32 (bf16 does not run on CPU); for bf16 / fp16 (Float16OptimizerWithFloat16Params,
whose form adds the fp32 master weights) and fp32 alike, one forked process checks that the
optimizer sharded state dict built for frozen experts is ep's own, key for key, offset for offset
and in its whole nested structure (common values included).
"""

from __future__ import annotations

import re
import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from support.mp import run_ranks
from support.training import launch_many

pytestmark = pytest.mark.e2e

G, K = 4, 3
COMMON = [
    "--lr-warmup-iters", "2", "--lr-decay-iters", str(3 * K), "--log-interval", "1", "--eval-interval", "1000",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--expert-model-parallel-size", str(G),
]
REPLICATE = ["--moe-parallel-mode", "replicate"]


def train_records(run) -> dict[int, dict]:
    return {record["iteration"]: record for record in run.records if "loss" in record}


def assert_same_losses(run: dict[int, dict], reference: dict[int, dict], iterations) -> None:
    iterations = list(iterations)
    assert sorted(run) == iterations
    np.testing.assert_allclose([run[i]["loss"] for i in iterations], [reference[i]["loss"] for i in iterations], rtol=1e-5, atol=0)
    np.testing.assert_allclose(
        [run[i]["grad_norm"] for i in iterations], [reference[i]["grad_norm"] for i in iterations], rtol=1e-5, atol=0
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("replicate_checkpoint")
    a_ckpt, c_ckpt = work / "a_ckpt", work / "c_ckpt"
    runs = launch_many(G, {
        "a": [*COMMON, *REPLICATE, "--train-iters", str(2 * K), "--save", str(a_ckpt), "--save-interval", str(K)],
        "b": [*COMMON, *REPLICATE, "--train-iters", str(2 * K), "--load", str(a_ckpt)],
        "c": [*COMMON, "--train-iters", str(3 * K), "--load", str(a_ckpt), "--save", str(c_ckpt), "--save-interval", str(2 * K)],
        "d": [*COMMON, *REPLICATE, "--train-iters", str(3 * K), "--load", str(c_ckpt)],
    }, work, trackers={"b": (a_ckpt, K), "d": (c_ckpt, 2 * K)})  # the mid-run saves, not the last ones
    return {**runs, "a_ckpt": a_ckpt, "c_ckpt": c_ckpt}


def test_replicate_resumes_exactly_with_its_placement(runs):
    a, b = train_records(runs["a"]), train_records(runs["b"])
    assert_same_losses(b, a, range(K + 1, 2 * K + 1))
    replicas = {i: [layer["replicas"] for layer in a[i]["replicate"]["layers"]] for i in a}
    # the adaptive policy re-placed the experts across the checkpoint, so the placement had to travel
    assert len({str(replicas[i]) for i in range(K, 2 * K + 1)}) > 1
    assert all([layer["replicas"] for layer in b[i]["replicate"]["layers"]] == replicas[i] for i in b)
    assert f"checkpoint: replicate: restored the placement and {K} observed iterations of popularity" in runs["b"].output
    assert f"checkpoint: replicate: experts' master weights and Adam moments loaded (step {K})" in runs["b"].output


def test_replicate_checkpoint_has_eps_keys_and_resumes_in_ep(runs):
    saved = FileSystemReader(str(runs["a_ckpt"] / f"iter_{K:07d}")).read_metadata().state_dict_metadata
    ep_saved = FileSystemReader(str(runs["c_ckpt"] / f"iter_{2 * K:07d}")).read_metadata().state_dict_metadata
    assert set(saved) == set(ep_saved)
    for key in saved:
        if hasattr(saved[key], "size"):
            assert saved[key].size == ep_saved[key].size, key
    assert "chained_1.optimizer.state.exp_avg_sq.module.decoder.layers.mlp.experts.experts.linear_fc2.weight" in saved
    assert_same_losses(
        {i: r for i, r in train_records(runs["c"]).items() if i <= 2 * K}, train_records(runs["a"]), range(K + 1, 2 * K + 1)
    )


def test_ep_checkpoint_loads_in_replicate_mode(runs):
    c, d = train_records(runs["c"]), train_records(runs["d"])
    assert_same_losses(d, c, range(2 * K + 1, 3 * K + 1))
    output = runs["d"].output
    assert "checkpoint: replicate: the checkpoint holds no replicate placement (saved in another mode); starting from static replication" in output
    assert f"checkpoint: replicate: experts' master weights and Adam moments loaded (step {2 * K})" in output


# ---- the optimizer's checkpoint form, in one process ---------------------------------------


def _describe(sharded_state_dict) -> dict[str, str]:
    """Every leaf of a nested sharded state dict by its path: sharded tensors by key, global shape,
    offset and dtype; non-persistent objects (parameter ids) and common values by their repr."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    out = {}

    def walk(value, path):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif isinstance(value, ShardedTensor):
            out[path] = f"{value.key} {value.global_shape} {value.global_offset} {value.dtype}"
        elif isinstance(value, LocalNonpersistentObject):
            out[path] = f"nonpersistent {value.unwrap()!r}"
        else:
            out[path] = repr(value)

    walk(sharded_state_dict, "")
    return out


def _ep_and_frozen_forms(bf16: bool, distributed: bool) -> list[dict[str, str]]:
    """On each of 2 ranks (EP 2): ep's optimizer sharded state dict for a tiny MoE GPT, and the one built for the same model
    with frozen experts by `compat.moe.ep_optimizer_sharded_state_dict` (loading templates)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_patches.compat import mcore, moe, prepare_megatron

    prepare_megatron(False)
    # EP = 2: with EP = 1 Megatron counts experts as dense parameters (their allreduce attribute).
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    dtype = torch.bfloat16 if bf16 else torch.float32

    def build(frozen: bool):
        config = TransformerConfig(
            num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=2, moe_router_topk=2,
            moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
            hidden_dropout=0.0, attention_dropout=0.0,
        )
        model = GPTModel(config, get_gpt_layer_local_spec(num_experts=2), vocab_size=64, max_sequence_length=8)
        if bf16:
            model = Float16Module(config, model)
        experts = [p for name, p in model.named_parameters() if ".experts." in name]
        for p in experts if frozen else []:
            p.requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16, use_distributed_optimizer=distributed)
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16, params_dtype=dtype, use_distributed_optimizer=distributed), [ddp]
        )
        return ddp, optimizer, experts

    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    ddp, optimizer, _ = build(frozen=False)
    mcore.prepare_optimizer_state(optimizer, is_loading=True)  # as the loop's loading does
    ep_form = optimizer.sharded_state_dict(ddp.sharded_state_dict(), is_loading=True, metadata=metadata)
    ddp, optimizer, experts = build(frozen=True)
    mcore.prepare_optimizer_state(optimizer, is_loading=True)
    model_sd = ddp.sharded_state_dict()
    groups = moe.frozen_expert_param_groups([ddp], optimizer, experts)
    buffers = {p: {name: torch.zeros(p.shape) for name in ("exp_avg", "exp_avg_sq", "fp32_param")} for p in experts}
    frozen_form = moe.ep_optimizer_sharded_state_dict(optimizer, model_sd, groups, buffers, None, is_loading=True)
    return [_describe(ep_form), _describe(frozen_form)]


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_frozen_expert_optimizer_form_is_eps(bf16, distributed):
    # Fresh processes, not forks: by this point in a full run the pytest process has thread pools,
    # and a forked child that inherits them can hang (it did in CI, past the 300 s timeout).
    for ep_form, frozen_form in run_ranks(2, __file__, "_ep_and_frozen_forms", timeout=300, args=(bf16, distributed)):
        assert any("chained_1.optimizer.state.exp_avg." in v for v in ep_form.values())
        # the fp32 master weights: Float16OptimizerWithFloat16Params' fp32_param, every
        # DistributedOptimizer's param (fp32 training too)
        assert any(".state.fp32_param." in v for v in ep_form.values()) == (bf16 and not distributed)
        assert any("chained_1.optimizer.state.param." in v for v in ep_form.values()) == distributed
        assert _by_tensor_key(frozen_form) == _by_tensor_key(ep_form)


def _by_tensor_key(form: dict[str, str]) -> dict[str, str]:
    """A DistributedOptimizer's param_state is a dict by parameter index in its gradient buffer's
    order, which never reaches the files (tensors are stored by key and offset): its entries are
    named by their tensor's key, shape, offset and dtype instead."""
    out = {}
    for path, value in form.items():
        match = re.fullmatch(r"(.*/param_state)/\d+/(\w+)", path)
        out[f"{match[1]}/{value}/{match[2]}" if match else path] = value
    return out
