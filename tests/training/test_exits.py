"""Megatron-LM's run-control flags end to end, `pretrain_gpt_moe.py` on 2 gloo ranks: the early
exits (--exit-interval, --exit-signal-handler: save, then exit 0; the checkpoint resumes), --finetune,
sample-based training with a warm-up fraction and a warm-up start (the logged learning rates are
Megatron-Core's scheduler's at Megatron-LM's sample counts), --log-throughput (Megatron-LM's model
FLOPs), --log-params-norm, --log-num-zeros-in-grad, --manual-gc and --distributed-timeout-minutes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from support.training import ENTRY, MOCK, NO_DROPOUT, REPO, launch_many

from megatron_patches.training import checkpoint_dirs
from megatron_patches.training.metrics import read_records

# MOCK without its --lr-warmup-iters (a --train-samples run counts its warm-up in samples); global batch 8
WARMUP = MOCK.index("--lr-warmup-iters")
COMMON = [*MOCK[:WARMUP], *MOCK[WARMUP + 2:], *NO_DROPOUT, "--expert-model-parallel-size", "2"]
# 48 samples = 6 iterations of 8; the warm-up is 0.25 of them (1.5 iterations), from 1e-4 up to 1e-3
SAMPLES = ["--train-samples", "48", "--lr-warmup-fraction", "0.25", "--lr-warmup-init", "1e-4", "--lr", "1e-3",
           "--min-lr", "1e-5", "--lr-decay-style", "cosine"]


@pytest.fixture(scope="module")
def runs(workdir):
    ckpt = workdir / "ckpt_exit"
    return launch_many(2, {
        "exit_interval": [*COMMON, *SAMPLES, "--exit-interval", "4", "--save", str(ckpt), "--save-interval", "100",
                          "--manual-gc", "--manual-gc-interval", "2", "--distributed-timeout-minutes", "5"],
        "resumed": [*COMMON, *SAMPLES, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "100"],
        "straight": [*COMMON, *SAMPLES, "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad"],
        "finetune": [*COMMON, *SAMPLES, "--load", str(ckpt), "--finetune"],
        # the embedded corpus (a real indexed dataset), its index files in --data-cache-path
        "data_cache": ["--train-iters", "1", "--eval-iters", "0", "--expert-model-parallel-size", "2",
                       "--data-cache-path", str(workdir / "index_cache")],
    }, workdir), ckpt


def megatron_lm_lrs(iterations: int) -> list[float]:
    """Megatron-LM's learning rate at iterations 1..n: its scheduler in samples, stepped by the
    global batch of 8 after each iteration (SAMPLES' values)."""
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(opt, init_lr=1e-4, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=0.25 * 48,
                                    lr_decay_steps=48, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=48, wd_incr_style="constant")
    lrs = []
    for _ in range(iterations):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(increment=8)
    return lrs


@pytest.mark.e2e
def test_exit_interval_saves_and_the_checkpoint_resumes(runs):
    result, ckpt = runs
    stopped, resumed, straight = result["exit_interval"], result["resumed"], result["straight"]
    assert "exit: after iteration 4 of 6: --exit-interval 4; the checkpoint of iteration 4" in stopped.output
    assert [r["iteration"] for r in stopped.records if "loss" in r] == [1, 2, 3, 4]
    assert "training: iterations 4 -> 6" in resumed.output
    assert [r["iteration"] for r in resumed.records if "loss" in r] == [5, 6]
    assert checkpoint_dirs.latest_iteration(ckpt) == 6
    # stopping and resuming changes nothing: the same losses as the run that went straight through
    assert stopped.losses + resumed.losses == pytest.approx(straight.losses, rel=1e-6)


@pytest.mark.e2e
def test_sample_based_schedule_is_megatron_lm_s(runs):
    straight = runs[0]["straight"]
    assert [r["iteration"] for r in straight.records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # --log-throughput: Megatron-LM's model FLOPs of the iteration (MOCK: 2 layers, hidden 64, seq 64,
    # FFN 128, 8 experts top-2, vocabulary 1000 padded to 1024, global batch 8) per second and rank
    per_token = 2 * 6 * (64 * 192 + 64 * 64 + 64 * 64) + 2 * 6 * 64 * 128 * 2 * 2 + 6 * 64 * 1024
    for record in (r for r in straight.records if "loss" in r):
        expected = 8 * 64 * per_token / (record["iteration_time_s"] * 1e12 * 2)
        assert record["tflops_per_gpu"] == pytest.approx(expected, rel=1e-9)
    assert "TFLOP/s/GPU" in straight.output and "params norm" in straight.output
    # --log-params-norm (tests/training/test_model_init.py checks its value) and --log-num-zeros-in-grad
    norms = [r["params_norm"] for r in straight.records if "loss" in r]
    assert all(n > 0 for n in norms) and norms[0] != norms[-1]  # the weights move
    assert all(isinstance(r["num_zeros_in_grad"], int) and r["num_zeros_in_grad"] >= 0 for r in straight.records if "loss" in r)
    # each record's lr is the rate after that iteration's scheduler step, as Megatron-LM logs it
    assert [r["lr"] for r in straight.records if "loss" in r] == pytest.approx(megatron_lm_lrs(7)[1:], rel=1e-9)


def _rank_pids(root: int) -> dict[int, int]:
    """rank -> pid of the training processes under the torchrun agent `root` (from /proc)."""
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            todo += [int(child) for child in (task / "children").read_text().split()]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [item.split(b"=", 1)[1] for item in environ if item.startswith(b"RANK=")]
        if rank and pid != root:
            found[int(rank[0])] = pid
    return found


@pytest.mark.e2e
def test_a_signal_to_one_rank_saves_and_ends_the_run_cleanly(workdir):
    """SIGTERM to rank 1 only (Slurm's warning signal reaches every task; one is the hardest case):
    every rank stops after the same iteration, the checkpoint is written, exit code 0."""
    ckpt, log = workdir / "ckpt_signal", workdir / "signal.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ENTRY), *COMMON,
           "--train-iters", "500", "--lr-warmup-iters", "1", "--exit-signal-handler", "--save", str(ckpt), "--save-interval", "1000",
           "--log-json", str(log)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and len(read_records(str(log))) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before iteration 2"
            time.sleep(0.2)
        os.kill(_rank_pids(proc.pid)[1], signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-4000:]
    stopped = checkpoint_dirs.latest_iteration(ckpt)
    assert stopped is not None and 2 <= stopped < 500
    assert (f"exit: after iteration {stopped} of 500: SIGTERM received (--exit-signal-handler); the checkpoint of "
            f"iteration {stopped}") in output
    assert "summary:" in output and "Traceback" not in output


@pytest.mark.e2e
def test_finetune_starts_from_the_checkpoint_s_model_at_iteration_0(runs):
    """--finetune: the model of the checkpoint (iteration 6), nothing else: iteration 0, the first
    batch again, a fresh schedule."""
    finetune, straight = runs[0]["finetune"], runs[0]["straight"]
    assert "--finetune: the model of iteration 6, training from iteration 0" in finetune.output
    assert "training: iterations 0 -> 6" in finetune.output
    first, fresh = finetune.records[0], straight.records[0]
    assert first["iteration"] == 1 and first["lr"] == fresh["lr"]
    assert first["loss"] != pytest.approx(fresh["loss"], rel=1e-3)  # trained weights on the same first batch


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_exit_conditions_decide_by_signal_duration_and_interval(world_of_one):
    from types import SimpleNamespace

    from megatron_patches.training.exits import ExitConditions

    def conditions(**changes):
        values = dict(exit_interval=None, exit_duration_in_mins=None, exit_signal_handler=False,
                      exit_signal=signal.SIGUSR1)
        return ExitConditions(SimpleNamespace(**{**values, **changes}))

    before = signal.getsignal(signal.SIGUSR1)
    with conditions(exit_signal_handler=True) as exits:
        assert exits.reason(1) is None
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only notes it: the iteration goes on
        assert exits.reason(2) == "SIGUSR1 received (--exit-signal-handler)"
    assert signal.getsignal(signal.SIGUSR1) is before
    with conditions(exit_duration_in_mins=0) as exits:  # every elapsed time is past 0 minutes
        assert exits.reason(1).startswith("--exit-duration-in-mins 0 reached (0.0 minutes of training)")
    with conditions(exit_duration_in_mins=60, exit_interval=3) as exits:
        assert [exits.reason(i) for i in (1, 2, 3)] == [None, None, "--exit-interval 3"]


@pytest.mark.e2e
def test_dataset_indices_go_to_the_data_cache_path(runs, workdir):
    assert [r["iteration"] for r in runs[0]["data_cache"].records if "loss" in r] == [1]
    cached = sorted(p.name for p in (workdir / "index_cache").rglob("*.npy"))
    assert cached and any(name.endswith("document_index.npy") for name in cached), cached
