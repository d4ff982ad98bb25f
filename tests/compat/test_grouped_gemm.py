"""fssdp's and replicate's grouped GEMM (`InstanceMoELayer.run_instances` with grouped_gemm on)
against the per-instance path (Megatron's own expert MLP module once per instance), on a real
Megatron MoE layer: outputs and the gradients of the weight rows, tokens and probabilities, for
gated (SwiGLU) and plain (GELU) experts, fp32 and bf16, groups in and out of row order, rows
without tokens, and a rank without any token; and the whole layer (router, dispatch, instances,
combine) against Megatron's own MoELayer. Training with it is in tests/training/test_composition.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from support.mp import single_rank_group
from megatron_patches.comm.virtual import virtual_routing
from megatron_patches.compat import prepare_megatron
from megatron_patches.compat.grouped import grouped_mm_problem
from megatron_patches.mode.layer import InstanceMoELayer

HIDDEN, FFN, EXPERTS = 16, 32, 4


class RowsLayer(InstanceMoELayer):
    """The smallest concrete instance layer, on one rank: every routed token stays here, and
    expert e runs on its own module's weights packed into row e (as ep mode would compute)."""

    def route_to_instances(self, routing_map_TE, probs_TE):
        tokens_ED = routing_map_TE.sum(dim=0).numpy()[:, None]  # one device holds every expert
        return virtual_routing(routing_map_TE, probs_TE, tokens_ED)

    def compute_instances(self, tokens_ND, tokens_per_expert_E, probs_N):
        rows_EN = torch.stack([self.expert_layout.flatten(expert) for expert in self.experts.local_experts])
        counts_E = tokens_per_expert_E.cpu().numpy()
        expert_G = np.flatnonzero(counts_E)
        return self.run_instances(rows_EN, expert_G, counts_E[expert_G], tokens_ND, probs_N)


@pytest.fixture(scope="module")
def megatron_world():
    prepare_megatron(use_cuda=False)
    with single_rank_group():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def layer(gated: bool, dtype: torch.dtype) -> RowsLayer:
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN, num_attention_heads=2,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
        gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp
    return RowsLayer(config, spec.submodules, layer_number=1).to(dtype)


def both_paths(moe: RowsLayer, rows_RN, row_G, counts_G, tokens_ND, probs_N):
    """(output, grad rows, grad tokens, grad probs) per path, from one upstream gradient."""
    upstream = torch.randn(tokens_ND.shape, generator=torch.Generator().manual_seed(7)).to(tokens_ND.dtype)
    results = []
    for grouped in (False, True):
        moe.grouped_gemm = grouped
        leaves = [t.detach().clone().requires_grad_() for t in (rows_RN, tokens_ND, probs_N)]
        output = moe.run_instances(leaves[0], np.asarray(row_G, dtype=np.int64), np.asarray(counts_G, dtype=np.int64),
                                   leaves[1], leaves[2])
        output.backward(upstream)
        results.append([output.detach()] + [leaf.grad for leaf in leaves])
    return results


CASES = {
    # name: (rows, row of each group, tokens of each group)
    "groups in row order": (4, [0, 1, 2, 3], [3, 1, 4, 2]),
    "groups out of row order, rows without tokens": (5, [3, 0, 4], [2, 5, 3]),
    "one group": (3, [2], [6]),
    "no tokens at all": (3, [], []),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "gelu"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_grouped_gemm_equals_the_per_instance_path(megatron_world, case, gated, dtype):
    rows, row_G, counts_G = CASES[case]
    moe = layer(gated, dtype)
    generator = torch.Generator().manual_seed(0)
    rows_RN = (torch.randn(rows, moe.expert_layout.numel, generator=generator) * 0.3).to(dtype)
    tokens_ND = torch.randn(sum(counts_G), HIDDEN, generator=generator).to(dtype)
    probs_N = torch.rand(sum(counts_G), generator=generator)
    per_instance, grouped = both_paths(moe, rows_RN, row_G, counts_G, tokens_ND, probs_N)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, want, got in zip(("output", "rows' gradient", "tokens' gradient", "probs' gradient"), per_instance, grouped):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{name}: {m}")
    # rows that ran no token get no gradient on either path
    idle = sorted(set(range(rows)) - set(row_G))
    assert not grouped[1][idle].any()


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "gelu"])
def test_the_whole_layer_equals_megatrons_moe_layer_with_and_without_grouping(megatron_world, gated):
    """Router, virtual-expert dispatch (one rank), the instances and the combine: the instance
    layer's output equals Megatron's own MoELayer (SequentialMLP experts) on the same weights."""
    moe = layer(gated, torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp
    megatron = MoELayer(moe.config, spec.submodules, layer_number=1)
    megatron.load_state_dict(moe.state_dict())
    hidden_SBH = torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, _ = megatron(hidden_SBH)
        for grouped in (False, True):
            moe.grouped_gemm = grouped
            got, _ = moe(hidden_SBH)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"grouped={grouped}: {m}")


def test_misaligned_widths_and_dtypes_are_named():
    assert grouped_mm_problem(torch.float32, {"--hidden-size": 64}) is None
    assert grouped_mm_problem(torch.bfloat16, {"--hidden-size": 64}) is None
    problem = grouped_mm_problem(torch.bfloat16, {"--hidden-size": 64, "--moe-ffn-hidden-size": 36})
    assert "--moe-ffn-hidden-size=36" in problem and "multiples of 8" in problem
    assert "multiples of 4" in grouped_mm_problem(torch.float32, {"--hidden-size": 6})
