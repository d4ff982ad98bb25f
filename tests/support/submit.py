"""launch/submit.py for tests: the module (loaded from its path: launch/ is not a package), jobs
planned from run files or inline runs (megatron_patches.jobs.plan), and the training command line
a rendered job script passes to pretrain_gpt_moe.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_patches.jobs import plan as jobs

REPO = Path(__file__).resolve().parents[2]
TEST_DATA = REPO / "tests" / "data" / "slurm"


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


submit = load_module("launch_submit", REPO / "launch" / "submit.py")


def plan(run: str | Path | dict, **overrides):
    """plan_job for a run file or an inline run config."""
    config = jobs.run_config_from_dict(run, "inline") if isinstance(run, dict) else jobs.load_run_config(run)
    training = tuple(overrides.pop("training", ()))
    return jobs.plan_job(config, jobs.Overrides(training=training, **overrides))


def refused(run, **overrides) -> str:
    with pytest.raises(jobs.SubmitError) as info:
        plan(run, **overrides)
    return str(info.value)


def tiny_run(**changes) -> dict:
    """An inline run of the tiny model on the 2 x 2 CPU test cluster."""
    run = yaml.safe_load((TEST_DATA / "run_cpu_2x2.yaml").read_text())
    run.update(changes)
    return run


def expanded_argv(script: str, run_dir: str = "/out/7", ckpt_dir: str = "/out/checkpoints") -> list[str]:
    """The training command line the script passes to pretrain_gpt_moe.py, expanded by bash
    with the script's $RUN_DIR and $CKPT_DIR set to `run_dir` and `ckpt_dir`."""
    arrays = script[script.index("# ---- Training flags"):script.index("# ---- Launch")]
    refs = script[script.rindex("pretrain_gpt_moe.py \\\n") + len("pretrain_gpt_moe.py \\\n"):]
    refs = refs.replace("\\\n", " ")
    program = f'RUN_DIR="$1"; CKPT_DIR="$2"\n{arrays}\nprintf \'%s\\n\' {refs}'
    done = subprocess.run(["bash", "-c", program, "bash", run_dir, ckpt_dir], capture_output=True, text=True,
                          check=True)
    return done.stdout.splitlines()
