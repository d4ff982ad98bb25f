"""The planner's compiled kernels on an install nobody can write to (a shared, read-only software
tree on a cluster): numba then has no cache directory, and the planner must still run, saying
once on stderr that it compiles in every process and how to give it a cache (NUMBA_CACHE_DIR).

Needs root (a read-only bind mount; as root a chmod does not stop writes); skipped otherwise.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLAN = """
import numpy as np
from megatron_patches.placement import fssdp
from megatron_patches.placement.types import ShardLayout, Topology
topology = Topology(2, 4, 1e9, 1e9)
loads = np.random.default_rng(0).integers(0, 100, (8, 16))
placement = fssdp.materialize(ShardLayout.even(16, 8), loads.sum(axis=0).astype(float), 4, 2, topology)
print("device loads", fssdp.dispatch(placement, loads, topology).device_loads_D().sum())
"""


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root for a read-only bind mount")
def test_a_read_only_install_plans_and_says_its_kernels_are_not_cached(tmp_path):
    tree, mounted = tmp_path / "tree", tmp_path / "ro"
    shutil.copytree(os.path.join(REPO, "megatron_patches"), tree / "megatron_patches",
                    ignore=shutil.ignore_patterns("__pycache__"))
    mounted.mkdir()
    if subprocess.run(["mount", "--bind", str(tree), str(mounted)], capture_output=True).returncode:
        pytest.skip("bind mounts are not allowed here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(mounted)], capture_output=True).returncode:
            pytest.skip("read-only remounts are not allowed here")
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
        env.update(HOME=str(mounted), PYTHONPATH=str(mounted))  # no writable user cache either
        done = subprocess.run([sys.executable, "-c", PLAN], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=300)
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:]
    routed = int(np.random.default_rng(0).integers(0, 100, (8, 16)).sum())
    assert f"device loads {routed}" in done.stdout  # every routed token planned ...
    assert done.stderr.count("cannot be cached") == 1  # ... and the reason said once, with the way out
    assert "NUMBA_CACHE_DIR" in done.stderr
    assert "Traceback" not in done.stderr
