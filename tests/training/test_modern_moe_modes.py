"""Today's MoE architectures in the placement modes (issue 43), against ep on the same data.

Shared experts (`--moe-shared-expert-intermediate-size`, DeepSeek/Qwen-style): dense and
data-parallel beside the routed experts, which the mode places; fssdp and replicate keep
Megatron's shared-expert stage of the MoE layer unchanged. 4 gloo ranks, EP = 4, one spawn:

- fp32 on the embedded corpus without dropout: fssdp (fixed t and m) and replicate compute ep's
  model, losses within 1e-5 (they agree to the bit on this machine);
- Megatron's default dropout (0.1): the same, nothing in fssdp's or replicate's steps draws from
  the training's random streams;
- bf16 with full recompute on mock tokens (CPU bf16 matmuls at the corpus' 50k vocabulary are
  10x slower): each mode follows ep-bf16 within bf16's noise, measured over the other runs
  against ep-fp32 (`support/precision.py`).

Aux-loss-free and group-limited routing (`ROUTING`: sigmoid scores, the expert bias, a top-k
scaling factor, 4 groups of which 2 are picked, z-loss, fp32 router, no auxiliary loss),
DeepSeek-V3's router, with a shared expert: fssdp and replicate keep Megatron's router and place
what it routes, and the expert bias is updated from the logical experts' world-wide counts in
Megatron's finalize_model_grads, as in ep; so the routed loads are ep's every iteration (a bias
that moved otherwise would route otherwise) and the losses within 1e-5.

Multi-latent attention (DeepSeek-V2/V3's, with a query latent and query/key norms) with a shared
expert: only the attention changes, which fssdp and replicate leave to Megatron; losses within 1e-5.

Multi-token prediction (DeepSeek-V3's, one MTP layer repeating the decoder's last, an MoE layer,
with a shared expert): the MTP layer's MoE layer is built from the mode's layer spec like the
decoder's, so the mode places it as MoE layer num_layers + 1; it is in the loads and the mode's
records, and the losses (main and MTP) are ep's within 1e-5, at EP 4 and with the MTP layer on the
last of 2 pipeline stages (PP 2 x EP 2).

Zebra (2 attention + 2 expert ranks, 2 micro-batches: ep's global batch) runs the shared expert
on its attention ranks and Megatron's router as ep does, with the expert bias moved after each
iteration from the world's routed counts (compat.mcore.update_expert_bias):
- shared experts without dropout: ep's losses within 1e-5 (measured 7e-8); at the default dropout
  zebra draws the masks in another order, so it is not compared with ep here (it trains Qwen3 and
  DeepSeek-V2-Lite at the default dropout: tests/training/test_model_configs_train.py);
- the DeepSeek-V3 router: ep's losses and routed loads (measured: bit for bit), and the bias goes
  through zebra's checkpoint (a buffer: the attention ranks save and load it) so a run resumed at
  iteration 4 repeats the saved run's losses bit for bit;
- multi-latent attention (its own rotary embedding, as GPTModel passes none): ep's losses
  (measured: bit for bit, with full recompute too);
- multi-token prediction (the MTP layer one more MoE layer of zebra's schedule, the losses by
  GPTModel's own post-processing), with full recompute: ep's losses and MTP losses within 1e-5
  (measured 2.3e-8; 2 depths bit for bit), the MTP layer's loads ep's;
- bf16 with full recompute: follows ep-bf16 within bf16's noise.
Zebra refuses --moe-shared-expert-overlap (an option of the all-to-all dispatcher it does not
use) and MTP after a dense last layer (its MTP layers are MoE layers), naming why.
"""

from __future__ import annotations

import pytest

from megatron_patches.config.flags import ArgumentError
from megatron_patches.training.arguments import parse_args
from megatron_patches.training.validation import validate_args
from support.precision import NoiseScale, relative
from support.training import MOCK, NO_DROPOUT, TINY_JOB, launch_many

pytestmark = pytest.mark.e2e

SHARED = ["--moe-shared-expert-intermediate-size", "96", "--disable-bias-linear"]
COMMON = ["--expert-model-parallel-size", "4", "--log-interval", "1", "--eval-interval", "1000",
          "--lr-warmup-iters", "2", *SHARED]
MODES = {"ep": [], "fssdp": ["--moe-parallel-mode", "fssdp", "--fssdp-overlap-degree", "2",
                             "--fssdp-memory-capacity", "2"],
         "replicate": ["--moe-parallel-mode", "replicate"]}
ROUTING = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
           "0.01", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4", "--moe-router-group-topk",
           "2", "--moe-z-loss-coeff", "1e-3", "--moe-router-dtype", "fp32", "--moe-router-load-balancing-type", "none",
           "--moe-aux-loss-coeff", "0"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "8", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "16", "--position-embedding-type", "rope", "--normalization",
       "RMSNorm", "--qk-layernorm"]
MTP = ["--mtp-num-layers", "1"]
PP2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
ZEBRA = ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "2", "--zebra-expert-ranks", "2",
         "--zebra-microbatches", "2", "--expert-model-parallel-size", "1"]  # zebra's own EP (COMMON's 4 overridden)
ZEBRA_SAVE_AT = 4
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
ITERS = 8


@pytest.fixture(scope="module")
def runs(workdir):
    flags = {}
    for mode, more in MODES.items():
        flags[f"{mode}_fp32"] = [*COMMON, *NO_DROPOUT, "--train-iters", str(ITERS), *more]
        flags[f"{mode}_dropout"] = [*COMMON, "--train-iters", str(ITERS), *more]
        flags[f"{mode}_routing"] = [*COMMON, *NO_DROPOUT, *ROUTING, "--train-iters", str(ITERS), *more]
        flags[f"{mode}_mla"] = [*COMMON, *NO_DROPOUT, *MLA, "--train-iters", str(ITERS), *more]
        flags[f"{mode}_mtp"] = [*COMMON, *NO_DROPOUT, *MTP, "--train-iters", str(ITERS), *more]
        flags[f"{mode}_mtp_pp2"] = [*COMMON, *NO_DROPOUT, *MTP, *PP2, "--train-iters", str(ITERS), *more]
    flags["ep_mock_fp32"] = [*COMMON, *MOCK, "--train-iters", str(ITERS), *NO_DROPOUT]
    for mode, more in {**MODES, "zebra": ZEBRA}.items():
        flags[f"{mode}_bf16"] = [*COMMON, *MOCK, "--train-iters", str(ITERS), *NO_DROPOUT, "--bf16", *FULL_RECOMPUTE,
                                 *more]
    saved = workdir / "ckpt_zebra_routing"
    flags["zebra_fp32"] = [*COMMON, *NO_DROPOUT, "--train-iters", str(ITERS), *ZEBRA]
    flags["zebra_mla"] = [*COMMON, *NO_DROPOUT, *MLA, "--train-iters", str(ITERS), *ZEBRA]
    flags["zebra_mtp"] = [*COMMON, *NO_DROPOUT, *MTP, "--train-iters", str(ITERS), *ZEBRA, *FULL_RECOMPUTE]
    flags["zebra_routing"] = [*COMMON, *NO_DROPOUT, *ROUTING, "--train-iters", str(ITERS), *ZEBRA, "--save", str(saved),
                              "--save-interval", str(ZEBRA_SAVE_AT)]
    flags["zebra_routing_resumed"] = [*COMMON, *NO_DROPOUT, *ROUTING, "--train-iters", str(ITERS), *ZEBRA, "--load",
                                      str(saved)]
    return launch_many(4, flags, workdir, trackers={"zebra_routing_resumed": (saved, ZEBRA_SAVE_AT)})


def routed_loads(run) -> list:
    return [[layer["expert_tokens"] for layer in r["moe_layers"]] for r in run.records if "loss" in r]


@pytest.mark.parametrize("mode", ["fssdp", "replicate"])
def test_shared_experts_train_as_in_ep(runs, mode):
    for variant, tolerance in (("fp32", 1e-5), ("dropout", 1e-7)):
        ep, run = runs[f"ep_{variant}"], runs[f"{mode}_{variant}"]
        assert len(run.losses) == ITERS
        assert relative(run.losses, ep.losses).max() <= tolerance, (variant, run.losses, ep.losses)
    # the shared expert is in the model: 2 MoE layers x (fc1 64 x 96 + fc2 96 x 64) beside the routed experts
    assert "3,352,192 parameters" in runs[f"{mode}_fp32"].output


@pytest.mark.parametrize("mode", ["fssdp", "replicate"])
def test_aux_loss_free_group_limited_routing_routes_and_trains_as_in_ep(runs, mode):
    ep, run = runs["ep_routing"], runs[f"{mode}_routing"]
    assert relative(run.losses, ep.losses).max() <= 1e-5, (run.losses, ep.losses)
    assert routed_loads(run) == routed_loads(ep)
    # the bias moved the routing: without it (the shared-expert runs, same data) the loads differ
    assert routed_loads(run)[-1] != routed_loads(runs["ep_fp32"])[-1]


@pytest.mark.parametrize("mode", ["fssdp", "replicate", "zebra"])
def test_multi_latent_attention_trains_as_in_ep(runs, mode):
    ep, run = runs["ep_mla"], runs[f"{mode}_mla"]
    assert len(run.losses) == ITERS and relative(run.losses, ep.losses).max() <= 1e-5, (run.losses, ep.losses)
    assert ep.losses != runs["ep_fp32"].losses  # another attention, not the default one


@pytest.mark.parametrize("mode", ["fssdp", "replicate"])
def test_multi_token_prediction_layers_are_placed_and_train_as_in_ep(runs, mode):
    for variant in ("mtp", "mtp_pp2"):
        ep, run = runs[f"ep_{variant}"], runs[f"{mode}_{variant}"]
        assert len(run.losses) == ITERS and relative(run.losses, ep.losses).max() <= 1e-5, (variant, run.losses, ep.losses)
        mtp = [r["mtp_loss"][0] for r in run.records if "loss" in r]
        assert relative(mtp, [r["mtp_loss"][0] for r in ep.records if "loss" in r]).max() <= 1e-5, variant
        # MoE layer 3 is the MTP layer's: in the loads every iteration, routed as in ep
        routed = [[layer["expert_tokens"] for layer in r["moe_layers"]] for r in run.records if "loss" in r]
        assert all(len(layers) == 3 for layers in routed), variant
        assert [layers[2] for layers in routed] == [[layer["expert_tokens"] for layer in r["moe_layers"]][2]
                                                     for r in ep.records if "loss" in r], variant
    # ... and placed by the mode: its records name it, with the pipeline's last stage's layers at PP 2
    for variant in ("mtp", "mtp_pp2"):
        placed = [[layer["layer"] for layer in r[mode]["layers"]] for r in runs[f"{mode}_{variant}"].records if "loss" in r]
        assert placed == [[1, 2, 3]] * ITERS, variant
    assert runs["ep_mtp"].losses != runs["ep_fp32"].losses  # the MTP loss is in the gradient


@pytest.mark.parametrize("mode", ["fssdp", "replicate", "zebra"])
def test_shared_experts_in_bf16_with_full_recompute_follow_ep_within_bf16_noise(runs, mode):
    half = {name: runs[f"{name}_bf16"].losses for name in [*MODES, "zebra"]}
    reference = runs["ep_mock_fp32"].losses
    assert 1e-5 < relative(half["ep"], reference).max() < 1e-2  # bf16 rounding, not fp32's
    noise = NoiseScale.over_others(half, reference, mode)
    noise.check(relative(half[mode], half["ep"]), f"{mode}-bf16 with shared experts vs ep-bf16")


def test_zebra_runs_shared_experts_on_its_attention_ranks_as_ep_does(runs):
    zebra, ep = runs["zebra_fp32"], runs["ep_fp32"]
    assert len(zebra.losses) == ITERS and relative(zebra.losses, ep.losses).max() <= 1e-5, (zebra.losses, ep.losses)


def test_zebra_routes_with_the_expert_bias_as_ep_does_and_resumes_it(runs):
    zebra, ep = runs["zebra_routing"], runs["ep_routing"]
    assert relative(zebra.losses, ep.losses).max() <= 1e-5, (zebra.losses, ep.losses)
    assert routed_loads(zebra) == routed_loads(ep)
    # the bias is in the checkpoint: a resumed run that routed with a zero bias would route otherwise
    resumed = runs["zebra_routing_resumed"]
    assert [r["iteration"] for r in resumed.records if "loss" in r] == list(range(ZEBRA_SAVE_AT + 1, ITERS + 1))
    assert resumed.losses == zebra.losses[ZEBRA_SAVE_AT:], (resumed.losses, zebra.losses)
    assert routed_loads(resumed) == routed_loads(zebra)[ZEBRA_SAVE_AT:]


def test_zebra_runs_the_mtp_layer_in_its_schedule_as_ep_does(runs):
    zebra, ep = runs["zebra_mtp"], runs["ep_mtp"]
    assert len(zebra.losses) == ITERS and relative(zebra.losses, ep.losses).max() <= 1e-5, (zebra.losses, ep.losses)
    mtp = [[r["mtp_loss"][0] for r in run.records if "loss" in r] for run in (zebra, ep)]
    assert relative(*mtp).max() <= 1e-5, mtp
    assert [layers[2] for layers in routed_loads(zebra)] == [layers[2] for layers in routed_loads(ep)]


def test_zebra_refuses_the_dispatcher_s_shared_expert_overlap_and_mtp_after_a_dense_layer():
    zebra = [*TINY_JOB, *ZEBRA]
    with pytest.raises(ArgumentError, match=r"--mtp-num-layers=1: zebra runs each MTP layer as one more MoE layer "
                                            r".* valid: an MoE last layer"):
        validate_args(parse_args([*zebra, *MTP, "--moe-layer-freq", "2"]), 4)
    with pytest.raises(ArgumentError, match=r"--moe-shared-expert-overlap=True: zebra runs the shared expert on the "
                                            r"attention ranks .* drop it"):
        validate_args(parse_args([*zebra, *SHARED, "--moe-shared-expert-overlap"]), 4)
    validate_args(parse_args([*zebra, *SHARED, *ROUTING, *MLA, *MTP]), 4)
