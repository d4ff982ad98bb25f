"""The failure catalogue: bad inputs and faults, each with its exact outcome.

README "Failure behaviour" promises what happens on a bad flag, a NaN, a stuck rank, a damaged
checkpoint or a full disk; this file holds every case in one place:

1. Bad inputs (flags, YAML, data files, output paths, checkpoint directories): the training
   entry point's own `main(argv)`, all cases in one process (tests/support/refusals.py). Each is
   refused with exit code 2 and a message naming the value, and no case writes anything.
2. Launch values (submit.py): refused, naming the key and value, before any script is written.
3. Faults in running jobs (torchrun, gloo ranks): a non-finite loss (exit 3), a stopped rank, a
   hung job and stopped monitor ranks (exit 4), a damaged newest checkpoint (fallback), a save
   that hits the file-size limit (exit 5), the launcher killed with SIGKILL (no process left):
   what each prints, its exit code, what is on disk afterwards, and that no good checkpoint
   was lost.

Hostile shell values on a real Slurm are in test_slurm_real.py (homogeneous job).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_patches.training import checkpoint_dirs, resume
from megatron_patches.training.arguments import parse_args
from megatron_patches.training.metrics import read_records
from megatron_patches.training.validation import validate_args
from support.submit import TEST_DATA, refused, tiny_run
from support.training import ENTRY, MOCK, REPO, TINY_JOB, launch

DATA = "inputs/corpus_text_document"
"""A real indexed dataset of 64 sequences (written by the inputs fixture)."""

# A model as a Megatron-LM script gives it (no --config): Megatron-LM's defaults for the rest.
SCRIPT_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]

# (id, flags, world size, fragments of the message after "pretrain_gpt_moe.py: error: ")
BAD_INPUTS = [
    # numeric flags: non-finite, out of range, absurd
    ("lr_inf", ["--lr", "inf"], 1, ["--lr=inf", "must be a finite"]),
    ("lr_nan", ["--lr", "nan"], 1, ["--lr=nan", "must be a finite"]),
    ("lr_negative", ["--lr", "-1"], 1, ["--lr=-1.0"]),
    ("seed_negative", ["--seed", "-1"], 1, ["--seed=-1", "valid: 0..2147483647"]),
    ("train_iters_zero", ["--train-iters", "0"], 1, ["--train-iters=0", "must be a positive integer"]),
    ("micro_batch_zero", ["--micro-batch-size", "0"], 1, ["--micro-batch-size=0", "must be a positive integer"]),
    ("dropout_above_one", ["--hidden-dropout", "1.5"], 1, ["--hidden-dropout=1.5", "must be a probability in [0, 1)"]),
    ("stall_timeout_negative", ["--stall-timeout", "-1"], 1, ["--stall-timeout=-1.0", "must be 0 or more"]),
    ("keep_last_negative", ["--keep-last-checkpoints", "-1"], 1, ["--keep-last-checkpoints=-1", "must be 0 or more"]),
    ("max_nonfinite_negative", ["--max-nonfinite-steps", "-1"], 1, ["--max-nonfinite-steps=-1", "must be 0 or more"]),
    ("fssdp_budget_inf", ["--moe-parallel-mode", "fssdp", "--expert-model-parallel-size", "4",
                          "--fssdp-memory-budget-mb", "inf"], 4, ["--fssdp-memory-budget-mb=inf"]),
    # flag combinations
    ("unknown_flag", ["--lrr", "1e-3"], 1, ["--lrr", "--lr"]),
    # Megatron-LM's own flags that this entry point refuses (training/megatron_lm.py): the reason, what instead
    ("megatron_lm_not_built", ["--moe-latent-size", "16"], 1,
     ["--moe-latent-size (Megatron-LM's flag", "is refused: not built", "Instead: leave it out (Megatron-LM's default: None)"]),
    ("context_parallel_unbuilt", ["--context-parallel-size", "2"], 1,
     ["--context-parallel-size=2", "context parallelism is not built yet", "valid: 1"]),
    ("shared_expert_with_bias", ["--moe-shared-expert-intermediate-size", "64"], 1,
     ["--moe-shared-expert-intermediate-size=64", "no biases", "--disable-bias-linear"]),
    ("shared_expert_gate_alone", ["--moe-shared-expert-gate"], 1,
     ["--moe-shared-expert-gate=True", "--moe-shared-expert-intermediate-size"]),
    ("shared_expert_overlap_in_zebra", ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "1",
                                        "--zebra-expert-ranks", "1", "--zebra-microbatches", "1",
                                        "--moe-shared-expert-intermediate-size", "64", "--disable-bias-linear",
                                        "--moe-shared-expert-overlap"], 2,
     ["--moe-shared-expert-overlap=True", "zebra runs the shared expert on the attention ranks", "drop it"]),
    ("mla_with_gqa", [*TINY_JOB, "--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"], 1,
     ["--multi-latent-attention=True", "mutually exclusive", "--group-query-attention"]),
    ("mla_flag_without_mla", ["--mscale", "0.707"], 1, ["--mscale=0.707", "multi-latent attention", "--multi-latent-attention"]),
    ("yarn_without_mla", ["--rope-type", "yarn"], 1, ["--rope-type=yarn", "takes only rope"]),
    ("reset_mask_without_mask", ["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"], 1,
     ["--reset-attention-mask=True", "--no-create-attention-mask-in-dataloader", "drop one of the two"]),
    ("eod_flags_with_bert", ["--model-family", "bert", "--eod-mask-loss"], 1, ["--eod-mask-loss=True", "GPT dataset"]),
    ("logging_level_unknown", ["--logging-level", "15"], 1, ["--logging-level=15", "20 (INFO)"]),
    ("mtp_with_bert", ["--model-family", "bert", "--mtp-num-layers", "1"], 1, ["--mtp-num-layers=1", "GPT models only"]),
    ("megatron_lm_gpu_choice", ["--use-flash-attn"], 1, ["--use-flash-attn", "a GPU kernel", "Instead: "]),
    ("megatron_lm_other_workload", ["--grpo-group-size", "4"], 1, ["--grpo-group-size", "reinforcement-learning", "Instead: "]),
    ("num_workers_unbuilt", ["--num-workers", "2"], 1, ["--num-workers=2", "worker processes are not built", "valid: 0"]),
    ("unknown_mode", ["--moe-parallel-mode", "sharded"], 1, ["--moe-parallel-mode", "sharded", "ep, fssdp, replicate, zebra"]),
    ("ep_not_dividing", ["--expert-model-parallel-size", "3"], 4, ["--expert-model-parallel-size=3"]),
    ("bf16_and_fp16", ["--bf16", "--fp16"], 1, ["--fp16", "--bf16"]),
    ("save_without_interval", ["--save", "never_written"], 1, ["--save=never_written", "needs --save-interval"]),
    ("zebra_fp16", ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "2", "--zebra-expert-ranks", "2",
                    "--zebra-microbatches", "2", "--use-distributed-optimizer"], 4,
     ["--use-distributed-optimizer=True", "zebra has its own optimizer"]),
    # YAML configs
    ("yaml_missing", ["--config", "inputs/absent.yaml"], 1, ["inputs/absent.yaml"]),
    ("yaml_unknown_key", ["--config", "inputs/unknown_key.yaml"], 1, ["hiden_size", "hidden_size"]),
    ("yaml_not_utf8", ["--config", "inputs/latin1.yaml"], 1, ["inputs/latin1.yaml", "UTF-8"]),
    ("yaml_wrong_type", ["--config", "inputs/wrong_type.yaml"], 1, ["lr", "fast"]),
    # data files
    ("data_missing", ["--data-path", "inputs/absent", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"], 1,
     ["--data-path=inputs/absent", "inputs/absent.bin and inputs/absent.idx"]),
    ("data_bad_magic", ["--data-path", "inputs/bad_magic", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"],
     1, ["--data-path=inputs/bad_magic", "does not start with Megatron's index magic"]),
    ("data_truncated_bin", ["--data-path", "inputs/truncated", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                            "1000"], 1, ["--data-path=inputs/truncated", "truncated"]),
    ("split_no_validation", ["--data-path", DATA, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                             "--split", "100,0,0"], 1, ["--split=100,0,0"]),
    ("split_no_train", ["--data-path", DATA, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                        "--split", "0,100,0"], 1, ["--split=0,100,0"]),
    # output paths
    ("log_json_under_a_file", ["--log-json", "inputs/a_file/metrics.jsonl"], 1, ["--log-json=inputs/a_file/metrics.jsonl"]),
    ("trace_under_a_file", ["--moe-log-loads", "inputs/a_file/loads.npz"], 1, ["--moe-log-loads=inputs/a_file/loads.npz"]),
    ("run_dir_is_a_file", ["--run-dir", "inputs/a_file"], 1, ["--run-dir=inputs/a_file"]),
    # a Megatron-LM script's model: Megatron-LM's defaults, no tiny-model values
    ("script_without_run_flags", [*SCRIPT_MODEL, "--num-experts", "8"], 1,
     ["--micro-batch-size is not set", "--train-iters is not set", "--lr is not set",
      "Megatron-LM has no default for these flags", "The model came from the command line (--num-layers, "]),
    ("script_dense_model", [*SCRIPT_MODEL, "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-4"], 1,
     ["--num-experts=None: without experts the model is dense", "pretrain_gpt.py", "valid: 1 or more"]),
    # Megatron-LM flags: refused with the reason, or checked as Megatron-LM / Megatron-Core check them
    ("train_samples_and_iters", ["--train-samples", "64", "--train-iters", "5"], 1,
     ["--train-samples=64", "either it or --train-iters (is 5)"]),
    ("exit_signal_unknown", ["--exit-signal", "TERM"], 1, ["--exit-signal", "'TERM' is not a signal name", "SIGTERM"]),
    ("mtp_after_a_dense_layer_in_zebra", ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "1",
                                          "--zebra-expert-ranks", "1", "--zebra-microbatches", "1",
                                          "--mtp-num-layers", "1", "--moe-layer-freq", "2"], 2,
     ["--mtp-num-layers=1", "zebra runs each MTP layer as one more MoE layer", "valid: an MoE last layer"]),
    ("expert_bias_with_softmax", ["--moe-router-enable-expert-bias"], 1,
     ["--moe-router-enable-expert-bias=True", "needs --moe-router-score-function sigmoid"]),
    ("rotary_without_rope", ["--rotary-percent", "0.5"], 1, ["--rotary-percent=0.5", "add --position-embedding-type rope"]),
    ("no_position_embedding_without_rope", ["--no-position-embedding"], 1,
     ["--no-position-embedding=True", "use --position-embedding-type none"]),
    ("ckpt_format_torch", ["--ckpt-format", "torch"], 1, ["--ckpt-format=torch", "valid: torch_dist"]),
    ("rampup_batch_size", ["--rampup-batch-size", "4", "4", "100"], 1,
     ["--rampup-batch-size (Megatron-LM's flag", "is refused: a global batch that grows", "a fixed --global-batch-size"]),
    ("async_save", ["--async-save"], 1, ["--async-save (Megatron-LM's flag", "saves are synchronous"]),
    ("virtual_pipeline_without_pp", ["--num-layers-per-virtual-pipeline-stage", "1"], 1,
     ["--pipeline-model-parallel-size=1", "virtual pipeline stages (2 model chunks per rank)", "valid: 2 or more"]),
    ("attention_backend_unknown", ["--attention-backend", "sdpa"], 1,
     ["--attention-backend=sdpa", "flash, fused, unfused, local, auto"]),
    # checkpoint directories
    ("load_missing", ["--load", "inputs/no_such_dir"], 1, ["--load=inputs/no_such_dir", "directory not found"]),
    ("load_no_tracker", ["--load", "inputs"], 1, ["--load=inputs", "holds no checkpoint (no latest_checkpointed_iteration.txt)"]),
    ("load_tracker_garbage", ["--load", "inputs/ckpt_release"], 1, ["holds 'release', expected an iteration number"]),
    ("load_nothing_left", ["--load", "inputs/ckpt", "--train-iters", "20"], 1,
     ["--train-iters=20", "the checkpoint in inputs/ckpt is at iteration 20", "valid: more than 20"]),
    ("load_other_model_shape", [*TINY_JOB, "--load", "inputs/ckpt", "--train-iters", "30", "--num-layers", "6"], 1,
     ["--num-layers=6", "was saved with num_layers 2; a model's shape cannot change", "valid: 2, or no --load"]),
    ("load_other_optimizer_form", ["--load", "inputs/ckpt", "--train-iters", "30", "--use-distributed-optimizer"], 1,
     ["--use-distributed-optimizer=True", "was saved with use_distributed_optimizer False", "--no-load-optim"]),
    ("load_all_damaged", ["--load", "inputs/ckpt_damaged", "--train-iters", "30"], 1,
     ["--load=inputs/ckpt_damaged", "no checkpoint verifies", "iter_0000020/common.pt does not match its checksum",
      "iter_0000010/__0_0.distcp has 3 bytes, the manifest says 5"]),
]


def write_inputs(work: Path) -> None:
    """The files the bad inputs name, under work/inputs/."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    import numpy

    inputs = work / "inputs"
    inputs.mkdir()
    for name in ("corpus_text_document", "bad_magic", "truncated"):
        builder = IndexedDatasetBuilder(str(inputs / f"{name}.bin"), dtype=numpy.uint16)
        for i in range(64):
            builder.add_document(numpy.arange(i, i + 70, dtype=numpy.uint16), [70])
        builder.finalize(str(inputs / f"{name}.idx"))
    index = (inputs / "bad_magic.idx").read_bytes()
    (inputs / "bad_magic.idx").write_bytes(b"PK\x03\x04" + index[4:])
    tokens = (inputs / "truncated.bin").read_bytes()
    (inputs / "truncated.bin").write_bytes(tokens[:-10])
    (inputs / "unknown_key.yaml").write_text("hiden_size: 64\n")
    (inputs / "latin1.yaml").write_bytes("# mod\xe8le\nhidden_size: 64\n".encode("latin-1"))
    (inputs / "wrong_type.yaml").write_text("lr: fast\n")
    (inputs / "a_file").write_text("not a directory\n")
    (inputs / "ckpt_release").mkdir()
    (inputs / "ckpt_release" / checkpoint_dirs.TRACKER_FILE).write_text("release\n")
    # a checkpoint's directory as validation reads it: tracker, manifest, flags (no tensors needed)
    saving = validate_args(parse_args(["--train-iters", "20"]), 1)
    saving.tokenizer_type, saving.data_path = "GPT2BPETokenizer", ["data/austen-gpt-v1/austen_text_document"]
    for name, iterations in (("ckpt", (20,)), ("ckpt_damaged", (10, 20))):
        for iteration in iterations:
            partial = checkpoint_dirs.start_partial(inputs / name, iteration)
            resume.write_flags(partial, saving)
            (partial / "common.pt").write_bytes(b"common")
            (partial / "__0_0.distcp").write_bytes(b"shard")
            (partial / checkpoint_dirs.DIST_METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
            checkpoint_dirs.publish(inputs / name, iteration, world_size=1)
    (inputs / "ckpt_damaged" / "iter_0000020" / "common.pt").write_bytes(b"COMMON")
    (inputs / "ckpt_damaged" / "iter_0000010" / "__0_0.distcp").write_bytes(b"sha")


def snapshot(work: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(work)): (p.stat().st_size, p.stat().st_mtime_ns) for p in work.rglob("*")}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every bad input through the entry point's main(), in one process run in a work folder."""
    work = tmp_path_factory.mktemp("refusals")
    write_inputs(work)
    before = snapshot(work)
    cases = [{"argv": flags, "world_size": world} for _, flags, world, _ in BAD_INPUTS]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "refusals.py")], input=json.dumps(cases),
                          cwd=work, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(proc.stdout)
    after = snapshot(work)
    return {case[0]: result for case, result in zip(BAD_INPUTS, results)}, before, after


@pytest.mark.parametrize("name, flags, world, fragments", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_a_bad_input_is_refused_before_any_work(refusals, name, flags, world, fragments):
    results, before, after = refusals
    result = results[name]
    assert result["code"] == 2, result
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt_moe.py: error: "), result["stderr"]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in result["stdout"] + result["stderr"]
    # no case wrote anything: no checkpoint, run folder or log (the inputs are untouched too)
    assert after == before, sorted(set(after) ^ set(before))


LAUNCH_VALUES = [
    ("description_newline", {"description": "tiny\ntouch /tmp/x"}, "description='tiny\\ntouch /tmp/x': control characters"),
    ("name_carriage_return", {"name": "a\rb"}, "name='a\\rb': control characters"),
    ("output_dir_newline", {"output_dir": "out\n$(reboot)"}, "output_dir='out\\n$(reboot)': control characters"),
]


@pytest.mark.parametrize("name, values, fragment", LAUNCH_VALUES, ids=[case[0] for case in LAUNCH_VALUES])
def test_a_hostile_launch_value_is_refused(name, values, fragment):
    assert fragment in refused(tiny_run(**values))


def test_an_output_folder_an_sbatch_line_cannot_carry_is_refused(tmp_path):
    out = tmp_path / "o $(touch x) 'q'"
    message = refused(TEST_DATA / "run_cpu_2x2.yaml", output_dir=str(out))
    assert f"output_dir={str(out)!r}: whitespace, quotes and backslashes cannot be written" in message
    assert not out.exists()


# ----------------------------------------------------------------------------------------
# Faults in running jobs
# ----------------------------------------------------------------------------------------


def torchrun(nproc: int, args: list[str], cwd: Path, env: dict | None = None, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        proc.kill()


def read_until(proc: subprocess.Popen, pattern: str, lines: list[str]) -> re.Match:
    for line in proc.stdout:
        lines.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"{pattern!r} never printed:\n{''.join(lines)[-6000:]}")


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> PID among a torchrun's children (from /proc)."""
    pids = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue  # a rank that has just exited (the one that reported, say)
            rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                pids[rank] = int(pid)
    return pids


def processes_with(marker: str) -> list[str]:
    """Live processes whose environment holds `marker` (every descendant of a launch inherits it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(f"{environ.parent.name}: {(environ.parent / 'cmdline').read_bytes()[:120]!r}")
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return found


@pytest.mark.e2e
def test_a_refused_flag_reaches_the_user_under_torchrun(tmp_path):
    """zebra with a refused flag (it was --fp16) under torchrun used to end with no message at all: another rank exited
    first and torchrun killed rank 0 before it printed. Rank 0 prints at once now, the others
    only after a grace period (and are killed before it ends)."""
    started = time.monotonic()
    output = finish(torchrun(4, [str(ENTRY), *MOCK, "--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "2",
                                 "--zebra-expert-ranks", "2", "--zebra-microbatches", "2", "--use-distributed-optimizer"], tmp_path))
    assert "exitcode  : 2" in output
    # rank 0's line; another rank's only if rank 0 was still importing 10 s after it refused
    said = re.findall(r"pretrain_gpt_moe.py: error( \(rank [123]\))?: --use-distributed-optimizer=True: zebra has its own optimizer", output)
    assert 1 <= len(said) == len(set(said)), output
    assert time.monotonic() - started < 60


@pytest.mark.e2e
def test_a_non_finite_loss_stops_the_run_without_checkpointing_it(tmp_path):
    """--lr 1e6 without clipping drives the loss to NaN within a few iterations. Every rank skips
    that step (one world-wide decision), rank 0 says which iteration, the run exits 3, and the
    newest checkpoint is the last finite iteration's; with --max-nonfinite-steps 1 the first
    such step is skipped and the run stops at the next one. Zebra (1 attention + 1 expert rank)
    stops alike."""
    diverging = [*MOCK, "--train-iters", "12", "--lr", "1e6", "--clip-grad", "0"]
    common = [*diverging, "--expert-model-parallel-size", "2"]

    def run(name: str, *flags: str, base: list[str] = common) -> tuple[str, list[dict]]:
        log = tmp_path / f"{name}.jsonl"
        output = finish(torchrun(2, [str(ENTRY), *base, *flags, "--log-json", str(log)], tmp_path))
        assert "exitcode  : 3" in output, output[-6000:]
        return output, read_records(str(log))

    ckpt = tmp_path / "ckpt"
    output, records = run("stop", "--save", str(ckpt), "--save-interval", "1")
    bad = records[-1]["iteration"]
    assert records[-1]["loss"] is None and not records[-1]["update_successful"]
    assert records[-1]["non_finite"]["loss"] == "nan"  # strict JSON: null, and a field saying what it was
    assert all(math.isfinite(r["loss"]) for r in records[:-1]) and 1 < bad < 12
    assert f"non-finite: iteration {bad}: loss nan is not finite; the update was skipped on every rank" in output
    assert (f"pretrain_gpt_moe.py: stopped: iteration {bad}: 1 non-finite step(s), more than --max-nonfinite-steps 0 "
            f"allows; no checkpoint of this state was written; the newest checkpoint in {ckpt} is untouched") in output
    assert checkpoint_dirs.latest_iteration(ckpt) == bad - 1 and checkpoint_dirs.problem(ckpt, bad - 1) is None
    assert checkpoint_dirs.iterations_on_disk(ckpt)[-1] == bad - 1

    output, records = run("skip_one", "--max-nonfinite-steps", "1")
    assert [r["iteration"] for r in records if r["loss"] is None] == [bad, bad + 1]
    assert records[-1]["skipped_iterations"] == 2 and "stopped: iteration" in output

    # zebra's own loop (until the zebra issue moves it onto the shared one) guards alike
    zebra = ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "1", "--zebra-expert-ranks", "1",
             "--zebra-microbatches", "2", "--global-batch-size", "4"]
    output, records = run("zebra", *zebra, base=diverging)
    bad = records[-1]["iteration"]
    assert records[-1]["loss"] is None and not records[-1]["update_successful"] and records[-1]["skipped_iterations"] == 1
    assert all(math.isfinite(r["loss"]) and r["update_successful"] for r in records[:-1]) and 1 < bad < 12
    assert (f"pretrain_gpt_moe.py: stopped: iteration {bad}: 1 non-finite step(s), more than --max-nonfinite-steps 0 "
            "allows") in output


@pytest.mark.e2e
def test_an_fp16_checkpoint_saved_before_any_step_resumes(tmp_path):
    """fp16 at Megatron's initial loss scale 2^32 overflows and skips its first iterations, so a
    checkpoint saved then comes from an optimizer that never stepped. It saved no Adam moments
    (KeyError on resume), and Megatron drops a shared step of 0 (`if step:`, KeyError 'step');
    on CPU the loss scale could not be read back either. Now it resumes, and the loss scale
    goes on halving from where it stopped."""
    ckpt = tmp_path / "ckpt"
    fp16 = [*MOCK, "--fp16", "--global-batch-size", "2"]
    saved = launch(1, [*fp16, "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2"], tmp_path, "fp16_save")
    assert [r["update_successful"] for r in saved.records] == [False, False]
    resumed = launch(1, [*fp16, "--train-iters", "3", "--load", str(ckpt)], tmp_path, "fp16_resume")
    assert "checkpoint: loaded" in resumed.output
    assert [r["iteration"] for r in resumed.records] == [3]
    assert resumed.records[0]["loss_scale"] == saved.records[-1]["loss_scale"] / 2


@pytest.mark.e2e
def test_dist_ckpt_strictness_reports_or_refuses_keys_the_load_leaves_out(tmp_path):
    """--no-load-optim reads the model only, so the checkpoint's optimizer tensors are keys the load
    leaves out (dist_checkpointing's "missing" keys): Megatron-LM's default ignores them, log_all
    names them, raise_all stops the load with the flag and the keys (exit 2, no traceback);
    raise_unexpected (keys asked for that the checkpoint lacks) has none to raise on."""
    ckpt = tmp_path / "ckpt"
    tiny = [*MOCK, "--global-batch-size", "2"]
    launch(1, [*tiny, "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2"], tmp_path, "save")
    resume = [*tiny, "--train-iters", "3", "--load", str(ckpt), "--no-load-optim"]
    missing = "Some keys found in the checkpoint are missing in the provided sharded state dict"
    quiet = launch(1, resume, tmp_path, "default")
    logged = launch(1, [*resume, "--dist-ckpt-strictness", "log_all"], tmp_path, "log_all")
    unexpected_only = launch(1, [*resume, "--dist-ckpt-strictness", "raise_unexpected"], tmp_path, "raise_unexpected")
    assert missing not in quiet.output and missing in logged.output and "optimizer." in logged.output
    assert [r["iteration"] for r in logged.records] == [r["iteration"] for r in unexpected_only.records] == [3]
    output = finish(torchrun(1, [str(ENTRY), *resume, "--dist-ckpt-strictness", "raise_all"], tmp_path))
    assert "exitcode  : 2" in output and "CheckpointingException" not in output, output[-6000:]  # the rank's own message
    assert f"pretrain_gpt_moe.py: error: --load {ckpt / 'iter_0000002'} with --dist-ckpt-strictness raise_all: " \
           f"{missing}" in output


@pytest.mark.e2e
def test_a_stopped_rank_is_named_and_ends_the_job(tmp_path):
    """SIGSTOP one rank mid-run: with --stall-timeout 10 the watchdog names it (host, last
    reported step) and the job ends with exit code 4 within seconds, not after the 30-minute
    process-group timeout."""
    proc = torchrun(2, [str(ENTRY), *MOCK, "--expert-model-parallel-size", "2", "--train-iters", "2000",
                        "--stall-timeout", "10"], tmp_path)
    lines = []
    stopped = None
    try:
        read_until(proc, r"^iter +10/", lines)
        # the watchdog beats once a second (timeout / 10): let rank 1 report a step past 0 before it
        # stops (ten iterations can take less than a beat on a fast machine)
        time.sleep(2.5)
        stopped = rank_pids(proc.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        since = time.monotonic()
        read_until(proc, "stalled:", lines)
        waited = time.monotonic() - since
        os.kill(stopped, signal.SIGKILL)  # a stopped process would hold the launcher's shutdown 30 s
        output = "".join(lines) + finish(proc, 120)
    finally:
        if stopped is not None and Path(f"/proc/{stopped}").exists():
            os.kill(stopped, signal.SIGKILL)
        proc.kill()
    assert "exitcode  : 4" in output, output[-3000:]
    said = re.search(r"pretrain_gpt_moe.py: stalled: rank 1 on (\S+) \(last reported step (\d+)\): not running for "
                     r"more than 10 s \(stopped, swapped out or dead\); ending the job \(--stall-timeout 10\)", output)
    assert said, output[-3000:]
    assert said.group(1) == socket.gethostname() and int(said.group(2)) >= 1
    # the beat last seen moving may be up to one interval (1 s here) older than the stop
    assert 10 - 1.5 < waited < 30, waited


@pytest.mark.e2e
def test_a_hung_job_and_stopped_monitor_ranks_are_named(tmp_path):
    """The watchdog's other two verdicts, on ranks that run only the watchdog (3 s timeout):
    every rank alive but none completing a step (a deadlock) is named by rank 0 with the last
    completed step; ranks 0 and 1 (the ranks that read every heartbeat) stopped together are
    named by rank 2, which reads theirs."""
    script = str(REPO / "tests" / "support" / "watchdog_ranks.py")
    host = socket.gethostname()
    env = {"PYTHONPATH": str(REPO)}

    output = finish(torchrun(3, [script, "hang"], tmp_path, env), timeout=120)
    assert "exitcode  : 4" in output, output[-3000:]
    assert (f"pretrain_gpt_moe.py: stalled: no rank completed a step for more than 3 s although every rank is running: "
            f"hung in a collective or a deadlock; last completed step 1 on rank 0 on {host}, rank 1 on {host}, rank 2 on "
            f"{host}; ending the job (--stall-timeout 3)") in output

    proc = torchrun(3, [script, "monitors"], tmp_path, env)
    lines = []
    try:
        read_until(proc, "stalled:", lines)
        for pid in rank_pids(proc.pid).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the stopped ranks would hold the launcher's shutdown 30 s
        output = "".join(lines) + finish(proc, 120)
    finally:
        proc.kill()
    assert (f"pretrain_gpt_moe.py: stalled: rank 0 on {host} (last reported step 1); rank 1 on {host} (last reported "
            f"step 1): not running for more than 3 s (stopped, swapped out or dead)") in output, output[-3000:]


@pytest.mark.e2e
def test_damaged_checkpoint_full_disk_and_killed_launcher_lose_nothing(tmp_path):
    """One checkpoint directory through three faults (2 ranks, EP 2, the distributed optimizer,
    dropout on, saves every 2 iterations):

    a. a straight run to iteration 4 (checkpoints 2 and 4, each with the run's flags);
    b. iteration 4's largest shard truncated, then a resume under a file-size limit smaller than
       that shard: it falls back to iteration 2 with a warning, trains 3 and 4 to the straight
       run's losses and gradient norms bit for bit (model, Adam state, RNG states restored),
       cannot write checkpoint 4 and stops with exit code 5, naming the limit; on disk the
       tracker, checkpoint 2 and the damaged 4 are as they were;
    c. a resume without the limit and with a new peak lr under --override-opt_param-scheduler
       falls back again, trains at half the straight run's lr, writes checkpoints 4 (replacing
       the damaged one) and 6, removes 2 (--keep-last-checkpoints 2), and then its launcher is
       killed with SIGKILL: every rank and helper process is gone within seconds, and the
       tracker names a checkpoint that verifies;
    d. checkpoint 4 copied without its manifest and one rank's RNG file: exit code 2, naming it.
    """
    ckpt = tmp_path / "ckpt"
    common = [str(ENTRY), *MOCK, "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--save",
              str(ckpt), "--save-interval", "2", "--lr-decay-iters", "100"]

    def records(name: str) -> dict[int, dict]:
        return {r["iteration"]: r for r in read_records(str(tmp_path / f"{name}.jsonl")) if "loss" in r}

    output = finish(torchrun(2, [*common, "--train-iters", "4", "--log-json", str(tmp_path / "a.jsonl")], tmp_path))
    straight = records("a")
    assert checkpoint_dirs.iterations_on_disk(ckpt) == [2, 4], output[-3000:]
    assert json.loads((ckpt / "iter_0000002" / resume.FLAGS_FILE).read_text())["train_iters"] == 4

    manifest = json.loads((ckpt / "iter_0000004" / checkpoint_dirs.MANIFEST_FILE).read_text())["files"]
    shard, size = max(((name, entry["bytes"]) for name, entry in manifest.items() if name.endswith(".distcp")),
                      key=lambda item: item[1])
    damaged = ckpt / "iter_0000004" / shard
    with open(damaged, "r+b") as stream:
        stream.truncate(size - 1)
    limit = size // 2

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    output = finish(torchrun(2, [*common, "--load", str(ckpt), "--train-iters", "6", "--log-json",
                                 str(tmp_path / "b.jsonl")], tmp_path, preexec_fn=limited))
    fallback = (f"checkpoint: iteration 4 is unreadable ({damaged} has {size - 1} bytes, the manifest says {size}): "
                f"resuming from iteration 2, the newest checkpoint that verifies")
    assert fallback in output and "exitcode  : 5" in output, output[-6000:]
    assert [line for line in output.splitlines() if line.startswith("resume: ")] == [
        "resume: --train-iters 4 -> 6: applied"]
    stopped = re.search(rf"pretrain_gpt_moe.py: stopped: rank \d could not write the checkpoint of iteration 4 into "
                        rf"{re.escape(str(ckpt))}/iter_0000004.partial: .*file-size limit: {limit} bytes\); the "
                        rf"checkpoints in {re.escape(str(ckpt))} are untouched \(the tracker names iteration 4\)", output)
    assert stopped, output[-6000:]
    resumed = records("b")
    assert sorted(resumed) == [3, 4]
    for i in (3, 4):
        assert (resumed[i]["loss"], resumed[i]["grad_norm"]) == (straight[i]["loss"], straight[i]["grad_norm"])
    assert checkpoint_dirs.latest_iteration(ckpt) == 4 and checkpoint_dirs.iterations_on_disk(ckpt) == [2, 4]
    assert checkpoint_dirs.problem(ckpt, 2) is None and damaged.stat().st_size == size - 1

    marker = f"CATALOGUE_RUN={uuid.uuid4().hex}"
    proc = torchrun(2, [*common, "--load", str(ckpt), "--train-iters", "2000", "--lr", "5e-4",
                        "--override-opt_param-scheduler", "--log-json", str(tmp_path / "c.jsonl")],
                    tmp_path, env=dict([marker.split("=")]))
    lines = []
    try:
        read_until(proc, r"^checkpoint: removed .*iter_0000002 \(--keep-last-checkpoints 2\)", lines)
        assert fallback in "".join(lines)
        assert "resume: --lr 0.001 -> 0.0005: applied (--override-opt_param-scheduler)" in "".join(lines)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = processes_with(marker)
    finally:
        for entry in processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.split(":")[0]), signal.SIGKILL)
    assert left == [], left
    tracked = checkpoint_dirs.latest_iteration(ckpt)
    assert tracked >= 6 and checkpoint_dirs.choose(ckpt, tracked) == (tracked, [])
    assert checkpoint_dirs.problem(ckpt, 4) is None  # the damaged checkpoint 4 was replaced
    assert 2 not in checkpoint_dirs.iterations_on_disk(ckpt)
    # Megatron's scheduler alone would keep the checkpoint's peak (its param groups hold it); min lr is 0
    halved = records("c")
    assert [halved[i]["lr"] for i in (3, 4)] == pytest.approx([0.5 * straight[i]["lr"] for i in (3, 4)], rel=1e-12)

    # d. a checkpoint without a manifest (Megatron-LM's form) loads unverified; a rank whose RNG
    # file is missing then says so and the job ends with exit code 2
    bare = tmp_path / "bare"
    shutil.copytree(ckpt / "iter_0000004", bare / "iter_0000004")
    (bare / "iter_0000004" / checkpoint_dirs.MANIFEST_FILE).unlink()
    (bare / "iter_0000004" / "rng" / "rank_00001.pt").unlink()
    checkpoint_dirs.write_tracker(bare, 4)
    output = finish(torchrun(2, [str(ENTRY), *MOCK, "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                 "--load", str(bare), "--train-iters", "6"], tmp_path))
    assert f"checkpoint: {bare / 'iter_0000004'} has no manifest.json (not written by this version): loaded without " \
           "verification" in output, output[-3000:]
    assert (f"pretrain_gpt_moe.py: error (rank 1): --load: {bare / 'iter_0000004' / 'rng' / 'rank_00001.pt'} is missing: "
            "the checkpoint is incomplete") in output and "exitcode  : 2" in output, output[-3000:]
