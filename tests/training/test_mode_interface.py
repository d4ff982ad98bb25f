"""The mode contract (megatron_patches/mode): every registered runtime is a ModeRuntime whose
overridden steps keep the base signatures, every mode owns its flags under its own prefix, and
the training loop reaches modes only through the registry and the interface."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from megatron_patches.mode.runtime import ModeRuntime
from megatron_patches.training.modes import MODES

REPO = Path(__file__).resolve().parents[2]
STEPS = [name for name, member in vars(ModeRuntime).items()
         if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, classmethod))]


@pytest.mark.parametrize("name", list(MODES))
def test_runtime_overrides_keep_the_base_signatures(name):
    runtime = MODES[name].runtime_class()
    assert issubclass(runtime, ModeRuntime)
    assert runtime.name == name
    for step in STEPS:
        base, own = inspect.signature(getattr(ModeRuntime, step)), inspect.signature(getattr(runtime, step))
        assert list(own.parameters) == list(base.parameters), f"{runtime.__name__}.{step}{own} differs from {base}"


def test_each_mode_owns_its_flags_under_its_prefix():
    seen = {}
    for name, spec in MODES.items():
        for dest in spec.own_dests():
            assert dest.startswith(f"{name}_"), f"{name} registers {dest}"
            assert dest not in seen, f"{dest} registered by {seen[dest]} and {name}"
            seen[dest] = name


def test_loop_and_shared_files_name_no_mode():
    """Only the registry and the modes' own packages may name a mode."""
    names = "|".join(name for name in MODES if name != "ep")
    pattern = re.compile(rf"moe_parallel_mode\s*==|[\"']({names})[\"']")
    for path in ("training/loop.py", "training/model.py", "training/checkpoint.py", "training/validation.py",
                 "training/arguments.py", "compat/mcore.py", "compat/moe.py"):
        text = (REPO / "megatron_patches" / path).read_text()
        assert not pattern.search(text), f"{path} names a mode: {pattern.search(text).group(0)}"
