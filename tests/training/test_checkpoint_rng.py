"""A checkpoint's pickled files are read without running code: the per-rank RNG file (torch.load
weights_only) and torch_dist's shard index (`.metadata`, which torch itself reads with plain
pickle.load: checked first with an allow-list)."""

from __future__ import annotations

import pytest
import torch

import pickle

from megatron_patches.training.checkpoint import CheckpointUnreadable, check_shard_index, read_rng_state


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


def test_shard_index_that_would_run_code_is_refused_without_running_it(tmp_path):
    """A real torch_dist save's index passes; one holding a callable outside torch's checkpoint
    classes is refused before torch's reader would unpickle it."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3, dtype=torch.bfloat16), "step": 3}, storage_writer=dcp.FileSystemWriter(tmp_path / "ok"),
             no_dist=True)
    check_shard_index(tmp_path / "ok")
    marker = tmp_path / "ran"
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointUnreadable, match=r"\.metadata is not a torch_dist shard index this script wrote "
                                                  r"\(pathlib\.Path\.touch is not part of a torch_dist shard index\)"):
        check_shard_index(crafted)
    assert not marker.exists()
    with pytest.raises(CheckpointUnreadable, match="is missing"):
        check_shard_index(tmp_path)
