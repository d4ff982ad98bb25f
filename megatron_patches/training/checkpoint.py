"""Distributed checkpoints (Megatron dist_checkpointing, torch_dist format) with Megatron-LM's
directory layout: `<dir>/iter_0000100/` plus `<dir>/latest_checkpointed_iteration.txt`.

The model and optimizer are saved as sharded state (reloadable into other TP/PP/EP/DP
layouts; the distributed optimizer uses the fully-reshardable format); the loop state
(iteration, consumed samples, LR scheduler) is common state; RNG states are per rank and
are restored only when the world size is unchanged.

Replicate mode (`replicate`: its ReplicateRuntime) writes and reads ep mode's checkpoint form:
before saving, every expert's current weights go into the frozen Megatron local expert that
EP's layout gives it (so the model's own sharded state dict writes them under ep's keys) and
its fp32 master weights and Adam moments go under ep's expert-optimizer keys
(`compat.moe.ep_optimizer_sharded_state_dict`). An ep, fssdp or replicate checkpoint therefore
loads in any of the three modes. Loading in replicate mode fills the slices and the slots from
the loaded experts; expert moments absent from the checkpoint start at zero (logged). The
replicate placement (slots per layer, popularity history) is common state under "replicate".
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel import random as mp_random

from megatron_patches.compat import mcore, moe

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    tracker = Path(root) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"--load {root}: {TRACKER_FILE} holds {text!r}, expected an iteration number")
    return int(text)


def save(root: str, iteration: int, model_chunks, optimizer, scheduler, loop_state: dict, replicate=None) -> Path:
    directory = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    common = {"loop_state": dict(loop_state, iteration=iteration), "scheduler": scheduler.state_dict()}
    if replicate is None:
        mcore.save_checkpoint(str(directory), model_chunks, optimizer, common)
    else:
        _save_replicate(str(directory), model_chunks, optimizer, common, replicate)
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
        (Path(root) / TRACKER_FILE).write_text(f"{iteration}\n")
    return directory


def load(root: str, model_chunks, optimizer, scheduler, load_optim: bool, load_rng: bool, replicate=None) -> tuple[dict, list[str]]:
    """Loads the latest checkpoint under `root`; returns (loop_state, notes for the log)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER_FILE}; it does not hold a checkpoint saved by this script")
    directory = iteration_dir(root, iteration)
    template = {"loop_state": None, "scheduler": None}
    notes = [f"loaded {directory}"]
    if replicate is None:
        loaded = mcore.load_checkpoint(str(directory), model_chunks, optimizer if load_optim else None, template)
    else:
        loaded = _load_replicate(str(directory), model_chunks, optimizer, template, load_optim, replicate, notes)
    if load_optim:
        scheduler.load_state_dict(loaded["scheduler"])
    else:
        notes.append("optimizer state not loaded (--no-load-optim)")
    rng_file = directory / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if load_rng and rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        if rng["world_size"] == dist.get_world_size():
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] is not None:
                torch.cuda.set_rng_state(rng["cuda"])
            mp_random.get_cuda_rng_tracker().set_states(rng["tracker"])
        else:
            notes.append(f"RNG states not restored: saved with {rng['world_size']} ranks, running with {dist.get_world_size()}")
    return loaded["loop_state"], notes


def _save_replicate(directory: str, model_chunks, optimizer, common: dict, replicate) -> None:
    expert_state, step = replicate.export_experts()
    groups = moe.frozen_expert_param_groups(model_chunks, optimizer, replicate.expert_params())
    model_sd = model_chunks[0].sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": moe.ep_optimizer_sharded_state_dict(optimizer, model_sd, groups, expert_state, step, is_loading=False),
        "replicate": replicate.placement_state_dict(),
        **common,
    }
    dist_checkpointing.save(state, directory)


def _load_replicate(directory: str, model_chunks, optimizer, template: dict, load_optim: bool, replicate, notes: list[str]) -> dict:
    """Loads an ep-form checkpoint into replicate mode: dense parts as ep, experts into the slices."""
    model_sd = model_chunks[0].sharded_state_dict()
    state = {"model": model_sd, **template}
    groups, with_experts = None, False
    if load_optim:
        groups = moe.frozen_expert_param_groups(model_chunks, optimizer, replicate.expert_params())
        wanted = moe.expert_checkpoint_keys(optimizer, model_sd, groups)
        available = set(dist_checkpointing.load_tensors_metadata(directory))
        missing = sorted(k for keys in wanted.values() for k in keys if k not in available)
        with_experts = not missing
        buffers = {
            p: {name: torch.empty(p.shape, dtype=torch.float32, device=p.device) for name in wanted}
            for _, params in groups
            for p in params
        }
        state["optimizer"] = moe.ep_optimizer_sharded_state_dict(optimizer, model_sd, groups, buffers, None, is_loading=True)
        if not with_experts:
            del state["optimizer"][moe.EXPERT_INDEX]
            notes.append(f"replicate: the experts' optimizer state is not in the checkpoint ({len(missing)} keys missing, "
                         f"e.g. {missing[0]}); their Adam moments start at zero")
    loaded = dist_checkpointing.load(state, directory)
    model_chunks[0].load_state_dict(loaded.pop("model"), strict=False)
    expert_state, step = {}, None
    if load_optim:
        expert_state, step = moe.load_ep_optimizer_state(optimizer, loaded.pop("optimizer"), groups, with_experts)
    if "replicate" in loaded:
        notes.extend(replicate.load_placement_state_dict(loaded["replicate"]))
    else:
        notes.append("replicate: the checkpoint holds no replicate placement (saved in another mode); starting from static replication")
    replicate.import_experts(expert_state if with_experts else None, step)
    if with_experts:
        notes.append(f"replicate: experts' master weights and Adam moments loaded (step {step:g})")
    return loaded
