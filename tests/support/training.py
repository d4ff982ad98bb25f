"""Launching the real training script for end-to-end tests: `pretrain_gpt_moe.py` under torchrun
on local gloo ranks, its JSON-lines metrics read back (`launch`), and the checks every MoE record
must pass (`check_moe_records`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.multirun import MARKER

from megatron_patches.placement.zebra import DeviceProfile, ZebraShape, save_device_profile
from megatron_patches.training.arguments import EMBEDDED_JOB
from megatron_patches.training.metrics import read_records

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "pretrain_gpt_moe.py"

# The embedded tiny job given explicitly: the entry point loads it by itself only when no model-size
# flag is given, so a test that changes the tiny model's size (--num-experts 4) names it.
TINY_JOB = [f"--config={path}" for path in EMBEDDED_JOB]

# A small, fast configuration on synthetic tokens (the mock dataset), for layout checks.
MOCK = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "1000",
]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


@dataclass
class Run:
    output: str
    records: list[dict]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records if "loss" in r]

    @property
    def grad_norms(self) -> list[float]:
        return [r["grad_norm"] for r in self.records if "loss" in r]


def launch(nproc: int, flags: list[str], workdir: Path, name: str, timeout: int = 600) -> Run:
    log = workdir / f"{name}.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(ENTRY), *flags, "--log-json", str(log),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{output[-6000:]}"
    records = read_records(str(log)) if log.exists() else []
    return Run(output, records)


def launch_many(nproc: int, runs: dict[str, list[str]], workdir: Path, trackers: dict[str, tuple[Path, int]] | None = None,
                timeout: int = 1800, nodes: int = 1, delays: dict[str, dict] | None = None) -> dict[str, Run]:
    """Several runs in one spawn (support/multirun.py: the ranks' imports are paid once), in the
    order given; each Run as `launch` returns it, its output the spawn's lines between its marker
    and the next (stdout and stderr as one stream). `trackers`: run name -> (checkpoint directory,
    iteration) its tracker is pointed at before that run starts. `delays`: run name -> {"rank",
    "max_ms", "seed"}: that rank pauses before each zebra compute task (support/multirun.py).
    `nodes` > 1 emulates that many nodes of nproc / nodes ranks: one torchrun per node on this
    machine, each with its own SLURMD_NODENAME (what `comm.groups.node_layout` reads); the output
    is node 0's."""
    trackers, delays = trackers or {}, delays or {}
    spec = workdir / f"multirun_{next(iter(runs))}.json"
    logs = {name: workdir / f"{name}.jsonl" for name in runs}
    reused = [str(path) for path in logs.values() if path.exists()]
    if reused:  # the records would append to another run's and be read as one run
        raise ValueError(f"run names already used in {workdir}: {reused}; give every run in a workdir its own name")
    spec.write_text(json.dumps([
        {"name": name, "argv": [*flags, "--log-json", str(logs[name])],
         **({"tracker": [str(trackers[name][0]), trackers[name][1]]} if name in trackers else {}),
         **({"delay": delays[name]} if name in delays else {})}
        for name, flags in runs.items()]))
    script = [str(REPO / "tests" / "support" / "multirun.py"), str(spec)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nodes == 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        returncode, stdout = proc.returncode, proc.stdout
    else:
        port = str(free_port())
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={n}",
             f"--nproc-per-node={nproc // nodes}", "--master-addr=127.0.0.1", f"--master-port={port}", *script],
            cwd=REPO, env=dict(env, SLURMD_NODENAME=f"node{n}"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True) for n in range(nodes)]
        try:
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        failed = [n for n, p in enumerate(procs) if p.returncode != 0]
        returncode, stdout = (procs[failed[0]].returncode if failed else 0), outputs[failed[0] if failed else 0]
    assert returncode == 0, f"{', '.join(runs)}: exit {returncode}\n{stdout[-6000:]}"
    outputs, name = {}, None
    for line in stdout.splitlines(keepends=True):
        if line.startswith(MARKER + " "):
            name = line.split(" ", 1)[1].strip()
            outputs[name] = ""
        elif name is not None:
            outputs[name] += line
    assert list(outputs) == list(runs), (list(outputs), stdout[-6000:])
    return {name: Run(outputs[name], read_records(str(logs[name])) if logs[name].exists() else []) for name in runs}


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zebra_replan_flags(path: Path, layers: int, experts: int, attention_ranks: int, expert_ranks: int,
                       interval: int) -> list[str]:
    """Flags that re-plan Asym-EA every ``interval`` iterations, with a profile (written to ``path``)
    of this machine's device type in which one layer's attention takes 1 ms and one expert 1 ms (an
    expert rank's E task is n/N ms), every expert fitting everywhere: moving experts to the attention
    ranks pays whatever the loads."""
    per_rank = experts // expert_ranks
    save_device_profile(path, ZebraShape(layers, experts, attention_ranks, expert_ranks),
                        DeviceProfile("cpu-rank", 1e-3, per_rank * 1e-3, layers * experts, layers * per_rank))
    return ["--zebra-profile", str(path), "--zebra-replan-interval", str(interval)]


def check_moe_records(run: Run, tokens_per_iteration: int, topk: int, num_layers: int, ep: int, dropless: bool = True) -> None:
    for record in run.records:
        if "loss" not in record:
            continue
        assert set(record) >= {"iteration", "loss", "tokens_per_s", "moe_layers", "bytes"}
        assert "a2a" in record["bytes"]
        assert len(record["moe_layers"]) == num_layers
        for layer in record["moe_layers"]:
            assert set(layer) >= {"layer", "expert_tokens", "device_tokens", "imbalance", "survival"}
            # Every token is routed to exactly topk experts (counted before capacity dropping).
            routed, processed = sum(layer["expert_tokens"]), sum(layer["device_tokens"])
            assert routed == tokens_per_iteration * topk
            assert len(layer["device_tokens"]) == ep
            mean = processed / ep
            assert layer["imbalance"] == pytest.approx(max(layer["device_tokens"]) / mean)
            assert layer["survival"] == pytest.approx(processed / routed)
            if dropless:
                assert processed == routed and layer["survival"] == 1.0
            else:
                assert processed <= routed


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the TensorBoard event files in `directory`: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def tensorboard_texts(directory: Path) -> dict[str, str]:
    """Every text summary of the TensorBoard event files in `directory`: tag -> the text (step 0)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    accumulator.Reload()
    return {tag.removesuffix("/text_summary"): accumulator.Tensors(tag)[0].tensor_proto.string_val[0].decode()
            for tag in accumulator.Tags()["tensors"]}
