"""Checkpoint directories (training/checkpoint_dirs.py): publishing through a partial directory,
the manifest and what it catches, which checkpoint a resume picks, pruning. Files only: the
checkpoints here are made of bytes shaped like torch_dist's (shards, common state, RNG files);
the training runs that write and load real ones are in test_failure_catalogue.py."""

from __future__ import annotations

import json

import pytest

from megatron_patches.training import checkpoint_dirs as C

SHARD = b"s" * 1000
COMMON = b"common state"


def write_partial(root, iteration: int, world: int = 2) -> None:
    """What the ranks leave in iter_N.partial/ before rank 0 publishes it."""
    partial = C.start_partial(root, iteration)
    for rank in range(world):
        (partial / f"__{rank}_0.distcp").write_bytes(SHARD + bytes([iteration, rank]))
        (partial / "rng").mkdir(exist_ok=True)
        (partial / "rng" / f"rank_{rank:05d}.pt").write_bytes(b"rng")
    (partial / "common.pt").write_bytes(COMMON + bytes([iteration]))
    (partial / ".metadata").write_bytes(b"index")
    (partial / C.DIST_METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
    (partial / "flags.json").write_text("{}\n")


def save(root, iteration: int, keep: int = 2) -> list:
    write_partial(root, iteration)
    C.publish(root, iteration, world_size=2)
    return C.prune(root, iteration, keep)


def test_publish_renames_the_partial_directory_writes_the_manifest_then_moves_the_tracker(tmp_path):
    write_partial(tmp_path, 5)
    assert C.latest_iteration(tmp_path) is None  # nothing points at a partial checkpoint
    final = C.publish(tmp_path, 5, world_size=2)
    assert final == tmp_path / "iter_0000005" and final.is_dir()
    assert not C.partial_dir(tmp_path, 5).exists()
    assert C.latest_iteration(tmp_path) == 5 and not (tmp_path / f"{C.TRACKER_FILE}.partial").exists()
    manifest = json.loads((final / C.MANIFEST_FILE).read_text())
    assert manifest["iteration"] == 5 and manifest["world_size"] == 2
    files = manifest["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "flags.json", "metadata.json",
                             "rng/rank_00000.pt", "rng/rank_00001.pt"]
    # every size; checksums of the common state, not of the shards or RNG files
    assert files["__0_0.distcp"] == {"bytes": len(SHARD) + 2}
    assert files["rng/rank_00001.pt"] == {"bytes": 3}
    assert files["common.pt"]["bytes"] == len(COMMON) + 1 and len(files["common.pt"]["sha256"]) == 64
    assert C.problem(tmp_path, 5) is None


def test_a_stale_partial_directory_is_replaced_and_never_chosen(tmp_path):
    save(tmp_path, 2)
    write_partial(tmp_path, 4)  # a job killed while writing iteration 4
    (C.partial_dir(tmp_path, 4) / "left_over").write_text("x")
    assert C.iterations_on_disk(tmp_path) == [2]
    assert C.choose(tmp_path, C.latest_iteration(tmp_path)) == (2, [])
    save(tmp_path, 4)
    assert not (tmp_path / "iter_0000004" / "left_over").exists()


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes(SHARD[:10]), "__0_0.distcp has 10 bytes, the manifest says 1002"),
    (lambda d: (d / "rng" / "rank_00000.pt").write_bytes(b""), "rank_00000.pt has 0 bytes, the manifest says 3"),
    # same size, other bytes: only a checksum sees it
    (lambda d: (d / "common.pt").write_bytes(b"COMMON STATE" + bytes([7])), "common.pt does not match its checksum"),
    (lambda d: (d / C.MANIFEST_FILE).write_text("{not json"), "manifest.json is unreadable"),
    (lambda d: (d / C.MANIFEST_FILE).write_text('{"files": {}, "iteration": 3}'), "manifest.json describes iteration 3"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_that_verifies(tmp_path, damage, expected):
    for iteration in (5, 7, 9):
        save(tmp_path, iteration, keep=0)
    damage(tmp_path / "iter_0000009")
    found = C.problem(tmp_path, 9)
    assert found is not None and expected in found, found
    iteration, notes = C.choose(tmp_path, 9)
    assert iteration == 7
    assert notes == [f"iteration 9 is unreadable ({found}): resuming from iteration 7, the newest checkpoint that "
                     "verifies"]


def test_fallback_skips_every_damaged_checkpoint_and_names_them_all_when_none_verifies(tmp_path):
    for iteration in (5, 7, 9):
        save(tmp_path, iteration, keep=0)
    (tmp_path / "iter_0000009" / "common.pt").unlink()
    (tmp_path / "iter_0000007" / "__0_0.distcp").write_bytes(b"")
    assert C.choose(tmp_path, 9)[0] == 5
    (tmp_path / "iter_0000005" / "flags.json").write_text("{} \n")
    with pytest.raises(ValueError) as refused:
        C.choose(tmp_path, 9)
    message = str(refused.value)
    assert message.startswith("no checkpoint verifies: ")
    for iteration in (9, 7, 5):
        assert f"iter_{iteration:07d}" in message
    # the tracker's checkpoint gone altogether
    C.write_tracker(tmp_path, 11)
    with pytest.raises(ValueError, match="iter_0000011 does not exist"):
        C.choose(tmp_path, 11)


def test_a_checkpoint_without_manifest_loads_unverified_with_a_note(tmp_path):
    (tmp_path / "iter_0000003").mkdir()  # Megatron-LM's, or this project's before manifests
    (tmp_path / "iter_0000003" / C.DIST_METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')
    assert C.problem(tmp_path, 3) is None
    assert C.choose(tmp_path, 3) == (3, [f"{tmp_path / 'iter_0000003'} has no manifest.json (not written by this "
                                         "version): loaded without verification"])


def test_prune_keeps_the_newest_k_at_or_below_the_saved_iteration(tmp_path):
    removed = [save(tmp_path, i, keep=2) for i in (2, 4, 6, 8)]
    assert [[p.name for p in r] for r in removed] == [[], [], ["iter_0000002"], ["iter_0000004"]]
    assert C.iterations_on_disk(tmp_path) == [6, 8]
    # 0 keeps every checkpoint
    assert save(tmp_path, 10, keep=0) == [] and C.iterations_on_disk(tmp_path) == [6, 8, 10]
    # after a fallback past iteration 10 to 8: the newer directory is neither counted nor removed,
    # and the save of its iteration replaces it
    (tmp_path / "iter_0000010" / "common.pt").write_bytes(b"")
    assert C.choose(tmp_path, 10)[0] == 8
    assert [p.name for p in save(tmp_path, 9, keep=1)] == ["iter_0000006", "iter_0000008"]
    assert C.iterations_on_disk(tmp_path) == [9, 10]
    save(tmp_path, 10, keep=1)
    assert C.iterations_on_disk(tmp_path) == [10] and C.problem(tmp_path, 10) is None


def test_a_tracker_that_is_not_a_number_is_an_error(tmp_path):
    (tmp_path / C.TRACKER_FILE).write_text("release\n")
    with pytest.raises(ValueError, match="holds 'release', expected an iteration number"):
        C.latest_iteration(tmp_path)


def test_a_checkpoint_in_another_format_is_named_up_front(tmp_path):
    """Megatron-LM's legacy torch form and other sharded backends are refused with their format."""
    (tmp_path / "iter_0000003" / "mp_rank_00").mkdir(parents=True)
    assert "is not a torch_dist checkpoint (its format: torch;" in C.problem(tmp_path, 3)
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / C.DIST_METADATA_FILE).write_text('{"sharded_backend": "fsdp_dtensor"}')
    assert "(its format: fsdp_dtensor;" in C.problem(tmp_path, 4)
    (tmp_path / "iter_0000005").mkdir()
    assert "(its format: unknown;" in C.problem(tmp_path, 5) and "--ckpt-convert-format torch_dist" in C.problem(tmp_path, 5)
    with pytest.raises(ValueError, match="no checkpoint verifies: .*its format: unknown.*its format: fsdp_dtensor"):
        C.choose(tmp_path, 5)
