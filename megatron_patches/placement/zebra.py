"""Zebra parallelism planning: the profile, Asym-EA ("gather and squeeze") and the task order.

Zebra mode (DESIGN 4.7, 4.8) splits a ZP group into M attention ranks (newer GPUs: embeddings,
attention, gate, norms, head; replicated data-parallel) and N expert ranks (older GPUs: the
experts of every MoE layer, expert-parallel). This module holds the pure planning side of it:

1. ``ZebraShape`` / ``ZebraProfile`` / ``DeviceProfile``: the model/group shape and the profiled
   per-micro-batch times and memory bounds, with a JSON file format that the profiler merges
   into, one entry per device type.
2. ``asym_ea`` / ``resolve_asym_ea``: how many experts of each layer move from the expert ranks
   to the attention ranks ("chunks" per layer), and ``expert_owners`` for the concrete owners.
3. ``task_order`` / ``build_schedule``: the Theorem-1 order of compute and communication tasks per
   stream for both roles, as data with explicit dependencies; ``check_deadlock_free`` and a
   tiny discrete-event ``simulate_schedule``.
4. ``zebra_durations`` / ``iteration_time``: an exact cost model of one iteration of the zig-zag
   pipeline as a function of the per-layer offload counts, built on the two pieces above. The
   tests use it to brute-force the best offload vector on small cases and compare Asym-EA with it.

The reading of T_squeeze implemented here (the published formula is ambiguous about which of n1,
n2 multiplies which time):

    per-expert time on an expert GPU     tau_E = T_E^exp  / (n/N)
    per-expert time on an attention GPU  tau_A = T_E^attn / (n/N)
    T_squeeze = n2 * tau_E + n1 * tau_A

Why: one chunk takes n2 experts away from *every* expert GPU (each then computes n2 experts
less: it saves n2 * tau_E) and gives n1 experts to *every* attention GPU (each computes n1
experts more: its idle time shrinks by n1 * tau_A). Every expert sees the same tokens wherever it
lives (it receives the tokens of all M attention ranks), so the per-expert times do not depend on
M or N beyond the n/N normalisation. The per-layer bubble T_E^exp - T_A^attn therefore shrinks by
exactly n2 * tau_E + n1 * tau_A per chunk. The other reading (n1 * tau_E + n2 * tau_A) coincides
with this one only when M == N; the tests show it mis-sizes the offload when M != N.

Everything here is pure Python / numpy and deterministic: every rank computes the same plan.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import Callable, Mapping, Sequence

import numpy as np

ROLES = ("attention", "expert")
STREAMS = ("compute", "dispatch", "combine")
KINDS = ("A", "D", "E", "C")
PHASES = ("F", "B")
PROFILE_FORMAT = "zebra-profile/1"


# --------------------------------------------------------------------------------------------
# Shape and profile
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZebraShape:
    """The model and ZP-group shape that a zebra plan is made for."""

    num_layers: int
    """L: MoE layers of the model (every transformer layer has one MoE block)."""
    num_experts: int
    """n: experts per MoE layer."""
    attention_ranks: int
    """M: attention ranks per ZP group."""
    expert_ranks: int
    """N: expert ranks per ZP group; the n experts of a layer are split evenly over them."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "attention_ranks", "expert_ranks"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ZebraShape.{name} must be an integer >= 1, got {value!r}")
        if self.num_experts % self.expert_ranks != 0:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by expert_ranks="
                f"{self.expert_ranks}: every expert rank must hold the same number of experts "
                f"per layer (valid expert_ranks: divisors of {self.num_experts})"
            )

    @property
    def experts_per_expert_rank(self) -> int:
        """n/N: experts of one layer on one expert rank before any offloading."""
        return self.num_experts // self.expert_ranks

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ZebraProfile:
    """Profiled inputs of Asym-EA (DESIGN 4.8); all times are per micro-batch and per layer,
    forward plus backward, in seconds."""

    shape: ZebraShape
    """The model / group shape the times were measured for."""
    t_attn_A: float
    """T_A^attn: one layer's non-expert block (norms, attention, gate) on an attention GPU."""
    t_exp_E: float
    """T_E^exp: one layer's experts as held by one expert GPU (n/N experts, receiving the tokens
    of all M attention ranks) on an expert GPU."""
    t_exp_A: float
    """T_E^attn: the same expert work as t_exp_E, run on an attention GPU."""
    n_min: int
    """Experts (summed over layers) each expert GPU must give away because its memory cannot
    hold all L*n/N of its experts; 0 when they fit."""
    n_max: int
    """Experts (summed over layers) each attention GPU can take in addition to its own model."""

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ZebraShape):
            raise ValueError(f"ZebraProfile.shape must be a ZebraShape, got {self.shape!r}")
        for name in ("t_attn_A", "t_exp_E", "t_exp_A"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ZebraProfile.{name} must be a finite time > 0 s, got {value!r}")
        for name in ("n_min", "n_max"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ZebraProfile.{name} must be an integer >= 0, got {value!r}")
        held = self.shape.num_layers * self.shape.experts_per_expert_rank
        if self.n_min > held:
            raise ValueError(
                f"ZebraProfile.n_min={self.n_min} exceeds the {held} experts an expert GPU holds "
                f"(L={self.shape.num_layers} layers x n/N={self.shape.experts_per_expert_rank})"
            )
        # A profile exists to drive Asym-EA, which needs whole chunks on both sides.
        chunk_sizes(self.shape)

    def to_dict(self) -> dict:
        return {
            "shape": self.shape.to_dict(),
            "t_attn_A": self.t_attn_A,
            "t_exp_E": self.t_exp_E,
            "t_exp_A": self.t_exp_A,
            "n_min": self.n_min,
            "n_max": self.n_max,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "ZebraProfile":
        missing = {"shape", "t_attn_A", "t_exp_E", "t_exp_A", "n_min", "n_max"} - set(data)
        if missing:
            raise ValueError(f"zebra profile is missing the keys {sorted(missing)}")
        return cls(
            shape=ZebraShape(**data["shape"]),
            t_attn_A=float(data["t_attn_A"]),
            t_exp_E=float(data["t_exp_E"]),
            t_exp_A=float(data["t_exp_A"]),
            n_min=int(data["n_min"]),
            n_max=int(data["n_max"]),
        )


@dataclass(frozen=True)
class DeviceProfile:
    """What the profiler measures on one device type (one run per type, merged into one file).

    A type profiled for one role only (tools/profile_moe.py --role attention / expert) leaves the
    other role's figures as None: an expert GPU may be unable to run the attention block at all
    (a 32K-token score matrix does not fit a 16 GB T4). ``t_experts_s`` is always measured, since
    both roles compute experts (T_E^exp on expert GPUs, T_E^attn on attention GPUs).
    """

    device_type: str
    """Device name as the cluster config spells it, e.g. "A40", "V100", "cpu"."""
    t_attention_s: float | None
    """One layer's non-expert block (norms, attention, gate), forward + backward, per micro-batch;
    None when the type was profiled only as an expert GPU."""
    t_experts_s: float
    """One layer's experts of one expert rank (n/N experts, tokens of all M attention ranks),
    forward + backward, per micro-batch."""
    expert_slots_as_attention: int | None
    """Experts (with gradients and optimizer state) that fit next to the attention model when
    this device is an attention GPU; None when the type was profiled only as an expert GPU."""
    expert_slots_as_expert: int | None
    """Experts (with gradients and optimizer state) that fit when this device is an expert GPU;
    None when the type was profiled only as an attention GPU."""

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, str) or not self.device_type:
            raise ValueError(f"DeviceProfile.device_type must be a non-empty string, got {self.device_type!r}")
        for name in ("t_attention_s", "t_experts_s"):
            value = getattr(self, name)
            if value is None and name == "t_attention_s":
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"DeviceProfile[{self.device_type}].{name} must be a finite time > 0 s, got {value!r}"
                )
        for name in ("expert_slots_as_attention", "expert_slots_as_expert"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"DeviceProfile[{self.device_type}].{name} must be an integer >= 0, got {value!r}"
                )
        if self.t_attention_s is None and self.expert_slots_as_expert is None:
            raise ValueError(
                f"DeviceProfile[{self.device_type}] has neither attention-role figures (t_attention_s) "
                "nor expert-role figures (expert_slots_as_expert): it was profiled for no role"
            )
        if (self.t_attention_s is None) != (self.expert_slots_as_attention is None):
            raise ValueError(
                f"DeviceProfile[{self.device_type}]: t_attention_s={self.t_attention_s!r} and "
                f"expert_slots_as_attention={self.expert_slots_as_attention!r} must both be given "
                "(profiled as an attention GPU) or both be None"
            )


def profile_from_devices(shape: ZebraShape, attention: DeviceProfile, expert: DeviceProfile) -> ZebraProfile:
    """Combine the measurements of the attention-GPU type and the expert-GPU type."""
    if attention.t_attention_s is None:
        raise ValueError(
            f"device type {attention.device_type!r} was profiled only as an expert GPU (no "
            "t_attention_s / expert_slots_as_attention); profile it with --role attention or both "
            "to use it for the attention ranks"
        )
    if expert.expert_slots_as_expert is None:
        raise ValueError(
            f"device type {expert.device_type!r} was profiled only as an attention GPU (no "
            "expert_slots_as_expert); profile it with --role expert or both to use it for the "
            "expert ranks"
        )
    held = shape.num_layers * shape.experts_per_expert_rank
    return ZebraProfile(
        shape=shape,
        t_attn_A=attention.t_attention_s,
        t_exp_E=expert.t_experts_s,
        t_exp_A=attention.t_experts_s,
        n_min=max(0, held - expert.expert_slots_as_expert),
        n_max=attention.expert_slots_as_attention,
    )


def _read_profile_file(path: str | os.PathLike) -> dict:
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: format is {data.get('format')!r}, expected {PROFILE_FORMAT!r}")
    if not isinstance(data.get("devices"), dict) or "shape" not in data:
        raise ValueError(f"{path}: a zebra profile needs a 'shape' and a 'devices' object")
    return data


def save_device_profile(
    path: str | os.PathLike,
    shape: ZebraShape,
    device: DeviceProfile,
    *,
    workload: Mapping | None = None,
    details: Mapping | None = None,
) -> None:
    """Merge one device type's measurements into the profile file at ``path`` (created if absent).

    An existing entry of the same device type is replaced; the file's shape must match, because
    times measured for another (L, n, M, N) are not comparable. ``workload`` names what else the
    times depend on (sequence length, micro-batch size, dtype, ...): it is stored once per file
    and must equal the file's too (None matches only a file saved without one). ``details`` (any
    JSON-able mapping, e.g. the forward/backward split and the memory figures behind the slots)
    is kept per device type under "details"; the loader ignores it.
    """
    if os.path.exists(path):
        data = _read_profile_file(path)
        if data["shape"] != shape.to_dict():
            raise ValueError(
                f"{path} was profiled for shape {data['shape']}, not {shape.to_dict()}; "
                "write the new measurements to another file"
            )
        stored = data.get("workload")
        wanted = None if workload is None else json.loads(json.dumps(workload))
        if stored != wanted:
            raise ValueError(
                f"{path} was profiled under workload {stored}, not {wanted}; times measured under "
                "other conditions are not comparable: write the new measurements to another file"
            )
    else:
        data = {"format": PROFILE_FORMAT, "shape": shape.to_dict(), "devices": {}}
        if workload is not None:
            data["workload"] = dict(workload)
    entry = asdict(device)
    del entry["device_type"]
    data["devices"][device.device_type] = entry
    data["devices"] = dict(sorted(data["devices"].items()))
    all_details = {k: v for k, v in data.get("details", {}).items() if k != device.device_type}
    if details is not None:
        all_details[device.device_type] = dict(details)
    if all_details:
        data["details"] = dict(sorted(all_details.items()))
    else:
        data.pop("details", None)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def load_zebra_profile(
    path: str | os.PathLike, attention_device: str | None = None, expert_device: str | None = None
) -> ZebraProfile:
    """Read a merged profile file and build the ZebraProfile for one (attention, expert) pairing.

    A device type left as None is allowed only when the file holds exactly one type (a
    homogeneous pool, e.g. CPU tests); then both roles use it.
    """
    data = _read_profile_file(path)
    shape = ZebraShape(**data["shape"])
    devices = {name: DeviceProfile(device_type=name, **entry) for name, entry in data["devices"].items()}

    def pick(name: str | None, role: str) -> DeviceProfile:
        if name is None:
            if len(devices) != 1:
                raise ValueError(
                    f"{path} holds device types {sorted(devices)}; name the {role} device type"
                )
            return next(iter(devices.values()))
        if name not in devices:
            raise ValueError(f"{path} has no measurements for {role} device type {name!r} "
                             f"(profiled types: {sorted(devices)})")
        return devices[name]

    return profile_from_devices(shape, pick(attention_device, "attention"), pick(expert_device, "expert"))


# --------------------------------------------------------------------------------------------
# Asym-EA: gather and squeeze (DESIGN 4.8)
# --------------------------------------------------------------------------------------------


def chunk_sizes(shape: ZebraShape) -> tuple[int, int]:
    """(n1, n2): experts each attention GPU takes and each expert GPU gives per offloaded chunk.

    n1 = max(1, N/M), n2 = n1*M/N, so M*n1 == N*n2 experts move per chunk. Needs M | N or N | M.
    """
    m, n = shape.attention_ranks, shape.expert_ranks
    if n % m != 0 and m % n != 0:
        raise ValueError(
            f"Asym-EA needs attention_ranks M={m} to divide expert_ranks N={n} or N to divide M "
            "(whole experts per chunk on both sides)"
        )
    n1 = max(1, n // m)
    n2 = n1 * m // n
    return n1, n2


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
        if shape.attention_ranks % shape.expert_ranks and shape.expert_ranks % shape.attention_ranks:
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

    Expert rank r (group rank M+r) owns the contiguous block [r*n/N, (r+1)*n/N); under Asym-EA it
    gives away the last o*n2 experts of its block. The given-away experts, in expert-rank order,
    go to attention ranks in consecutive runs of o*n1. Deterministic on every rank.
    """
    shape = plan.shape
    if not 0 <= layer < shape.num_layers:
        raise ValueError(f"layer {layer} out of range 0..{shape.num_layers - 1}")
    m, per_rank = shape.attention_ranks, shape.experts_per_expert_rank
    owners_E = m + np.arange(shape.num_experts, dtype=np.int64) // per_rank
    moved = plan.offload_chunks_L[layer] * plan.n2
    if moved == 0:
        return owners_E
    # moved_E: ids of given-away experts, expert-rank-major; e.g. per_rank=4, moved=1 -> 3, 7, ...
    starts_N = np.arange(shape.expert_ranks, dtype=np.int64) * per_rank + per_rank - moved
    moved_E = (starts_N[:, None] + np.arange(moved, dtype=np.int64)[None, :]).reshape(-1)
    owners_E[moved_E] = np.arange(moved_E.size, dtype=np.int64) // (plan.offload_chunks_L[layer] * plan.n1)
    return owners_E


# --------------------------------------------------------------------------------------------
# Theorem-1 task order (DESIGN 4.7)
# --------------------------------------------------------------------------------------------
#
# Indexing. Attention tasks run for layers 0..L: A(l) for l < L is [the combine of MoE layer l-1
# (weighted sum with the gate scores, residual add) or the embedding for l = 0] + norms +
# attention + gate of layer l; A(L) is the output head (combine of MoE layer L-1, final norm,
# output projection, loss). Expert tasks E(l) and communication tasks D(l), C(l) exist for l < L.
#
# Data flow for micro-batch j (every edge is a dependency in Task.deps):
#   forward   A_F(l,j) -> D_F(l,j) -> E_F(l,j) -> C_F(l,j) -> A_F(l+1,j);  A_F(l,j) -> A_F(l+1,j)
#   head      A_F(L,j) -> A_B(L,j)
#   backward  A_B(l+1,j) -> C_B(l,j) -> E_B(l,j) -> D_B(l,j) -> A_B(l,j);  A_B(l+1,j) -> A_B(l,j)
#             and every backward task depends on its own forward task (saved activations).
# Directions of the all-to-alls (bipartite between the M attention and N expert ranks):
#   D_F: attention -> expert (tokens after the gate)
#   C_F: expert -> attention (expert outputs)
#   C_B: attention -> expert (gradient of the expert outputs, produced by A_B(l+1,j))
#   D_B: expert -> attention (gradient of the expert inputs). A_B(l,j) adds it to the gate-branch
#        gradient before running the attention backward, so no weight gets its backward twice.
# Streams: D tasks run on the "dispatch" stream/group and C tasks on the "combine" stream/group
# of both roles; in each phase the two flow in opposite directions, so they never queue behind
# each other. An all-to-all is one task that sits in the queue of that stream on both roles and
# starts when it is at the head of both (a collective needs every member).
# With Asym-EA, a layer with offloaded experts also has E tasks on the attention ranks' compute
# stream (their share of the experts); D_F / D_B then also carry tokens between attention ranks
# and C_F(l,j) / D_B(l,j) wait for both roles' E tasks. See _insert_attention_experts for where
# they sit in the compute order.


@dataclass(frozen=True)
class Task:
    """One compute or communication task of the zebra schedule."""

    kind: str
    """"A" attention block, "D" dispatch all-to-all, "E" experts, "C" combine all-to-all."""
    phase: str
    """"F" forward or "B" backward."""
    layer: int
    """Layer index: 0..L for A (L is the head), 0..L-1 for D, E, C."""
    microbatch: int
    """Micro-batch index 0..R-1."""
    stream: str
    """"compute" for A and E, "dispatch" for D, "combine" for C."""
    role: str
    """Where it runs: "attention" or "expert" for compute tasks, "group" for all-to-alls (one
    collective over both roles' queues)."""
    deps: tuple[str, ...] = field(default=())
    """Ids of the tasks whose outputs this task consumes."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.phase not in PHASES or self.stream not in STREAMS:
            raise ValueError(
                f"task ({self.kind!r}, {self.phase!r}, stream {self.stream!r}): kind must be one of "
                f"{KINDS}, phase one of {PHASES}, stream one of {STREAMS}"
            )
        if self.role not in (*ROLES, "group"):
            raise ValueError(f"task role must be one of {(*ROLES, 'group')}, got {self.role!r}")

    @cached_property
    def label(self) -> str:
        """Role-free name, e.g. "A_F(1,0)"."""
        return f"{self.kind}_{self.phase}({self.layer},{self.microbatch})"

    @cached_property
    def id(self) -> str:
        """Unique id: compute tasks are prefixed by their role ("expert:E_F(0,1)"), all-to-alls
        are shared by both roles ("D_F(0,1)")."""
        return self.label if self.role == "group" else f"{self.role}:{self.label}"


def _att(kind: str, phase: str, layer: int, mb: int) -> str:
    return f"attention:{kind}_{phase}({layer},{mb})"


def _exp(phase: str, layer: int, mb: int) -> str:
    return f"expert:E_{phase}({layer},{mb})"


def _comm(kind: str, phase: str, layer: int, mb: int) -> str:
    return f"{kind}_{phase}({layer},{mb})"


def _tasks_of_step(
    kind: str, phase: str, layer: int, mb: int, num_layers: int, offloaded: frozenset[int]
) -> dict[str, Task]:
    """The tasks created for one (kind, phase, layer, micro-batch) with their dependencies."""
    L = num_layers
    if kind == "A" and phase == "F":
        deps = () if layer == 0 else (_att("A", "F", layer - 1, mb), _comm("C", "F", layer - 1, mb))
        return {"attention": Task("A", "F", layer, mb, "compute", "attention", deps)}
    if kind == "A" and phase == "B":
        own = _att("A", "F", layer, mb)
        deps = (own,) if layer == L else (own, _att("A", "B", layer + 1, mb), _comm("D", "B", layer, mb))
        return {"attention": Task("A", "B", layer, mb, "compute", "attention", deps)}
    if kind == "E":
        incoming = _comm("D", "F", layer, mb) if phase == "F" else _comm("C", "B", layer, mb)
        saved = (_exp("F", layer, mb),) if phase == "B" else ()
        tasks = {"expert": Task("E", phase, layer, mb, "compute", "expert", (incoming, *saved))}
        if layer in offloaded:
            saved = (_att("E", "F", layer, mb),) if phase == "B" else ()
            tasks["attention"] = Task("E", phase, layer, mb, "compute", "attention", (incoming, *saved))
        return tasks
    producers = {
        ("D", "F"): (_att("A", "F", layer, mb),),
        ("C", "F"): (_exp("F", layer, mb),) + ((_att("E", "F", layer, mb),) if layer in offloaded else ()),
        ("C", "B"): (_att("A", "B", layer + 1, mb),),
        ("D", "B"): (_exp("B", layer, mb),) + ((_att("E", "B", layer, mb),) if layer in offloaded else ()),
    }[(kind, phase)]
    stream = "dispatch" if kind == "D" else "combine"
    return {"group": Task(kind, phase, layer, mb, stream, "group", producers)}


def task_order(
    num_layers: int, num_microbatches: int, role: str, offloaded_layers: Sequence[int] = ()
) -> dict[str, list[Task]]:
    """Theorem-1 order of every stream of one rank of ``role`` ("attention" or "expert").

    Returns {"compute": [...], "dispatch": [...], "combine": [...]}, each list in execution
    order. Attention compute: A_F layer-major / micro-batch-minor for layers 0..L-1, then for
    each micro-batch A_F(L,j) immediately followed by A_B(L,j) (the head), then A_B layer-major
    descending (L-1..0) / micro-batch-minor. Expert compute: E_F layer-major / micro-batch-minor,
    then E_B for layers L-1..0, micro-batch-minor. Communication tasks are enqueued right after
    their producer: on the producing role in the producer's order, and on the receiving role in
    the same order (all-to-alls are collectives, so both queues must agree).
    ``offloaded_layers``: layers with Asym-EA experts on attention ranks (adds their E tasks).
    """
    if not isinstance(num_layers, (int, np.integer)) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    if not isinstance(num_microbatches, (int, np.integer)) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    offloaded = frozenset(int(l) for l in offloaded_layers)
    bad = sorted(l for l in offloaded if not 0 <= l < num_layers)
    if bad:
        raise ValueError(f"offloaded_layers {bad} out of range 0..{num_layers - 1}")
    L, R = num_layers, num_microbatches

    if role == "attention":
        steps = [("A", "F", l, j) for l in range(L) for j in range(R)]
        steps += [step for j in range(R) for step in (("A", "F", L, j), ("A", "B", L, j))]
        steps += [("A", "B", l, j) for l in reversed(range(L)) for j in range(R)]
    else:
        steps = [("E", "F", l, j) for l in range(L) for j in range(R)]
        steps += [("E", "B", l, j) for l in reversed(range(L)) for j in range(R)]

    compute = [_tasks_of_step(k, ph, l, j, L, offloaded)[role] for k, ph, l, j in steps]
    if role == "attention" and offloaded:
        compute = _insert_attention_experts(compute, L, R, offloaded)
    # Every all-to-all in the order its producers run (forward layer-major, then backward from
    # the last layer), which is also the order its consumers need it; the same on both roles.
    comm_order = [(ph, l, j) for ph, layers in (("F", range(L)), ("B", reversed(range(L)))) for l in layers for j in range(R)]
    return {
        "compute": compute,
        "dispatch": [_tasks_of_step("D", ph, l, j, L, offloaded)["group"] for ph, l, j in comm_order],
        "combine": [_tasks_of_step("C", ph, l, j, L, offloaded)["group"] for ph, l, j in comm_order],
    }


def _insert_attention_experts(
    compute: list[Task], num_layers: int, num_microbatches: int, offloaded: frozenset[int]
) -> list[Task]:
    """Place the attention ranks' expert tasks into their compute order.

    E_F(l,j) needs D_F(l,j), which starts only when A_F(l,j) has ended; E_B(l,j) needs C_B(l,j)
    after A_B(l+1,j). Run right after that producer, the compute stream would idle for the whole
    all-to-all, so each is deferred by one task: it runs after the compute task that follows its
    producer, which hides an all-to-all up to that task's length. With R >= 2 that following
    task never depends on the deferred one: it is either the same step's next micro-batch, or
    micro-batch 0 of the next step, which needs only the E task of micro-batch 0 (placed
    earlier). With R == 1 it would (A_F(l+1,0) needs C_F(l,0)), so there the E task runs right
    after its producer and the compute stream waits for the all-to-all.
    """
    producer_of = {}
    for layer in offloaded:
        for mb in range(num_microbatches):
            producer_of[_att("A", "F", layer, mb)] = _tasks_of_step("E", "F", layer, mb, num_layers, offloaded)
            producer_of[_att("A", "B", layer + 1, mb)] = _tasks_of_step("E", "B", layer, mb, num_layers, offloaded)
    delay = 1 if num_microbatches >= 2 else 0
    slots: list[list[Task]] = [[] for _ in compute]
    for position, task in enumerate(compute):
        if task.id in producer_of:
            slots[min(position + delay, len(compute) - 1)].append(producer_of[task.id]["attention"])
    return [t for task, extra in zip(compute, slots) for t in (task, *extra)]


Schedule = dict[tuple[str, str], list[Task]]
"""(role, stream) -> tasks in execution order; all-to-all tasks appear under both roles."""


def build_schedule(num_layers: int, num_microbatches: int, offloaded_layers: Sequence[int] = ()) -> Schedule:
    """The full ZP-group schedule: both roles' streams from ``task_order``."""
    return {
        (role, stream): tasks
        for role in ROLES
        for stream, tasks in task_order(num_layers, num_microbatches, role, offloaded_layers).items()
    }


def _schedule_graph(schedule: Schedule) -> tuple[dict[str, Task], dict[str, list[str]]]:
    """All tasks by id and each task's predecessors (data deps + stream predecessors)."""
    tasks: dict[str, Task] = {}
    preds: dict[str, list[str]] = {}
    for (role, stream), queue in schedule.items():
        if role not in ROLES or stream not in STREAMS:
            raise ValueError(f"schedule key {(role, stream)} is not a (role in {ROLES}, stream in {STREAMS})")
        previous = None
        for task in queue:
            if task.stream != stream or task.role not in (role, "group"):
                raise ValueError(f"task {task.id} (stream {task.stream}) is queued on {role}/{stream}")
            if task.id in tasks and tasks[task.id] != task:
                raise ValueError(f"two different tasks share the id {task.id}")
            if task.id not in tasks:
                tasks[task.id] = task
                preds[task.id] = list(task.deps)
            if previous is not None:
                preds[task.id].append(previous)
            previous = task.id
    for task_id, ps in preds.items():
        unknown = [p for p in ps if p not in tasks]
        if unknown:
            raise ValueError(f"task {task_id} depends on {unknown}, which no stream runs")
    return tasks, preds


def _topological_order(schedule: Schedule) -> tuple[dict[str, Task], dict[str, list[str]], list[str]]:
    tasks, preds = _schedule_graph(schedule)
    succs: dict[str, list[str]] = {t: [] for t in tasks}
    missing = {t: 0 for t in tasks}
    for t, ps in preds.items():
        for p in ps:
            succs[p].append(t)
            missing[t] += 1
    ready = [t for t in tasks if missing[t] == 0]
    order = []
    while ready:
        t = ready.pop()
        order.append(t)
        for s in succs[t]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    if len(order) != len(tasks):
        stuck = sorted(t for t in tasks if missing[t] > 0)
        raise ValueError(
            f"the schedule deadlocks: {len(stuck)} tasks wait on each other through their "
            f"dependencies and stream order, e.g. {stuck[:6]}"
        )
    return tasks, preds, order


def check_deadlock_free(schedule: Schedule) -> None:
    """Raise ValueError unless every task can run: the graph of dependencies plus in-order stream
    queues (a collective waits for its predecessor on every queue it sits in) has no cycle."""
    _topological_order(schedule)


def simulate_schedule(
    schedule: Schedule, durations: Mapping[str, float] | Callable[[Task], float]
) -> dict[str, tuple[float, float]]:
    """Discrete-event run of ``schedule``: task id -> (start, end) in seconds.

    Streams execute in order, one task at a time; a task starts when all its dependencies have
    ended and it is at the head of every queue it sits in. No other resource is modelled, so the
    start time is exactly the latest end among its predecessors (a longest path in a DAG).
    ``durations``: by task id, or a function of the task.
    """
    tasks, preds, order = _topological_order(schedule)
    duration_of = durations if callable(durations) else (lambda task: durations[task.id])
    return _longest_paths(tasks, preds, order, duration_of)


def _longest_paths(
    tasks: dict[str, Task], preds: dict[str, list[str]], order: list[str], duration_of: Callable[[Task], float]
) -> dict[str, tuple[float, float]]:
    times: dict[str, tuple[float, float]] = {}
    for t in order:
        start = max((times[p][1] for p in preds[t]), default=0.0)
        d = float(duration_of(tasks[t]))
        if not d >= 0:
            raise ValueError(f"duration of {t} must be >= 0 s, got {d!r}")
        times[t] = (start, start + d)
    return times


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
    """Task durations of one iteration under per-layer offload counts.

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
    fraction = {"F": forward_fraction, "B": 1.0 - forward_fraction}

    def duration(task: Task) -> float:
        if task.kind == "A":
            total = t_head if task.layer == shape.num_layers else profile.t_attn_A
        elif task.kind == "E" and task.role == "expert":
            total = (per_rank - offload_chunks_L[task.layer] * n2) * tau_e
        elif task.kind == "E":
            total = offload_chunks_L[task.layer] * n1 * tau_a
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
    offloaded = tuple(l for l, o in enumerate(offload_chunks_L) if o > 0)
    durations = zebra_durations(
        profile, offload_chunks_L, t_comm=t_comm, t_head=t_head, forward_fraction=forward_fraction
    )
    times = _longest_paths(*_compiled_schedule(profile.shape.num_layers, num_microbatches, offloaded), durations)
    return max(end for _, end in times.values())


@lru_cache(maxsize=64)
def _compiled_schedule(
    num_layers: int, num_microbatches: int, offloaded_layers: tuple[int, ...]
) -> tuple[dict[str, Task], dict[str, list[str]], list[str]]:
    """The task graph and a topological order of ``build_schedule``, kept because searches over
    offload vectors simulate the same few schedules many times (read-only; never handed out)."""
    return _topological_order(build_schedule(num_layers, num_microbatches, offloaded_layers))
