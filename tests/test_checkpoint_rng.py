"""The per-rank RNG file of a checkpoint is read without running code (torch.load weights_only)."""

from __future__ import annotations

import pytest
import torch

from megatron_patches.training.checkpoint import read_rng_state


class _RunsCode:
    """Unpickling this calls Path.touch on `target`: proof that the file ran code."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (type(self.target).touch, (self.target,))


def test_rng_file_round_trips_its_states(tmp_path):
    states = {"world_size": 4, "cpu": torch.get_rng_state(), "cuda": None,
              "tracker": {"model-parallel-rng": torch.get_rng_state()}}
    torch.save(states, tmp_path / "rank_00000.pt")
    loaded = read_rng_state(tmp_path / "rank_00000.pt")
    assert loaded["world_size"] == 4 and loaded["cuda"] is None
    assert torch.equal(loaded["cpu"], states["cpu"])
    assert torch.equal(loaded["tracker"]["model-parallel-rng"], states["cpu"])


def test_rng_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"world_size": 1, "cpu": _RunsCode(marker)}, tmp_path / "rank_00000.pt")
    with pytest.raises(ValueError, match="rank_00000.pt is not an RNG state file this script wrote"):
        read_rng_state(tmp_path / "rank_00000.pt")
    assert not marker.exists()
