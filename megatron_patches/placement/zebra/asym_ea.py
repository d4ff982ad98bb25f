"""Zebra planning, part 2: Asym-EA, "gather and squeeze" (DESIGN 4.8): how many experts of each
layer move from the expert ranks to the attention ranks, and the concrete owners. The reading
of T_squeeze is explained in the package docstring."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

from megatron_patches.placement.zebra.profile import (
    ZebraProfile,
    ZebraShape,
    chunk_sizes,
)

# --------------------------------------------------------------------------------------------
# Asym-EA: gather and squeeze (DESIGN 4.8)
# --------------------------------------------------------------------------------------------


def max_chunks_per_layer(shape: ZebraShape) -> int:
    """Most chunks one layer can offload: every expert GPU can give at most its n/N experts."""
    _, n2 = chunk_sizes(shape)
    return shape.experts_per_expert_rank // n2


def squeeze_time(profile: ZebraProfile) -> Fraction:
    """T_squeeze: the per-micro-batch bubble one chunk removes (see the module docstring)."""
    n1, n2 = chunk_sizes(profile.shape)
    per_rank = profile.shape.experts_per_expert_rank
    tau_e = Fraction(profile.t_exp_E) / per_rank  # per-expert time on an expert GPU
    tau_a = Fraction(profile.t_exp_A) / per_rank  # per-expert time on an attention GPU
    return n2 * tau_e + n1 * tau_a


def _memory_chunk_bounds(profile: ZebraProfile) -> tuple[int, int]:
    """(need, cap): total chunks over all layers the memory of both kinds of GPU requires / allows.

    need = ceil(n_min / n2): each chunk frees n2 experts on every expert GPU.
    cap = floor(n_max / n1): each chunk adds n1 experts to every attention GPU. DESIGN 4.8 writes
    n2 here; that counts attention-GPU memory in expert-GPU experts and only agrees when M == N
    (for M=2, N=4 it would put 2*n_max experts on an attention GPU), so n1 is used.
    """
    n1, n2 = chunk_sizes(profile.shape)
    need = -(-profile.n_min // n2)
    cap = profile.n_max // n1
    most = profile.shape.num_layers * max_chunks_per_layer(profile.shape)
    if need > most:
        raise ValueError(
            f"n_min={profile.n_min} experts per expert GPU need {need} chunks of n2={n2}, but only "
            f"{most} fit (L={profile.shape.num_layers} layers x {max_chunks_per_layer(profile.shape)}"
            " chunks per layer): the experts cannot be placed; add expert GPUs or memory"
        )
    if need > cap:
        raise ValueError(
            f"n_min cannot be met within n_max: expert GPUs must give away n_min={profile.n_min} "
            f"experts ({need} chunks of n2={n2}) but attention GPUs can take only n_max="
            f"{profile.n_max} experts ({cap} chunks of n1={n1})"
        )
    return need, cap


@dataclass(frozen=True)
class AsymEAPlan:
    """Per-layer expert offloading from expert ranks to attention ranks."""

    shape: ZebraShape
    """The shape the plan is made for."""
    offload_chunks_L: tuple[int, ...]
    """Chunks offloaded per layer (length L)."""
    n1: int
    """Experts each attention GPU takes per chunk (0 for an "off" plan whose M and N do not
    divide each other: such a group cannot offload at all)."""
    n2: int
    """Experts each expert GPU gives per chunk (0 in the same case as n1)."""
    t_gather: float | None = None
    """T_gather = T_E^exp - T_A^attn in s (auto plans only)."""
    t_squeeze: float | None = None
    """T_squeeze in s (auto plans only)."""
    alpha: float | None = None
    """Memory cap factor alpha of DESIGN 4.8 (auto plans with T_gather > 0 only)."""
    beta: float | None = None
    """Memory floor factor beta of DESIGN 4.8 (auto plans with T_gather > 0 only)."""
    owners_LE: tuple[tuple[int, ...], ...] | None = None
    """Explicit owners of every layer's experts (ZP-group-local ranks), for plans that choose which
    experts move (``replan``: by load); None: the contiguous choice of ``expert_owners``. Each
    expert stays on its home expert rank or moves to an attention rank; every expert rank gives
    o*n2 experts of a layer with o chunks and every attention rank takes o*n1."""

    def __post_init__(self) -> None:
        if self.owners_LE is None:
            return
        shape = self.shape
        owners_LE = np.asarray(self.owners_LE, dtype=np.int64)
        if owners_LE.shape != (shape.num_layers, shape.num_experts):
            raise ValueError(f"owners_LE has shape {owners_LE.shape}, expected ({shape.num_layers}, {shape.num_experts})")
        m, per_rank = shape.attention_ranks, shape.experts_per_expert_rank
        home_E = m + np.arange(shape.num_experts) // per_rank
        for layer, (owners_E, chunks) in enumerate(zip(owners_LE, self.offload_chunks_L)):
            moved_E = owners_E != home_E
            given_N = np.bincount(home_E[moved_E] - m, minlength=shape.expert_ranks)
            taken_A = np.bincount(owners_E[moved_E], minlength=m)
            if (owners_E[moved_E] >= m).any() or (given_N != chunks * self.n2).any() or (taken_A != chunks * self.n1).any():
                raise ValueError(
                    f"owners of layer {layer} {owners_E.tolist()} do not offload {chunks} chunks: each expert stays on "
                    f"its home expert rank {home_E.tolist()} or moves to an attention rank 0..{m - 1}, every expert rank "
                    f"gives {chunks * self.n2} and every attention rank takes {chunks * self.n1}"
                )

    @property
    def experts_per_attention_rank_L(self) -> tuple[int, ...]:
        """Experts of each layer that every attention rank holds."""
        return tuple(o * self.n1 for o in self.offload_chunks_L)

    @property
    def experts_moved_per_expert_rank_L(self) -> tuple[int, ...]:
        """Experts of each layer that every expert rank gives away."""
        return tuple(o * self.n2 for o in self.offload_chunks_L)

    @property
    def total_chunks(self) -> int:
        return sum(self.offload_chunks_L)


def asym_ea(profile: ZebraProfile) -> AsymEAPlan:
    """Gather and squeeze: walk the layers, gather alpha*beta*T_gather of bubble per layer and
    offload floor(t_bubble / T_squeeze) chunks whenever a whole chunk's worth has gathered.

    Arithmetic is exact (Fractions of the profiled floats) so the chunk totals hit the memory
    bounds exactly and every rank gets the same answer. Where a layer would exceed its
    ``max_chunks_per_layer`` the rest of the bubble is carried to the next layer.
    When attention is the slower side (T_gather <= 0) there is no bubble to fill and only the
    memory floor n_min is offloaded, spread evenly over the layers.

    Quality (brute force against ``iteration_time``, R >= 2, tests/placement/test_zebra.py): the
    plan is within (R + 1) * L * max(n1*tau_A, n2*tau_E) of the best offload vector and exactly
    best on about 60% of random tiny cases. The floor rounding loses most when a chunk is coarse
    (T_squeeze > T_gather): it then offloads nothing although one chunk would shorten the layer.
    """
    shape = profile.shape
    n1, n2 = chunk_sizes(shape)
    need, cap = _memory_chunk_bounds(profile)
    layers = shape.num_layers
    t_gather = Fraction(profile.t_exp_E) - Fraction(profile.t_attn_A)
    t_squeeze = squeeze_time(profile)
    alpha = beta = None
    if t_gather > 0:
        alpha = min(cap * t_squeeze / (layers * t_gather), Fraction(1))
        beta = max(need * t_squeeze / (layers * t_gather), Fraction(1))
        per_layer = alpha * beta * t_gather
    else:
        per_layer = need * t_squeeze / layers
    per_layer_cap = max_chunks_per_layer(shape)
    chunks_L = []
    t_bubble = Fraction(0)
    for _ in range(layers):
        t_bubble += per_layer
        chunks = min(int(t_bubble // t_squeeze), per_layer_cap)
        t_bubble -= chunks * t_squeeze
        chunks_L.append(chunks)
    return AsymEAPlan(
        shape=shape,
        offload_chunks_L=tuple(chunks_L),
        n1=n1,
        n2=n2,
        t_gather=float(t_gather),
        t_squeeze=float(t_squeeze),
        alpha=None if alpha is None else float(alpha),
        beta=None if beta is None else float(beta),
    )


def resolve_asym_ea(
    spec: str | Sequence[int], shape: ZebraShape, profile: ZebraProfile | None = None
) -> AsymEAPlan:
    """Turn the value of ``--zebra-asym-ea {auto,off,LIST}`` into a plan.

    ``auto`` runs gather-and-squeeze on ``profile``; ``off`` offloads nothing; a LIST (a
    comma-separated string such as "0,1,1,0" or a sequence of ints) gives the chunks per layer.
    With a profile, off and LIST are checked against its memory bounds too.
    """
    if profile is not None and profile.shape != shape:
        raise ValueError(f"the zebra profile was made for {profile.shape}, the run has {shape}")
    if isinstance(spec, str) and spec.strip() == "auto":
        if profile is None:
            raise ValueError("--zebra-asym-ea auto needs a profile (--zebra-profile FILE)")
        return asym_ea(profile)
    if isinstance(spec, str) and spec.strip() == "off":
        chunks_L = (0,) * shape.num_layers
        if profile is not None and profile.n_min > 0:
            raise ValueError(
                f"--zebra-asym-ea off is impossible: the profile says each expert GPU must give "
                f"away n_min={profile.n_min} experts to fit in memory; use auto or a LIST"
            )
        m, n = shape.attention_ranks, shape.expert_ranks
        if (m % n and n % m) or shape.num_experts % n:  # no chunks exist, and none are needed
            return AsymEAPlan(shape=shape, offload_chunks_L=chunks_L, n1=0, n2=0)
        n1, n2 = chunk_sizes(shape)
        return AsymEAPlan(shape=shape, offload_chunks_L=chunks_L, n1=n1, n2=n2)
    chunks_L = _parse_chunk_list(spec, shape)
    n1, n2 = chunk_sizes(shape)
    if profile is not None:
        need, cap = _memory_chunk_bounds(profile)
        total = sum(chunks_L)
        if total < need:
            raise ValueError(
                f"--zebra-asym-ea {','.join(map(str, chunks_L))} offloads {total} chunks, but expert "
                f"GPUs must give away n_min={profile.n_min} experts = {need} chunks of n2={n2}"
            )
        if total > cap:
            raise ValueError(
                f"--zebra-asym-ea {','.join(map(str, chunks_L))} offloads {total} chunks, but "
                f"attention GPUs can take only n_max={profile.n_max} experts = {cap} chunks of n1={n1}"
            )
    return AsymEAPlan(shape=shape, offload_chunks_L=chunks_L, n1=n1, n2=n2)


def _parse_chunk_list(spec: str | Sequence[int], shape: ZebraShape) -> tuple[int, ...]:
    if isinstance(spec, str):
        try:
            values = [int(item) for item in spec.split(",")]
        except ValueError:
            raise ValueError(
                f"--zebra-asym-ea {spec!r} is not auto, off or a comma-separated list of integers"
            ) from None
    else:
        values = list(spec)
        for value in values:
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise ValueError(f"--zebra-asym-ea list entries must be integers, got {value!r}")
    if len(values) != shape.num_layers:
        raise ValueError(
            f"--zebra-asym-ea list has {len(values)} entries, expected one per layer "
            f"(num_layers={shape.num_layers})"
        )
    per_layer_cap = max_chunks_per_layer(shape)
    for layer, value in enumerate(values):
        if not 0 <= value <= per_layer_cap:
            raise ValueError(
                f"--zebra-asym-ea entry for layer {layer} is {value}; valid: 0..{per_layer_cap} chunks "
                f"(each expert rank holds {shape.experts_per_expert_rank} experts per layer, "
                f"n2={chunk_sizes(shape)[1]} per chunk)"
            )
    return tuple(int(v) for v in values)


def expert_owners(plan: AsymEAPlan, layer: int) -> np.ndarray:
    """Owner of every expert of ``layer`` as a ZP-group-local rank (attention ranks 0..M-1, expert
    ranks M..M+N-1), shape [n], int64.

    Expert rank r (group rank M+r) owns the contiguous block [r*n/N, (r+1)*n/N) (blocks as even as
    possible when N does not divide n: `ZebraShape.expert_block_starts`); under Asym-EA it gives
    away the last o*n2 experts of its block. The given-away experts, in expert-rank order,
    go to attention ranks in consecutive runs of o*n1. A plan with explicit owners (a re-plan by
    load) gives those instead. Deterministic on every rank.
    """
    shape = plan.shape
    if not 0 <= layer < shape.num_layers:
        raise ValueError(f"layer {layer} out of range 0..{shape.num_layers - 1}")
    if plan.owners_LE is not None:
        return np.array(plan.owners_LE[layer], dtype=np.int64)
    m, per_rank = shape.attention_ranks, shape.experts_per_expert_rank
    owners_E = m + np.repeat(np.arange(shape.expert_ranks, dtype=np.int64), np.diff(shape.expert_block_starts))
    moved = plan.offload_chunks_L[layer] * plan.n2
    if moved == 0:
        return owners_E
    # moved_E: ids of given-away experts, expert-rank-major; e.g. per_rank=4, moved=1 -> 3, 7, ...
    starts_N = np.arange(shape.expert_ranks, dtype=np.int64) * per_rank + per_rank - moved
    moved_E = (starts_N[:, None] + np.arange(moved, dtype=np.int64)[None, :]).reshape(-1)
    owners_E[moved_E] = np.arange(moved_E.size, dtype=np.int64) // (plan.offload_chunks_L[layer] * plan.n1)
    return owners_E
