"""Checkpoint directories on disk: layout, integrity, which one a resume loads, pruning.

Files only (no torch): validation reads these before any process group starts. Layout
(Megatron-LM's names, plus a manifest):

    <root>/latest_checkpointed_iteration.txt   the tracker: the newest complete checkpoint
    <root>/iter_0000100/                        a complete checkpoint
        manifest.json                           written last (see below)
        flags.json  common.pt  .metadata        the run's flags, common state, shard index
        __R_I.distcp                            tensor shards (torch_dist)
        rng/rank_RRRRR.pt                       RNG states, one file per rank
    <root>/iter_0000200.partial/                a checkpoint being written, or left by a killed job

A save writes into `iter_N.partial/`, flushes every file to disk, writes the manifest, renames
the directory to `iter_N` and only then moves the tracker (written beside it and renamed over
it). A job killed at any moment therefore leaves the tracker at a complete checkpoint, and a
`.partial` directory is never read (the next save removes it).

The manifest records the iteration, the saving world size, every file's size, and the sha256
of every file except the tensor shards and RNG files (the common state: loop state, scheduler,
flags, shard index). Shards hold nearly all the bytes: their sizes are checked, their contents
are not hashed (torch_dist's reader fails on a shard it cannot parse). A resume verifies the
tracker's checkpoint; one that is missing, truncated or altered is passed over, with a
warning, for the newest older checkpoint that verifies. Every rank verifies the same files
and so chooses the same checkpoint (checked again once the process group exists).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
DIST_METADATA_FILE = "metadata.json"  # dist_checkpointing's, beside the shards (its sharded backend and version)
PARTIAL_SUFFIX = ".partial"
MANIFEST_FORMAT = 1
_ITERATION_DIR = re.compile(r"iter_(\d{7})")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def partial_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}{PARTIAL_SUFFIX}"


def latest_iteration(root: str | Path) -> int | None:
    """The tracker's iteration; None when `root` has no tracker yet."""
    tracker = Path(root) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{TRACKER_FILE} holds {text!r}, expected an iteration number")
    return int(text)


def iterations_on_disk(root: str | Path) -> list[int]:
    """Iterations of the complete (renamed) checkpoint directories under `root`, ascending."""
    found = (_ITERATION_DIR.fullmatch(path.name) for path in Path(root).iterdir() if path.is_dir())
    return sorted(int(match.group(1)) for match in found if match)


# ----------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------


def start_partial(root: str | Path, iteration: int) -> Path:
    """A fresh, empty `iter_N.partial/` (one left by a killed save is removed first)."""
    partial = partial_dir(root, iteration)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def fsync_file(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _hashed(relative: str) -> bool:
    return not relative.endswith(".distcp") and not relative.startswith("rng/")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*")
                  if path.is_file() and path.name != MANIFEST_FILE)


def publish(root: str | Path, iteration: int, world_size: int) -> Path:
    """Rank 0, once every rank has written its part of `iter_N.partial/`: flush the common files
    (the shards and RNG files are flushed by the ranks that wrote them), write the manifest,
    rename the directory to `iter_N` (a checkpoint already there is replaced) and move the
    tracker. Returns the checkpoint's directory."""
    root = Path(root)
    partial, final = partial_dir(root, iteration), iteration_dir(root, iteration)
    files = {}
    for relative in _files(partial):
        path = partial / relative
        if _hashed(relative):
            fsync_file(path)
        files[relative] = {"bytes": path.stat().st_size, **({"sha256": _sha256(path)} if _hashed(relative) else {})}
    manifest = {"format": MANIFEST_FORMAT, "iteration": iteration, "world_size": world_size, "files": files}
    with open(partial / MANIFEST_FILE, "w") as stream:
        stream.write(json.dumps(manifest, indent=1) + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    for directory in {partial, *((partial / relative).parent for relative in files)}:
        _fsync_dir(directory)
    if final.exists():
        # a checkpoint of this iteration from before a resume fell back past it (see choose)
        replaced = final.with_name(final.name + ".replaced")
        os.replace(final, replaced)
        shutil.rmtree(replaced)
    os.replace(partial, final)
    _fsync_dir(root)
    write_tracker(root, iteration)
    return final


def write_tracker(root: Path, iteration: int) -> None:
    """Point the tracker at `iteration`, atomically: written beside it, flushed, renamed over it."""
    tracker = root / TRACKER_FILE
    partial = tracker.with_name(f"{TRACKER_FILE}{PARTIAL_SUFFIX}")
    with open(partial, "w") as stream:
        stream.write(f"{iteration}\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, tracker)
    _fsync_dir(root)


def prune(root: str | Path, newest: int, keep: int) -> list[Path]:
    """Rank 0, after the checkpoint of `newest` is published: remove the checkpoints older than
    the `keep` newest at or below it (0 keeps all). Newer directories (left when a resume fell
    back past an unreadable checkpoint) are not counted and not removed: a save of their
    iteration replaces them. Returns the removed directories."""
    if keep == 0:
        return []
    older = [i for i in iterations_on_disk(root) if i <= newest]
    removed = [iteration_dir(root, i) for i in older[:-keep]]
    for directory in removed:
        shutil.rmtree(directory)
    return removed


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------


def checkpoint_format(directory: Path) -> str:
    """The format a Megatron checkpoint directory is in: its dist_checkpointing metadata.json's
    sharded backend (torch_dist, fsdp_dtensor, ...), "torch" for Megatron-LM's legacy form
    (mp_rank_XX/model_optim_rng.pt), or "unknown"."""
    try:
        return str(json.loads((directory / DIST_METADATA_FILE).read_text())["sharded_backend"])
    except FileNotFoundError:
        return "torch" if any(directory.glob("mp_rank_*")) else "unknown"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "unknown"


def problem(root: str | Path, iteration: int) -> str | None:
    """Why the checkpoint of `iteration` cannot be loaded (missing, in another format than
    torch_dist, incomplete, altered), or None when it verifies. A checkpoint without a manifest
    (written before they were kept, or by Megatron-LM) is not verifiable and is loaded as it is:
    see `unverified`."""
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        return f"{directory} does not exist"
    found = checkpoint_format(directory)
    if found != "torch_dist":
        return (f"{directory} is not a torch_dist checkpoint (its format: {found}; this entry point reads Megatron-Core's "
                "torch_dist only: convert it with Megatron-LM's checkpoint converter, --ckpt-convert-format torch_dist)")
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        files, saved_iteration = manifest["files"], manifest["iteration"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"{manifest_path} is unreadable ({error!r})"
    if saved_iteration != iteration:
        return f"{manifest_path} describes iteration {saved_iteration}"
    for relative, entry in files.items():
        path = directory / relative
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path} has {size} bytes, the manifest says {entry['bytes']}"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{path} does not match its checksum in the manifest"
    return None


def unverified(root: str | Path, iteration: int) -> bool:
    return not (iteration_dir(root, iteration) / MANIFEST_FILE).exists()


def choose(root: str | Path, tracked: int) -> tuple[int, list[str]]:
    """The checkpoint a resume loads: the tracker's when it verifies, else the newest older one
    that does. Returns (iteration, notes for the log); raises ValueError naming every problem
    when none verifies."""
    problems = []
    for iteration in [tracked, *reversed([i for i in iterations_on_disk(root) if i < tracked])]:
        found = problem(root, iteration)
        if found is None:
            notes = [f"iteration {tracked} is unreadable ({problems[0]}): resuming from iteration {iteration}, the "
                     "newest checkpoint that verifies"] if problems else []
            if unverified(root, iteration):
                notes.append(f"{iteration_dir(root, iteration)} has no {MANIFEST_FILE} (not written by this version): "
                             "loaded without verification")
            return iteration, notes
        problems.append(found)
    raise ValueError("no checkpoint verifies: " + "; ".join(problems))
