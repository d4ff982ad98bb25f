"""Pre-registered process groups for every contiguous rank range (replicate mode, DESIGN 4.6 (b)).

In replicate mode an expert's instances sit on consecutive ranks, and the holders of each
expert all-reduce its gradient among themselves. The holder set changes every iteration, but
it is always a contiguous range of the replicate group's ranks, so all N(N-1)/2 ranges of at
least two ranks are registered once, at start-up (`ContiguousGroups`); training only looks
them up. Creating a group during training would stall every rank (process-group creation is a
collective over the whole job, and building NCCL communicators takes seconds).

Positions: a range [start, stop) counts ranks of the *parent* group by their position in it
(group rank), the same numbering as the placement's devices. `torch.distributed.new_group`
must be entered by every process of the job, in the same order, even by non-members; so every
process passes the list of *all* parent groups (for example one per tensor-parallel rank) and
registers every range of every parent, keeping the ranges of its own parent.

Bytes: `ContiguousGroups.all_reduce` records into a `TrafficCounter` the bytes of a ring
all-reduce (the bandwidth-optimal volume, 2 (m - 1) / m of the buffer per member; the model
`placement.policies.ring_allreduce_bytes` uses for the simulator). gloo and NCCL pick their own
algorithms, whose wire bytes a process cannot observe; the counters state the model's bytes.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.traffic import TrafficCounter, default_counter
from megatron_patches.placement.replicate import contiguous_rank_groups
from megatron_patches.placement.types import ElementShardLayout, Topology

__all__ = ["ContiguousGroups", "node_layout", "record_ring_allreduce", "ring_allreduce_numel", "sum_over_groups"]


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


def _check_parents(parents, world: int, me: int) -> tuple[list[tuple[int, ...]], int]:
    """Validated parents as tuples and the index of the one holding this process."""
    if isinstance(parents, (str, bytes)) or not isinstance(parents, Sequence) or len(parents) == 0:
        raise ValueError(f"parents must be a non-empty list of rank lists, got {parents!r}")
    checked: list[tuple[int, ...]] = []
    seen: dict[int, int] = {}
    for i, parent in enumerate(parents):
        if isinstance(parent, (str, bytes)) or not isinstance(parent, Sequence) or len(parent) == 0:
            raise ValueError(f"parents[{i}] must be a non-empty list of global ranks, got {parent!r}")
        ranks = []
        for rank in parent:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world:
                raise ValueError(f"parents[{i}] holds {rank!r}, which is not a global rank in [0, {world})")
            ranks.append(int(rank))
        if any(b <= a for a, b in zip(ranks, ranks[1:])):
            raise ValueError(f"parents[{i}] = {ranks} must list its ranks strictly ascending (position = group rank)")
        for rank in ranks:
            if rank in seen:
                raise ValueError(
                    f"global rank {rank} is in parents[{seen[rank]}] and parents[{i}]; parents must be disjoint"
                )
            seen[rank] = i
        checked.append(tuple(ranks))
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        # Every process must reach the same verdict, or the ones that pass would wait forever
        # in new_group for the ones that raised: so the rule is global, not "this process is in one".
        raise ValueError(
            f"global ranks {missing[:8]} are in no parent; the parents must partition all {world} ranks of the job"
        )
    return checked, seen[me]


class ContiguousGroups:
    """One process group per contiguous range of >= 2 ranks of a parent group, made at construction.

    Every process of the job constructs it at start-up with the same `parents` (collectively,
    like `torch.distributed.new_group`, which it calls for every range of every parent, parents
    in list order, ranges ordered by start then stop). Afterwards it never creates a group.

    Args:
        parents: lists of global ranks, each strictly ascending, that partition the job's ranks
            (every process is in exactly one: its parent). E.g. `[list(range(world_size))]`, or
            one list per tensor-parallel rank.
        backend: backend of the new groups; None = the default group's.
        timeout: timeout of the new groups; None = the default.
    """

    def __init__(
        self,
        parents: Sequence[Sequence[int]],
        *,
        backend: str | None = None,
        timeout: datetime.timedelta | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError("ContiguousGroups needs an initialised default process group (init_process_group)")
        me = dist.get_rank()
        checked, mine = _check_parents(parents, dist.get_world_size(), me)
        self.ranks: tuple[int, ...] = checked[mine]
        """Global ranks of this process's parent group; position i = group rank i."""
        self.position: int = self.ranks.index(me)
        """This process's position (group rank) in its parent."""
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        for i, parent in enumerate(checked):
            for start, stop in contiguous_rank_groups(len(parent)):
                group = dist.new_group(list(parent[start:stop]), timeout=timeout, backend=backend)
                if i == mine and start <= self.position < stop:
                    self._groups[(start, stop)] = group
        self.ranges: tuple[tuple[int, int], ...] = tuple(contiguous_rank_groups(self.size))
        """Every registered range [start, stop) of this process's parent, ordered by start then stop."""

    @property
    def size(self) -> int:
        """N, ranks in this process's parent group."""
        return len(self.ranks)

    def get(self, start: int, stop: int) -> dist.ProcessGroup:
        """The process group of parent positions [start, stop); this process must be one of them.

        Raises ValueError for a range that was never registered (fewer than 2 ranks, or not
        inside [0, size)) and for a range without this process: only members may use a group.
        """
        if not (0 <= start and start + 2 <= stop <= self.size):
            raise ValueError(
                f"no group was registered for positions [{start}, {stop}): registered are the ranges of >= 2 "
                f"ranks inside [0, {self.size})"
            )
        if not start <= self.position < stop:
            raise ValueError(
                f"this process (position {self.position}) is not a member of positions [{start}, {stop}); "
                "only members may use the group"
            )
        return self._groups[(start, stop)]

    def all_reduce(
        self,
        tensor: torch.Tensor,
        start: int,
        stop: int,
        *,
        kind: str,
        traffic: TrafficCounter | None = None,
        topology: Topology | None = None,
        async_op: bool = False,
    ):
        """Sum `tensor` in place over parent positions [start, stop) and record its ring bytes.

        Only the members call it. A range of one rank has nothing to reduce: it returns None
        at once and records nothing.

        Args:
            tensor: contiguous, the same shape and dtype on every member.
            start, stop: the members, as positions in the parent.
            kind: the traffic kind the bytes are recorded under.
            traffic: the counter; None = `traffic.default_counter()`.
            topology: devices = parent positions, for intra/inter-node counts; None = one node.
            async_op: return the work object instead of waiting.

        Returns:
            The work object (async_op), else None.
        """
        if stop - start == 1 and start == self.position:
            return None
        group = self.get(start, stop)
        if not tensor.is_contiguous():
            raise ValueError(f"all_reduce needs a contiguous tensor, got strides {tensor.stride()}")
        topology = Topology.single_node(self.size) if topology is None else topology
        if topology.num_devices != self.size:
            raise ValueError(f"the topology has {topology.num_devices} devices but the parent group {self.size} ranks")
        work = dist.all_reduce(tensor, group=group, async_op=async_op)
        record_ring_allreduce(default_counter() if traffic is None else traffic, kind, tensor, self.position - start,
                              stop - start, topology, first=start)
        return work


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
