"""FSSDP mode end to end: `pretrain_gpt_moe.py --moe-parallel-mode fssdp` on 4 gloo ranks.

The reference is Megatron's own EP on the same data and seed: in fp32 without token dropping
FSSDP computes the same model (copies hold the owners' weights, the gradients of the copies
are summed into the owners), so the losses must agree within 1e-5 relative, while the
materialized copies lower the imbalance. One ep run serves every comparison, and its save at
iteration 10 is the checkpoint fssdp resumes; the LR schedule is pinned (--lr-decay-iters) so
that runs of different lengths share it. The four runs share one spawn (support/multirun.py).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from support.training import launch_many, tensorboard_scalars

pytestmark = pytest.mark.e2e

ITERS = 30
# tiny on the embedded Austen corpus, EP = FSSDP group = 4 ranks, no dropout (so the only
# difference between modes is where each token's expert runs).
# Megatron-LM's default aux-loss coefficient 0 (the tiny job sets 1e-2): a skewed router for fssdp
# to balance, and the 1e-5 bound over 30 iterations was measured there (with 1e-2: 1.4e-5 by
# iteration 17, the aux loss's gradient amplifying the copies' summation order)
BASE = [
    "--expert-model-parallel-size", "4", "--lr-warmup-iters", "5", "--lr-decay-iters", str(ITERS),
    "--log-interval", "1", "--eval-interval", "1000", "--moe-aux-loss-coeff", "0",
]
COMMON = [*BASE, "--hidden-dropout", "0", "--attention-dropout", "0"]
TOKENS_PER_ITERATION = 16 * 128  # 4 ranks x micro-batch 4 x 128 tokens, one micro-batch
# The same 16 sequences per iteration as k micro-batches of 4 / k per rank (gradient accumulation).
MICRO_BATCHES = {2: ["--micro-batch-size", "2", "--global-batch-size", "16"],
                 4: ["--micro-batch-size", "1", "--global-batch-size", "16"]}
# fixed t and m, calibration off (its gathers follow measured times): the same plans in every run
FIXED = ["--moe-parallel-mode", "fssdp", "--fssdp-overlap-degree", "2", "--fssdp-memory-capacity", "2",
         "--no-fssdp-calibrate"]
EXPERT_BYTES = 16_576 * 4  # fc1 64x128 + 128, fc2 128x64 + 64, fp32
LAYERS, EXPERTS = 2, 8


HALF = ITERS // 3
"""fssdp resumes ep's checkpoint of iteration HALF and trains to 2 x HALF."""
RECHECK = 10
"""The auto-t run's re-shard interval: t is chosen after iteration 1 and again after 10, 20 and 30."""


@pytest.fixture(scope="module")
def runs(workdir):
    ckpt = workdir / "ckpt_ep"
    flags = {
        "ep": [*COMMON, "--train-iters", str(ITERS), "--save", str(ckpt), "--save-interval", str(HALF),
               "--keep-last-checkpoints", "0"],
        # the reference run (auto t and m; t chosen again at the re-shard checks after
        # iterations 10, 20 and 30) and a memory-bound one with re-materialization
        "fssdp": [*COMMON, "--train-iters", str(ITERS), "--moe-parallel-mode", "fssdp", "--fssdp-reshard-interval",
                  str(RECHECK), "--tensorboard-dir", str(workdir / "tb_fssdp")],
        # (re-materialization gathers, re-gathers and reduces per micro-batch: 2 here; the plans
        # before the gate made by the planner thread while the layers before them run)
        "fssdp_remat": [*COMMON, "--train-iters", str(ITERS), "--moe-parallel-mode", "fssdp", "--fssdp-rematerialize",
                        "--fssdp-overlap-degree", "3", "--fssdp-memory-capacity", "1", *MICRO_BATCHES[2],
                        "--fssdp-planner-thread"],
        # one gather and one reduce per iteration whatever the micro-batch count: fixed t and m,
        # so that both runs plan the same copies from the same (integer, global) loads
        "fssdp_k1": [*COMMON, "--train-iters", str(HALF), *FIXED],
        "fssdp_k4": [*COMMON, "--train-iters", str(HALF), *FIXED, *MICRO_BATCHES[4]],
        # calibrating after the gate (t = m = 2 leaves room for extra copies), on the first of 4
        # micro-batches
        "load_fssdp_from_ep": [*COMMON, "--train-iters", str(2 * HALF), *FIXED, "--fssdp-calibrate", *MICRO_BATCHES[4],
                               "--load", str(ckpt)],
        # Megatron's default dropout (0.1): auto t's probe must not draw from the training's streams
        **{name: [*BASE, "--train-iters", str(HALF), *more]
           for name, more in (("ep_dropout", []), ("fssdp_auto_dropout", ["--moe-parallel-mode", "fssdp", "--fssdp-calibrate"]))},
    }
    return launch_many(4, flags, workdir, trackers={"load_fssdp_from_ep": (ckpt, HALF)})


@pytest.fixture(scope="module")
def ep_run(runs):
    return runs["ep"]


def assert_same_losses(run, reference, first: int = 0):
    losses, expected = np.array(run.losses), np.array(reference.losses[first : first + len(run.losses)])
    assert len(losses) == len(expected) > 0
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=0)


def check_fssdp_records(run, remat: bool, micro_batches: int = 1):
    before, after = [], []
    for record in run.records:
        if "loss" not in record:
            continue
        fssdp = record["fssdp"]
        copies = sum(sum(layer["copies"]) for layer in fssdp["layers"])
        spag, sprs, calibrate = (fssdp["bytes"][k] for k in ("spag", "sprs", "spag_calibrate"))
        # Byte formula (DESIGN 3): one message per copy, owner -> holder and back, one node, once
        # per iteration (per micro-batch with re-materialization); calibration's extra copies are
        # gathered apart and reduced with the others.
        per = micro_batches if remat else 1
        assert spag == {"intra": per * copies * EXPERT_BYTES, "inter": 0}
        calibrated = [layer["calibrated_copies"] for layer in fssdp["layers"]]
        assert calibrate == {"intra": sum(calibrated) * EXPERT_BYTES, "inter": 0}
        assert sprs == {"intra": spag["intra"] + calibrate["intra"], "inter": 0}
        assert (calibrate["intra"] > 0) == (fssdp["calibrations"] > 0)
        # the host planner's time per step (issue 44): every iteration plans and dispatches
        planner = fssdp["planner_s"]
        assert set(planner) == {"materialize", "calibrate", "dispatch"}
        assert planner["materialize"] > 0 and planner["dispatch"] > 0
        assert planner["calibrate"] >= 0 and (fssdp["calibrations"] == 0 or planner["calibrate"] > 0)
        # the training thread waits for the first layer's plan at least, and dispatches after every gate
        assert fssdp["planner_exposed_s"] >= planner["dispatch"] > 0
        remat_bytes = fssdp["bytes"]["spag_remat"]["intra"]
        if remat:
            # every layer but the stage's last is gathered again for its backward, with the
            # copies calibration added to that micro-batch's forward (on by default)
            layer0 = fssdp["layers"][0]
            assert remat_bytes == (per * sum(layer0["copies"]) + layer0["calibrated_copies"]) * EXPERT_BYTES
        else:
            assert remat_bytes == 0
        # all-to-all: 4 transfers (dispatch, combine, forward and backward) of each remote copy
        assert record["bytes"]["a2a"] == 4 * fssdp["a2a_remote_copies"] * 64 * 4
        for ep_layer, layer in zip(record["moe_layers"], fssdp["layers"]):
            assert sum(layer["device_tokens"]) == sum(ep_layer["device_tokens"]) == TOKENS_PER_ITERATION * 2
            replicas = np.array(layer["replicas"])
            assert replicas.min() >= 1 and replicas.sum() == EXPERTS + sum(layer["copies"])
            # the ring carries every expert all 4 ranks hold, or none (placement.collectives)
            assert layer["ring_experts"] in (0, int((replicas == 4).sum()))
            before.append(ep_layer["imbalance"])
            after.append(layer["imbalance"])
        # Memory: the expert shards and their Adam state exist once over the 4 ranks.
        memory = fssdp["memory"]
        assert sum(memory["shard_bytes"]) == LAYERS * EXPERTS * EXPERT_BYTES
        assert sum(memory["optimizer_state_bytes"]) == 2 * LAYERS * EXPERTS * EXPERT_BYTES
        assert len(set(memory["optimizer_state_bytes"])) == 1
    return np.mean(before), np.mean(after)


def test_fssdp_matches_ep_and_balances(ep_run, runs, workdir):
    """The issue's reference run (auto t and m) and a memory-bound one with re-materialization."""
    auto = runs["fssdp"]
    assert_same_losses(auto, ep_run)
    # the mode's TensorBoard scalars (FSSDPRuntime.tensorboard_scalars) carry the records' figures
    scalars = tensorboard_scalars(workdir / "tb_fssdp")
    for record in (r for r in auto.records if "loss" in r):
        step, fssdp = record["iteration"], record["fssdp"]
        assert scalars["fssdp/overlap_degree"][step] == fssdp["t"]
        assert scalars["fssdp/bytes_spag_intra"][step] == pytest.approx(fssdp["bytes"]["spag"]["intra"])
        assert scalars["fssdp/planner_ms"][step] == pytest.approx(1e3 * sum(fssdp["planner_s"].values()), rel=1e-6)
        assert scalars["fssdp/planner_exposed_ms"][step] == pytest.approx(1e3 * fssdp["planner_exposed_s"], rel=1e-6)
        for layer in fssdp["layers"]:
            assert scalars[f"fssdp/imbalance_layer{layer['layer']}"][step] == pytest.approx(layer["imbalance"])
    before, after = check_fssdp_records(auto, remat=False)
    # auto t is chosen by cost on measured times (the log below), so how far it balances depends
    # on this machine; the fixed t = 2, m = 2 run balances to < 1.1 (test_copies_are_gathered...)
    if auto.records[-1]["fssdp"]["t"] > 0:
        assert after < before, (before, after)
    assert "fssdp: auto overlap degree t =" in auto.output and "fssdp: auto memory capacity m =" in auto.output
    # t by cost: the logged prices of every candidate t (on the loads of iteration 1, then 4 (powers
    # of 4 below the re-shard interval), 10, 20 and 30 (the re-shard checks), with the first
    # iteration's measured times; the last is for a run resumed from here), the chosen one marked
    # and the cheapest, and the records' t is it from the next iteration on
    lines = [x for x in auto.output.splitlines() if "fssdp: auto overlap degree t =" in x]
    priced_at = [int(re.search(r"priced on iteration (\d+)'s loads", line).group(1)) for line in lines]
    assert priced_at == [1, 4, RECHECK, 2 * RECHECK, 3 * RECHECK], lines
    t_from = {}
    for line, iteration in zip(lines, priced_at):
        prices = {int(t): float(ms) for t, ms in re.findall(r"t=(\d+): ([0-9.]+) ms", line)}
        chosen = int(re.search(r"t=(\d+): [^;]*<-", line).group(1))
        assert 0 in prices and prices[chosen] == min(prices.values()), line  # (the log rounds to 0.01 ms)
        assert chosen == int(re.search(r"auto overlap degree t = (\d+)", line).group(1)), line
        t_from[iteration + 1] = chosen
    for record in (r for r in auto.records if "loss" in r and r["iteration"] > 1):
        assert record["fssdp"]["t"] == t_from[max(i for i in t_from if i <= record["iteration"])], record["iteration"]
    assert re.search(r"fssdp: cost model: [0-9.]+ us per token copy \(measured\) and [0-9.]+ us per expert instance",
                     auto.output)
    # auto t: the first iteration runs without copies (it measures), later ones with
    assert all(sum(layer["copies"]) == 0 for layer in auto.records[0]["fssdp"]["layers"])

    bound = runs["fssdp_remat"]
    assert_same_losses(bound, ep_run)
    before, after = check_fssdp_records(bound, remat=True, micro_batches=2)
    assert after < before, (before, after)
    for record in bound.records:
        if "loss" in record:
            assert record["fssdp"]["t"] == 3 and record["fssdp"]["m"] == 1
            assert all(max(layer["copies"]) <= 1 for layer in record["fssdp"]["layers"])


def test_auto_t_at_default_dropout_draws_the_same_masks_as_ep(runs):
    """At Megatron's default dropout (0.1) fssdp with auto t, auto m and calibration trains as ep
    with the same seed: the per-instance probe and the planners take no random draw from the
    training's streams, so every dropout mask is ep's, and the losses differ only by the copies'
    summation order (measured 2026-11-27: t = 8 from iteration 2, at most 2.2e-8 relative; t is
    chosen from measured times, so on another machine it may be 0 and the losses equal). Before
    the probe's input was fixed (it drew torch.randn from the training generator) they left ep's
    from iteration 2 (1.7e-4, then 4e-5 to 1.4e-4 relative)."""
    ep, fssdp = runs["ep_dropout"], runs["fssdp_auto_dropout"]
    assert "fssdp: auto overlap degree t =" in fssdp.output
    assert len(fssdp.losses) == HALF
    np.testing.assert_allclose(fssdp.losses, ep.losses, rtol=1e-6, atol=0)


def test_copies_are_gathered_and_reduced_once_per_iteration(ep_run, runs):
    """With 4 micro-batches per iteration (gradient accumulation) the copies of each layer are
    gathered on the first, kept, and their summed gradient reduced once after the last backward:
    spAG and spRS bytes per iteration equal the one-micro-batch run's, record for record (same
    t, m and global loads, so the same plans), and both train like ep, with the hot experts every
    rank holds broadcast and reduced along the ring (`dist.broadcast` / `dist.reduce`)."""
    one, four = runs["fssdp_k1"], runs["fssdp_k4"]
    assert_same_losses(one, ep_run)
    assert_same_losses(four, ep_run)
    records = [[r["fssdp"] for r in run.records if "loss" in r] for run in (one, four)]
    assert len(records[0]) == len(records[1]) == HALF
    for first, second in zip(*records):
        assert [layer["copies"] for layer in first["layers"]] == [layer["copies"] for layer in second["layers"]]
        assert first["bytes"] == second["bytes"]
    assert sum(r["bytes"]["spag"]["intra"] for r in records[1]) > 0
    # t = m = 2 copies the two busiest experts to every rank: owned by one or two of the 4 ranks,
    # they go around the ring (each rank sends at most 2 copies) rather than 3 from each owner
    assert sum(layer["ring_experts"] for r in records[0] for layer in r["layers"]) > 0
    check_fssdp_records(four, remat=False, micro_batches=4)
    before, after = check_fssdp_records(one, remat=False)
    assert after < before and after < 1.1, (before, after)  # measured 1.46 -> 1.06


def test_checkpoints_move_between_ep_and_fssdp(ep_run, runs):
    """Saved in ep, resumed in fssdp (calibrating after the gate): the continuation equals the
    uninterrupted ep run.

    Both checkpoints are Megatron's per-expert sharded tensors (FSSDP's owners are Megatron's
    local experts), so the other mode loads them as they are. The other direction, fssdp saved
    and resumed in ep, is tests/fssdp/test_fssdp_reshard.py's (saved after a re-shard, the harder case),
    and bf16 checkpoints cross every pair of modes in tests/training/test_precision_training.py."""
    resumed = runs["load_fssdp_from_ep"]
    assert resumed.records[0]["iteration"] == HALF + 1
    assert_same_losses(resumed, ep_run, first=HALF)
    # Calibration gathers only when the measured expert time says it pays off, so whether it
    # happens depends on the machine's speed (a quiet CI box once saw none in 10 iterations):
    # the records are checked either way (spag_calibrate bytes iff calibrations, sprs = spag +
    # spag_calibrate), and the losses above must equal ep's with or without it.
    check_fssdp_records(resumed, remat=False)
