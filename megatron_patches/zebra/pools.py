"""Zebra pools: which rank does attention and which expert work, and whether the pool can run.

A zebra run (DESIGN 4.7) splits the world into G = world / (M + N) ZP groups of M + N consecutive
ranks: the first M ranks of each group are attention ranks (embeddings, attention, gate, norms,
head, replicated and data-parallel over all G*M attention ranks), the next N are expert ranks
(the experts of every layer, expert-parallel inside the group; expert rank j of every group
holds the same experts, so those G ranks are its data-parallel group).

Ranks are placed on the cluster's devices as the launchers do (launch/submit.py and
launch/templates/task_env.sh): a cluster with one node group runs rank r on device r; a cluster
with two node groups (a zebra pool: the attention GPU type listed first) is a Slurm hetjob whose
component 0 holds the G*M attention ranks and component 1 the G*N expert ranks, interleaved so
that each ZP group is [M of component 0, N of component 1].

``zebra_layout`` validates a pool against the model and, when given, a profile, and returns the
layout as plain data (rank lists, no process groups): every check fails with a message naming
the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

from megatron_patches.config.clusters import ClusterConfig, load_cluster_config
from megatron_patches.placement.zebra import AsymEAPlan, ZebraProfile, ZebraShape, load_zebra_profile, resolve_asym_ea

__all__ = ["PoolError", "ZebraLayout", "local_pool", "move_link_bytes_per_s", "pool_cluster", "rank_device_types",
           "zebra_layout"]


class PoolError(ValueError):
    """A zebra pool that cannot run; the message names the value and what would be valid."""


@dataclass(frozen=True)
class ZebraLayout:
    """Rank roles and groups of a zebra run, as plain data."""

    attention_ranks: int
    """M: attention ranks per ZP group."""
    expert_ranks: int
    """N: expert ranks per ZP group."""
    world_size: int
    """Ranks in all."""
    roles: tuple[str, ...]
    """Per rank: "attention" or "expert"."""
    device_types: tuple[str, ...]
    """Per rank: the GPU type name of its device (the cluster config's gpu_types key)."""
    zp_groups: tuple[tuple[int, ...], ...]
    """Ranks of each ZP group, its M attention ranks first: the dispatch/combine all-to-all group."""
    attention_dp_group: tuple[int, ...]
    """Every attention rank: the data-parallel group of the non-expert parameters."""
    expert_dp_groups: tuple[tuple[int, ...], ...]
    """Per expert-rank index j < N: the j-th expert rank of every ZP group, which hold the same
    experts (their gradients are reduced over this group)."""
    offloaded_expert_dp_groups: tuple[tuple[int, ...], ...]
    """Per attention-rank index i < M: the i-th attention rank of every ZP group, which hold the
    same Asym-EA-offloaded experts."""
    asym_ea: AsymEAPlan
    """The per-layer offload plan at the start (all zeros when Asym-EA is off)."""
    profile: ZebraProfile | None = None
    """The profile of the pool's attention and expert GPU types (--zebra-profile), if given."""
    link_bytes_per_s: float = 0.0
    """The slowest link between two devices of the pool in bytes/s (``move_link_bytes_per_s``):
    what a re-plan prices moving an expert with."""

    @property
    def num_groups(self) -> int:
        """G: ZP groups (= data-parallel degree of the whole model)."""
        return len(self.zp_groups)

    @property
    def attention_device_type(self) -> str:
        return self.device_types[self.zp_groups[0][0]]

    @property
    def expert_device_type(self) -> str:
        return self.device_types[self.zp_groups[0][self.attention_ranks]]

    def attention_ranks_of(self, group: int) -> tuple[int, ...]:
        """The M attention ranks of ZP group ``group``."""
        return self.zp_groups[group][: self.attention_ranks]

    def expert_ranks_of(self, group: int) -> tuple[int, ...]:
        """The N expert ranks of ZP group ``group`` (its expert-parallel group)."""
        return self.zp_groups[group][self.attention_ranks :]


def local_pool(world_size: int) -> ClusterConfig:
    """This machine as one pool of ``world_size`` identical devices: configs/clusters/local_cpu.yaml
    with its one node widened to the world (local runs and tests; every rank has the same type)."""
    local = load_cluster_config("local_cpu")
    return dataclasses.replace(local, nodes=(dataclasses.replace(local.nodes[0], gpus_per_node=world_size),))


def pool_cluster(name_or_path: str | None, world_size: int) -> ClusterConfig:
    """The cluster of --zebra-cluster (a name under configs/clusters or a YAML path), or
    ``local_pool(world_size)`` when it is None."""
    if name_or_path is None:
        return local_pool(world_size)
    try:
        return load_cluster_config(name_or_path)
    except (OSError, ValueError) as err:
        raise PoolError(f"--zebra-cluster {name_or_path}: {err}") from None


def move_link_bytes_per_s(cluster: ClusterConfig) -> float:
    """Bytes/s of the slowest link between two devices of ``cluster``: the intra-node link on one
    node, else the slower of it and the NIC (a hetjob's attention and expert ranks sit on other
    nodes)."""
    intra = min(g.intra_node_bw_gb_s for g in cluster.nodes) * 1e9
    if cluster.num_nodes == 1:
        return intra
    return min(intra, min(g.inter_node_gbps for g in cluster.nodes) * 1e9 / 8)


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoolError(f"{name}={value!r} is invalid; expected an integer >= 1")


def rank_device_types(
    cluster: ClusterConfig, attention_ranks: int, expert_ranks: int, world_size: int
) -> tuple[str, ...]:
    """The GPU type each rank runs on, as the launchers place ranks (see the module docstring)."""
    groups = world_size // (attention_ranks + expert_ranks)
    nodes = cluster.nodes
    if len(nodes) == 1:
        if world_size > cluster.num_devices:
            raise PoolError(
                f"world size {world_size} exceeds the {cluster.num_devices} devices of cluster {cluster.name}; "
                f"valid: at most {cluster.num_devices}"
            )
        return cluster.device_types[:world_size]
    if len(nodes) != 2:
        described = ", ".join(f"{g.count} x {g.gpus_per_node} {g.gpu}" for g in nodes)
        raise PoolError(
            f"cluster {cluster.name} has {len(nodes)} node groups ({described}); zebra runs on one node "
            "group (a homogeneous pool) or two (attention GPUs first, then expert GPUs)"
        )
    for role, per_group, group in (("attention", attention_ranks, nodes[0]), ("expert", expert_ranks, nodes[1])):
        if groups * per_group > group.num_devices:
            raise PoolError(
                f"{groups} ZP group(s) x {per_group} {role} ranks = {groups * per_group} {group.gpu} devices, but "
                f"cluster {cluster.name} has {group.num_devices}; valid {role} ranks per group: at most "
                f"{group.num_devices // groups}"
            )
    per_group = attention_ranks + expert_ranks
    return tuple(
        nodes[0].gpu if r % per_group < attention_ranks else nodes[1].gpu for r in range(world_size)
    )


def _check_attention_is_faster(cluster: ClusterConfig, layout_types: Sequence[str], groups: Sequence[Sequence[int]],
                               attention_ranks: int) -> None:
    """Attention ranks must be on the newer GPUs: no expert rank of a group may have a higher
    peak FP16 rate than an attention rank of it."""
    for g, ranks in enumerate(groups):
        attention = min(ranks[:attention_ranks], key=lambda r: cluster.gpu_types[layout_types[r]].peak_fp16_tflops)
        expert = max(ranks[attention_ranks:], key=lambda r: cluster.gpu_types[layout_types[r]].peak_fp16_tflops)
        slow, fast = cluster.gpu_types[layout_types[attention]], cluster.gpu_types[layout_types[expert]]
        if slow.peak_fp16_tflops < fast.peak_fp16_tflops:
            raise PoolError(
                f"ZP group {g}: attention rank {attention} runs on a {slow.name} ({slow.peak_fp16_tflops:g} TFLOP/s "
                f"fp16) but expert rank {expert} on a faster {fast.name} ({fast.peak_fp16_tflops:g} TFLOP/s); the "
                "attention ranks must be the newer, faster GPUs: list their node group first in the cluster config"
            )


def zebra_layout(
    cluster: ClusterConfig,
    attention_ranks: int,
    expert_ranks: int,
    world_size: int,
    *,
    num_layers: int,
    num_experts: int,
    asym_ea: str | Sequence[int] = "off",
    profile: ZebraProfile | str | os.PathLike | None = None,
    replan: bool = False,
) -> ZebraLayout:
    """Validate a zebra pool and lay out its ranks.

    ``asym_ea`` is the value of --zebra-asym-ea (auto, off, or chunks per layer); ``profile`` a
    ZebraProfile or the path of a profile file, read for the pool's attention and expert GPU
    types; ``replan`` whether --zebra-replan-interval is on. Checks, in order: positive sizes; world
    divisible by M + N; experts divisible by N; M | N or N | M when Asym-EA or re-planning is on; the devices exist; attention ranks on the faster GPUs; and
    with a profile (or with auto, which needs one) the memory bounds (placement.zebra.resolve_asym_ea).
    """
    for name, value in (("--zebra-attention-ranks", attention_ranks), ("--zebra-expert-ranks", expert_ranks),
                        ("world size", world_size), ("num_layers", num_layers), ("num_experts", num_experts)):
        _check_positive(name, value)
    per_group = attention_ranks + expert_ranks
    if world_size % per_group:
        raise PoolError(
            f"world size {world_size} is not divisible by M + N = {attention_ranks} + {expert_ranks} = {per_group}: "
            f"every ZP group needs M attention and N expert ranks; valid world sizes: multiples of {per_group}"
        )
    if num_experts % expert_ranks:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise PoolError(
            f"--zebra-expert-ranks={expert_ranks} does not divide the {num_experts} experts per layer: every expert "
            f"rank must hold the same number; valid: {divisors}"
        )
    asym_on = not (isinstance(asym_ea, str) and asym_ea.strip() == "off")
    if (asym_on or replan) and attention_ranks % expert_ranks and expert_ranks % attention_ranks:
        what = f"--zebra-asym-ea {asym_ea!r}" if asym_on else "--zebra-replan-interval"
        raise PoolError(
            f"{what} needs M to divide N or N to divide M, got --zebra-attention-ranks="
            f"{attention_ranks} and --zebra-expert-ranks={expert_ranks}; use --zebra-asym-ea off without re-planning "
            "or change M or N"
        )
    types = rank_device_types(cluster, attention_ranks, expert_ranks, world_size)
    groups = tuple(tuple(range(g * per_group, (g + 1) * per_group)) for g in range(world_size // per_group))
    _check_attention_is_faster(cluster, types, groups, attention_ranks)

    shape = ZebraShape(num_layers, num_experts, attention_ranks, expert_ranks)
    if profile is not None and not isinstance(profile, ZebraProfile):
        try:
            profile = load_zebra_profile(profile, types[groups[0][0]], types[groups[0][attention_ranks]])
        except (OSError, ValueError) as err:
            raise PoolError(f"--zebra-profile {os.fspath(profile)}: {err}") from None
    try:
        plan = resolve_asym_ea(asym_ea, shape, profile)
    except ValueError as err:
        where = f"zebra pool on cluster {cluster.name} (M={attention_ranks}, N={expert_ranks})"
        raise PoolError(f"{where}: {err}") from None

    roles = tuple("attention" if r % per_group < attention_ranks else "expert" for r in range(world_size))
    return ZebraLayout(
        attention_ranks=attention_ranks,
        expert_ranks=expert_ranks,
        world_size=world_size,
        roles=roles,
        device_types=types,
        zp_groups=groups,
        attention_dp_group=tuple(r for r in range(world_size) if roles[r] == "attention"),
        expert_dp_groups=tuple(tuple(g[attention_ranks + j] for g in groups) for j in range(expert_ranks)),
        offloaded_expert_dp_groups=tuple(tuple(g[i] for g in groups) for i in range(attention_ranks)),
        asym_ea=plan,
        profile=profile,
        link_bytes_per_s=move_link_bytes_per_s(cluster),
    )
