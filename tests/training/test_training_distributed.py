"""End-to-end training on several local gloo ranks: `pretrain_gpt_moe.py` under torchrun.

Each test launches the real entry point (real Megatron-Core modules, real collectives,
real text where it matters) and asserts on its JSON-lines metrics, its expert-load trace
and its checkpoints. Every spawn pays 3-7 s of imports per rank, so each test is one or a
few launches that check several things at once, and runs of one rank count share a spawn
(support/multirun.py).
"""

from __future__ import annotations

import math
import os
import re
import subprocess

import numpy as np
import pytest

from megatron_patches.placement.trace import read_trace
from megatron_patches.training.metrics import read_records
from support.training import MOCK, NO_DROPOUT, REPO, Run, check_moe_records, launch, launch_many, tensorboard_scalars

pytestmark = pytest.mark.e2e


def test_the_main_job_trains_on_real_text_and_fills_its_run_folder(tmp_path):
    """The README's main job as a user runs it (`bash launch/local.sh`: 4 ranks, fssdp over EP=4
    on the embedded Austen corpus), 30 iterations: what it prints before the first progress line,
    the imbalance ep would have had beside fssdp's on every progress line and in the summary, and
    its run folder (arguments, metrics, TensorBoard, load trace, plot)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, RUN_DIR=str(run_dir), NPROC="4", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        ["bash", "launch/local.sh", "--train-iters", "30", "--lr-warmup-iters", "5", "--log-interval", "1",
         "--use-distributed-optimizer"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]

    # a start-up a person reads: Megatron's known warnings once as one line, the arguments in a file
    before_progress = proc.stdout.split("\niter ")[0].splitlines() + proc.stderr.splitlines()
    assert len(before_progress) < 30, "\n".join(before_progress)
    assert "UserWarning" not in output and "warnings.warn" not in output
    assert output.count("warning: megatron-core: Transformer Engine and Apex are not installed") == 1
    assert f"run folder: {run_dir} (arguments.txt, loads.npz, loss_imbalance.png, metrics.jsonl, tensorboard)" in output
    assert "layout: gpt 2 layers x hidden 64, 8 experts top-2, seq 128 | mode fssdp | world 4 = TP 1 x PP 1 x DP 4" in output
    arguments = (run_dir / "arguments.txt").read_text()
    assert "  train_iters ." in arguments and arguments.split("  train_iters ")[1].split()[1] == "30"
    assert "------------------------ arguments" not in output

    run = Run(output, read_records(str(run_dir / "metrics.jsonl")))
    losses = run.losses
    assert len(losses) == 30
    # Loss falls on real text: from ~ln(50257) = 10.8 towards a unigram-level model.
    assert losses[0] > 10.0
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
    # tiny: 2 MoE layers, 8 experts, top-2; 4 ranks x 4 sequences x 128 tokens.
    check_moe_records(run, tokens_per_iteration=16 * 128, topk=2, num_layers=2, ep=4)
    assert any(r["bytes"]["a2a"] > 0 for r in run.records if "loss" in r)
    assert "summary: 30 iterations" in run.output

    # ep's imbalance on the same routing beside fssdp's: the same tokens, on fewer of the busiest rank
    progress = [line for line in output.splitlines() if line.startswith("iter ")]
    assert len(progress) == 30
    assert all(re.search(r"\| imbalance\(max layer\) ep \d\.\d\d -> fssdp \d\.\d\d \(t=\d+, spAG", line) for line in progress)
    summary = re.search(r"imbalance\(max layer, mean\) ep (\d\.\d\d) -> fssdp (\d\.\d\d), tokens on the busiest rank "
                        r"([+-]\d+)%", output)
    assert summary, output[-3000:]
    records = [r for r in run.records if "loss" in r]
    for record in records:
        for owner_layer, placed_layer in zip(record["moe_layers"], record["fssdp"]["layers"]):
            assert sum(owner_layer["device_tokens"]) == sum(placed_layer["device_tokens"]) == 16 * 128 * 2
        assert record["balance"]["owners"]["busiest_tokens"] == sum(max(layer["device_tokens"]) for layer in record["moe_layers"])
    owners_mean = np.mean([r["balance"]["owners"]["imbalance"] for r in records])
    placed_mean = np.mean([r["balance"]["placed"]["imbalance"] for r in records])
    assert float(summary.group(1)) == pytest.approx(owners_mean, abs=0.005)
    assert float(summary.group(2)) == pytest.approx(placed_mean, abs=0.005)
    assert placed_mean < owners_mean - 0.1 and int(summary.group(3)) < 0  # with the aux loss ep stays above ~1.3
    assert tensorboard_scalars(run_dir / "tensorboard")["train/loss"][30] == pytest.approx(losses[-1])
    assert (run_dir / "loss_imbalance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    trace = read_trace(run_dir / "loads.npz")
    assert trace.loads.shape == (30, 2, 8) and trace.loads.dtype == np.int64
    assert trace.source_loads.shape == (30, 2, 4, 8)
    assert (trace.source_loads.sum(axis=2) == trace.loads).all()
    # Every rank routed its own 4 x 128 tokens to 2 experts each.
    assert (trace.source_loads.sum(axis=3) == 4 * 128 * 2).all()
    assert trace.metadata["topk"] == 2 and trace.metadata["ranks"] == 4
    for record, loads_LE in zip((r for r in run.records if "loss" in r), trace.loads):
        assert [layer["expert_tokens"] for layer in record["moe_layers"]] == loads_LE.tolist()


LAYOUTS = [
    ("tp2_sp_ep2", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                    "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], 2),
    ("pp2_ep2", ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 2),
    ("tp2_sp_etp2_ep2", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear",
                         "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"], 2),
    ("ep2_capacity_allgather", ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0",
                                "--moe-token-dispatcher-type", "allgather"], 4),
]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("layouts")
    return launch_many(4, {name: [*MOCK, "--train-iters", "8", "--tensorboard-dir", str(work / f"tb_{name}"), *flags]
                           for name, flags, _ in LAYOUTS}, work), work


@pytest.mark.parametrize("name,flags,dp", LAYOUTS, ids=[name for name, _, _ in LAYOUTS])
def test_model_parallel_layouts_train(layout_runs, name, flags, dp):
    """TP2 x SP x EP2, PP2 x EP2 (several micro-batches), TP2 x SP x ETP2 x EP2 (uneven expert-TP
    gathers) and EP2 with a capacity factor and
    Megatron's allgather dispatcher, on 4 ranks: training runs, loss falls, metrics add up."""
    runs, work = layout_runs
    run = runs[name]
    losses = run.losses
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert f"micro-batches of 2 x DP {dp}" in run.output
    capacity = "--moe-expert-capacity-factor" in flags
    check_moe_records(run, tokens_per_iteration=8 * 64, topk=2, num_layers=2, ep=2, dropless=not capacity)
    if capacity:
        # Capacity 1.0 with uneven routing drops some token copies.
        assert min(layer["survival"] for r in run.records for layer in r["moe_layers"]) < 1.0
    assert list((work / f"tb_{name}").glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_bert_moe_on_real_text(tmp_path):
    """BERT-MoE (masked LM + sentence order) with EP=2 on the embedded corpus's WordPiece data."""
    run = launch(
        2,
        ["--model-family", "bert", "--expert-model-parallel-size", "2", "--train-iters", "12",
         "--lr-warmup-iters", "2", "--seq-length", "64", "--max-position-embeddings", "64",
         "--log-interval", "1", "--eval-interval", "1000"],
        tmp_path, "bert",
    )
    assert "BertWordPieceLowerCase" in run.output
    losses = run.losses
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    check_moe_records(run, tokens_per_iteration=2 * 4 * 64, topk=2, num_layers=2, ep=2)


def test_layouts_are_equivalent_from_the_same_checkpoint(tmp_path):
    """One model, trained on the same global batches under EP, TP+SP, PP and plain DP layouts.

    A world-1 run saves its model after one iteration; every layout loads it (resharding the
    dist checkpoint to its TP/PP/EP) and trains three more iterations without dropout. Losses
    and gradient norms must agree to float-reduction accuracy: this checks Megatron's EP, the
    compat fixes (expert-bias grads under TP, the expert optimizer's grad norm) and the
    checkpoint resharding together.
    """
    common = [*MOCK, *NO_DROPOUT, "--lr-decay-iters", "4"]
    resume = [*common, "--train-iters", "4", "--load", str(tmp_path / "ckpt"), "--no-load-optim"]
    reference = launch_many(1, {
        "seed": [*common, "--train-iters", "1", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"],
        "world1": resume,
    }, tmp_path)["world1"]
    runs = launch_many(2, {
        "ep2": [*resume, "--expert-model-parallel-size", "2"],
        "tp2_sp_ep2": [*resume, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
        "pp2": [*resume, "--pipeline-model-parallel-size", "2"],
    }, tmp_path)
    assert len(reference.losses) == 3
    for name, run in runs.items():
        np.testing.assert_allclose(run.losses, reference.losses, rtol=2e-5, err_msg=name)
        np.testing.assert_allclose(run.grad_norms, reference.grad_norms, rtol=2e-4, err_msg=name)
