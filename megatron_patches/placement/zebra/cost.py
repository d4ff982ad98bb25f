"""Zebra planning, part 4: an exact cost model of one iteration of the zig-zag pipeline as a
function of the per-layer offload counts (the tests brute-force the best offload vector with it
and compare Asym-EA)."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

from megatron_patches.placement.zebra.profile import ZebraProfile, chunk_sizes
from megatron_patches.placement.zebra.schedule import (
    Task,
    _longest_paths,
    _topological_order,
    build_schedule,
)

# --------------------------------------------------------------------------------------------
# Cost model of one iteration (used to check Asym-EA against a brute-force search)
# --------------------------------------------------------------------------------------------


def zebra_durations(
    profile: ZebraProfile,
    offload_chunks_L: Sequence[int],
    *,
    t_comm: float = 0.0,
    t_head: float = 0.0,
    forward_fraction: float = 1.0 / 3.0,
) -> Callable[[Task], float]:
    """Task durations of one iteration under per-layer offload counts, every expert equally loaded.

    Profiled times are forward + backward; a task's phase takes ``forward_fraction`` (forward)
    or the rest (backward) of it. Offloading o chunks at layer l takes o*n2 experts off every
    expert GPU (E on the expert rank shrinks by o*n2*tau_E) and gives o*n1 experts to every
    attention GPU (its E task lasts o*n1*tau_A). All-to-alls take ``t_comm`` each and the head
    A(L) ``t_head`` (both forward + backward totals as well).
    """
    shape = profile.shape
    if len(offload_chunks_L) != shape.num_layers:
        raise ValueError(f"offload_chunks_L has {len(offload_chunks_L)} entries, expected {shape.num_layers}")
    n1, n2 = chunk_sizes(shape)
    per_rank = shape.experts_per_expert_rank
    tau_e, tau_a = profile.t_exp_E / per_rank, profile.t_exp_A / per_rank
    expert_L = [(per_rank - o * n2) * tau_e for o in offload_chunks_L]
    attention_L = [o * n1 * tau_a for o in offload_chunks_L]
    return role_durations(profile, expert_L, attention_L, t_comm=t_comm, t_head=t_head,
                          forward_fraction=forward_fraction)


def role_durations(
    profile: ZebraProfile,
    expert_L: Sequence[float],
    attention_L: Sequence[float],
    *,
    t_comm: float = 0.0,
    t_head: float = 0.0,
    forward_fraction: float = 1.0 / 3.0,
) -> Callable[[Task], float]:
    """Task durations given each layer's E task time (forward + backward) on the expert ranks
    (``expert_L``) and on the attention ranks (``attention_L``, 0 where a layer offloads
    nothing): the slowest rank of a role sets its E task, since the all-to-alls after it wait for
    every rank. The rest as in ``zebra_durations``."""
    shape = profile.shape
    for name, values in (("expert_L", expert_L), ("attention_L", attention_L)):
        if len(values) != shape.num_layers:
            raise ValueError(f"{name} has {len(values)} entries, expected {shape.num_layers}")
    fraction = {"F": forward_fraction, "B": 1.0 - forward_fraction}

    def duration(task: Task) -> float:
        if task.kind == "A":
            total = t_head if task.layer == shape.num_layers else profile.t_attn_A
        elif task.kind == "E" and task.role == "expert":
            total = expert_L[task.layer]
        elif task.kind == "E":
            total = attention_L[task.layer]
        else:
            total = t_comm
        return total * fraction[task.phase]

    return duration


def iteration_time(
    profile: ZebraProfile,
    offload_chunks_L: Sequence[int],
    num_microbatches: int,
    *,
    t_comm: float = 0.0,
    t_head: float = 0.0,
    forward_fraction: float = 1.0 / 3.0,
) -> float:
    """Makespan in s of one iteration of the zig-zag pipeline with the given offload counts."""
    durations = zebra_durations(
        profile, offload_chunks_L, t_comm=t_comm, t_head=t_head, forward_fraction=forward_fraction
    )
    return makespan(profile.shape.num_layers, num_microbatches, offload_chunks_L, durations)


def makespan(num_layers: int, num_microbatches: int, offload_chunks_L: Sequence[int],
             durations: Callable[[Task], float]) -> float:
    """Makespan in s of the zig-zag pipeline whose layers with a nonzero offload count have
    attention-rank E tasks, under the given task durations."""
    offloaded = tuple(l for l, o in enumerate(offload_chunks_L) if o > 0)
    times = _longest_paths(*_compiled_schedule(num_layers, num_microbatches, offloaded), durations)
    return max(end for _, end in times.values())


@lru_cache(maxsize=64)
def _compiled_schedule(
    num_layers: int, num_microbatches: int, offloaded_layers: tuple[int, ...]
) -> tuple[dict[str, Task], dict[str, list[str]], list[str]]:
    """The task graph and a topological order of ``build_schedule``, kept because searches over
    offload vectors simulate the same few schedules many times (read-only; never handed out)."""
    return _topological_order(build_schedule(num_layers, num_microbatches, offloaded_layers))
