"""Process-group helpers: ring all-reduce byte accounting (`ring_allreduce_numel`,
`record_ring_allreduce`, `all_reduce_recorded`), node layouts (`node_layout`) and integer
counters summed over groups (`sum_over_groups`).

Bytes: the counters record the bytes of a ring all-reduce (the bandwidth-optimal volume,
2 (m - 1) / m of the buffer per member; the model `placement.policies.ring_allreduce_bytes`
uses for the simulator). gloo and NCCL pick their own algorithms, whose wire bytes a process
cannot observe; the counters state the model's bytes.

No helper here makes a process group: the modes run in Megatron's groups (replicate's gradient
path in its EP group), so the job's communicator count is Megatron's.
"""

from __future__ import annotations

import os
import socket
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.traffic import TrafficCounter, default_counter
from megatron_patches.placement.types import ElementShardLayout, Topology

__all__ = ["all_reduce_recorded", "node_layout", "record_ring_allreduce", "ring_allreduce_numel", "sum_over_groups"]


def ring_allreduce_numel(numel: int, members: int) -> np.ndarray:
    """Elements each member of a ring all-reduce sends to its successor; int64 [members].

    The buffer is cut into `members` chunks (np.array_split sizes c_0 .. c_{m-1}). In the
    reduce-scatter half member i sends every chunk but c_{i+1}, in the all-gather half every
    chunk but c_{i+2} (indices mod m), so it sends 2 numel - c_{i+1} - c_{i+2} and the members
    send 2 (m - 1) numel in total. Member i receives what member i - 1 sends.
    """
    if members < 1:
        raise ValueError(f"a ring all-reduce needs >= 1 member, got {members}")
    if members == 1:
        return np.zeros(1, dtype=np.int64)
    chunk_M = ElementShardLayout(int(numel), members).sizes_D()
    return 2 * int(numel) - np.roll(chunk_M, -1) - np.roll(chunk_M, -2)


def all_reduce_recorded(tensor: torch.Tensor, group: dist.ProcessGroup, *, kind: str,
                        traffic: TrafficCounter | None = None, topology: Topology | None = None) -> None:
    """Sum `tensor` in place over `group` (every member calls it) and record this member's bytes
    of a ring all-reduce under `kind`.

    Args:
        tensor: contiguous, the same shape and dtype on every member.
        traffic: the counter; None = `traffic.default_counter()`.
        topology: devices = group ranks, for intra/inter-node counts; None = one node.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"all_reduce_recorded needs a contiguous tensor, got strides {tensor.stride()}")
    members = dist.get_world_size(group)
    topology = Topology.single_node(members) if topology is None else topology
    if topology.num_devices != members:
        raise ValueError(f"the topology has {topology.num_devices} devices but the group {members} ranks")
    dist.all_reduce(tensor, group=group)
    record_ring_allreduce(default_counter() if traffic is None else traffic, kind, tensor, dist.get_rank(group),
                          members, topology)


def record_ring_allreduce(counter: TrafficCounter, kind: str, tensor: torch.Tensor, position: int, members: int,
                          topology: Topology, first: int = 0) -> None:
    """Record one member's bytes of a ring all-reduce of `tensor` (`ring_allreduce_numel`).

    Args:
        position: the member's place in the ring, in [0, members).
        topology: its devices are the ring's members at first, first + 1, ... (classifies the
            successor and predecessor as intra- or inter-node).
    """
    sent_M = ring_allreduce_numel(tensor.numel(), members) * tensor.element_size()
    # Sends go to the successor, receipts come from the predecessor (the same rank in a ring of two).
    peer_P = np.array([first + (position + 1) % members, first + (position - 1) % members])
    counter.record(kind, first + position, topology, peer_P, np.array([sent_M[position], 0]),
                   np.array([0, sent_M[position - 1]]))


def sum_over_groups(groups, *arrays_I: np.ndarray) -> list[np.ndarray]:
    """Integer counters (numpy arrays of any shape) summed over each of `groups` in turn (e.g. the
    expert-data-parallel then the expert-tensor-parallel group: every rank at one expert-parallel
    position of a stage), with one all-reduce of their concatenation per group (host tensors:
    gloo); groups of one are skipped."""
    flat = [np.asarray(a, dtype=np.int64) for a in arrays_I]
    total = torch.from_numpy(np.concatenate([a.ravel() for a in flat]))
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    parts = np.split(total.numpy(), np.cumsum([a.size for a in flat])[:-1])
    return [part.reshape(a.shape) for part, a in zip(parts, flat)]


def node_layout(group_ranks: Sequence[int]) -> tuple[int, int]:
    """(nodes, devices per node) of a group's global ranks, for a `Topology` of the group.

    A rank's node is its Slurm node name (SLURMD_NODENAME, which tells apart the virtual nodes
    of a test cluster too) or else its host name; gathered over the world (a collective: every
    rank calls it). The group must be node-major with the same number of ranks per node.
    """
    key = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    node_ids = {name: i for i, name in enumerate(dict.fromkeys(keys))}
    nodes_of = [node_ids[keys[r]] for r in group_ranks]
    distinct = sorted(set(nodes_of))
    counts = [nodes_of.count(n) for n in distinct]
    if len(set(counts)) != 1 or nodes_of != sorted(nodes_of):
        raise ValueError(
            f"the group's ranks {list(group_ranks)} sit on nodes {[keys[r] for r in group_ranks]}: not node-major "
            "with the same number of ranks per node; launch one process per device, equal processes per node"
        )
    return len(distinct), counts[0]
