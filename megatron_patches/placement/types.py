"""The vocabulary of the placement engine: topology, loads, layouts, placements, dispatch plans.

Every planner in `megatron_patches.placement` consumes and produces these types, and the
runtime modes (FSSDP, replicate, zebra) and the simulator consume them too. They are small
frozen dataclasses around numpy arrays. Each validates its invariants on construction and
raises `PlacementError` naming the offending expert / device / value, so a bad plan fails
where it is made rather than as a hang inside a collective.

Array names carry their shape as a suffix: `_E` experts, `_D` devices, `_L` layers,
`_S` source devices (token origins), `_R` ranks, `_ED` experts x devices, and so on.
Token counts and loads are int64; bandwidths are bytes per second.

Arrays stored in these types are copied on construction and made read-only, so a plan that
was validated cannot be mutated into an invalid one afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_patches.placement import kernels

__all__ = [
    "PlacementError",
    "Topology",
    "ShardLayout",
    "ModelShardLayout",
    "ElementShardLayout",
    "InstancePlacement",
    "DispatchPlan",
    "check_int",
    "check_loads",
    "even_shares",
]


class PlacementError(ValueError):
    """An input or a plan violates an invariant of the placement engine.

    The message names the violating expert, device, layer or value and says what would be
    valid.
    """


def _frozen(arr: np.ndarray) -> bool:
    """Whether `arr` and every array it views are read-only: the planners' convention for an
    array nobody writes again (`check_loads`' own results, `InstancePlacement.trusted`)."""
    while arr is not None:
        if not isinstance(arr, np.ndarray) or arr.flags.writeable:
            return False
        arr = arr.base
    return True


def _frozen_int_array(values, name: str, ndim: int) -> np.ndarray:
    """Copy `values` into a read-only int64 array of `ndim` dimensions; an int64 array that is
    already read-only, with everything it views, is taken as it is (at D = 1,024 and E = 256 a
    layer's source loads are 2 MB, and the planners check them in every call).

    Accepts any integer-valued array-like (ints, integer dtypes, or floats that are whole
    numbers, e.g. loads read back from JSON). Raises PlacementError otherwise.
    """
    arr = np.asarray(values)
    if arr.ndim != ndim:
        raise PlacementError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if arr.dtype == np.int64 and _frozen(arr):
        return arr
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int64)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise PlacementError(f"{name} must hold whole numbers, got non-integer values")
    elif arr.dtype.kind not in "iu":
        raise PlacementError(f"{name} must be an integer array, got dtype {arr.dtype}")
    out = np.array(arr, dtype=np.int64, copy=True)
    out.setflags(write=False)
    return out


def check_loads(loads, name: str = "loads", ndim: int | None = None) -> np.ndarray:
    """Validate token counts and return them as a read-only int64 array.

    Loads are tokens routed to an expert (`loads_E` for one layer, `loads_LE` for all layers,
    `source_loads_DE` split by the device the tokens come from). They must be non-negative
    whole numbers. `ndim`, when given, is the required number of dimensions.
    """
    arr = np.asarray(loads)
    dims = arr.ndim if ndim is None else ndim
    out = _frozen_int_array(arr, name, dims)
    if out.size and out.min() < 0:
        idx = np.unravel_index(int(np.argmin(out)), out.shape)
        raise PlacementError(
            f"{name} must be non-negative token counts, got {int(out[idx])} at index {tuple(int(i) for i in idx)}"
        )
    return out


def check_source_loads(loads, name: str = "source_loads_DE") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`check_loads` of 2-D loads [S, E] (tokens per source and expert), with their column sums
    (tokens per expert, int64 [E]) and row sums (tokens per source, int64 [S]). An array that is
    already checked (read-only int64, C order) is checked and summed in one compiled pass: the
    planners check, sum by expert and sum by source a layer's loads in every call, and at S = 1,024
    and E = 256 numpy's four passes took 0.25 ms."""
    arr = np.asarray(loads)
    if arr.ndim == 2 and arr.dtype == np.int64 and arr.flags.c_contiguous and _frozen(arr):
        least, tokens_E, sent_S = kernels.load_sums(arr)
        if least >= 0:
            return arr, tokens_E, sent_S
    arr = check_loads(arr, name, 2)  # raises, naming the negative entry, or copies
    return arr, arr.sum(axis=0), arr.sum(axis=1)


def check_int(value, name: str, minimum: int = 0) -> int:
    """Return `value` as an int if it is an integer >= minimum, else raise PlacementError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise PlacementError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def even_shares(n_P: np.ndarray, k_P: np.ndarray, offset_P: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split n tokens evenly over k targets, for many pairs at once (no per-token loop).

    Pair p splits n_P[p] tokens over its targets 0..k_P[p]-1: every target gets n // k, and
    the n mod k targets (offset + i) mod k, i < n mod k, get one more. Rotating the remainder
    by a per-pair offset (e.g. the source id) keeps the remainders of different sources from
    all landing on target 0. Requires k >= 1 and 0 <= offset < k.

    Returns:
        (pair_K, target_K, share_K): one entry per target with a non-zero share, i.e.
        min(n, k) entries per pair, all int64.
    """
    q_P = np.minimum(n_P, k_P)
    pair_K = np.repeat(np.arange(n_P.size), q_P)
    i_K = np.arange(pair_K.size) - np.repeat(np.cumsum(q_P) - q_P, q_P)  # index within the pair
    k_K = k_P[pair_K]
    target_K = offset_P[pair_K] + i_K
    target_K -= np.where(target_K >= k_K, k_K, 0)  # offset + i < 2k: one wrap is enough
    quot_P, rem_P = np.divmod(n_P, k_P)
    share_K = quot_P[pair_K] + (i_K < rem_P[pair_K])
    return pair_K, target_K, share_K


@dataclass(frozen=True)
class Topology:
    """The devices taking part in expert placement and the links between them.

    Devices are numbered 0..D-1 node-major: device d sits on node d // devices_per_node,
    which matches the rank order of Slurm / torchrun launches with one process per GPU.
    """

    nodes: int
    """Number of nodes (machines); >= 1."""
    devices_per_node: int
    """Devices (GPUs, or CPU processes in tests) per node; >= 1, the same on every node."""
    intra_node_bw: float
    """Point-to-point bandwidth between two devices of one node, bytes/s; > 0."""
    inter_node_bw: float
    """Point-to-point bandwidth between devices of different nodes, bytes/s; > 0."""
    device_types: tuple[str, ...] | None = None
    """Device type per device (e.g. "A100", "V100"; heterogeneous pools for zebra). `None`
    means every device is "gpu"; after construction this is always a tuple of length D."""
    _node_of: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            object.__setattr__(self, name, check_int(getattr(self, name), f"Topology.{name}", 1))
        for name in ("intra_node_bw", "inter_node_bw"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value) or value <= 0:
                raise PlacementError(f"Topology.{name} must be a positive finite bandwidth in bytes/s, got {value!r}")
            object.__setattr__(self, name, float(value))
        num_devices = self.nodes * self.devices_per_node
        if self.device_types is None:
            types = ("gpu",) * num_devices
        else:
            types = tuple(self.device_types)
            if len(types) != num_devices:
                raise PlacementError(
                    f"Topology.device_types must name one type per device ({num_devices}), got {len(types)}"
                )
            for d, t in enumerate(types):
                if not isinstance(t, str) or not t:
                    raise PlacementError(f"Topology.device_types[{d}] must be a non-empty string, got {t!r}")
        object.__setattr__(self, "device_types", types)
        node_of = np.arange(num_devices, dtype=np.int64) // self.devices_per_node
        node_of.setflags(write=False)
        object.__setattr__(self, "_node_of", node_of)

    @classmethod
    def single_node(cls, devices: int, bw: float = 1e11) -> Topology:
        """One node of `devices` devices, every link at `bw` bytes/s."""
        return cls(nodes=1, devices_per_node=devices, intra_node_bw=bw, inter_node_bw=bw)

    @property
    def num_devices(self) -> int:
        """D = nodes * devices_per_node."""
        return self.nodes * self.devices_per_node

    @property
    def node_of(self) -> np.ndarray:
        """node_of[d] = node index of device d; int64 [D], read-only."""
        return self._node_of

    def check_device(self, device: int, what: str = "device") -> int:
        """Return `device` as an int if it is a valid device id, else raise PlacementError."""
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < self.num_devices:
            raise PlacementError(f"{what} {device!r} is not a device id in [0, {self.num_devices})")
        return int(device)

    def devices_on_node(self, node: int) -> np.ndarray:
        """Device ids of `node`, ascending; int64 [devices_per_node]."""
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or not 0 <= node < self.nodes:
            raise PlacementError(f"node {node!r} is not a node id in [0, {self.nodes})")
        start = int(node) * self.devices_per_node
        return np.arange(start, start + self.devices_per_node, dtype=np.int64)

    def same_node(self, a, b):
        """Whether devices a and b share a node; works elementwise on arrays of device ids."""
        return self._node_of[a] == self._node_of[b]

    def same_node_DD(self) -> np.ndarray:
        """Boolean [D, D] matrix: entry (a, b) is True when a and b share a node."""
        return self._node_of[:, None] == self._node_of[None, :]

    def bandwidth(self, a: int, b: int) -> float:
        """Bandwidth of the link a -> b in bytes/s (intra- or inter-node)."""
        return self.intra_node_bw if self.same_node(a, b) else self.inter_node_bw


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """Expert-granular ownership of one MoE layer (FSSDP's sharded placement P).

    Each expert's master weights and optimizer state live on exactly one owner device; a
    device may own any number of experts of a layer (0..E), which is what heterogeneous
    sharding (DESIGN 4.3) needs. "Owned exactly once" holds by construction: there is one
    owner per expert.
    """

    owner_E: np.ndarray
    """owner_E[e] = device that owns expert e; int64 [E], each in [0, num_devices)."""
    num_devices: int
    """D, the number of devices the layer is sharded over; >= 1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_devices", check_int(self.num_devices, "ShardLayout.num_devices", 1))
        owner_E = _frozen_int_array(self.owner_E, "ShardLayout.owner_E", 1)
        if owner_E.size == 0:
            raise PlacementError("ShardLayout.owner_E must list at least one expert")
        bad = np.flatnonzero((owner_E < 0) | (owner_E >= self.num_devices))
        if bad.size:
            e = int(bad[0])
            raise PlacementError(
                f"expert {e} is owned by device {int(owner_E[e])}, which is not in [0, {self.num_devices})"
            )
        object.__setattr__(self, "owner_E", owner_E)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardLayout):
            return NotImplemented
        return self.num_devices == other.num_devices and np.array_equal(self.owner_E, other.owner_E)

    @classmethod
    def even(cls, num_experts: int, num_devices: int) -> ShardLayout:
        """Megatron EP's static layout: contiguous blocks of experts per device.

        Device d owns experts [start_d, start_d + size_d) with sizes as in np.array_split:
        the first E mod D devices own one expert more. With E < D the last D - E devices own
        nothing.
        """
        if num_experts < 1 or num_devices < 1:
            raise PlacementError(f"need >= 1 expert and >= 1 device, got E={num_experts}, D={num_devices}")
        sizes = np.full(num_devices, num_experts // num_devices, dtype=np.int64)
        sizes[: num_experts % num_devices] += 1
        return cls(np.repeat(np.arange(num_devices, dtype=np.int64), sizes), num_devices)

    @property
    def num_experts(self) -> int:
        """E, the number of experts in the layer."""
        return int(self.owner_E.size)

    def experts_of(self, device: int) -> np.ndarray:
        """Experts owned by `device`, ascending; int64."""
        return np.flatnonzero(self.owner_E == device).astype(np.int64)

    def counts_D(self) -> np.ndarray:
        """Number of experts owned per device; int64 [D]."""
        return np.bincount(self.owner_E, minlength=self.num_devices).astype(np.int64)

    def holds_ED(self, dtype=np.int64) -> np.ndarray:
        """One-hot ownership matrix, int64 [E, D] (1 where the device owns the expert), or of
        `dtype` (bool for the planners)."""
        out = np.zeros((self.num_experts, self.num_devices), dtype=dtype)
        out[np.arange(self.num_experts), self.owner_E] = 1
        return out


@dataclass(frozen=True, eq=False)
class ModelShardLayout:
    """Expert-granular ownership of all MoE layers at once (heterogeneous sharding, DESIGN 4.3).

    Memory balance is a property of the whole model: a device may own many experts of one
    layer and none of another as long as its total matches the others'.
    """

    owners_LE: np.ndarray
    """owners_LE[l, e] = device owning expert e of layer l; int64 [L, E]."""
    num_devices: int
    """D, the number of devices; >= 1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_devices", check_int(self.num_devices, "ModelShardLayout.num_devices", 1))
        owners = _frozen_int_array(self.owners_LE, "ModelShardLayout.owners_LE", 2)
        if owners.size == 0:
            raise PlacementError(f"ModelShardLayout.owners_LE must have >= 1 layer and >= 1 expert, got shape {owners.shape}")
        bad = np.argwhere((owners < 0) | (owners >= self.num_devices))
        if bad.size:
            l, e = (int(i) for i in bad[0])
            raise PlacementError(
                f"layer {l} expert {e} is owned by device {int(owners[l, e])}, which is not in [0, {self.num_devices})"
            )
        object.__setattr__(self, "owners_LE", owners)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelShardLayout):
            return NotImplemented
        return self.num_devices == other.num_devices and np.array_equal(self.owners_LE, other.owners_LE)

    @classmethod
    def even(cls, num_layers: int, num_experts: int, num_devices: int) -> ModelShardLayout:
        """Every layer with ShardLayout.even's contiguous-block layout."""
        if num_layers < 1:
            raise PlacementError(f"need >= 1 layer, got L={num_layers}")
        one = ShardLayout.even(num_experts, num_devices).owner_E
        return cls(np.tile(one, (num_layers, 1)), num_devices)

    @property
    def num_layers(self) -> int:
        """L."""
        return int(self.owners_LE.shape[0])

    @property
    def num_experts(self) -> int:
        """E, experts per layer."""
        return int(self.owners_LE.shape[1])

    def layer(self, layer: int) -> ShardLayout:
        """The ShardLayout of one layer."""
        if not 0 <= layer < self.num_layers:
            raise PlacementError(f"layer {layer} is not in [0, {self.num_layers})")
        return ShardLayout(self.owners_LE[layer], self.num_devices)

    def counts_LD(self) -> np.ndarray:
        """Experts owned per layer and device; int64 [L, D]."""
        L, D = self.num_layers, self.num_devices
        flat = (np.arange(L, dtype=np.int64)[:, None] * D + self.owners_LE).ravel()
        return np.bincount(flat, minlength=L * D).reshape(L, D).astype(np.int64)

    def counts_D(self) -> np.ndarray:
        """Experts owned per device over all layers (the memory-balance measure); int64 [D]."""
        return np.bincount(self.owners_LE.ravel(), minlength=self.num_devices).astype(np.int64)


@dataclass(frozen=True)
class ElementShardLayout:
    """Uniform element-granular partition of a flat buffer over devices (replicate mode).

    In replicate mode every expert's flattened master weights and optimizer state are split
    the same way: rank r owns slice r of every expert. Slices follow np.array_split: the
    first (num_elements mod num_devices) ranks get one element more, so sizes differ by at
    most one and every rank has a (possibly empty) slice. (torch.chunk differs: it uses
    ceil-sized chunks and may return fewer than D chunks, leaving trailing ranks without
    a slice, which would break "rank r owns slice r".)
    """

    num_elements: int
    """N, elements in the flat buffer (e.g. parameters of one expert); >= 0."""
    num_devices: int
    """D, number of ranks sharing the buffer; >= 1."""

    def __post_init__(self) -> None:
        for name, low in (("num_elements", 0), ("num_devices", 1)):
            object.__setattr__(self, name, check_int(getattr(self, name), f"ElementShardLayout.{name}", low))

    def sizes_D(self) -> np.ndarray:
        """Elements per rank; int64 [D]."""
        sizes = np.full(self.num_devices, self.num_elements // self.num_devices, dtype=np.int64)
        sizes[: self.num_elements % self.num_devices] += 1
        return sizes

    def offsets(self) -> np.ndarray:
        """Slice boundaries; int64 [D + 1]: rank r owns [offsets[r], offsets[r+1])."""
        return np.concatenate(([0], np.cumsum(self.sizes_D()))).astype(np.int64)

    def bounds(self, rank: int) -> tuple[int, int]:
        """(start, end) of rank's slice, end exclusive."""
        if not 0 <= rank < self.num_devices:
            raise PlacementError(f"rank {rank} is not in [0, {self.num_devices})")
        q, rem = divmod(self.num_elements, self.num_devices)
        start = rank * q + min(rank, rem)
        return start, start + q + (1 if rank < rem else 0)

    def owner_of(self, element: int) -> int:
        """Rank owning flat element index `element`."""
        if not 0 <= element < self.num_elements:
            raise PlacementError(f"element {element} is not in [0, {self.num_elements})")
        return int(np.searchsorted(self.offsets(), element, side="right") - 1)


@dataclass(frozen=True, eq=False)
class InstancePlacement:
    """Which device holds a usable copy of which expert in one layer and iteration.

    A multiset of (expert, device) pairs stored as counts: in replicate mode a rank's slots may
    hold the same expert more than once, so counts can exceed 1; FSSDP placements are 0/1.
    Every expert must have at least one instance, or its tokens would have nowhere to go.
    """

    counts_ED: np.ndarray
    """counts_ED[e, d] = number of instances (slots) of expert e on device d; int64 [E, D], >= 0."""

    def __post_init__(self) -> None:
        counts = _frozen_int_array(self.counts_ED, "InstancePlacement.counts_ED", 2)
        E, D = counts.shape
        if E < 1 or D < 1:
            raise PlacementError(f"InstancePlacement needs >= 1 expert and >= 1 device, got shape {counts.shape}")
        neg = np.argwhere(counts < 0)
        if neg.size:
            e, d = (int(i) for i in neg[0])
            raise PlacementError(f"expert {e} has {int(counts[e, d])} instances on device {d}; counts must be >= 0")
        missing = np.flatnonzero(counts.sum(axis=1) == 0)
        if missing.size:
            raise PlacementError(
                f"expert {int(missing[0])} has no instance on any device "
                f"({missing.size} expert(s) unreachable: {missing[:8].tolist()}); every expert needs >= 1"
            )
        object.__setattr__(self, "counts_ED", counts)

    @classmethod
    def trusted(cls, holds_ED: np.ndarray) -> InstancePlacement:
        """Wrap a planner's 0/1 holdings (bool [E, D], every expert held somewhere) without
        validating or copying them; the array is made read-only and must not be written again.

        For planners whose output is valid by construction (tests check every plan): at E = 256,
        D = 1,024 validation costs about as much as planning a layer (tools/bench_planners.py).
        `counts_ED` is built from it on first use; `holds_ED()` answers from it directly.
        """
        holds_ED.setflags(write=False)
        placement = object.__new__(cls)
        object.__setattr__(placement, "_holds_ED", holds_ED)
        return placement

    def __getattr__(self, name: str):
        # counts_ED of a `trusted` placement, built once when first asked for
        if name == "counts_ED" and "_holds_ED" in self.__dict__:
            counts = self.__dict__["_holds_ED"].astype(np.int64)
            counts.setflags(write=False)
            object.__setattr__(self, "counts_ED", counts)
            return counts
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InstancePlacement):
            return NotImplemented
        return np.array_equal(self.counts_ED, other.counts_ED)

    @classmethod
    def from_shard(cls, shard: ShardLayout) -> InstancePlacement:
        """The placement in which each expert lives only on its owner (P = the shard layout)."""
        return cls(shard.holds_ED())

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self._shape()[0])

    @property
    def num_devices(self) -> int:
        """D."""
        return int(self._shape()[1])

    def _shape(self) -> tuple[int, int]:
        holds = self.__dict__.get("_holds_ED")
        return (holds if holds is not None else self.counts_ED).shape

    def holds_ED(self) -> np.ndarray:
        """Boolean [E, D]: device d holds at least one instance of expert e (a fresh array)."""
        return self.held_ED().copy()

    def held_ED(self) -> np.ndarray:
        """`holds_ED()` read-only, without a copy where the placement keeps one (`trusted`): the
        planners read it several times per layer, and at E = 256, D = 1,024 each copy costs as
        much as the compiled step that reads it."""
        holds = self.__dict__.get("_holds_ED")
        if holds is None:
            holds = self.counts_ED > 0
            holds.setflags(write=False)
        return holds

    def holders(self, expert: int) -> np.ndarray:
        """Devices holding expert `expert`, ascending; int64."""
        if not 0 <= expert < self.num_experts:
            raise PlacementError(f"expert {expert} is not in [0, {self.num_experts})")
        return np.flatnonzero(self.counts_ED[expert]).astype(np.int64)

    def replicas_E(self) -> np.ndarray:
        """Number of distinct devices holding each expert; int64 [E]."""
        return (self.counts_ED > 0).sum(axis=1).astype(np.int64)

    def instances_E(self) -> np.ndarray:
        """Number of instances (slots) per expert, counting multiplicity; int64 [E]."""
        return self.counts_ED.sum(axis=1)

    def slots_used_D(self) -> np.ndarray:
        """Instances per device, counting multiplicity; int64 [D]."""
        return self.counts_ED.sum(axis=0)

    def _check_shard_shape(self, shard: ShardLayout) -> None:
        if shard.num_experts != self.num_experts or shard.num_devices != self.num_devices:
            raise PlacementError(
                f"shard layout has E={shard.num_experts}, D={shard.num_devices} but the placement has "
                f"E={self.num_experts}, D={self.num_devices}"
            )

    def contains(self, shard: ShardLayout) -> bool:
        """Whether every expert is present on its owner (placement ⊇ shard layout)."""
        self._check_shard_shape(shard)
        return bool(np.all(self.counts_ED[np.arange(self.num_experts), shard.owner_E] > 0))

    def require_contains(self, shard: ShardLayout) -> None:
        """Raise PlacementError naming the first expert whose owner holds no instance of it."""
        self._check_shard_shape(shard)
        lacking = np.flatnonzero(~self.held_ED()[np.arange(self.num_experts), shard.owner_E])
        if lacking.size:
            e = int(lacking[0])
            raise PlacementError(
                f"expert {e} is not held by its owner device {int(shard.owner_E[e])}; a placement must contain its shard layout"
            )

    def extra_copies_D(self, shard: ShardLayout) -> np.ndarray:
        """Copies per device beyond the experts it owns (FSSDP's materialized copies); int64 [D].

        Counts distinct experts held but not owned; requires the placement to contain `shard`.
        """
        self.require_contains(shard)
        return self.held_ED().sum(axis=0) - shard.counts_D()

    def check_slot_limit(self, slots_per_device) -> None:
        """Raise PlacementError naming a device holding more instances than its slot limit.

        `slots_per_device` is an int (same limit everywhere) or an int array [D].
        """
        limit_D = np.broadcast_to(np.asarray(slots_per_device, dtype=np.int64), (self.num_devices,))
        used_D = self.slots_used_D()
        over = np.flatnonzero(used_D > limit_D)
        if over.size:
            d = int(over[0])
            raise PlacementError(f"device {d} holds {int(used_D[d])} expert instances but has only {int(limit_D[d])} slots")

    def check_extra_limit(self, shard: ShardLayout, max_extra) -> None:
        """Raise PlacementError naming a device with more extra copies than `max_extra` (int or [D])."""
        limit_D = np.broadcast_to(np.asarray(max_extra, dtype=np.int64), (self.num_devices,))
        extra_D = self.extra_copies_D(shard)
        over = np.flatnonzero(extra_D > limit_D)
        if over.size:
            d = int(over[0])
            raise PlacementError(
                f"device {d} holds {int(extra_D[d])} extra expert copies but its memory capacity is {int(limit_D[d])}"
            )


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Where the tokens of one layer go: per source device and expert, tokens per destination.

    Stored sparsely as parallel arrays of (source, expert, destination, tokens) entries,
    because the dense [S, E, D] tensor is too large at scale (S = D = 1024, E = 256 would be
    2 GiB of int64) while a plan has only a few entries per (source, expert). Entries may come
    in any order and may carry 0 tokens; the same (source, expert, destination) may appear
    more than once, in which case the counts add up. `to_dense()` / `from_dense()` convert for small cases and tests.

    Sources are the devices the tokens sit on after the router (usually the same D devices
    that hold experts; zebra's attention ranks are a different set, hence a separate S).
    """

    source_K: np.ndarray
    """Source device of each entry; int64 [K], in [0, num_sources)."""
    expert_K: np.ndarray
    """Expert of each entry; int64 [K], in [0, num_experts)."""
    dest_K: np.ndarray
    """Destination device (the instance holder that processes the tokens); int64 [K], in [0, num_devices)."""
    tokens_K: np.ndarray
    """Tokens of the entry; int64 [K], >= 0."""
    num_sources: int
    """S, number of token sources."""
    num_experts: int
    """E, number of experts in the layer."""
    num_devices: int
    """D, number of devices that can hold expert instances."""

    def __post_init__(self) -> None:
        for name in ("num_sources", "num_experts", "num_devices"):
            object.__setattr__(self, name, check_int(getattr(self, name), f"DispatchPlan.{name}", 1))
        arrays = {}
        for name, bound in (("source_K", self.num_sources), ("expert_K", self.num_experts), ("dest_K", self.num_devices)):
            arr = _frozen_int_array(getattr(self, name), f"DispatchPlan.{name}", 1)
            bad = np.flatnonzero((arr < 0) | (arr >= bound))
            if bad.size:
                raise PlacementError(f"DispatchPlan.{name}[{int(bad[0])}] = {int(arr[bad[0]])} is not in [0, {bound})")
            arrays[name] = arr
        arrays["tokens_K"] = check_loads(self.tokens_K, "DispatchPlan.tokens_K", 1)
        lengths = {name: arr.size for name, arr in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise PlacementError(f"DispatchPlan entry arrays must have equal lengths, got {lengths}")
        for name, arr in arrays.items():
            object.__setattr__(self, name, arr)

    @classmethod
    def trusted(cls, source_K, expert_K, dest_K, tokens_K, num_sources, num_experts, num_devices) -> DispatchPlan:
        """Wrap entry arrays without validating or copying them (they are made read-only).

        For planners whose output is valid by construction and large (validation and copies
        would cost as much as planning). The arrays must be fresh int64 arrays the caller no
        longer writes to.
        """
        plan = object.__new__(cls)
        for name, arr in (("source_K", source_K), ("expert_K", expert_K), ("dest_K", dest_K), ("tokens_K", tokens_K)):
            arr.setflags(write=False)
            object.__setattr__(plan, name, arr)
        object.__setattr__(plan, "num_sources", int(num_sources))
        object.__setattr__(plan, "num_experts", int(num_experts))
        object.__setattr__(plan, "num_devices", int(num_devices))
        return plan

    @classmethod
    def by_owner(cls, loads_SE: np.ndarray, dest_E: np.ndarray, grid_E: np.ndarray, tokens_E: np.ndarray,
                 rep: np.ndarray, quota_RD: np.ndarray, node_start: np.ndarray, num_devices: int,
                 sent_S: np.ndarray | None = None) -> DispatchPlan:
        """`dispatch`'s plan, kept in the form it is decided in, without validation or copies (the
        arrays must be int64, grid_E bool, and no longer written to; S = D):

        - every source sends all its tokens of each expert e with grid_E[e] to dest_E[e]
          (`tokens_E` is loads_SE's column sums);
        - the tokens of the replicated experts rep[r] fill their holders' quotas quota_RD[r]
          as `kernels.route_replicated` routes them (devices node-major, node n spanning
          node_start[n]:node_start[n + 1]).

        At S = D = 1,024 and E = 256 its entries are a quarter of a million (single-holder
        experts) plus about R x D pieces (R replicated experts), whose construction alone would
        cost more than planning the layer, while the runtime asks one source's row
        (`tokens_from_source`) and per-device totals (`device_loads_D`, `remote_tokens`,
        `link_tokens`, `instances_with_tokens_D`), which this form answers from the loads and
        the quotas (the quotas are filled exactly: the loads per device are the quotas'
        sums) or one walk without writes. The entry arrays are built on first access: every
        (source, expert) pair in source-major order, the experts outside the grid with 0
        tokens, then the pieces. `sent_S`: loads_SE's row sums, when the caller has them (`link_tokens`
        reads them; built on first use otherwise).
        """
        plan = object.__new__(cls)
        for name, arr in (("loads_SE", loads_SE), ("dest_E", dest_E), ("grid_E", grid_E), ("tokens_E", tokens_E),
                          ("rep", rep), ("quota_RD", quota_RD), ("node_start", node_start)):
            arr.setflags(write=False)
            object.__setattr__(plan, f"_{name}", arr)
        if sent_S is not None:
            sent_S.setflags(write=False)
            object.__setattr__(plan, "_sent_S", sent_S)
        S, E = loads_SE.shape
        object.__setattr__(plan, "num_sources", int(S))
        object.__setattr__(plan, "num_experts", int(E))
        object.__setattr__(plan, "num_devices", int(num_devices))
        return plan

    def __getattr__(self, name: str):
        # the entry arrays of a `by_owner` plan, built once when first asked for
        if name in ("source_K", "expert_K", "dest_K", "tokens_K") and "_loads_SE" in self.__dict__:
            for key, arr in zip(("source_K", "expert_K", "dest_K", "tokens_K"), self._owner_entries()):
                arr.setflags(write=False)
                object.__setattr__(self, key, arr)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def by_owner_form(self) -> bool:
        """Whether the plan is kept in `by_owner`'s form."""
        return "_loads_SE" in self.__dict__

    def _pieces(self, only_source: int = -1) -> np.ndarray:
        """The replicated experts' pieces of a `by_owner` plan (source, expert, destination,
        tokens; int64 [4, K]), or only those from `only_source`."""
        d = self.__dict__
        return kernels.route_replicated(d["_loads_SE"], d["_rep"], d["_quota_RD"], d["_node_start"], only_source)

    def _owner_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        d = self.__dict__
        S, E = self.num_sources, self.num_experts
        G = S * E
        source_P, expert_P, dest_P, tokens_P = self._pieces()
        K = G + source_P.size
        source_K = np.empty(K, dtype=np.int64)
        expert_K = np.empty(K, dtype=np.int64)
        dest_K = np.empty(K, dtype=np.int64)
        tokens_K = np.empty(K, dtype=np.int64)
        source_K[:G].reshape(S, E)[:] = np.arange(S, dtype=np.int64)[:, None]
        expert_K[:G].reshape(S, E)[:] = np.arange(E, dtype=np.int64)
        dest_K[:G].reshape(S, E)[:] = d["_dest_E"]
        grid_tokens = tokens_K[:G].reshape(S, E)
        grid_tokens[:] = d["_loads_SE"]
        grid_tokens[:, ~d["_grid_E"]] = 0
        source_K[G:], expert_K[G:], dest_K[G:], tokens_K[G:] = source_P, expert_P, dest_P, tokens_P
        return source_K, expert_K, dest_K, tokens_K

    def _grid_tokens_E(self) -> np.ndarray:
        """Tokens per expert sent by the grid (0 for the replicated experts); int64 [E]."""
        return np.where(self.__dict__["_grid_E"], self.__dict__["_tokens_E"], 0)

    def remote_tokens(self) -> int:
        """Tokens sent to another device than their source (S = D)."""
        if not self.by_owner_form:
            return int(self.tokens_K[self.source_K != self.dest_K].sum())
        d = self.__dict__
        grid, rep = np.flatnonzero(d["_grid_E"]), d["_rep"]
        kept = d["_loads_SE"][d["_dest_E"][grid], grid]  # what each grid expert's owner routed to itself
        # a replicated expert's source keeps up to its quota of its own tokens, the rest moves
        kept_rep = np.minimum(d["_loads_SE"][:, rep].T, d["_quota_RD"])
        return int(self._grid_tokens_E().sum() - kept.sum() + d["_tokens_E"][rep].sum() - kept_rep.sum())

    def link_tokens(self, node_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tokens (sent within the node, sent to other nodes) per source and (received within the
        node, from other nodes) per device, transfers to self excluded; four int64 arrays, the
        devices' node ids `node_of` [D] (S = D)."""
        if not self.by_owner_form:
            return tuple(kernels.link_sums(self.source_K, self.dest_K, self.tokens_K.astype(np.float64),
                                           np.asarray(node_of, dtype=np.int64)).astype(np.int64))
        d = self.__dict__
        if "_sent_S" not in d:
            object.__setattr__(self, "_sent_S", d["_loads_SE"].sum(axis=1))
        return tuple(kernels.owner_link_tokens(d["_loads_SE"], d["_sent_S"], d["_dest_E"], d["_grid_E"],
                                               d["_tokens_E"], d["_rep"], d["_quota_RD"], d["_node_start"],
                                               np.asarray(node_of, dtype=np.int64)))

    def source_row(self, source: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(expert, destination, tokens) of the entries from `source`; int64 arrays."""
        if not self.by_owner_form:
            mine = self.source_K == source
            return self.expert_K[mine], self.dest_K[mine], self.tokens_K[mine]
        d = self.__dict__
        grid = np.flatnonzero(d["_grid_E"])
        _, expert_P, dest_P, tokens_P = self._pieces(source)
        return (np.concatenate((grid, expert_P)), np.concatenate((d["_dest_E"][grid], dest_P)),
                np.concatenate((d["_loads_SE"][source, grid], tokens_P)))

    def instances_with_tokens_D(self) -> np.ndarray:
        """Distinct experts per device that receive at least one token; int64 [D]."""
        D = self.num_devices
        if not self.by_owner_form:
            busy = self.tokens_K > 0
            pairs = np.unique(self.expert_K[busy] * D + self.dest_K[busy])
            return np.bincount(pairs % D, minlength=D)
        d = self.__dict__
        grid_busy = d["_grid_E"] & (d["_tokens_E"] > 0)
        # a holder of a replicated expert receives exactly its quota
        return np.bincount(d["_dest_E"][grid_busy], minlength=D) + np.count_nonzero(d["_quota_RD"], axis=0)

    @classmethod
    def from_dense(cls, tokens_SED) -> DispatchPlan:
        """Build a plan from a dense int array [S, E, D] of tokens (non-zero entries only)."""
        tokens_SED = check_loads(tokens_SED, "tokens_SED", 3)
        S, E, D = tokens_SED.shape
        s, e, d = np.nonzero(tokens_SED)
        return cls(s, e, d, tokens_SED[s, e, d], S, E, D)

    def to_dense(self) -> np.ndarray:
        """Dense tokens [S, E, D]; int64. Only for small plans (tests, examples)."""
        out = np.zeros((self.num_sources, self.num_experts, self.num_devices), dtype=np.int64)
        np.add.at(out, (self.source_K, self.expert_K, self.dest_K), self.tokens_K)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DispatchPlan):
            return NotImplemented
        shape = (self.num_sources, self.num_experts, self.num_devices)
        if shape != (other.num_sources, other.num_experts, other.num_devices):
            return False
        return self._canonical() == other._canonical()

    def _canonical(self) -> tuple[bytes, bytes]:
        """Flat (s, e, d) keys with summed non-zero tokens, sorted: equal for equal plans."""
        keys = (self.source_K * self.num_experts + self.expert_K) * self.num_devices + self.dest_K
        uniq, inverse = np.unique(keys, return_inverse=True)
        sums = np.bincount(inverse, weights=self.tokens_K, minlength=uniq.size).astype(np.int64)
        keep = sums > 0
        return uniq[keep].tobytes(), sums[keep].tobytes()

    def _sum_by(self, index_K: np.ndarray, size: int, tokens_K: np.ndarray | None = None) -> np.ndarray:
        # bincount with float weights is exact for token counts below 2**53
        weights = self.tokens_K if tokens_K is None else tokens_K
        return np.bincount(index_K, weights=weights, minlength=size).astype(np.int64)

    def routed_SE(self) -> np.ndarray:
        """Tokens per (source, expert) the plan accounts for; int64 [S, E]."""
        flat = self._sum_by(self.source_K * self.num_experts + self.expert_K, self.num_sources * self.num_experts)
        return flat.reshape(self.num_sources, self.num_experts)

    def received_ED(self) -> np.ndarray:
        """Tokens per (expert, destination device); int64 [E, D]."""
        if self.by_owner_form:  # the grid experts' tokens at their holder, the quotas elsewhere
            d = self.__dict__
            out = np.zeros((self.num_experts, self.num_devices), dtype=np.int64)
            grid = np.flatnonzero(d["_grid_E"])
            out[grid, d["_dest_E"][grid]] = d["_tokens_E"][grid]
            out[d["_rep"]] = d["_quota_RD"]
            return out
        flat = self._sum_by(self.expert_K * self.num_devices + self.dest_K, self.num_experts * self.num_devices)
        return flat.reshape(self.num_experts, self.num_devices)

    def device_loads_D(self) -> np.ndarray:
        """Tokens processed per device (DESIGN 5's device load); int64 [D]."""
        if not self.by_owner_form:
            return self._sum_by(self.dest_K, self.num_devices)
        d = self.__dict__
        return self._sum_by(d["_dest_E"], self.num_devices, self._grid_tokens_E()) + d["_quota_RD"].sum(axis=0)

    def traffic_SD(self) -> np.ndarray:
        """Tokens sent from each source to each destination (including to itself); int64 [S, D]."""
        if self.by_owner_form and "source_K" not in self.__dict__:
            d = self.__dict__
            grid = np.flatnonzero(d["_grid_E"])
            source_P, _, dest_P, tokens_P = self._pieces()
            return kernels.owner_traffic(d["_loads_SE"], grid, d["_dest_E"][grid], source_P, dest_P, tokens_P,
                                         self.num_devices)
        flat = self._sum_by(self.source_K * self.num_devices + self.dest_K, self.num_sources * self.num_devices)
        return flat.reshape(self.num_sources, self.num_devices)

    def check(self, placement: InstancePlacement, source_loads_SE) -> None:
        """Raise PlacementError unless the plan is consistent with a placement and the loads.

        Checks: shapes agree; tokens only go to devices holding the expert; for every
        (source, expert) the plan dispatches exactly the routed tokens.
        """
        source_loads_SE = check_loads(source_loads_SE, "source_loads_SE", 2)
        S, E, D = self.num_sources, self.num_experts, self.num_devices
        if placement.counts_ED.shape != (E, D):
            raise PlacementError(
                f"dispatch plan covers E={E}, D={D} but the placement has shape {placement.counts_ED.shape}"
            )
        if source_loads_SE.shape != (S, E):
            raise PlacementError(
                f"dispatch plan has S={S} sources and E={E} experts but source loads have shape {source_loads_SE.shape}"
            )
        stray = np.flatnonzero((self.tokens_K > 0) & (placement.counts_ED[self.expert_K, self.dest_K] == 0))
        if stray.size:
            k = int(stray[0])
            s, e, d = int(self.source_K[k]), int(self.expert_K[k]), int(self.dest_K[k])
            raise PlacementError(
                f"{int(self.tokens_K[k])} tokens of expert {e} from source {s} go to device {d}, "
                f"which holds no instance of expert {e} (holders: {placement.holders(e).tolist()})"
            )
        routed_SE = self.routed_SE()
        mismatch = np.argwhere(routed_SE != source_loads_SE)
        if mismatch.size:
            s, e = (int(i) for i in mismatch[0])
            raise PlacementError(
                f"source {s} routes {int(source_loads_SE[s, e])} tokens to expert {e} but the plan dispatches "
                f"{int(routed_SE[s, e])}"
            )
