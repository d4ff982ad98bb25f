"""tools/device_check.py (the device kit) on a machine without CUDA, as CI runs it: the dry run's
table, every command line the GPU stages will run (validated by the training script's own parser),
and the CPU halves whose figures set the kit's tolerances."""

import json
import subprocess
import sys

import pytest

from megatron_patches.training.arguments import parse_args
from megatron_patches.training.validation import validate_args
from support.training import REPO

sys.path.insert(0, str(REPO / "tools"))
import device_check as kit  # noqa: E402

pytestmark = pytest.mark.e2e


def test_the_dry_run_prints_the_table_with_every_gpu_stage_skipped(tmp_path):
    done = subprocess.run([sys.executable, "tools/device_check.py", "--out", str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "device_check.json").read_text())
    assert [r["stage"] for r in rows if r["check"] == "stage"] == [s.name for s in kit.STAGES if s.needs_cuda]
    assert all(r["result"] == "skipped: no CUDA" for r in rows if r["check"] == "stage")
    env = {r["check"]: r["figure"] for r in rows if r["stage"] == "env"}
    assert env["megatron.core"] == "0.16.1" and env["devices"] == "no CUDA device"
    assert env["apex"].startswith("not importable")
    table = (tmp_path / "device_check.md").read_text()
    assert table.splitlines()[0].split("|")[1:6] == [" stage     ", " check              ", " result           ",
                                                     " figure" + " " * (len(table.splitlines()[0].split("|")[4]) - 7),
                                                     " tolerance "]
    assert table in done.stdout


def test_bad_stage_names_are_refused_naming_the_valid_ones():
    done = subprocess.run([sys.executable, "tools/device_check.py", "--stages", "env,trian"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert "--stages: unknown trian; valid: env, kernels, overlap, train, sync, memory, te-apex, multi-gpu" in done.stderr


@pytest.mark.parametrize("name", sorted(kit.kit_runs()))
def test_every_command_line_of_the_kit_is_valid(name, monkeypatch):
    flags, world = kit.kit_runs()[name]
    monkeypatch.chdir(REPO)
    args = parse_args(flags)
    validate_args(args, world_size=world)
    assert args.use_cpu_initialization and args.hidden_dropout == 0 or name == "memory"


def test_the_cpu_halves_and_the_tolerances(tmp_path):
    runs = {p: kit.training(kit.train_run(p), tmp_path / f"{p}.jsonl", cpu=True) for p in kit.PRECISIONS}
    for name, records in runs.items():
        assert [r["iteration"] for r in records] == list(range(1, kit.ITERATIONS + 1)), name
        # fp16's initial loss scale lets every step update, so the comparison covers 5 updates
        assert all(r["update_successful"] for r in records), name
        assert records[-1]["loss"] < records[0]["loss"] - 0.1, name
    assert kit.compare_losses(runs["fp32"], runs["fp32"]) == 0.0
    # the half-precision tolerances hold for a CPU run against fp32: wider than precision, far
    # narrower than one lost update
    for half in ("bf16", "fp16"):
        assert kit.compare_losses(runs[half], runs["fp32"]) <= kit.PRECISIONS[half][1]
    lost = [dict(r, loss=r["loss"] + (0.05 if r["iteration"] == 3 else 0)) for r in runs["fp32"]]
    assert kit.compare_losses(lost, runs["fp32"]) > max(tol for _, tol in kit.PRECISIONS.values())
    assert kit.compare_losses(runs["fp32"][:-1], runs["fp32"]) == float("inf")


def test_the_sync_child_runs_the_training_script_in_process(tmp_path):
    out = tmp_path / "sync.json"
    assert kit.SYNC_RUN[-2:] == ["--train-iters", str(kit.SYNC_ITERATION + 1)]
    done = subprocess.run([sys.executable, "tools/device_check.py", "--sync-child", str(out), "2",
                           *kit.SYNC_RUN[:-2], "--train-iters", "2", "--cpu"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # no CUDA, nothing synchronises (on a GPU the kit fails the stage when nothing is warned)
    assert json.loads(out.read_text()) == {"iteration": 2, "warned": 0, "sources": {}}
    assert "iter      2/2" in done.stdout


def test_the_memory_stage_s_model_by_hand():
    parts = kit.simulated_memory()
    # 12 layers x 64 experts x 2,361,600 parameters x 18 B (bf16 weight, fp32 gradient, fp32
    # master weight and two Adam moments)
    assert parts["experts"] == 12 * 64 * 2_361_600 * 18
    assert 0 < parts["activations"] < 4e9 and 0 < parts["dense"] < 2e9
