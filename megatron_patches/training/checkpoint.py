"""Distributed checkpoints (Megatron dist_checkpointing, torch_dist format) with Megatron-LM's
directory layout, written so that a job killed at any moment keeps its newest complete
checkpoint (checkpoint_dirs.py: partial directory, manifest, tracker, pruning, verification).

The model and optimizer are saved as sharded state (reloadable into other TP/PP/EP/DP
layouts; the distributed optimizer uses the fully-reshardable format); the loop state
(iteration, consumed samples, LR scheduler) is common state; RNG states are per rank and
are restored only when the world size is unchanged.

What the model and optimizer state look like on disk is the mode's
(`ModeRuntime.save_checkpoint` / `load_checkpoint`): ep and fssdp write Megatron's own sharded
state dicts (fssdp under per-expert keys, so placement-independent); replicate and zebra write
ep's form (replicate/checkpoint.py, zebra/checkpoint.py). Any of the four loads in any of the
four (an ep checkpoint with EP > 1 in zebra).
"""

from __future__ import annotations

import importlib
import pathlib
import pickle
import resource
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from megatron.core.tensor_parallel import random as mp_random

from megatron_patches.compat import mcore
from megatron_patches.mode.runtime import CheckpointRefused
from megatron_patches.training import checkpoint_dirs, resume


class CheckpointWriteFailed(RuntimeError):
    """A rank could not write its part of a checkpoint; the message says which and why.
    `own`: the failure was this rank's (False: torch_dist reports another rank's)."""

    def __init__(self, message: str, own: bool):
        super().__init__(message)
        self.own = own


class CheckpointUnreadable(ValueError):
    """A file of the chosen checkpoint cannot be used (one the manifest does not cover, or a
    checkpoint written without one); the message names it and what would do instead."""


def _write_failure(error: BaseException, root: str) -> tuple[str, bool]:
    """(why, whether this rank's own write failed): torch_dist wraps its ranks' failures in one
    CheckpointException, raised on every rank; the free space and the file-size limit are
    named because torch's writer reports a full disk or a reached limit only as a short write."""
    rank = dist.get_rank()
    if isinstance(error, CheckpointException):
        own = rank in error.failures
        why = str(error.failures[rank][0]) if own else f"another rank failed (ranks {sorted(error.failures)})"
    else:
        own, why = True, str(error)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limit_text = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
    try:
        free = f"{shutil.disk_usage(root).free / 2**30:.1f} GiB"
    except OSError as error:
        free = f"unknown ({error.strerror})"
    return f"{why} (free space under {root}: {free}; file-size limit: {limit_text})", own


def save(root: str, iteration: int, model_chunks, optimizer, scheduler, loop_state: dict, mode, args) -> tuple[Path, list[Path]]:
    """Writes `<root>/iter_N/` (the mode's model + optimizer state, loop state, scheduler, RNG per
    rank, the run's flags) through `iter_N.partial/`, points the tracker at it, and removes the
    checkpoints beyond --keep-last-checkpoints. Returns (the directory, the removed ones: rank 0).
    `mode`: the run's ModeRuntime. A rank that cannot write raises CheckpointWriteFailed; the
    tracker then still names the previous complete checkpoint."""
    rank = dist.get_rank()
    partial = checkpoint_dirs.partial_dir(root, iteration)
    try:
        if rank == 0:
            checkpoint_dirs.start_partial(root, iteration)
        dist.barrier()
        common = {"loop_state": dict(loop_state, iteration=iteration), "scheduler": scheduler.state_dict()}
        mcore.finish_param_gather(model_chunks)
        mode.save_checkpoint(str(partial), model_chunks, optimizer, common)
        rng_dir = partial / "rng"
        rng_dir.mkdir(exist_ok=True)
        rng_file = rng_dir / f"rank_{rank:05d}.pt"
        torch.save(
            {
                "world_size": dist.get_world_size(),
                "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                "tracker": mp_random.get_cuda_rng_tracker().get_states(),
            },
            rng_file,
        )
        checkpoint_dirs.fsync_file(rng_file)
        if rank == 0:
            resume.write_flags(partial, args)  # after Megatron's save, which expects an empty directory
        dist.barrier()
        removed = []
        if rank == 0:
            checkpoint_dirs.publish(root, iteration, dist.get_world_size())
            removed = checkpoint_dirs.prune(root, iteration, args.keep_last_checkpoints)
    except (OSError, RuntimeError, CheckpointException) as error:  # CheckpointException: torch_dist's
        why, own = _write_failure(error, root)
        raise CheckpointWriteFailed(f"rank {rank} could not write the checkpoint of iteration {iteration} into "
                                    f"{partial}: {why}", own) from error
    return checkpoint_dirs.iteration_dir(root, iteration), removed


def _missing(path: Path) -> CheckpointUnreadable:
    return CheckpointUnreadable(f"--load: {path} is missing: the checkpoint is incomplete (--no-load-rng starts the "
                                "random states fresh instead)")


def read_rng_state(path: Path) -> dict:
    """One rank's RNG file (world size, CPU / CUDA / Megatron tracker states: ints and tensors).

    Read with `weights_only=True`: a checkpoint directory must not be able to run code on --load.
    A file that holds anything else is refused, naming it."""
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise _missing(path) from None
    except pickle.UnpicklingError as error:
        raise CheckpointUnreadable(f"--load: {path} is not an RNG state file this script wrote ({error})") from None


_SHARD_INDEX_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                        "torch.distributed.checkpoint.filesystem")


class _ShardIndexUnpickler(pickle.Unpickler):
    """Reads torch_dist's shard index (`.metadata`, a pickle that torch's reader loads with plain
    pickle.load, so a crafted one would run code on --load) admitting only what torch writes
    there: the classes its checkpoint modules define, torch.Size, dtypes, torch's layout lookup
    and a path (the checkpoint id). The same bytes are then safe for torch's reader."""

    def find_class(self, module: str, name: str):
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # a checkpoint id given as a Path
            return getattr(pathlib, name)
        found = getattr(importlib.import_module(module), name, None) if module.startswith("torch") else None
        admitted = (
            (module in _SHARD_INDEX_MODULES and isinstance(found, type) and found.__module__ == module)
            or (module == "torch" and (name == "Size" or isinstance(found, torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
        )
        if not admitted:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a torch_dist shard index")
        return found


def check_shard_index(directory: Path) -> None:
    """Refuse a checkpoint whose shard index would run code when torch reads it."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as stream:
            _ShardIndexUnpickler(stream).load()
    except FileNotFoundError:
        raise _missing(path) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as error:
        raise CheckpointUnreadable(f"--load: {path} is not a torch_dist shard index this script wrote ({error}); it "
                                   "was not loaded") from None


def load(root: str, iteration: int | None, model_chunks, optimizer, scheduler, load_optim: bool, load_rng: bool,
         mode, strictness: str) -> tuple[dict | None, list[str]]:
    """Loads the checkpoint of `iteration` under `root` (validation chose it: checkpoint_dirs.choose);
    returns (loop_state, notes for the log). `strictness`: --dist-ckpt-strictness.

    `iteration` None is the --save directory of a job's first start (validation refuses any
    other): loop_state is None and nothing is loaded."""
    if iteration is None:
        return None, [f"{root} holds no checkpoint yet (it is the --save directory): starting from iteration 0"]
    chosen = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, iteration)
    if len(set(chosen)) > 1:
        # each rank verified the files on its own before the process group existed
        raise RuntimeError(f"--load {root}: the ranks chose different checkpoints to resume from ({chosen}, by rank): "
                           "the file system showed them different files; check it and restart")
    directory = checkpoint_dirs.iteration_dir(root, iteration)
    check_shard_index(directory)
    template = {"loop_state": None, "scheduler": None}
    try:
        loaded, mode_notes = mode.load_checkpoint(str(directory), model_chunks, optimizer, template, load_optim, strictness)
    except CheckpointRefused as error:
        raise CheckpointUnreadable(str(error)) from None
    except mcore.CheckpointingException as error:  # --dist-ckpt-strictness raise_*: keys not shared
        raise CheckpointUnreadable(f"--load {directory} with --dist-ckpt-strictness {strictness}: {error}") from None
    notes = [f"loaded {directory}", *mode_notes]
    if load_optim:
        if scheduler.override_opt_param_scheduler:
            mcore.override_schedule_peaks(optimizer, scheduler)
        scheduler.load_state_dict(loaded["scheduler"])
    else:
        # half precision: the fp32 main weights still hold the initial values; refresh them from
        # the loaded model (Megatron-LM does the same), or the first step would write them back
        optimizer.reload_model_params()
        notes.append("optimizer state not loaded (--no-load-optim): main weights taken from the loaded model")
    rng_file = directory / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if load_rng:
        # a rank beyond the saving world has no file of its own: rank 0's says so
        rng = read_rng_state(rng_file if rng_file.exists() else directory / "rng" / "rank_00000.pt")
        if not rng_file.exists() and dist.get_rank() < rng["world_size"]:
            raise _missing(rng_file)
        if rng["world_size"] == dist.get_world_size():
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] is not None:
                torch.cuda.set_rng_state(rng["cuda"])
            mp_random.get_cuda_rng_tracker().set_states(rng["tracker"])
        else:
            notes.append(f"RNG states not restored: saved with {rng['world_size']} ranks, running with {dist.get_world_size()}")
    return loaded["loop_state"], notes
