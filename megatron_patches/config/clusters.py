"""Cluster configurations: the YAML files under configs/clusters/ and their loader.

A cluster is a list of node groups (how many nodes, GPUs per node, which GPU type, the links
inside and out of each node) plus a table of GPU types with their published figures. Devices
are numbered node-major in the order the groups are listed, which is the rank order of a
Slurm / torchrun launch with one process per GPU; heterogeneous (zebra) pools list the
attention GPUs' group first.

`ClusterConfig.to_topology()` gives the placement engine's `Topology`. The simulator and the
profiler read the GPU-type figures (memory, peak FP16 / FP32 / TF32 rates, memory bandwidth,
FlashAttention and bf16 support) for their cost models. `peak_fp32_tflops`, `peak_tf32_tflops`
and `bf16` are optional keys: every file under configs/clusters states them, but a cluster
written for a launcher test need not; the simulator refuses a precision whose figure is
missing and names the file and key to add.

Units are in the key names: `_gb` gigabytes (1e9 bytes), `_gb_s` gigabytes per second,
`_gbps` gigabits per second, `_tflops` 1e12 FLOP/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Union

from megatron_patches.config.models import CONFIGS_DIR, ConfigError, read_yaml_mapping, resolve_config_path
from megatron_patches.placement.types import Topology

__all__ = [
    "GpuType",
    "NodeGroup",
    "ClusterConfig",
    "CLUSTERS_DIR",
    "available_clusters",
    "load_cluster_config",
    "cluster_config_from_dict",
]

CLUSTERS_DIR = CONFIGS_DIR / "clusters"
"""Where `load_cluster_config(name)` looks for `<name>.yaml`."""


@dataclass(frozen=True)
class GpuType:
    """Published figures of one accelerator model (or of one CPU rank for local runs)."""

    name: str
    """Key of this type in the cluster's gpu_types table, e.g. "V100-SXM2-32GB"."""
    memory_gb: float
    """Device memory, GB."""
    peak_fp16_tflops: float
    """Dense (no sparsity) FP16 tensor-core peak, TFLOP/s; used for MFU and compute cost models."""
    hbm_gb_s: float
    """Device memory bandwidth, GB/s (HBM or GDDR)."""
    flash_attention: bool
    """Whether FlashAttention-2 / fused attention kernels run on it (Ampere, sm80, or newer)."""
    source: str
    """Where the figures are published (datasheet name), or how they were measured."""
    peak_fp32_tflops: float | None = None
    """Dense FP32 peak without tensor cores (CUDA-core FMA), TFLOP/s; None when the file does
    not state it."""
    peak_tf32_tflops: float | None = None
    """Dense TF32 tensor-core peak (Ampere and newer), TFLOP/s; None on GPUs without TF32
    tensor cores (Volta, Turing) or when the file does not state it."""
    bf16: bool | None = None
    """Whether the GPU computes in bfloat16 natively (tensor cores with bf16 inputs: Ampere,
    sm80, and newer); None when the file does not state it."""
    memory_efficient_attention: bool = False
    """Whether the systems simulated on it run a memory-efficient attention kernel where flash
    does not run (xFormers' CUTLASS kernel, PyTorch SDPA's efficient backend: sm50 and newer,
    fp16 and fp32): attention then keeps no scores, at the unfused path's time. A choice of
    the paper whose systems the file describes, not a datasheet figure: Megatron-Core's own
    attention on such GPUs is unfused."""


@dataclass(frozen=True)
class NodeGroup:
    """`count` identical nodes of the cluster."""

    count: int
    """Number of nodes in this group; >= 1."""
    gpus_per_node: int
    """Devices used per node; >= 1."""
    gpu: str
    """GPU type of every device of these nodes; a key of the cluster's gpu_types."""
    intra_node_bw_gb_s: float
    """Bandwidth between the devices of one node, per device and per direction, GB/s
    (half of NVIDIA's bidirectional NVLink figures)."""
    intra_node_link: str
    """What that link is, e.g. "NVLink 2.0" or "PCIe 4.0 x16"."""
    inter_node_gbps: float
    """NIC line rate per node and per direction, Gbit/s; shared by the node's devices."""

    @property
    def num_devices(self) -> int:
        """count x gpus_per_node."""
        return self.count * self.gpus_per_node


@dataclass(frozen=True)
class ClusterConfig:
    """A cluster: node groups in device order and the GPU types they use."""

    name: str
    """Cluster name, e.g. "cluster_a" (the file stem by convention)."""
    nodes: tuple[NodeGroup, ...]
    """Node groups in device order: group 0's devices come first."""
    gpu_types: Mapping[str, GpuType]
    """GPU types by name (read-only); every type is used by at least one group."""
    source: str = field(default="<dict>", compare=False)
    """The file the config was read from, for messages that ask for a change in it (not part of
    equality: the same cluster read from two paths is the same cluster)."""

    @property
    def num_nodes(self) -> int:
        """Total nodes over all groups."""
        return sum(g.count for g in self.nodes)

    @property
    def num_devices(self) -> int:
        """Total devices (= ranks of a one-process-per-device launch)."""
        return sum(g.num_devices for g in self.nodes)

    @property
    def device_types(self) -> tuple[str, ...]:
        """GPU type name of each device, node-major in group order; length num_devices."""
        return tuple(g.gpu for g in self.nodes for _ in range(g.num_devices))

    def device_gpu(self, device: int) -> GpuType:
        """The GpuType of device `device` (0-based rank)."""
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < self.num_devices:
            raise ConfigError(f"cluster {self.name}: device {device!r} is not in [0, {self.num_devices})")
        return self.gpu_types[self.device_types[device]]

    def to_topology(self) -> Topology:
        """The placement engine's Topology of this cluster.

        Topology has one device count per node and one bandwidth per link class, so every
        group must use the same gpus_per_node, and the slowest group's links stand for all
        (intra-node: per-device GB/s; inter-node: the NIC rate, which one device pair can
        use alone; sharing a NIC between a node's devices is left to the consumer's cost model).
        """
        per_node = {g.gpus_per_node for g in self.nodes}
        if len(per_node) != 1:
            groups = ", ".join(f"{g.count} x {g.gpus_per_node} {g.gpu}" for g in self.nodes)
            raise ConfigError(
                f"cluster {self.name}: a Topology needs the same gpus_per_node in every node group, got {groups}"
            )
        return Topology(
            nodes=self.num_nodes,
            devices_per_node=per_node.pop(),
            intra_node_bw=min(g.intra_node_bw_gb_s for g in self.nodes) * 1e9,
            inter_node_bw=min(g.inter_node_gbps for g in self.nodes) * 1e9 / 8,
            device_types=self.device_types,
        )


_GPU_KEYS = ("memory_gb", "peak_fp16_tflops", "hbm_gb_s", "flash_attention", "source")
_GPU_OPTIONAL_KEYS = ("peak_fp32_tflops", "peak_tf32_tflops", "bf16", "memory_efficient_attention")
_GROUP_KEYS = ("count", "gpus_per_node", "gpu", "intra_node_bw_gb_s", "intra_node_link", "inter_node_gbps")
_CLUSTER_KEYS = ("name", "nodes", "gpu_types")


def _check_keys(values: Any, valid: tuple[str, ...], where: str, optional: tuple[str, ...] = ()) -> None:
    """ConfigError unless `values` is a mapping with every key of `valid`, and otherwise only keys of `optional`."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {list(valid)}, got {values!r}")
    unknown = sorted(set(values) - set(valid) - set(optional))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {list(valid + optional)}")
    missing = [k for k in valid if k not in values]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")


def _positive_number(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: {key}={value!r} is invalid; expected a positive number")
    return float(value)


def _positive_int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key}={value!r} is invalid; expected a positive integer")
    return value


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: {key}={value!r} is invalid; expected a non-empty string")
    return value


def cluster_config_from_dict(values: dict[str, Any], source: str = "<dict>") -> ClusterConfig:
    """Build and validate a ClusterConfig from parsed YAML; `source` names the file in errors."""
    _check_keys(values, _CLUSTER_KEYS, source)
    name = _text(values["name"], "name", source)

    raw_types = values["gpu_types"]
    if not isinstance(raw_types, dict) or not raw_types:
        raise ConfigError(f"{source}: gpu_types must map GPU type names to their figures, got {raw_types!r}")
    gpu_types = {}
    for type_name, figures in raw_types.items():
        where = f"{source}: gpu_types.{type_name}"
        _text(type_name, "gpu type name", source)
        _check_keys(figures, _GPU_KEYS, where, _GPU_OPTIONAL_KEYS)
        for key in ("flash_attention", "bf16", "memory_efficient_attention"):
            if key in figures and not isinstance(figures[key], bool):
                raise ConfigError(f"{where}: {key}={figures[key]!r} is invalid; expected true or false")
        fp32 = figures.get("peak_fp32_tflops")
        if "peak_fp32_tflops" in figures:  # every GPU has an FP32 rate: null is an error
            fp32 = _positive_number(fp32, "peak_fp32_tflops", where)
        tf32 = figures.get("peak_tf32_tflops")
        if tf32 is not None:  # null: no TF32 tensor cores
            tf32 = _positive_number(tf32, "peak_tf32_tflops", where)
        gpu_types[type_name] = GpuType(
            name=type_name,
            memory_gb=_positive_number(figures["memory_gb"], "memory_gb", where),
            peak_fp16_tflops=_positive_number(figures["peak_fp16_tflops"], "peak_fp16_tflops", where),
            hbm_gb_s=_positive_number(figures["hbm_gb_s"], "hbm_gb_s", where),
            flash_attention=figures["flash_attention"],
            source=_text(figures["source"], "source", where),
            peak_fp32_tflops=fp32,
            peak_tf32_tflops=tf32,
            bf16=figures.get("bf16"),
            memory_efficient_attention=figures.get("memory_efficient_attention", False),
        )

    raw_nodes = values["nodes"]
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ConfigError(f"{source}: nodes must be a non-empty list of node groups, got {raw_nodes!r}")
    groups = []
    for i, group in enumerate(raw_nodes):
        where = f"{source}: nodes[{i}]"
        _check_keys(group, _GROUP_KEYS, where)
        if group["gpu"] not in gpu_types:
            raise ConfigError(f"{where}: gpu={group['gpu']!r} is not a key of gpu_types; valid: {sorted(gpu_types)}")
        groups.append(NodeGroup(
            count=_positive_int(group["count"], "count", where),
            gpus_per_node=_positive_int(group["gpus_per_node"], "gpus_per_node", where),
            gpu=group["gpu"],
            intra_node_bw_gb_s=_positive_number(group["intra_node_bw_gb_s"], "intra_node_bw_gb_s", where),
            intra_node_link=_text(group["intra_node_link"], "intra_node_link", where),
            inter_node_gbps=_positive_number(group["inter_node_gbps"], "inter_node_gbps", where),
        ))
    unused = sorted(set(gpu_types) - {g.gpu for g in groups})
    if unused:
        raise ConfigError(f"{source}: gpu_types {unused} are not used by any node group (a typo in nodes[].gpu?)")
    return ClusterConfig(name=name, nodes=tuple(groups), gpu_types=MappingProxyType(gpu_types), source=source)


def available_clusters() -> list[str]:
    """Names (file stems) of the cluster configs under configs/clusters, sorted."""
    return sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml"))


def load_cluster_config(path_or_name: Union[str, Path]) -> ClusterConfig:
    """Load and validate a cluster YAML, given as a path or as a name under configs/clusters (e.g. "cluster_a")."""
    path = resolve_config_path(path_or_name, CLUSTERS_DIR, available_clusters(), "cluster")
    return cluster_config_from_dict(read_yaml_mapping(path), source=str(path))
