#!/usr/bin/env python
"""The device kit: every GPU check prepared in advance, run in one call, one table (issue 46).

    python tools/device_check.py                         # every stage, about 5-8 minutes on one H200
    python tools/device_check.py --stages env,train      # some of them
    python tools/device_check.py --out DIR               # also DIR/device_check.{json,md} and the device profile

Stages, in order (the short ones first), each in a child process and process group with its own
time box (a crash, a CUDA error or a hang ends that stage and its runs only, as a FAIL row, and
the table still prints):
- env: Python, torch, CUDA, the devices, megatron-core, Transformer Engine, Apex (no GPU needed).
- kernels: GEMM, expert GEMM (over 64-8192 tokens), fused attention and HBM rates at the paper
  models' shapes in fp32, bf16 and fp16, written as a device profile that
  `tools/simulate.py --device-profile FILE` reads (sim/profile.py); and the simulator's predicted
  attention-block and expert times, with the cited efficiencies and with the profile, against the
  measured ones.
- overlap: GPT-MoE-S attention (forward and backward, 12 layers, 4 x 2048 tokens, bf16) on the
  compute stream, alone and beside a side-stream copy of t = 8 expert copies per layer (device to
  device, and pinned host to device as a stand-in for the NIC, whole or in 8 pieces); the target
  is <= 10% slowdown. Each timing starts behind a spin kernel long enough for the host to enqueue
  the whole pass first: launched eagerly the pass is bound by the host's launches (measured), and
  the slowdown would measure the host.
- train: the training script on one GPU, ep, in fp32 (full recompute), bf16 (selective) and fp16
  (full), 5 iterations each, against a CPU run of the same seed and flags. Both runs use
  `--use-cpu-initialization` and dropout 0, so they start from the same weights and see the same
  batches: the losses differ only by the kernels' arithmetic. Reports the iteration time and the
  allocator's peak. fssdp and replicate need an expert-parallel group of two ranks and zebra an
  attention and an expert rank: NCCL puts one rank on one GPU, so on one GPU they are skipped,
  saying so, and run in the multi-gpu stage.
- sync: one iteration (the third of four, not a logging one) of the ep run with
  torch.cuda.set_sync_debug_mode("warn"): every host synchronisation is counted and named by the
  innermost frame of this project or of Megatron-Core, whichever is nearer the call (autograd's
  device thread included); the target is 0 in this project's code. A run in which nothing is
  warned fails: the loss is read on the host every iteration, so the hook would be blind.
- memory: GPT-MoE-S (configs/models/gpt_moe_s.yaml, 1.88 B parameters, all 64 experts on the one
  GPU) for 3 iterations in bf16 with selective recompute: the allocator's peak against the
  simulator's memory model (sim.costs.MemoryModel: weights, gradients, optimizer, experts,
  activations; the 1.5 GB reserve for the CUDA context is outside the allocator and left out),
  and the activations kept for the backward against the model's activations alone.
- te-apex (on the GPU machine only: CI must not download them): whether Transformer Engine and
  Apex import; if not, pip's verbatim answer to installing Transformer Engine; if it imports, ep
  with `--transformer-impl transformer_engine` against the local implementation's losses.
- multi-gpu (2+ GPUs): every mode under torchrun with NCCL against the CPU losses of the same
  flags (gloo), in bf16.

Without CUDA every GPU stage reports "skipped: no CUDA" and the table still prints (CI runs this
dry run: tests/test_device_check.py). Results of real runs go to docs/benchmarks.md, "Device kit",
with the device named. How to run it on the lent machine: README, "CPU and GPU".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ITERATIONS = 5
"""Training iterations per run of the train stage."""
SYNC_ITERATION = 3
"""The iteration the sync stage counts (the first two warm up caches and allocators)."""
COMPARED = ["--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
            "--eval-iters", "0", "--log-interval", "1"]
"""Flags of every GPU-against-CPU run: the same initial weights (drawn on the host) and no dropout
(CUDA and CPU draw different masks), so only the arithmetic differs."""
PRECISIONS = {
    # name: (flags, tolerance on |GPU loss - CPU loss| at every iteration)
    "fp32": (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
             2e-4),
    "bf16": (["--bf16", "--recompute-granularity", "selective"], 5e-3),
    # Megatron-LM's initial loss scale 2^32 skips the first ~17 steps; 4096 lets all 5 update
    "fp16": (["--fp16", "--initial-loss-scale", "4096", "--recompute-granularity", "full", "--recompute-method",
              "uniform", "--recompute-num-layers", "1"], 2e-3),
}
"""Tolerances: on CPU the three precisions' losses of these runs differ by at most 8e-4 (bf16 vs
fp32) and 3.1e-4 (fp16 vs fp32) over 5 iterations, while one lost update moves the loss by ~0.05."""
OVERLAP_COPIES = 8
"""t, expert copies gathered per layer in the overlap stage (FSSDP's typical overlap degree)."""
OVERLAP_TARGET = 0.10
GPU_TYPES = {"NVIDIA H200": ("H200-SXM-141GB", "h200_hgx"), "NVIDIA H100 80GB HBM3": ("H100-SXM5-80GB", "h100_dgx")}
"""CUDA device names (exact: "NVIDIA H200 NVL" is another, slower part) -> (the cluster files' GPU
type a device profile describes, a cluster of that type)."""


@dataclass
class Row:
    stage: str
    check: str
    result: str
    """pass, FAIL, report (a figure without a tolerance), skipped: why, error: why."""
    figure: str = ""
    tolerance: str = ""


@dataclass(frozen=True)
class Stage:
    name: str
    needs_cuda: bool
    budget_s: int
    """The stage's time box (its child process is killed after it)."""
    min_gpus: int = 1


STAGES = (
    Stage("env", False, 60),
    Stage("kernels", True, 120),
    Stage("overlap", True, 60),
    Stage("train", True, 240),
    Stage("sync", True, 90),
    Stage("memory", True, 150),
    Stage("te-apex", True, 150),
    Stage("multi-gpu", True, 300, min_gpus=2),
)
"""The short stages first: a slow train stage then cannot cost the device profile."""


# ---------------------------------------------------------------------------------------------
# The parent: runs the stages, prints the table
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default=",".join(s.name for s in STAGES),
                   help="comma-separated stages to run, in the kit's order (default: all): "
                   + ", ".join(s.name for s in STAGES))
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write device_check.json, device_check.md and device_profile.json (kernels) to DIR")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="the whole kit's time box: a stage whose own box would end after it is skipped, saying so "
                   "(default 540 s, inside the device tool's 10-minute call)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sync-child", nargs=2, default=None, metavar=("OUT", "ITERATION"), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if rest and args.sync_child is None:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.train_argv = rest
    names = [s.name for s in STAGES]
    args.stage_list = [x for x in args.stages.split(",") if x]
    unknown = [x for x in args.stage_list if x not in names]
    if unknown:
        p.error(f"--stages: unknown {', '.join(unknown)}; valid: {', '.join(names)}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    return args


def cuda_devices() -> int:
    """GPUs torch sees, asked in a child so the parent never initialises CUDA (0 on any failure)."""
    try:
        done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
                               "if torch.cuda.is_available() else 0)"], capture_output=True, text=True, timeout=120)
        return int(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def run_stage(stage: Stage, out_dir: Path, timeout_s: float) -> list[Row]:
    """One stage in a child process; its rows, or one FAIL row saying how it ended."""
    result = out_dir / f"stage_{stage.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stage.name, "--child-out", str(out_dir)]
    log = out_dir / f"stage_{stage.name}.log"
    with open(log, "w") as log_file:
        # its own process group: a timeout ends the stage's training runs too, not only the stage
        child_process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env=child_env(),
                                         start_new_session=True)
        try:
            code = child_process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child_process.pid, signal.SIGKILL)
            child_process.wait()
            code = None
    rows = [Row(**r) for r in json.loads(result.read_text())] if result.exists() else []
    if code is None:
        rows.append(Row(stage.name, "stage", "FAIL", f"timed out after {timeout_s:.0f} s", f"<= {timeout_s:.0f} s"))
    elif code != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
        rows.append(Row(stage.name, "stage", "FAIL", f"exit {code}: {tail}"))
    return rows


def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1")


def format_table(rows: list[Row]) -> str:
    head = ("stage", "check", "result", "figure", "tolerance")
    cells = [head] + [(r.stage, r.check, r.result, r.figure, r.tolerance) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["| " + " | ".join(c[i].ljust(widths[i]) for i in range(len(head))) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sync_child is not None:
        return sync_child(Path(args.sync_child[0]), int(args.sync_child[1]), args.train_argv)
    if args.child is not None:
        return child(args.child, Path(args.child_out))
    started = time.monotonic()
    gpus = cuda_devices()
    print(f"device_check: {gpus} CUDA device(s); stages {', '.join(args.stage_list)}; budget {args.budget_s:.0f} s",
          flush=True)
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="device_check_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for stage in STAGES:
        if stage.name not in args.stage_list:
            continue
        left = args.budget_s - (time.monotonic() - started)
        if stage.needs_cuda and gpus < stage.min_gpus:
            why = "no CUDA" if gpus == 0 else f"needs {stage.min_gpus} GPUs, this machine has {gpus}"
            rows.append(Row(stage.name, "stage", f"skipped: {why}"))
        elif left < min(stage.budget_s, 30):
            rows.append(Row(stage.name, "stage", f"skipped: kit budget spent ({left:.0f} s left of "
                            f"{args.budget_s:.0f})"))
        else:
            t0 = time.monotonic()
            print(f"device_check: stage {stage.name} (time box {min(stage.budget_s, left):.0f} s)", flush=True)
            stage_rows = run_stage(stage, out_dir, min(stage.budget_s, left))
            rows += stage_rows
            print(f"device_check: stage {stage.name} done in {time.monotonic() - t0:.0f} s: "
                  f"{', '.join(r.result.split(':')[0] for r in stage_rows) or 'no rows'}", flush=True)
    table = format_table(rows)
    print(table)
    failed = [r for r in rows if r.result.startswith(("FAIL", "error"))]
    print(f"device_check: {len(rows)} rows, {len(failed)} failed, {time.monotonic() - started:.0f} s; "
          f"stage logs in {out_dir}")
    (out_dir / "device_check.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (out_dir / "device_check.md").write_text(table + "\n")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# Children: one stage each
# ---------------------------------------------------------------------------------------------


def child(name: str, out_dir: Path) -> int:
    """Run one stage; write its rows as they come (a crash keeps the rows made before it)."""
    rows: list[Row] = []
    path = out_dir / f"stage_{name}.json"

    def emit(row: Row) -> None:
        rows.append(row)
        # whole or not at all: the parent may kill this process at any moment
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps([asdict(r) for r in rows]))
        os.replace(partial, path)
        print(f"  {row.check}: {row.result} {row.figure}", flush=True)

    try:
        STAGE_FUNCTIONS[name](emit, out_dir)
    except Exception as error:  # a stage's failure is a row; the kit goes on with the next stage
        traceback.print_exc()
        emit(Row(name, "stage", f"error: {type(error).__name__}: {str(error)[:200]}"))
    return 0


def stage_env(emit, out_dir: Path) -> None:
    import platform

    emit(Row("env", "python", "report", f"{platform.python_version()} ({sys.executable})"))
    import torch

    cuda = torch.version.cuda or "none"
    emit(Row("env", "torch", "report", f"{torch.__version__}, CUDA {cuda}"))
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        props = torch.cuda.get_device_properties(0)
        emit(Row("env", "devices", "report", f"{len(names)} x {names[0]}, {props.total_memory / 2**30:.0f} GiB, "
                 f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs"))
    else:
        emit(Row("env", "devices", "report", "no CUDA device"))
    for module in ("megatron.core", "numba", "transformer_engine", "apex"):
        emit(Row("env", module, "report", import_outcome(module)))


def import_outcome(module: str) -> str:
    done = subprocess.run([sys.executable, "-c", f"import {module} as m; print(getattr(m, '__version__', 'imported'))"],
                          capture_output=True, text=True, timeout=120, env=child_env())
    if done.returncode == 0:
        return done.stdout.strip().splitlines()[-1]
    return "not importable: " + (done.stderr.strip().splitlines() or ["?"])[-1][:160]


def training(flags: list[str], log: Path, cpu: bool, launcher: list[str] | None = None,
             timeout_s: float = 180) -> list[dict]:
    """Run the training script; its per-iteration records (RuntimeError with the output's tail on failure)."""
    log.unlink(missing_ok=True)
    cmd = [*(launcher or [sys.executable]), "pretrain_gpt_moe.py", *flags, *(["--cpu"] if cpu else []),
           "--log-json", str(log)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=timeout_s)
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-4:])
        raise RuntimeError(f"{' '.join(cmd[-8:])} exited {done.returncode}: {tail[-400:]}")
    return [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]


def compare_losses(gpu: list[dict], cpu: list[dict]) -> float:
    """max over iterations of |GPU loss - CPU loss| (inf when the iterations differ)."""
    if [r["iteration"] for r in gpu] != [r["iteration"] for r in cpu]:
        return float("inf")
    return max(abs(g["loss"] - c["loss"]) for g, c in zip(gpu, cpu))


def train_run(precision: str) -> list[str]:
    """The train stage's flags in `precision` (the GPU run; the CPU run adds --cpu)."""
    return [*COMPARED, *PRECISIONS[precision][0], "--train-iters", str(ITERATIONS)]


SYNC_RUN = [*COMPARED, "--bf16", "--log-interval", "100", "--train-iters", str(SYNC_ITERATION + 1)]
"""Iteration SYNC_ITERATION is neither the last nor a logging one, so what it synchronises is the
step itself (the script's last --log-interval wins over COMPARED's)."""
MEMORY_RUN = ["--config", "configs/models/gpt_moe_s.yaml", "--micro-batch-size", "1", "--train-iters", "3", "--lr",
              "1e-4", "--bf16", "--recompute-granularity", "selective", "--eval-iters", "0", "--log-interval", "1"]
"""GPT-MoE-S describes its own model, so it takes Megatron-LM's defaults and gives the flags Megatron-LM requires."""
MULTI_GPU_RANKS = 2
MULTI_GPU_MODES = {
    "ep": [],
    # fixed t and no calibration: the GPU's and the CPU's timers would otherwise choose differently
    "fssdp": ["--moe-parallel-mode", "fssdp", "--fssdp-overlap-degree", "2", "--no-fssdp-calibrate"],
    "replicate": ["--moe-parallel-mode", "replicate"],
    "zebra": ["--moe-parallel-mode", "zebra", "--expert-model-parallel-size", "1", "--zebra-attention-ranks", "1",
              "--zebra-expert-ranks", "1", "--zebra-microbatches", "4"],
}


def multi_gpu_run(mode: str) -> list[str]:
    return [*train_run("bf16"), *MULTI_GPU_MODES[mode]]


def kit_runs() -> dict[str, tuple[list[str], int]]:
    """Every training command line of the kit with its world size (tests validate them all on CPU,
    so a renamed flag fails CI rather than the GPU day)."""
    runs = {f"train {p}": (train_run(p), 1) for p in PRECISIONS}
    runs["sync"] = (SYNC_RUN, 1)
    runs["memory"] = (MEMORY_RUN, 1)
    runs["te-apex"] = ([*train_run("bf16"), "--transformer-impl", "local"], 1)
    runs.update({f"multi-gpu {m}": (multi_gpu_run(m), MULTI_GPU_RANKS) for m in MULTI_GPU_MODES})
    return runs


def stage_train(emit, out_dir: Path) -> None:
    for name, (_, tol) in PRECISIONS.items():
        run = train_run(name)
        try:
            gpu = training(run, out_dir / f"train_{name}_gpu.jsonl", cpu=False)
            cpu = training(run, out_dir / f"train_{name}_cpu.jsonl", cpu=True)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            emit(Row("train", f"ep {name} vs CPU", "FAIL", str(error)[:300], f"<= {tol:g}"))
            continue
        diff = compare_losses(gpu, cpu)
        ms = 1e3 * sum(r["iteration_time_s"] for r in gpu[1:]) / max(len(gpu) - 1, 1)
        peak = max(max(r.get("memory", {}).get("cuda_peak_allocated_bytes", [0])) for r in gpu)
        skipped = sum(not r["update_successful"] for r in gpu)
        emit(Row("train", f"ep {name} vs CPU", "pass" if diff <= tol else "FAIL",
                 f"max |dloss| {diff:.2e}; loss {gpu[0]['loss']:.4f} -> {gpu[-1]['loss']:.4f}; {ms:.1f} ms/it; "
                 f"peak {peak / 2**20:.0f} MiB; {skipped} skipped", f"<= {tol:g}"))
    for mode, why in (("fssdp", "an expert-parallel group of 2+ ranks"), ("replicate", "a replicate group of 2+ ranks"),
                      ("zebra", "an attention rank and an expert rank")):
        emit(Row("train", f"{mode} one GPU", f"skipped: needs {why}; NCCL runs one rank per GPU (multi-gpu stage)"))


def stage_sync(emit, out_dir: Path) -> None:
    out = out_dir / "sync.json"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--sync-child", str(out),
                           str(SYNC_ITERATION), *SYNC_RUN], capture_output=True, text=True, cwd=REPO, env=child_env(),
                          timeout=80)
    if done.returncode != 0 or not out.exists():
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        emit(Row("sync", "ep bf16", "FAIL", f"exit {done.returncode}: {tail[-300:]}"))
        return
    found = json.loads(out.read_text())
    if found["warned"] == 0:
        # every iteration reads its loss on the host, so silence means the hook saw nothing
        emit(Row("sync", "ep bf16: the sync hook", "FAIL", "no synchronisation warned in the whole run: the hook "
                 "did not see set_sync_debug_mode's warnings"))
        return
    ours = {k: v for k, v in found["sources"].items() if k.startswith("ours ")}
    others = {k: v for k, v in found["sources"].items() if not k.startswith("ours ")}
    named = "; ".join(f"{k} x{v}" for k, v in sorted(ours.items(), key=lambda kv: -kv[1])[:6])
    emit(Row("sync", f"ep bf16 iteration {SYNC_ITERATION}, this project", "pass" if not ours else "FAIL",
             f"{sum(ours.values())} syncs" + (f": {named}" if named else ""), "0"))
    named = "; ".join(f"{k} x{v}" for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:6])
    emit(Row("sync", f"ep bf16 iteration {SYNC_ITERATION}, Megatron-Core/torch", "report",
             f"{sum(others.values())} syncs" + (f": {named}" if named else "") + f" ({found['warned']} in the run)"))


def sync_child(out: Path, iteration: int, argv: list[str]) -> int:
    """Train with every host synchronisation warned, counting those of `iteration` by source."""
    import collections
    import runpy
    import threading
    import warnings

    import torch

    sources: collections.Counter = collections.Counter()
    warned = 0

    def record(message, category, filename, lineno, file=None, line=None):
        nonlocal warned
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        warned += 1
        frames = stack(sys._getframe(1))
        # autograd runs Python Functions' backward on its own device thread: the iteration is
        # then the main thread's, the source still this thread's frames
        loop = loop_frame(frames) or loop_frame(stack(sys._current_frames().get(threading.main_thread().ident)))
        if loop is not None and loop.f_locals.get("iteration") == iteration:
            sources[sync_source(frames)] += 1
        return None

    warnings.simplefilter("always")
    if torch.cuda.is_available():  # a CPU-only torch refuses the call (the CPU rehearsal of CI)
        torch.cuda.set_sync_debug_mode("warn")
    sys.argv = ["pretrain_gpt_moe.py", *argv]
    entry = runpy.run_path(str(REPO / "pretrain_gpt_moe.py"), run_name="device_check")
    # the script's import installs its own warning printer (compat.known_warnings.show_once):
    # ours goes over it and hands it every other warning
    shown = warnings.showwarning
    warnings.showwarning = record
    code = entry["main"](argv)
    out.write_text(json.dumps({"iteration": iteration, "warned": warned, "sources": dict(sources)}))
    return code


def stack(frame) -> list:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def loop_frame(frames):
    """The training loop's frame (training/loop.py `train`, whose local `iteration` is the iteration), or None."""
    return next((f for f in frames if f.f_code.co_name == "train"
                 and f.f_code.co_filename.endswith(os.path.join("training", "loop.py"))), None)


def sync_source(frames) -> str:
    """The innermost frame of this project ("ours FILE:LINE (function)") or of Megatron-Core
    ("megatron-core ..."), whichever comes first from the synchronising call outwards; else the
    innermost other frame outside the warning machinery and this kit."""
    ours = str(REPO / "megatron_patches")
    mcore = f"{os.sep}megatron{os.sep}core{os.sep}"
    for frame in frames:
        name = frame.f_code.co_filename
        if name.startswith(ours):
            return f"ours {os.path.relpath(name, REPO)}:{frame.f_lineno} ({frame.f_code.co_name})"
        if mcore in name:
            return f"megatron-core {name.split(mcore)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
    frame = next((f for f in frames if os.path.basename(f.f_code.co_filename) not in ("warnings.py", "device_check.py")),
                 frames[0])
    return f"other {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def simulated_memory() -> dict[str, float]:
    """The simulator's bytes for MEMORY_RUN on one device, by part (without the CUDA-context reserve)."""
    import numpy as np

    from megatron_patches.config import load_cluster_config, load_model_config
    from megatron_patches.sim import Hardware, MemoryModel, Precision, Workload

    model = load_model_config("gpt_moe_s")
    workload = Workload(model, 1, 1, model.seq_length, Precision("bf16"), "selective")
    mem = MemoryModel(workload, Hardware.from_cluster(load_cluster_config("h200_hgx"), 1))
    tokens_LD = np.full((model.num_layers, 1), float(workload.routed_tokens_per_layer))
    return {"dense": mem.dense_bytes(),
            "experts": model.num_experts * model.num_layers * mem.expert_bytes_per_instance(True),
            "activations": float(mem.activation_bytes(tokens_LD)[0])}


def stage_memory(emit, out_dir: Path) -> None:
    import numpy as np

    records = training(MEMORY_RUN, out_dir / "memory_gpt_moe_s.jsonl", cpu=False, timeout_s=140)
    peak = max(max(r["memory"]["cuda_peak_allocated_bytes"]) for r in records)
    parts = simulated_memory()
    need = sum(parts.values())
    ratio = peak / need
    emit(Row("memory", "GPT-MoE-S bf16 selective, 1 GPU: allocator peak / simulator", "pass" if 0.8 <= ratio <= 1.25
             else "FAIL", f"{peak / 1e9:.2f} GB / {need / 1e9:.2f} GB = {ratio:.2f} ("
             + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items()) + f"); "
             f"{np.mean([r['iteration_time_s'] for r in records[1:]]) * 1e3:.0f} ms/it", "0.80-1.25"))
    # the peak falls in the optimizer step (torch's foreach Adam holds temporaries there), where the
    # activations are gone: so the activations are compared on their own, as compat/activations.py counts them
    kept = max(max(r["memory"]["activation_bytes"]) for r in records)
    emit(Row("memory", "GPT-MoE-S activations kept for the backward / simulator", "report",
             f"{kept / 1e9:.2f} GB / {parts['activations'] / 1e9:.2f} GB = {kept / parts['activations']:.2f}"))


def attention_block(model, tokens: int, dtype):
    """GPT-MoE-S's attention block as plain torch (QKV, causal fused attention, projection): a
    function running it forward (and backward when asked) on the current stream."""
    import torch
    import torch.nn.attention
    import torch.nn.functional as F

    h, heads = model.hidden_size, model.num_attention_heads
    s = model.seq_length
    b = tokens // s
    x = torch.randn(s, b, h, device="cuda", dtype=dtype, requires_grad=True)
    # leaves (scaled before requires_grad): a non-leaf's graph would be freed by the first backward
    w_qkv = (torch.randn(3 * h, h, device="cuda", dtype=dtype) * 0.02).requires_grad_()
    w_proj = (torch.randn(h, h, device="cuda", dtype=dtype) * 0.02).requires_grad_()
    backend = torch.nn.attention.SDPBackend.FLASH_ATTENTION if dtype != torch.float32 else \
        torch.nn.attention.SDPBackend.MATH

    def run(backward: bool):
        qkv_SB3HD = F.linear(x, w_qkv).view(s, b, 3, heads, h // heads)
        q, k, v = (qkv_SB3HD[:, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, heads, s, d]
        with torch.nn.attention.sdpa_kernel(backend):
            ctx_BHSD = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y_SBH = F.linear(ctx_BHSD.permute(2, 0, 1, 3).reshape(s, b, h), w_proj)
        if backward:
            y_SBH.backward(torch.ones_like(y_SBH))
        return y_SBH

    return run


def timed(fn, repeats: int, warmup: int = 3) -> float:
    """Mean seconds of fn() on the current stream, by CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def graph_timed(fn, repeats: int) -> float:
    """Mean seconds of fn() replayed from a CUDA graph of `repeats` calls: small GEMMs timed
    without the host's launch cost, which would otherwise bound them."""
    import torch

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # capture needs the kernels' workspaces made outside it
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return timed(graph.replay, repeats=3, warmup=1) / repeats


def stage_overlap(emit, out_dir: Path) -> None:
    import torch

    from megatron_patches.config import load_model_config
    from megatron_patches.sim import Precision, Workload

    model = load_model_config("gpt_moe_s")
    layers, tokens = model.num_layers, 4 * model.seq_length
    block = attention_block(model, tokens, torch.bfloat16)
    expert_bytes = Workload(model, 1, 1, model.seq_length, Precision("bf16")).expert_params * 2
    copy_bytes = OVERLAP_COPIES * expert_bytes
    side = torch.cuda.Stream()
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pinned = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)

    def model_pass():
        for _ in range(layers):
            block(True)

    eager = timed(model_pass, repeats=5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model_pass()
    launch = time.perf_counter() - t0
    torch.cuda.synchronize()
    # Measured on an H200 (2026-11-29): the host takes longer to launch this pass than the GPU
    # to run it (16.2 against 13.8 ms), so eager timings measure the host, and any host work
    # beside them (enqueueing the copies) reads as a slowdown of attention. Every timing below
    # starts behind a spin kernel (torch.cuda._sleep) long enough for the host to enqueue the whole
    # pass first: the GPU's time alone, as a pass within a long step runs.
    cycles_per_s = spin_rate()
    lead_cycles = int(cycles_per_s * 2 * (launch + 0.01))

    def led(with_copies) -> float:
        """Median seconds on the compute stream of the pass, (with the copies on the side stream)."""
        compute = []
        for _ in range(6):  # the first warms up
            compute_stream = torch.cuda.current_stream()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(lead_cycles)
            side.wait_stream(compute_stream)
            start.record()
            if with_copies is not None:
                with torch.cuda.stream(side):
                    with_copies()
            model_pass()
            end.record()  # the compute stream's own time: attention as slowed by the copies
            compute_stream.wait_stream(side)
            torch.cuda.synchronize()
            compute.append(start.elapsed_time(end) / 1e3)
        return sorted(compute[1:])[len(compute[1:]) // 2]

    alone = led(None)
    emit(Row("overlap", f"attention fwd+bwd x {layers} alone", "report",
             f"{alone * 1e3:.2f} ms on the GPU behind a launch lead; eager {eager * 1e3:.2f} ms, the host "
             f"launching it in {launch * 1e3:.2f} ms"))
    # (label, source, pieces per layer): the pieces variant tells a rate effect from a per-copy one
    variants = (("device to device", src, 1), ("pinned host to device", pinned, 1),
                ("pinned host to device, 8 pieces per layer", pinned, 8))
    for label, source, pieces in variants:
        piece = copy_bytes // pieces

        def copies():
            for _ in range(layers):
                for i in range(pieces):
                    dst[i * piece:(i + 1) * piece].copy_(source[i * piece:(i + 1) * piece], non_blocking=True)

        copy_alone = timed(copies, repeats=5)
        both = led(copies)
        slowdown = both / alone - 1.0
        emit(Row("overlap", f"attention fwd+bwd x {layers} beside {label} copies",
                 "pass" if slowdown <= OVERLAP_TARGET else "FAIL",
                 f"{alone * 1e3:.2f} ms alone, {both * 1e3:.2f} ms beside {layers} x {copy_bytes / 1e6:.1f} MB "
                 f"(the copies alone {copy_alone * 1e3:.2f} ms, {layers * copy_bytes / copy_alone / 1e9:.0f} GB/s): "
                 f"{slowdown:+.1%}", f"<= {OVERLAP_TARGET:.0%}"))


def spin_rate() -> float:
    """Cycles per second of torch.cuda._sleep, measured (the SM clock it counts varies by part)."""
    import torch

    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def stage_kernels(emit, out_dir: Path) -> None:
    import numpy as np
    import torch
    import torch.nn.attention
    import torch.nn.functional as F

    from megatron_patches.config import load_cluster_config, load_model_config
    from megatron_patches.sim import ComputeModel, Hardware, KernelEfficiency, Precision, SimError, Workload
    from megatron_patches.sim.profile import DeviceProfile

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    models = [load_model_config(name) for name in ("gpt_moe_s", "gpt_moe_l")]
    tokens = 8192
    nbytes = 2**30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    hbm = 2 * nbytes / timed(lambda: dst.copy_(src), repeats=10) / 1e9
    emit(Row("kernels", "HBM copy (read + write)", "report", f"{hbm:.0f} GB/s"))
    precisions = {}
    expert_ns = np.array([64, 128, 256, 512, 1024, 2048, 4096, 8192])
    for name, dtype in dtypes.items():
        flops = seconds = 0.0
        for m in models:
            h = m.hidden_size
            x = torch.randn(tokens, h, device="cuda", dtype=dtype)
            for width in (3 * h, h, m.ffn_hidden_size):
                w = torch.randn(width, h, device="cuda", dtype=dtype)
                seconds += timed(lambda: F.linear(x, w), repeats=20)
                flops += 2.0 * tokens * h * width
        dense = flops / seconds / 1e12
        m = models[0]
        h, f = m.hidden_size, m.moe_ffn_hidden_size
        w1 = torch.randn(f, h, device="cuda", dtype=dtype)
        w2 = torch.randn(h, f, device="cuda", dtype=dtype)
        times = []
        for n in expert_ns:
            x = torch.randn(int(n), h, device="cuda", dtype=dtype)
            times.append(graph_timed(lambda: F.linear(F.linear(x, w1), w2), repeats=20))
        # the cost model's expert GEMM: 4 n h f FLOP at R n / (n + n_half), i.e. a time of
        # 4 h f (n + n_half) / R, a line in n: slope 4 h f / R, intercept n_half x slope
        slope, intercept = np.polyfit(expert_ns.astype(float), np.array(times), 1)
        peak_rate, half = 4.0 * h * f / slope / 1e12, intercept / slope
        rates = ", ".join(f"{n}: {4.0 * n * h * f / t / 1e12:.0f}" for n, t in zip(expert_ns, times))
        if slope <= 0 or intercept <= 0:
            emit(Row("kernels", f"{name} expert GEMM fit", "FAIL", f"time = {intercept:.3g} s + {slope:.3g} s x n "
                     f"is not the cost model's form (TFLOP/s at n tokens: {rates})"))
            return
        precisions[name] = {"dense_gemm_tflops": dense, "expert_gemm_tflops": peak_rate, "expert_half_tokens": half}
        figure = (f"dense {dense:.0f} TFLOP/s; expert {peak_rate:.0f} TFLOP/s, half at {half:.0f} tokens "
                  f"(TFLOP/s at n tokens, from CUDA graphs: {rates})")
        if name != "fp32":
            s, heads, d = m.seq_length, m.num_attention_heads, h // m.num_attention_heads
            q, k, v = (torch.randn(tokens // s, heads, s, d, device="cuda", dtype=dtype) for _ in range(3))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                t = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats=20)
            flash = 2.0 * tokens * s * heads * d / t / 1e12  # the cost model's causal count (costs.py)
            precisions[name]["flash_attention_tflops"] = flash
            figure += f"; flash attention {flash:.0f} TFLOP/s"
        emit(Row("kernels", f"{name} rates", "report", figure))
    # one expert's forward as training launches it (eager: fc1, GELU, fc2) at 16 tokens, where its
    # kernels take microseconds, against the same kernels replayed from a CUDA graph: the fixed
    # cost the cost model charges per expert (kernel_launch_s, 8 us cited; measured on an H200 on
    # 2026-11-29 the eager expert at 1,024 tokens took 54 us against about 14 us of kernels)
    m = models[0]
    w1 = torch.randn(m.moe_ffn_hidden_size, m.hidden_size, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(m.hidden_size, m.moe_ffn_hidden_size, device="cuda", dtype=torch.bfloat16)

    def expert_forward(tokens_TH):
        """One GPT-MoE-S expert's forward in bf16, eager as training runs it."""
        return F.linear(F.gelu(F.linear(tokens_TH, w1)), w2)

    x = torch.randn(16, m.hidden_size, device="cuda", dtype=torch.bfloat16)
    eager = timed(lambda: expert_forward(x), repeats=50)
    kernels = graph_timed(lambda: expert_forward(x), repeats=50)
    launch_us = (eager - kernels) * 1e6
    emit(Row("kernels", "expert launch cost (bf16, 16 tokens, GPT-MoE-S)", "report",
             f"eager {eager * 1e6:.1f} us, from a CUDA graph {kernels * 1e6:.1f} us: {launch_us:.1f} us per expert"))
    device = torch.cuda.get_device_name(0)
    gpu_type, cluster = GPU_TYPES.get(device, (None, None))
    profile = DeviceProfile(gpu_type or device, device, hbm, precisions,
                            f"tools/device_check.py kernels stage, {time.strftime('%Y-%m-%d')}, torch "
                            f"{torch.__version__}, CUDA {torch.version.cuda}; GEMMs of GPT-MoE-S/L at {tokens} tokens; "
                            f"fp32 without TF32 (torch's default, as the local implementation runs)",
                            expert_launch_us=launch_us if launch_us > 0 else None)
    path = out_dir / "device_profile.json"
    path.write_text(json.dumps(profile.to_dict(), indent=1))
    if gpu_type is None:
        emit(Row("kernels", "device profile", "report", f"written to {path}, but no cluster file names a {device}: "
                 f"add its GPU type to configs/clusters and GPU_TYPES to use it"))
        return
    hardware = Hardware.from_cluster(load_cluster_config(cluster), 1)
    try:
        measured_eff = profile.efficiency_overrides(hardware, Precision("bf16"))
    except SimError as error:
        emit(Row("kernels", "device profile", "FAIL", f"{path} ({gpu_type}) does not fit the cluster file: {error}"))
        return
    emit(Row("kernels", "device profile", "report", f"{path} ({gpu_type}): bf16 "
             + ", ".join(f"{k} {v:.3g}" for k, v in measured_eff.items())))
    workload = Workload(m, 1, tokens // m.seq_length, m.seq_length, Precision("bf16"))
    block = attention_block(m, tokens, torch.bfloat16)
    measured_attention = timed(lambda: block(False), repeats=10)
    n = 1024
    x = torch.randn(n, m.hidden_size, device="cuda", dtype=torch.bfloat16)
    # eager, as training runs it: launches included (the cost model adds kernel_launch_s per expert)
    measured_expert = timed(lambda: expert_forward(x), repeats=20)
    for label, eff in (("cited efficiencies", KernelEfficiency()),
                       ("device profile", KernelEfficiency().with_overrides(measured_eff))):
        compute = ComputeModel(workload, hardware, eff)
        attention = float(compute.attention_fwd_D()[0])
        expert = float(compute.expert_fwd(np.array([[float(n)]]))[0])
        emit(Row("kernels", f"simulator / measured, GPT-MoE-S bf16, {label}", "report",
                 f"attention block fwd {attention * 1e3:.3f} / {measured_attention * 1e3:.3f} ms = "
                 f"{attention / measured_attention:.2f}; expert fwd at {n} tokens {expert * 1e6:.0f} / "
                 f"{measured_expert * 1e6:.0f} us = {expert / measured_expert:.2f}"))


def stage_te_apex(emit, out_dir: Path) -> None:
    te = import_outcome("transformer_engine")
    for module, package in (("transformer_engine", "transformer-engine[pytorch]"), ("apex", "apex (NVIDIA's)")):
        outcome = te if module == "transformer_engine" else import_outcome(module)
        if not outcome.startswith("not importable"):
            emit(Row("te-apex", f"{module} import", "report", outcome))
            continue
        if module == "apex":
            # the PyPI package named apex is unrelated (pyproject.toml): NVIDIA's is built from source
            emit(Row("te-apex", "apex", "report", f"{outcome}; NVIDIA Apex is built from its source, not from PyPI"))
            continue
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--retries", "0", "--timeout", "10", package],
                              capture_output=True, text=True, timeout=120)
        answer = " | ".join((done.stdout + done.stderr).strip().splitlines()[-2:])[-300:]
        emit(Row("te-apex", f"pip install {package}", "report", f"exit {done.returncode}: {answer}"))
        te = import_outcome(module)
    if te.startswith("not importable"):
        emit(Row("te-apex", "ep transformer_engine vs local", "skipped: Transformer Engine does not import"))
        return
    run = train_run("bf16")
    local = training([*run, "--transformer-impl", "local"], out_dir / "te_local.jsonl", cpu=False)
    engine = training([*run, "--transformer-impl", "transformer_engine"], out_dir / "te_engine.jsonl", cpu=False)
    diff, tol = compare_losses(engine, local), PRECISIONS["bf16"][1]
    emit(Row("te-apex", "ep bf16 transformer_engine vs local", "pass" if diff <= tol else "FAIL",
             f"max |dloss| {diff:.2e}", f"<= {tol:g}"))


def stage_multi_gpu(emit, out_dir: Path) -> None:
    import torch

    ranks = MULTI_GPU_RANKS
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    tol = PRECISIONS["bf16"][1]
    for mode in MULTI_GPU_MODES:
        run = multi_gpu_run(mode)
        try:
            gpu = training(run, out_dir / f"multi_{mode}_gpu.jsonl", cpu=False, launcher=launcher, timeout_s=120)
            cpu = training(run, out_dir / f"multi_{mode}_cpu.jsonl", cpu=True, launcher=launcher, timeout_s=120)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            emit(Row("multi-gpu", f"{mode} NCCL x{ranks} vs gloo", "FAIL", str(error)[:300], f"<= {tol:g}"))
            continue
        diff = compare_losses(gpu, cpu)
        emit(Row("multi-gpu", f"{mode} NCCL x{ranks} vs gloo", "pass" if diff <= tol else "FAIL",
                 f"max |dloss| {diff:.2e}; {torch.cuda.device_count()} GPUs", f"<= {tol:g}"))
        if mode == "fssdp":
            # the waits behind fssdp's collectives on the compute stream (CUDA events), per iteration
            # after the first; the simulator's figure for the same run is the open step (issue 46)
            waits = [sum(r["fssdp"]["exposed_s"].values()) for r in gpu[1:]]
            planner = [r["fssdp"]["planner_exposed_s"] for r in gpu[1:]]
            emit(Row("multi-gpu", "fssdp exposed collectives and planner (NCCL)", "report",
                     f"collectives {1e3 * sum(waits) / len(waits):.2f} ms/it, planner "
                     f"{1e3 * sum(planner) / len(planner):.2f} ms/it"))


STAGE_FUNCTIONS = {"env": stage_env, "train": stage_train, "sync": stage_sync, "memory": stage_memory,
                   "overlap": stage_overlap, "kernels": stage_kernels, "te-apex": stage_te_apex,
                   "multi-gpu": stage_multi_gpu}


if __name__ == "__main__":
    sys.exit(main())
