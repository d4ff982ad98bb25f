"""Megatron-LM's own published MoE scripts through `pretrain_gpt_moe.py`, unchanged but for sizes
and paths.

tests/data/megatron_lm_scripts/*.json holds each script's flags as Megatron-LM's authors wrote them
(source path and commit in the file: example recipes, and functional-test configurations of
Megatron-LM's CI), the sizes shrunk to CPU ranks (`shrink`, with the reason in `why`; `ranks`, 2
unless given) and the flags a recipe leaves to its caller (`add`). Their data and tokenizer paths
become the mock dataset, their checkpoint, cache and TensorBoard paths a work folder; NCCL becomes
gloo and Transformer Engine Megatron's local modules (device choices).
Each then validates (unit) and trains 2 iterations in ep on its gloo ranks (e2e), one spawn per
rank count. The three model recipes (Mixtral 8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite: bf16, grouped
GEMM, sequence parallelism; DeepSeek's MLA, shared experts and dense first layer) also train in
fssdp and replicate, in the same spawn, within bf16's rounding of ep's losses (2^-8 relative;
measured 2026-11-28: fssdp 0, replicate up to 6.7e-7). The CI configurations log parameter norms
and gradient zeros: they train in fssdp too (whose owned experts are Megatron's parameters), with
ep's losses and parameter norms within bf16's rounding; replicate accepts them (it adds its expert
slices' norm and zeros; trained against ep's norms in tests/training/test_model_configs_train.py),
and they are not trained in replicate here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from support.precision import relative
from support.training import launch_many

from megatron_patches.training.arguments import parse_args
from megatron_patches.training.validation import validate_args

SCRIPTS = sorted((Path(__file__).parents[1] / "data" / "megatron_lm_scripts").glob("*.json"))
RANKS = 2

# The scripts' path and device flags -> what they become here (None: left out).
PATHS = {"--tokenizer-type": "NullTokenizer", "--tokenizer-model": None, "--data-path": None, "--vocab-file": None,
         "--merge-file": None, "--data-cache-path": "{work}/cache", "--save": "{work}/ckpt", "--load": "{work}/ckpt",
         "--tensorboard-dir": "{work}/tensorboard", "--distributed-backend": "gloo", "--transformer-impl": None}
MOCK = ["--mock-data", "--vocab-size", "1000"]


def shrunk_argv(script: dict, work: Path) -> list[str]:
    """The script's flags with `shrink`'s sizes and PATHS' paths (under `work`), then `add` and MOCK."""
    argv, tokens = [], list(script["argv"])
    while tokens:
        flag = tokens.pop(0)
        value = tokens.pop(0) if tokens and not tokens[0].startswith("--") else None
        if flag in PATHS:
            if PATHS[flag] is not None:
                argv += [flag, PATHS[flag].format(work=work)]
            continue
        value = script.get("shrink", {}).get(flag, value)
        argv += [flag] if value is None else [flag, value]
    return [*argv, *script.get("add", []), *MOCK]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_a_published_script_validates_unchanged_but_for_sizes(path, tmp_path):
    script = json.loads(path.read_text())
    assert script["source"]["commit"].startswith("55ac7082517c") and script["source"]["tag"] == "core_v0.16.1"
    for flag in script.get("shrink", {}):
        assert flag in script["argv"], f"{path.name}: shrinks {flag}, which the script does not give"
    argv = shrunk_argv(script, tmp_path / path.stem)
    args = validate_args(parse_args(argv), script.get("ranks", RANKS))
    assert "the command line" in args.model_source  # Megatron-LM's defaults for what the script leaves out
    given_ep = int(argv[len(argv) - 1 - argv[::-1].index("--expert-model-parallel-size") + 1])  # the last one given
    assert args.moe_parallel_mode == "ep" and args.expert_model_parallel_size == given_ep


RECIPES = ("deepseek_v2_lite", "mixtral_8x7b", "qwen3_30b_a3b")
"""The model recipes; the CI configurations log parameter norms, which replicate refuses."""
PLACEMENT_MODES = ("fssdp", "replicate")


def modes_of(name: str) -> tuple[str, ...]:
    """The placement modes a script trains in here besides ep."""
    return PLACEMENT_MODES if name in RECIPES else ("fssdp",)


def test_the_ci_configurations_are_accepted_by_replicate_with_their_norm_flags(tmp_path):
    checked = 0
    for path in SCRIPTS:
        if path.stem in RECIPES:
            continue
        script = json.loads(path.read_text())
        argv = [*shrunk_argv(script, tmp_path / path.stem), "--moe-parallel-mode", "replicate"]
        args = validate_args(parse_args(argv), script.get("ranks", RANKS))
        assert args.log_params_norm and args.log_num_zeros_in_grad, path.stem
        checked += 1
    assert checked >= 1


@pytest.fixture(scope="module")
def published(workdir):
    """Every script in ep, and the recipes in fssdp and replicate: {run name: Run}, ep's under the
    script's name and the others as `<script>_<mode>`."""
    scripts = {path.stem: json.loads(path.read_text()) for path in SCRIPTS}
    runs = {}
    for ranks in sorted({script.get("ranks", RANKS) for script in scripts.values()}):
        here = {name: script for name, script in scripts.items() if script.get("ranks", RANKS) == ranks}
        flags = {name: shrunk_argv(script, workdir / name) for name, script in here.items()}
        flags.update({f"{name}_{mode}": [*shrunk_argv(script, workdir / f"{name}_{mode}"), "--moe-parallel-mode", mode]
                      for name, script in here.items() for mode in modes_of(name)})
        runs.update(launch_many(ranks, flags, workdir))
    return runs


@pytest.mark.e2e
@pytest.mark.parametrize("mode", PLACEMENT_MODES)
def test_the_published_recipes_train_in_the_placement_modes_as_in_ep(published, mode):
    for name in RECIPES:
        ep, run = published[name], published[f"{name}_{mode}"]
        assert [r["iteration"] for r in run.records if "loss" in r] == [r["iteration"] for r in ep.records if "loss" in r]
        assert all(math.isfinite(x) for x in run.losses), (name, run.losses)
        assert relative(run.losses, ep.losses).max() <= 2.0 ** -8, (name, run.losses, ep.losses)


@pytest.mark.e2e
def test_the_ci_configurations_train_in_fssdp_with_ep_s_parameter_norms(published):
    for path in SCRIPTS:
        if path.stem in RECIPES:
            continue
        ep, run = published[path.stem], published[f"{path.stem}_fssdp"]
        assert relative(run.losses, ep.losses).max() <= 2.0 ** -8, (path.stem, run.losses, ep.losses)
        norms = [[r["params_norm"] for r in x.records if "loss" in r] for x in (run, ep)]
        assert relative(*norms).max() <= 2.0 ** -8, (path.stem, norms)
        # bf16 gradients: which elements round to exactly zero follows the summation order (measured
        # 449 against ep's 516 at iteration 2); the exact fp32 check is test_model_configs_train's
        assert all(r["num_zeros_in_grad"] >= 0 for r in run.records if "loss" in r), path.stem


@pytest.mark.e2e
def test_the_published_scripts_train_two_iterations_in_ep(published):
    scripts = {path.stem: json.loads(path.read_text()) for path in SCRIPTS}
    runs = {name: run for name, run in published.items() if name in scripts}
    for name, run in runs.items():
        # the last iteration is always logged; Mixtral's script logs every one, Qwen's recipe keeps
        # Megatron-LM's --log-interval 100
        logged = [r["iteration"] for r in run.records if "loss" in r]
        assert logged == ([1, 2] if "--log-interval" in scripts[name]["argv"] else [2]), name
        assert "GPU kernel choices, not applied on CPU" in run.output, name
        assert "accepted without effect: --use-mcore-models (deprecated in Megatron-LM, no effect there either)" in run.output
    assert "--no-masked-softmax-fusion, --moe-grouped-gemm" in runs["mixtral_8x7b"].output
    assert "--no-masked-softmax-fusion, --no-bias-swiglu-fusion, --no-rope-fusion" in runs["qwen3_30b_a3b"].output
    # DeepSeek-V2-Lite: multi-latent attention, a shared expert, a dense first layer, seq_aux_loss
    deepseek = runs["deepseek_v2_lite"]
    assert "--no-masked-softmax-fusion, --no-rope-fusion, --moe-grouped-gemm" in deepseek.output
    assert [layer["layer"] for layer in deepseek.records[-1]["moe_layers"]] == [2]
    # Megatron-LM's CI configuration: PP 2 x EP 2, sinkhorn top-1, bf16, the logging and checkpoint flags
    functional = runs["functional_gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel"]
    assert "world 4 = TP 1 x PP 2 x DP 2 | EP 2 x ETP 1" in functional.output
    assert all("params_norm" in r and "num_zeros_in_grad" in r for r in functional.records if "loss" in r)
    assert "--dist-ckpt-optim-fully-reshardable (the distributed optimizer's state is always saved fully" in functional.output
    etp1 = runs["functional_gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4"]
    assert "world 4 = TP 2 x PP 1 x DP 2 | EP 4 x ETP 1" in etp1.output and "--moe-grouped-gemm" in etp1.output
    assert "warning (rank" not in etp1.output  # Megatron's known warnings of TP 2 + SP with ETP 1: once, from rank 0


# DeepSeek-V3's features on the embedded tiny job (Megatron's default dropout 0.1), in the precision
# and recompute users run them with, through the pipeline: MLA with a query latent, a gated shared
# expert, two MTP layers on the last of 2 pipeline stages (ep); in fssdp and replicate at EP 2.
DEEPSEEK_FEATURES = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
                     "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--position-embedding-type",
                     "rope", "--disable-bias-linear", "--moe-shared-expert-intermediate-size", "64",
                     "--moe-shared-expert-gate", "--mtp-num-layers", "2", "--train-iters", "3", "--log-interval", "1"]


@pytest.mark.e2e
def test_deepseek_features_train_in_every_mode_with_half_precision_recompute_and_pipelines(workdir):
    full_recompute = ["--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]
    variants = {
        "bf16_full_recompute_pp2": [*DEEPSEEK_FEATURES, *full_recompute, "--pipeline-model-parallel-size", "2"],
        "fp16_selective_ep2": [*DEEPSEEK_FEATURES, "--fp16", "--recompute-granularity", "selective",
                               "--recompute-modules", "mla_up_proj", "shared_experts", "core_attn"],
        "bf16_full_recompute_ep2": [*DEEPSEEK_FEATURES, *full_recompute],
    }
    placed = ("fp16_selective_ep2", "bf16_full_recompute_ep2")  # fssdp and replicate need EP >= 2: PP 1 on 2 ranks
    runs = launch_many(RANKS, {**variants, **{f"{name}_{mode}": [*variants[name], "--moe-parallel-mode", mode]
                                              for name in placed for mode in PLACEMENT_MODES}}, workdir)
    # fssdp and replicate place the decoder's and the MTP layers' experts: ep's losses within half
    # precision's rounding (bf16's 2^-8, the coarser of the two)
    for name in placed:
        for mode in PLACEMENT_MODES:
            placed = runs[f"{name}_{mode}"]
            assert relative(placed.losses, runs[name].losses).max() <= 2.0 ** -8, (name, mode, placed.losses)
            assert [layer["layer"] for layer in placed.records[-1][mode]["layers"]] == [1, 2, 3, 4], (name, mode)
    for name, run in runs.items():
        records = [r for r in run.records if "loss" in r]
        assert [r["iteration"] for r in records] == [1, 2, 3], name
        # one MTP loss per depth, near the LM loss at initialisation (ln 50,304 = 10.83)
        assert all(len(r["mtp_loss"]) == 2 and all(10.0 < v < 11.5 for v in r["mtp_loss"]) for r in records), name
        assert "mtp_1 loss" in run.output and "mtp_2 loss" in run.output, name
        # MoE layers 1 and 2 of the decoder, 3 and 4 the MTP layers (they repeat the last, MoE, layer)
        assert [layer["layer"] for layer in records[-1]["moe_layers"]] == [1, 2, 3, 4], name
        assert all(math.isfinite(r["loss"]) for r in records), name
    # bf16 steps every iteration; fp16's dynamic loss scale may skip its first steps (2**32 halved)
    bf16 = [r for r in runs["bf16_full_recompute_pp2"].records if "loss" in r]
    assert bf16[-1]["loss"] < bf16[0]["loss"] and bf16[-1]["skipped_iterations"] == 0
    assert [r for r in runs["fp16_selective_ep2"].records if "loss" in r][-1]["loss_scale"] < 2**32
