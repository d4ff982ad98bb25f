"""Zebra planning, part 1: the model/group shape (ZebraShape), the profiled per-micro-batch
times and memory bounds (ZebraProfile, DeviceProfile) and the profile file format the
profiler merges into, one entry per device type."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Mapping

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
    """N: expert ranks per ZP group, N <= n; the n experts of a layer are split over them in
    contiguous blocks as even as possible (the first n mod N ranks hold one more). The runtime
    and Asym-EA need N to divide n; plain zebra (the simulator's) does not."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "attention_ranks", "expert_ranks"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ZebraShape.{name} must be an integer >= 1, got {value!r}")
        if self.expert_ranks > self.num_experts:
            raise ValueError(
                f"expert_ranks={self.expert_ranks} exceeds num_experts={self.num_experts}: every expert rank "
                f"must hold at least one expert per layer (valid expert_ranks: 1..{self.num_experts})"
            )

    @property
    def experts_per_expert_rank(self) -> int:
        """The most experts of one layer one expert rank holds before any offloading: n/N when N
        divides n, else ceil(n/N) (the busiest rank's, which sizes memory and the E task)."""
        return -(-self.num_experts // self.expert_ranks)

    @property
    def expert_block_starts(self) -> np.ndarray:
        """First expert of every expert rank's contiguous block, and n at the end; int64 [N + 1]."""
        q, r = divmod(self.num_experts, self.expert_ranks)
        sizes_N = np.full(self.expert_ranks, q, dtype=np.int64)
        sizes_N[:r] += 1
        return np.concatenate([[0], np.cumsum(sizes_N)]).astype(np.int64)

    def to_dict(self) -> dict:
        return asdict(self)


def chunk_sizes(shape: ZebraShape) -> tuple[int, int]:
    """(n1, n2): experts each attention GPU takes and each expert GPU gives per offloaded chunk.

    n1 = max(1, N/M), n2 = n1*M/N, so M*n1 == N*n2 experts move per chunk. Needs M | N or N | M,
    and N | n (every expert rank gives the same chunks from an equal block).
    """
    m, n = shape.attention_ranks, shape.expert_ranks
    if shape.num_experts % n != 0:
        raise ValueError(
            f"Asym-EA needs expert_ranks N={n} to divide num_experts={shape.num_experts} (equal blocks to give "
            f"chunks from; valid N: divisors of {shape.num_experts}); plain zebra (off) takes uneven blocks"
        )
    if n % m != 0 and m % n != 0:
        raise ValueError(
            f"Asym-EA needs attention_ranks M={m} to divide expert_ranks N={n} or N to divide M "
            "(whole experts per chunk on both sides)"
        )
    n1 = max(1, n // m)
    n2 = n1 * m // n
    return n1, n2


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
