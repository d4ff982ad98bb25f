"""Shared test set-up: the tiers and the fixtures several test files use.

Tiers, visible as marks (`pytest -m unit`, `-m multirank`, `-m e2e`):
- unit: in-process tests (no extra processes); every test without one of the marks below.
- multirank: spawns or forks several gloo ranks (tests/support/mp.py: run_ranks, run_forked).
- e2e: runs what a user runs on several ranks: pretrain_gpt_moe.py under torchrun
  (tests/support/training.py: launch), a launcher's rank check, or a real Slurm (also marked
  `slurm`), the commands of the README and docs/ as written (tests/test_readme.py). Tool command
  lines that run in seconds in one process stay unit tests.
multirank and e2e tests are also `slow` (`-m "not slow"` is the quick loop); CI runs all.

Helpers live in tests/support/ and are imported as `support.*` (pytest's pythonpath), never from
another test file.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Megatron-Core as the training script imports it on CPU (its jit_fuser eager), before any test
    # module imports it: the in-process tests and the ranks run_forked forks from this process run
    # the code the training does, and no test pays TorchInductor's import.
    from megatron_patches.compat.cpu import import_megatron_with_eager_fusers

    import_megatron_with_eager_fusers()

TIERS = ("multirank", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slurm") is not None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)
        if any(item.get_closest_marker(tier) is not None for tier in TIERS):
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("slow") is not None:
            raise pytest.UsageError(f"{item.nodeid}: marked slow without a tier; mark it multirank or e2e")
        else:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, request):
    """A directory shared by the tests of one module (launches reused across its tests)."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
