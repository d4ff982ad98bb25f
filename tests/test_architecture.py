"""The package layering of docs/architecture.md section 2, checked on every import of the code.

Each package may import only the packages of the levels above it (and `mode/` for the mode
packages); a new import that points down the stack fails here with the file and the import.
Also checks that the architecture document names every package and every registered mode.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from megatron_patches.training.modes import MODES

ROOT = Path(__file__).resolve().parents[1] / "megatron_patches"

ALLOWED = {
    "placement": set(),
    "config": {"placement"},
    "comm": {"placement"},
    "compat": {"placement", "config"},
    "data": {"placement", "config"},
    "mode": {"placement", "config", "comm", "compat"},
    "fssdp": {"placement", "config", "comm", "compat", "mode"},
    "replicate": {"placement", "config", "comm", "compat", "mode"},
    "zebra": {"placement", "config", "comm", "compat", "data", "mode"},  # data: attention ranks read their micro-batches
    "sim": {"placement", "config"},
    "training": {"placement", "config", "comm", "compat", "data", "mode", "fssdp", "replicate", "zebra"},
    "jobs": {"placement", "config", "comm", "compat", "data", "mode", "fssdp", "replicate", "zebra", "sim", "training"},
}
"""Package -> the packages it may import (docs/architecture.md, section 2)."""


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [(node.lineno, name) for name in names if name.startswith("megatron_patches.")]
    return found


def test_every_import_points_up_the_layers():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), "a package was added or removed: give it a level in ALLOWED and the document"
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        own = path.relative_to(ROOT).parts[0]
        for line, name in _imports(path):
            target = name.split(".")[1]
            if target != own and target not in ALLOWED[own]:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name} ({own} may import {sorted(ALLOWED[own])})")
    assert not wrong, "\n".join(wrong)


def test_architecture_document_names_every_package_and_mode():
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    for package in ALLOWED:
        assert f"`{package}/`" in text, package
    for mode in MODES:
        assert f"`{mode}`" in text, mode


def test_the_entry_point_and_the_parser_import_no_torch():
    """A process multiprocessing spawns re-imports the entry point, and every rank parses and
    validates its flags before torch is needed: both stay light (torch alone takes ~2 s of CPU
    per process; eight such processes on two cores cost a checkpoint save ~10 s once)."""
    code = (
        "import runpy, sys\n"
        "runpy.run_path('pretrain_gpt_moe.py', run_name='__mp_main__')\n"
        "import megatron_patches.training.arguments, megatron_patches.training.validation\n"
        "heavy = [m for m in ('torch', 'megatron.core') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, check=True, timeout=120)


def test_the_runtime_counts_traffic_under_the_one_vocabulary():
    """fssdp's and replicate's byte counters, fssdp's exposed waits and zebra's all-to-all records
    are named as placement.accounting.TRAFFIC_KINDS names them (the simulator too:
    tests/sim/test_sim_validation.py)."""
    from megatron_patches.zebra.executor import COMM_STREAMS
    from megatron_patches.fssdp.metrics import EXPOSED_KINDS, TRAFFIC_KINDS as FSSDP_KINDS
    from megatron_patches.placement.accounting import TRAFFIC_KINDS
    from megatron_patches.replicate.metrics import TRAFFIC_KINDS as REPLICATE_KINDS

    zebra = {f"a2a_{stream}" for stream in COMM_STREAMS}
    used = set(FSSDP_KINDS) | set(EXPOSED_KINDS) | set(REPLICATE_KINDS) | zebra
    assert used <= set(TRAFFIC_KINDS), sorted(used - set(TRAFFIC_KINDS))
