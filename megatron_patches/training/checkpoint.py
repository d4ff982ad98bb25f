"""Distributed checkpoints (Megatron dist_checkpointing, torch_dist format) with Megatron-LM's
directory layout: `<dir>/iter_0000100/` plus `<dir>/latest_checkpointed_iteration.txt`.

The model and optimizer are saved as sharded state (reloadable into other TP/PP/EP/DP
layouts; the distributed optimizer uses the fully-reshardable format); the loop state
(iteration, consumed samples, LR scheduler) is common state; RNG states are per rank and
are restored only when the world size is unchanged.

What the model and optimizer state look like on disk is the mode's
(`ModeRuntime.save_checkpoint` / `load_checkpoint`): ep and fssdp write Megatron's own sharded
state dicts (fssdp under per-expert keys, so placement-independent); replicate writes ep's form
(replicate/checkpoint.py). Any of the three loads in any of the three.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import random as mp_random

from megatron_patches.training import resume

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    tracker = Path(root) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{TRACKER_FILE} holds {text!r}, expected an iteration number")
    return int(text)


def save(root: str, iteration: int, model_chunks, optimizer, scheduler, loop_state: dict, mode, args) -> Path:
    """Writes `<root>/iter_N/` (the mode's model + optimizer state, loop state, scheduler, RNG per
    rank, the run's flags), then points the tracker file at it. `mode`: the run's ModeRuntime."""
    directory = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        resume.write_flags(directory, args)
    dist.barrier()
    common = {"loop_state": dict(loop_state, iteration=iteration), "scheduler": scheduler.state_dict()}
    mode.save_checkpoint(str(directory), model_chunks, optimizer, common)
    rng_dir = directory / "rng"
    rng_dir.mkdir(exist_ok=True)
    torch.save(
        {
            "world_size": dist.get_world_size(),
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": mp_random.get_cuda_rng_tracker().get_states(),
        },
        rng_dir / f"rank_{dist.get_rank():05d}.pt",
    )
    dist.barrier()
    if dist.get_rank() == 0:
        write_tracker(Path(root), iteration)
    return directory


def write_tracker(root: Path, iteration: int) -> None:
    """Point the tracker at `iteration`, atomically: written beside it, flushed to disk, renamed
    over it. Every rank has finished its files by then, so a job killed at any moment leaves the
    tracker at a complete checkpoint (the previous one while this one is being written)."""
    tracker = root / TRACKER_FILE
    partial = tracker.with_name(f"{TRACKER_FILE}.partial")
    with open(partial, "w") as stream:
        stream.write(f"{iteration}\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, tracker)


def read_rng_state(path: Path) -> dict:
    """One rank's RNG file (world size, CPU / CUDA / Megatron tracker states: ints and tensors).

    Read with `weights_only=True`: a checkpoint directory must not be able to run code on --load.
    A file that holds anything else is refused, naming it."""
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"--load: {path} is missing: the checkpoint is incomplete (--no-load-rng starts the random "
                         "states fresh instead)") from None
    except pickle.UnpicklingError as error:
        raise ValueError(f"--load: {path} is not an RNG state file this script wrote ({error})") from None


def load(root: str, model_chunks, optimizer, scheduler, load_optim: bool, load_rng: bool, mode) -> tuple[dict | None, list[str]]:
    """Loads the latest checkpoint under `root`; returns (loop_state, notes for the log).

    `root` without a checkpoint yet is the --save directory of a job's first start (validation
    refuses any other): loop_state is None and nothing is loaded."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None, [f"{root} holds no checkpoint yet (it is the --save directory): starting from iteration 0"]
    directory = iteration_dir(root, iteration)
    template = {"loop_state": None, "scheduler": None}
    loaded, mode_notes = mode.load_checkpoint(str(directory), model_chunks, optimizer, template, load_optim)
    notes = [f"loaded {directory}", *mode_notes]
    if load_optim:
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
        if rng["world_size"] == dist.get_world_size():
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] is not None:
                torch.cuda.set_rng_state(rng["cuda"])
            mp_random.get_cuda_rng_tracker().set_states(rng["tracker"])
        else:
            notes.append(f"RNG states not restored: saved with {rng['world_size']} ranks, running with {dist.get_world_size()}")
    return loaded["loop_state"], notes
