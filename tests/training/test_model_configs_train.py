"""Today's MoE models, shrunk: the tiny variants of configs/models/ train in every mode (issue 43).

DeepSeek-V3 (MLA with a query latent, a dense leading layer, 32 fine-grained experts top-8 with a
shared expert, sigmoid scores with the expert bias, group-limited routing, one MTP depth),
DeepSeek-V2-Lite (MLA without a query latent, two shared experts, a dense leading layer),
Qwen3-30B-A3B (32 fine-grained experts top-8, grouped-query attention with query/key norms and
heads wider than the hidden size) and Mixtral 8x7B: each `configs/models/<name>_tiny.yaml` with
the embedded job's run settings (configs/tiny_job.yaml, one sequence per rank and micro-batch),
nothing else but the mode, on 4 gloo ranks at Megatron-LM's defaults for every flag left out:
default dropout 0.1, EP the largest valid (4), fssdp's auto t and m, replicate's default slots
(16 for 32 experts on 4 ranks), 12 iterations (every model's loss falls by more than 0.5 in them).

- fssdp and replicate compute ep's model: losses within 1e-5 of ep's, at the default dropout
  (measured over 20 iterations: 2.3e-8 and 2.4e-8 on DeepSeek-V3 tiny);
- each model is the size count_parameters says: rank 0 holds the dense parameters and a quarter of
  every MoE layer's experts (the MTP layer's included);
- the placement modes balance what EP leaves unbalanced: on the same routing (each run's loads
  under EP's ownership against its own placement), their busiest rank takes fewer tokens than
  EP's would, on average over the run;
- zebra builds all four: Mixtral and DeepSeek-V3 (MLA, a dense leading layer and the shared
  expert on zebra's attention ranks, the expert bias, group-limited routing, the MTP layer in its
  schedule) within 1e-5 of ep without dropout (zebra draws the masks in another order), Qwen3 and
  DeepSeek-V2-Lite train at the default dropout.
- Megatron-LM's --log-params-norm and --log-num-zeros-in-grad in fssdp (its owned experts are
  Megatron's parameters, each once): ep's values, in fp32 (Mixtral tiny without dropout);
- SwiGLU experts (all four models) go through checkpoints: Megatron saves a SwiGLU fc1 weight as
  two halves (a ShardedTensorFactory), and replicate's and zebra's expert optimizer state follows
  it (a replicate save with the distributed optimizer failed on it before, found by Megatron-LM's
  Mixtral recipe); the runs resumed at iteration 6 repeat the saved runs' losses bit for bit
  (replicate: Mixtral; zebra: DeepSeek-V3, so MLA, the shared expert, the expert bias and the MTP
  layer go through zebra's checkpoint too);
- fssdp saves DeepSeek-V3 tiny's MTP layer's experts (before: refused, a decoder layer's key
  expected) and resumes on the saved run's losses (1e-6: its automatic choices follow measured times).
One spawn of 4 ranks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_patches.config.models import count_parameters, load_model_config, moe_layer_numbers
from support.precision import relative
from support.training import NO_DROPOUT, REPO, launch_many

pytestmark = pytest.mark.e2e

VARIANTS = ("deepseek_v3_tiny", "deepseek_v2_lite_tiny", "qwen3_30b_a3b_tiny", "mixtral_8x7b_tiny")
ITERS = 12
SAVE_AT = 6
RANKS = 4
MODES = {"ep": [], "fssdp": ["--moe-parallel-mode", "fssdp"], "replicate": ["--moe-parallel-mode", "replicate"]}
NORMS = ["--log-params-norm", "--log-num-zeros-in-grad"]
ZEBRA = ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "2", "--zebra-expert-ranks", "2",
         "--zebra-microbatches", "2"]  # global batch 1 x 2 micro-batches x 2 attention ranks = ep's 4


def job(variant: str) -> list[str]:
    return [f"--config={REPO / 'configs' / 'models' / f'{variant}.yaml'}", f"--config={REPO / 'configs' / 'tiny_job.yaml'}",
            "--micro-batch-size", "1", "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def runs(workdir):
    flags = {f"{variant}_{mode}": [*job(variant), *more] for variant in VARIANTS for mode, more in MODES.items()}
    for mode in ("ep", "replicate"):  # replicate's norms add its expert slices to Megatron's
        flags[f"mixtral_8x7b_tiny_{mode}"] += NORMS
    flags["mixtral_8x7b_tiny_ep_no_dropout"] = [*job("mixtral_8x7b_tiny"), *NO_DROPOUT, *NORMS]
    flags["mixtral_8x7b_tiny_fssdp_no_dropout"] = [*job("mixtral_8x7b_tiny"), *NO_DROPOUT, *NORMS, *MODES["fssdp"]]
    flags["mixtral_8x7b_tiny_zebra_no_dropout"] = [*job("mixtral_8x7b_tiny"), *NO_DROPOUT, *ZEBRA, *NORMS]
    for variant in ("qwen3_30b_a3b_tiny", "deepseek_v2_lite_tiny"):
        flags[f"{variant}_zebra"] = [*job(variant), *ZEBRA]
    flags["deepseek_v3_tiny_ep_no_dropout"] = [*job("deepseek_v3_tiny"), *NO_DROPOUT]
    flags["deepseek_v3_tiny_zebra_no_dropout"] = [*job("deepseek_v3_tiny"), *NO_DROPOUT, *ZEBRA]
    # SwiGLU experts through a checkpoint: replicate with the distributed optimizer (Mixtral), zebra
    # (DeepSeek-V3: its MLA, shared expert, expert bias and MTP layer through zebra's checkpoint too)
    trackers = {}
    for mode, variant, more in (("replicate", "mixtral_8x7b_tiny", [*MODES["replicate"], "--use-distributed-optimizer"]),
                                ("zebra", "deepseek_v3_tiny", ZEBRA)):
        saved = workdir / f"ckpt_{mode}"
        flags[f"swiglu_{mode}_saved"] = [*job(variant), *more, "--save", str(saved), "--save-interval", str(SAVE_AT)]
        flags[f"swiglu_{mode}_resumed"] = [*job(variant), *more, "--load", str(saved)]
        trackers[f"swiglu_{mode}_resumed"] = (saved, SAVE_AT)
    # fssdp's checkpoint of a model with an MTP layer, whose MoE layer is not one of the decoder's
    saved = workdir / "ckpt_mtp_fssdp"
    flags["deepseek_v3_tiny_fssdp"] += ["--save", str(saved), "--save-interval", str(SAVE_AT)]
    flags["mtp_fssdp_resumed"] = [*job("deepseek_v3_tiny"), *MODES["fssdp"], "--load", str(saved)]
    trackers["mtp_fssdp_resumed"] = (saved, SAVE_AT)
    return launch_many(RANKS, flags, workdir, trackers=trackers)


def rank0_parameters(variant: str) -> int:
    """What rank 0 holds at EP 4: everything but three quarters of each MoE layer's routed experts."""
    cfg = load_model_config(variant)
    moe_layers = len(moe_layer_numbers(cfg.moe_layer_freq, cfg.num_layers, cfg.mtp_num_layers))
    routed = moe_layers * cfg.num_experts * (count_parameters(cfg)["experts"] // (cfg.num_moe_layers * cfg.num_experts))
    return count_parameters(cfg)["total"] - routed * (RANKS - 1) // RANKS


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_mode_trains_the_model_as_ep_does(runs, variant):
    ep = runs[f"{variant}_ep"]
    for mode in MODES:
        run = runs[f"{variant}_{mode}"]
        assert len(run.losses) == ITERS and all(math.isfinite(x) for x in run.losses), (mode, run.losses)
        assert run.losses[-1] < run.losses[0] - 0.3, (mode, run.losses)
        assert f"{rank0_parameters(variant):,} parameters on rank 0" in run.output, mode
        assert relative(run.losses, ep.losses).max() <= 1e-5, (mode, run.losses, ep.losses)


@pytest.mark.parametrize("variant", VARIANTS)
def test_placement_modes_relieve_the_busiest_rank(runs, variant):
    def busiest(run) -> float:
        # every MoE layer's busiest rank over its even share, averaged over layers and iterations
        return float(np.mean([[layer["imbalance"] for layer in r["moe_layers"]] for r in run.records if "loss" in r]))

    def placed(run, mode) -> float:
        return float(np.mean([[layer["imbalance"] for layer in r[mode]["layers"]] for r in run.records if "loss" in r]))

    for mode in ("fssdp", "replicate"):
        run = runs[f"{variant}_{mode}"]
        assert placed(run, mode) < busiest(run), (mode, placed(run, mode), busiest(run))


def test_zebra_trains_all_four_models(runs):
    for variant in ("mixtral_8x7b_tiny", "deepseek_v3_tiny"):
        ep, zebra = runs[f"{variant}_ep_no_dropout"], runs[f"{variant}_zebra_no_dropout"]
        assert len(zebra.losses) == ITERS and relative(zebra.losses, ep.losses).max() <= 1e-5, (variant, zebra.losses,
                                                                                                ep.losses)
    v3 = [[r["mtp_loss"][0] for r in run.records if "loss" in r]
          for run in (runs["deepseek_v3_tiny_zebra_no_dropout"], runs["deepseek_v3_tiny_ep_no_dropout"])]
    assert relative(*v3).max() <= 1e-5, v3
    for variant in ("qwen3_30b_a3b_tiny", "deepseek_v2_lite_tiny"):
        run = runs[f"{variant}_zebra"]
        assert len(run.losses) == ITERS and all(math.isfinite(x) for x in run.losses), variant
        assert run.losses[-1] < run.losses[0] - 0.3, (variant, run.losses)


@pytest.mark.parametrize("mode", ["replicate", "zebra"])
def test_swiglu_experts_resume_bit_for_bit(runs, mode):
    saved, resumed = runs[f"swiglu_{mode}_saved"], runs[f"swiglu_{mode}_resumed"]
    assert [r["iteration"] for r in resumed.records if "loss" in r] == list(range(SAVE_AT + 1, ITERS + 1))
    assert resumed.losses == saved.losses[SAVE_AT:], (resumed.losses, saved.losses)


def test_mtp_layer_resumes_bit_for_bit_in_fssdp(runs):
    """fssdp names the experts its slots hold by their modules' paths; the MTP layer's MLP is at
    mtp.layers.0.transformer_layer.mlp, not among the decoder's layers (before: the save stopped
    with "state-dict prefix ... does not end in '4.mlp.'")."""
    saved, resumed = runs["deepseek_v3_tiny_fssdp"], runs["mtp_fssdp_resumed"]
    assert [r["iteration"] for r in resumed.records if "loss" in r] == list(range(SAVE_AT + 1, ITERS + 1))
    # not bit for bit: fssdp's automatic t and calibration follow measured times, so the copies,
    # and the order gradients are summed in, vary from run to run (two straight runs: 5e-8 apart)
    assert relative(resumed.losses, saved.losses[SAVE_AT:]).max() <= 1e-6, (resumed.losses, saved.losses)
    mtp = [[r["mtp_loss"][0] for r in run.records if "loss" in r] for run in (resumed, saved)]
    assert relative(mtp[0], mtp[1][SAVE_AT:]).max() <= 1e-6


@pytest.mark.parametrize("mode, dropout", [("fssdp", "_no_dropout"), ("replicate", ""), ("zebra", "_no_dropout")])
def test_every_mode_logs_ep_s_parameter_norm_and_gradient_zeros(runs, mode, dropout):
    ep, run = runs[f"mixtral_8x7b_tiny_ep{dropout}"], runs[f"mixtral_8x7b_tiny_{mode}{dropout}"]
    assert relative(run.losses, ep.losses).max() <= 1e-5
    norms = [[r["params_norm"] for r in each.records if "loss" in r] for each in (run, ep)]
    assert len(norms[0]) == ITERS and relative(*norms).max() <= 1e-6, norms
    zeros = [[r["num_zeros_in_grad"] for r in each.records if "loss" in r] for each in (run, ep)]
    if mode in ("fssdp", "zebra"):
        # zebra, and fssdp in some runs, sum in another order (their losses agree to 1e-5, not
        # always bit for bit): an element's gradient can be exactly zero in one run and a rounding
        # residue in the other (seen: 1 of 3.2 M at one iteration of 20 in zebra; fssdp 3,202,049
        # against ep's 3,202,048 at iteration 4 of 12, its losses then 5e-8 from ep's)
        assert max(abs(a - b) for a, b in zip(*zeros)) <= 1e-5 * max(zeros[1]), zeros
    else:
        assert zeros[0] == zeros[1], zeros
