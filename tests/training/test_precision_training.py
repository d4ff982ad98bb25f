"""Mixed precision and activation recompute end to end: `pretrain_gpt_moe.py` on 4 gloo ranks,
EP = 4 (so fssdp's and replicate's group is the world), the tiny GPT-MoE on Megatron's mock
tokens with a 1000-token vocabulary (CPU bf16 matmuls at the embedded corpus' 50k vocabulary
would cost this file 20 minutes).

bf16: fssdp and replicate in bf16 run ep's bf16 forward exactly (the same bf16 weights: the first
iterations agree to 1e-6), but their expert weight gradients are partial sums per holder, each
rounded to bf16 by autograd before the fp32 reduction, where ep rounds one sum; that difference
is itself bf16 rounding, so later the modes drift from ep-bf16 at the scale of the bf16 noise.
Every such comparison is bounded by several samples of that noise (each other run in the
precision against ep-fp32; `support/precision.py` says why one sample is not enough). zebra (2
attention + 2 expert ranks, 2 micro-batches each: ep's global batch of 8) sums its gradients in
another order, so it drifts alike. A run that stayed fp32 fails (fp32 modes differ by ~1e-8).

fp16 with expert parallelism (which Megatron-LM refuses) trains with a dynamic loss scale that
moves, in ep, fssdp, replicate and zebra, with ep's scale decisions and within fp16's noise (the
test runs zebra with Asym-EA "1,2" and full recompute, the paper's setting). zebra's arithmetic
does not follow timing: the same fp16 run with one rank pausing before every compute task is
bit-identical.

Recompute (full, selective) leaves the fp32 losses unchanged to 1e-6 in every mode, loads are
counted once, in fssdp recompute adds no spAG, and the activation memory measured on every rank
(what a forward keeps for its backward, `compat.activations`) drops. Each mode also trains in
bf16 and in fp16 with recompute and the distributed optimizer (the tolerances are at `HALF`).

bf16 checkpoints hold the fp32 main weights and Adam moments: a resume continues bit-exactly in
the saving mode (fssdp with its placement, replicate with its slots). Resumed in another mode,
the first iteration's loss is the saving run's exactly on 2 ranks (the same bf16 weights and
data; the modes' forwards agree) and within the same-weights bound on 4 (zebra), and from the
second on the modes' bf16 gradient rounding differs (see above), held to the noise bound of the
other modes' straight runs over the same iterations.

The measured figures (noise per precision and kernel set, each mode's drift, activation memory
with and without recompute) are in docs/benchmarks.md, "Half-precision noise across CPU kernel
sets" and "Mixed precision and recompute, measured".
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from support import precision
from support.precision import NoiseScale, same_weights_bound
from support.training import MOCK, Run, launch_many, zebra_replan_flags

pytestmark = pytest.mark.e2e

ITERS = 30
SHORT = 8
# Megatron-LM's aux-loss coefficient 0 (the tiny job sets 1e-2), as the measurements below were
# made; the fp16 aux runs set their own (AUX, later on the command line, wins)
COMMON = [
    *MOCK, "--expert-model-parallel-size", "4", "--lr-warmup-iters", "5", "--lr-decay-iters", str(ITERS),
    "--log-interval", "1", "--eval-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--moe-aux-loss-coeff", "0",
]
REPLICATE = ["--moe-parallel-mode", "replicate", "--replicate-slots-per-rank", "4"]
# t, m fixed and calibration off (its gathers follow measured times), so runs compare bit for bit
FSSDP = ["--moe-parallel-mode", "fssdp", "--fssdp-overlap-degree", "2", "--fssdp-memory-capacity", "2",
         "--no-fssdp-calibrate"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm"]
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2"]
# 2 attention + 2 expert ranks; the global batch of 8 = 2 micro-batches x 2 sequences x 2 attention ranks
ZEBRA = ["--moe-parallel-mode", "zebra", "--expert-model-parallel-size", "1", "--zebra-attention-ranks", "2",
         "--zebra-expert-ranks", "2", "--zebra-microbatches", "2"]
N = 16_576  # elements of one tiny expert: fc1 64x128 + 128, fc2 128x64 + 64
LAYERS, EXPERTS, RANKS = 2, 8, 4


RECOMPUTE = [
    ("ep_full", FULL),
    ("ep_selective", [*SELECTIVE, "moe"]),
    ("fssdp_full_remat", [*FSSDP, *FULL, "--fssdp-rematerialize"]),
    ("replicate_full", [*REPLICATE, *FULL]),
]

# Half precision with recompute and the distributed optimizer (8 iterations, 4 ranks), against
# the same mode and precision without either. Measured (2026-11-25): in bf16 the losses are
# bit-identical in every mode (Megatron reduces bf16 gradients in fp32 with or without the
# distributed optimizer, and a recomputed forward is the same computation), grad norms within
# 6e-7 (the distributed optimizer sums its shards' squares in another order). fp16 reduces
# gradients in fp16 (Megatron's default), and a reduce-scatter rounds other partial sums than an
# all-reduce: the losses drift from iteration 5, to 1.1e-6 (ep) and 1.9e-5 (fssdp) relative
# by iteration 8, the scale of fp16 itself (ep-fp16 against ep-fp32: 1.8e-5). replicate has no
# fp16 reference of its own; against ep-fp16 it is 5.3e-5 (the modes' rounding differs, as in
# bf16). fssdp runs both with DDP's overlapped gradient reduce and parameter gather (its owned
# experts wait for their gather and start their buckets' reduce after spRS): bf16 with
# re-materialization bit-identical losses, grad norms within 1.4e-6; fp16 with full recompute
# losses within 7.6e-7 (measured 2026-11-27).
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
HALF = [
    ("bf16", "ep", [*FULL]),
    ("bf16", "fssdp", [*FSSDP, "--fssdp-rematerialize", *OVERLAP]),
    ("bf16", "replicate", [*REPLICATE, *SELECTIVE]),
    ("fp16", "ep", [*SELECTIVE]),
    ("fp16", "fssdp", [*FSSDP, *FULL, *OVERLAP]),
    ("fp16", "replicate", [*REPLICATE, *SELECTIVE]),
]
BF16_MODES = {"ep": [], "fssdp": FSSDP, "replicate": REPLICATE, "zebra": ZEBRA}
AUX = ["--moe-aux-loss-coeff", "1.0"]
"""A strong auxiliary loss: it moves the fp16 runs well beyond fp16's noise."""
ZEBRA_BF16_SAVE = 15
"""zebra's bf16 run saves here (and at ITERS); ep resumes it."""
FP16_MODES = {"ep": [], "fssdp": FSSDP, "replicate": REPLICATE, "zebra": [*ZEBRA, "--zebra-asym-ea", "1,2", *FULL]}
TOKENS = 8 * 64
"""Token losses averaged into one iteration's loss (global batch x sequence)."""
DELAY = {"rank": 1, "max_ms": 4.0, "seed": 7}
"""zebra_fp16 again with attention rank 1 pausing up to 4 ms before each of its compute tasks."""


@pytest.fixture(scope="module")
def runs(workdir) -> dict[str, Run]:
    """Every 4-rank run of this file, in one spawn (support/multirun.py): the 30-iteration fp32
    and bf16 runs of every mode; 10 iterations in fp16 with a loss scale that starts low and grows
    every 2 iterations (zebra saves at 5); the recompute runs; half precision with recompute and
    the distributed optimizer; ep resuming zebra's fp16 checkpoint from iteration 5 and its bf16
    one from iteration ZEBRA_BF16_SAVE."""
    zebra_fp16, zebra_bf16 = workdir / "zebra_fp16_ckpt", workdir / "zebra_bf16_ckpt"
    flags = {"ep_fp32": [*COMMON, "--train-iters", str(ITERS)]}
    flags |= {f"{name}_bf16": [*COMMON, "--train-iters", str(ITERS), "--bf16", *more] for name, more in BF16_MODES.items()}
    flags["zebra_bf16"] += ["--save", str(zebra_bf16), "--save-interval", str(ZEBRA_BF16_SAVE)]
    flags |= {f"{name}_fp16": [*COMMON, "--train-iters", "10", *FP16, *more] for name, more in FP16_MODES.items()}
    flags["zebra_fp16"] += ["--save", str(zebra_fp16), "--save-interval", "5"]
    flags["zebra_fp16_delayed"] = [*COMMON, "--train-iters", "10", *FP16, *FP16_MODES["zebra"]]
    flags |= {name: [*COMMON, "--train-iters", str(SHORT), *more] for name, more in RECOMPUTE}
    flags |= {f"{mode}_{precision}_recompute_distopt": [
        *COMMON, "--train-iters", str(SHORT), *(["--bf16"] if precision == "bf16" else FP16), *more,
        "--use-distributed-optimizer"] for precision, mode, more in HALF}
    flags["ep_fp16_from_zebra"] = [*COMMON, "--train-iters", "10", *FP16, "--load", str(zebra_fp16)]
    flags["ep_bf16_from_zebra"] = [*COMMON, "--train-iters", str(ITERS), "--bf16", "--load", str(zebra_bf16)]
    replan = zebra_replan_flags(workdir / "zebra_profile.json", LAYERS, EXPERTS, 2, 2, interval=2)
    flags["zebra_bf16_replan"] = [*COMMON, "--train-iters", "10", "--bf16", *ZEBRA, *replan]
    flags["zebra_fp16_replan"] = [*COMMON, "--train-iters", "10", *FP16, *FP16_MODES["zebra"], *replan]
    flags |= {f"{name}_fp16_aux": [*COMMON, "--train-iters", "10", *FP16, *FP16_MODES[name], *AUX]
              for name in ("ep", "zebra")}
    return launch_many(4, flags, workdir, trackers={"ep_fp16_from_zebra": (zebra_fp16, 5),
                                                    "ep_bf16_from_zebra": (zebra_bf16, ZEBRA_BF16_SAVE)},
                       delays={"zebra_fp16_delayed": DELAY})


@pytest.fixture(scope="module")
def ep_fp32(runs):
    return runs["ep_fp32"]


@pytest.fixture(scope="module")
def bf16_runs(runs):
    return {name: runs[f"{name}_bf16"] for name in BF16_MODES}


@pytest.fixture(scope="module")
def fp16_runs(runs):
    return {name: runs[f"{name}_fp16"] for name in FP16_MODES}


def relative(run, reference) -> np.ndarray:
    return precision.relative(run.losses, reference.losses)


def noise_without(half_runs: dict, ep_fp32, *left_out: str) -> NoiseScale:
    """The precision's noise over every run of ``half_runs`` but ``left_out`` (each against ep-fp32)."""
    return NoiseScale.over_others({name: run.losses for name, run in half_runs.items()}, ep_fp32.losses, *left_out)


def test_bf16_in_every_mode_follows_ep_within_bf16_noise(ep_fp32, bf16_runs):
    ep_bf16 = bf16_runs["ep"]
    assert 1e-5 < relative(ep_bf16, ep_fp32).max() < 1e-2  # bf16 rounding, not fp32's 2e-8
    assert "precision: parameters bfloat16 | main weights and Adam state float32" in ep_bf16.output
    assert {str(r["dtypes"]) for r in ep_bf16.records if "loss" in r} == {
        str({"parameters": "bfloat16", "main_weights": "float32", "gradients": "float32"})}
    assert ep_fp32.records[0]["dtypes"] == {"parameters": "float32", "main_weights": "float32", "gradients": "float32"}
    assert ep_bf16.losses[-1] < ep_bf16.losses[0] - 0.3
    for name in ("fssdp", "replicate", "zebra"):
        run = bf16_runs[name]
        difference = relative(run, ep_bf16)
        assert difference[:2].max() < 1e-6, (name, difference)
        noise_without(bf16_runs, ep_fp32, name).check(difference, f"{name}-bf16 against ep-bf16")
        assert all(r["update_successful"] and r["loss_scale"] == 1.0 for r in run.records if "loss" in r)
        if name == "fssdp":
            for record in (r for r in run.records if "loss" in r):
                fssdp = record["fssdp"]
                copies = sum(sum(layer["copies"]) for layer in fssdp["layers"])
                # bf16 copies move 2 bytes per element; spRS sums in fp32 (Megatron's bf16 rule)
                assert fssdp["bytes"]["spag"]["intra"] == copies * N * 2
                assert fssdp["bytes"]["sprs"]["intra"] == copies * N * 4
                # shards in bf16; fp32 main weight + Adam's two moments per element
                assert sum(fssdp["memory"]["shard_bytes"]) == LAYERS * EXPERTS * N * 2
                assert sum(fssdp["memory"]["optimizer_state_bytes"]) == LAYERS * EXPERTS * N * 12


@pytest.mark.parametrize("name", list(FP16_MODES))
def test_fp16_with_expert_parallelism_moves_the_loss_scale(ep_fp32, fp16_runs, name):
    run = fp16_runs[name]
    records = [r for r in run.records if "loss" in r]
    scales = [r["loss_scale"] for r in records]
    if name != "ep":
        # the same scale decisions as ep, and losses within fp16's own noise (ep-fp16 vs ep-fp32)
        ep_fp16 = fp16_runs["ep"]
        assert scales == [r["loss_scale"] for r in ep_fp16.records if "loss" in r]
        noise_without(fp16_runs, ep_fp32, name).check(relative(run, ep_fp16), f"{name}-fp16 against ep-fp16")
    if name == "zebra":
        # the paper's setting: fp16 with full recompute (every layer's attention segment and expert
        # task checkpointed; the same arithmetic, so still ep's scale decisions and losses)
        assert "| recompute full (uniform, 1 layers)" in run.output
        # with Asym-EA "1,2": layer 0 moves one expert per expert rank, layer 1 all of them, onto the
        # attention ranks; copies to an expert on the sending attention rank itself stay local
        copies = 8 * 64 * 2  # global batch x sequence x top-2, per layer
        for record in records:
            assert record["zebra"]["offload_chunks"] == [1, 2]
            assert record["bytes"]["a2a"] < 4 * LAYERS * copies * 64 * 2
    assert len(set(scales)) > 1 and max(scales) > 1024, scales
    assert records[-1]["skipped_iterations"] == sum(not r["update_successful"] for r in records)
    assert run.losses[-1] < run.losses[0]
    assert "dynamic loss scale from 1024" in run.output and "loss scale" in run.output.split("iter      2/10")[1]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zebra_replanning_in_half_precision_keeps_the_losses(runs, precision):
    """Asym-EA re-planned every 2 iterations (fp16: from "1,2", with full recompute and the loss
    scaler) against the same zebra run without re-planning: the same losses and loss scales bit for
    bit over 10 iterations (the half-precision weights, fp32 main weights and Adam moments move
    exactly)."""
    run, reference = runs[f"zebra_{precision}_replan"], runs[f"zebra_{precision}"]
    records = [r for r in run.records if "loss" in r]
    assert run.losses == reference.losses[: len(run.losses)] and len(run.losses) == 10
    assert [r["loss_scale"] for r in records] == [r["loss_scale"] for r in reference.records if "loss" in r][:10]
    adopted = [r["zebra"]["replan"] for r in records if r["zebra"].get("replan", {}).get("adopted")]
    assert adopted and all(entry["move_bytes"] == entry["predicted_move_bytes"] for entry in adopted)
    # what moves per expert: (bf16/fp16 weights as fp32,) fp32 main weights, exp_avg, exp_avg_sq
    assert all(entry["move_bytes"] % (N * 16) == 0 for entry in adopted)


def test_zebra_fp16_auxiliary_loss_follows_ep(ep_fp32, fp16_runs, runs):
    """The auxiliary loss's backward carries the fp16 loss scale in zebra as in ep: without it the
    aux gradient would be unscaled away and zebra would train as ep without the loss, a distance of
    the loss's whole effect on ep-fp16. So zebra against ep, both with the loss, is held to a
    quarter of that effect, which itself stands clear of fp16's noise (several samples). Measured
    (2026-11-27, 10 iterations, coefficient 1.0): the effect 7.1e-4 to 7.3e-4 on three CPU kernel
    sets, zebra against ep 6.7e-6 to 4.4e-5 (7.5e-5 on issue 49's machine), the noise 5.7e-5 to
    7.2e-5 (one sample each)."""
    zebra, ep = runs["zebra_fp16_aux"], runs["ep_fp16_aux"]
    effect = relative(ep, fp16_runs["ep"]).max()
    noise = noise_without(fp16_runs, ep_fp32)
    assert effect > 2 * precision.NOISE_FACTOR * noise.max, (effect, noise)
    assert relative(zebra, ep).max() < effect / 4, (relative(zebra, ep), effect)
    assert [r["loss_scale"] for r in zebra.records if "loss" in r] == [r["loss_scale"] for r in ep.records if "loss" in r]


def test_zebra_fp16_checkpoint_resumes_in_ep(ep_fp32, fp16_runs, runs):
    """zebra's fp16 checkpoint (iteration 5; fp16 weights, fp32 main weights, Adam moments, the loss
    scaler) in ep: the first resumed loss is zebra's up to the order of roundings (the same fp16
    weights and data: measured 7e-8 to 4.7e-7 apart on three CPU kernel sets, against a bound of
    2.2e-5; weights from another iteration are 1e-3 away), the following ones within fp16's noise
    (the main weights and moments crossed), and the loss scale goes on as zebra's."""
    run = runs["ep_fp16_from_zebra"]
    zebra = [r for r in fp16_runs["zebra"].records if "loss" in r][5:]
    records = [r for r in run.records if "loss" in r]
    assert [r["iteration"] for r in records] == list(range(6, 11))
    assert records[0]["loss"] == pytest.approx(zebra[0]["loss"], rel=same_weights_bound("fp16", TOKENS))
    noise_without(fp16_runs, ep_fp32, "zebra").check(relative(run, Run("", zebra)), "ep resumed from zebra-fp16")
    assert [r["loss_scale"] for r in records] == [r["loss_scale"] for r in zebra]


def test_zebra_bf16_checkpoint_resumes_in_ep(ep_fp32, bf16_runs, runs):
    """zebra's bf16 checkpoint (bf16 weights, fp32 main weights and Adam moments) in ep-bf16: the
    resumed losses follow zebra's within bf16's noise (the modes round their gradients
    differently, as in test_bf16_in_every_mode_follows_ep_within_bf16_noise). Measured
    (2026-11-27): the first resumed loss 3.1e-6 to 5.3e-6 from zebra's on three CPU kernel sets
    (1.0e-5 on issue 49's machine, where a fixed 1e-5 failed), against the same-weights bound of
    1.7e-4; the rest up to 8.8e-5 (the noise: 2.5e-4 to 3.4e-4). The first is not bit-equal
    because the two modes' bf16 forwards round differently on trained weights, not because of
    the checkpoint: by hand (6 iterations, save at 3) zebra ->
    zebra and ep -> ep resume bit for bit, zebra -> ep and ep -> zebra both differ by ~4e-6 at
    iteration 4. Fresh runs agree bitwise for 2 iterations only (presumably the untrained experts'
    small outputs vanish into the residual whatever the summation order; fp16: 4.7e-7)."""
    run, k = runs["ep_bf16_from_zebra"], ZEBRA_BF16_SAVE
    zebra = [r for r in bf16_runs["zebra"].records if "loss" in r][k:]
    records = [r for r in run.records if "loss" in r]
    assert [r["iteration"] for r in records] == list(range(k + 1, ITERS + 1))
    assert records[0]["loss"] == pytest.approx(zebra[0]["loss"], rel=same_weights_bound("bf16", TOKENS))
    noise_without(bf16_runs, ep_fp32, "zebra").check(relative(run, Run("", zebra)), "ep resumed from zebra-bf16")


def test_zebra_arithmetic_does_not_follow_timing(fp16_runs, runs):
    """zebra-fp16 (Asym-EA, full recompute, the loss scaler) again with attention rank 1 pausing
    before every compute task: the collectives complete at other points of every rank's poll loop,
    and the losses, gradient norms and loss scales are the same bit for bit (every sum runs in the
    planned task order, never in arrival order)."""
    delayed, zebra = runs["zebra_fp16_delayed"], fp16_runs["zebra"]
    assert len(delayed.losses) == 10
    assert delayed.losses == zebra.losses and delayed.grad_norms == zebra.grad_norms
    assert [r["loss_scale"] for r in delayed.records] == [r["loss_scale"] for r in zebra.records]
    pauses, paused_ms = map(int, re.search(r"delay rank 1: (\d+) pauses, (\d+) ms", delayed.output).groups())
    assert pauses >= 10 * 2 * LAYERS * 2 and paused_ms > 0, (pauses, paused_ms)  # >= A_F and A_B per layer and micro-batch


@pytest.mark.parametrize("name, flags", RECOMPUTE, ids=[name for name, _ in RECOMPUTE])
def test_recompute_keeps_losses_and_loads(ep_fp32, runs, name, flags):
    run = runs[name]
    assert relative(run, ep_fp32).max() < 1e-6
    assert_recompute_lowers_activation_memory(run, ep_fp32, full="full" in name)
    for record, reference in zip(run.records, ep_fp32.records):
        # the recomputed forward routes again; loads are counted once per micro-batch
        assert [layer["expert_tokens"] for layer in record["moe_layers"]] == [
            layer["expert_tokens"] for layer in reference["moe_layers"]]
    if name.startswith("fssdp"):
        for record in run.records:
            fssdp = record["fssdp"]
            copies = sum(sum(layer["copies"]) for layer in fssdp["layers"])
            # no second spAG for the recompute; the backward's re-gather (all layers but the
            # stage's last) serves it
            assert fssdp["bytes"]["spag"]["intra"] == copies * N * 4
            assert fssdp["bytes"]["spag_remat"]["intra"] == sum(fssdp["layers"][0]["copies"]) * N * 4


def activation_bytes(run) -> list[list[int]]:
    return [r["memory"]["activation_bytes"] for r in run.records if "loss" in r]


def assert_recompute_lowers_activation_memory(run, reference, full: bool) -> None:
    """What a forward keeps for the backward, per rank, against the same run without recompute.
    Iteration 1 is compared rank by rank: same weights, same data, so the same routing."""
    kept, without = activation_bytes(run), activation_bytes(reference)
    assert all(a < b for a, b in zip(kept[0], without[0])), (kept[0], without[0])
    if full:
        # every layer keeps only its input, whatever the routing: one figure for every rank and iteration
        assert len({b for ranks in kept for b in ranks}) == 1, kept
        assert kept[0][0] < 0.5 * min(min(ranks) for ranks in without), (kept[0], without)


@pytest.mark.parametrize("precision, mode, flags", HALF, ids=[f"{p}-{m}" for p, m, _ in HALF])
def test_half_precision_with_recompute_and_distributed_optimizer(ep_fp32, bf16_runs, fp16_runs, runs, precision, mode, flags):
    run = runs[f"{mode}_{precision}_recompute_distopt"]
    line = next(l for l in run.output.splitlines() if "precision: " in l)
    assert "(distributed optimizer)" in line, line
    assert ("| recompute " in line) == any(f.startswith("--recompute") for f in flags), line
    runs = bf16_runs if precision == "bf16" else fp16_runs
    reference = runs[mode]
    records = [r for r in run.records if "loss" in r]
    if precision == "bf16":
        assert run.losses == reference.losses[:SHORT]
        np.testing.assert_allclose(run.grad_norms, reference.grad_norms[:SHORT], rtol=1e-5)
    else:
        noise_without(fp16_runs, ep_fp32, mode).check(relative(run, reference), f"{mode}-fp16 with recompute and distopt")
        expected = [r for r in reference.records if "loss" in r][:SHORT]
        # one world-wide overflow decision: the same scale trajectory and no skipped step
        assert [r["loss_scale"] for r in records] == [r["loss_scale"] for r in expected] == [1024.0 * 2 ** (i // 2 + i % 2) for i in range(SHORT)]
        assert records[-1]["skipped_iterations"] == 0
    if "--fssdp-rematerialize" in flags:
        # the re-materialized layers keep no copy for the backward: exactly the first layer's
        # gathered buffer (owned shards and copies, N bf16 elements each) is freed, on every rank
        same_plans = [(mine, theirs) for mine, theirs in zip(records, (r for r in reference.records if "loss" in r))
                      if [l["copies"] for l in mine["fssdp"]["layers"]] == [l["copies"] for l in theirs["fssdp"]["layers"]]]
        assert same_plans and same_plans[0][0]["iteration"] == 1
        for mine, theirs in same_plans:
            first = theirs["fssdp"]["layers"][0]
            freed = [b - a for a, b in zip(mine["memory"]["activation_bytes"], theirs["memory"]["activation_bytes"])]
            assert freed == [(o + c) * N * 2 for o, c in zip(first["owned"], first["copies"])], (mine["iteration"], freed)
    elif mode in runs:
        assert_recompute_lowers_activation_memory(run, reference, full="full" in flags)


def test_bf16_resumes_exactly_and_in_the_other_modes(workdir):
    """2 ranks (EP 2, two micro-batches per rank): save at K, resume to 2K; ep and replicate also
    with the distributed optimizer (replicate writes ep's distributed form for its experts)."""
    k = 4
    two = ["--expert-model-parallel-size", "2", "--train-iters", str(2 * k), "--bf16"]
    replicate = [*REPLICATE, "--replicate-slots-per-rank", "6"]
    distopt = ["--use-distributed-optimizer"]
    modes = {"ep": [], "fssdp": FSSDP, "replicate": replicate, "ep_distopt": distopt, "replicate_distopt": [*replicate, *distopt]}
    flags = {f"{name}_bf16_saved": [*COMMON, *two, *more, "--save", str(workdir / f"bf16_ckpt_{name}"), "--save-interval", str(k)]
             for name, more in modes.items()}
    flags |= {f"{name}_bf16_resumed": [*COMMON, *two, *more, "--load", str(workdir / f"bf16_ckpt_{name}")]
              for name, more in modes.items()}
    crossings = (("fssdp", "ep"), ("replicate", "fssdp"), ("ep", "replicate"),
                 ("replicate_distopt", "ep_distopt"), ("ep_distopt", "replicate_distopt"))
    flags |= {f"{saver}_to_{loader}_bf16": [*COMMON, *two, *modes[loader], "--load", str(workdir / f"bf16_ckpt_{saver}")]
              for saver, loader in crossings}
    flags["ep_fp32_two"] = [*COMMON, *two[:-1]]  # the reference of the noise samples
    # every resume from the mid-run save (the savers' trackers point at 2k)
    trackers = {f"{name}_bf16_resumed": (workdir / f"bf16_ckpt_{name}", k) for name in modes}
    runs = launch_many(2, flags, workdir, trackers)
    straight = {name: runs[f"{name}_bf16_saved"] for name in modes}
    for name in modes:
        resumed = runs[f"{name}_bf16_resumed"]
        assert resumed.records[0]["iteration"] == k + 1
        assert resumed.losses == straight[name].losses[k:], name
        assert resumed.grad_norms == straight[name].grad_norms[k:], name
    for saver, loader in crossings:
        resumed = runs[f"{saver}_to_{loader}_bf16"]
        assert resumed.losses[0] == straight[saver].losses[k], (saver, loader)
        drift = relative(resumed, Run("", straight[saver].records[k:]))
        # noise over the same iterations k+1..2k, from the straight runs of the other modes
        noise = NoiseScale.over_others({name: run.losses[k:] for name, run in straight.items()},
                                       runs["ep_fp32_two"].losses[k:], saver, loader)
        noise.check(drift, f"{saver} resumed in {loader}")
