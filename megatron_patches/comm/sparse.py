"""SparseAllGather and SparseReduceScatter over torch.distributed (DESIGN 3).

`SparseAllGather(P0, P1, group, chunk_numel)` materializes copies: P0 owns the chunks (a
partition), P1 ⊇ P0 says who holds a copy; afterwards every (c, d) in P1 holds chunk c.
`SparseReduceScatter(P1, P0, group, chunk_numel)` is its mirror for gradients: afterwards
the owner of every element in P0 holds the sum over all copies in P1. An iteration pairs
spAG(P, P') with spRS(P', P): the reduce runs exactly the gather's messages reversed.
Ownership may also be element-granular (ElementShardLayout: rank r owns slice r of every
chunk, replicate mode); see `transfers` for the buffers' layout.

Usage, on every rank of `group` in the same order (like any collective):

    gather = SparseAllGather(shard, placement, group, chunk_numel)
    handle = gather(owned)             # owned: [O, N], this rank's chunks, ascending ids
    ...                                # overlap: attention runs meanwhile
    held = handle.wait()               # [H, N], rows = gather.held_chunks
    ...
    grads = SparseReduceScatter(placement, shard, group, chunk_numel)(held_grads).wait()  # [O, N]

Why batched point-to-point (`batch_isend_irecv`) and not grouped broadcasts/reduces:
- bytes: exactly the chunks that move travel, once per (owner, holder) pair, which is what
  the accounting formulas count; a broadcast's internal tree or ring would move other bytes;
- groups: a broadcast per chunk needs a process group per holder set, and holder sets change
  every iteration; creating NCCL communicators during training is far too slow, while P2P
  works within the one group for any placement;
- messages: all chunks between two ranks travel as one message (packed rows), so a
  collective costs at most one send and one receive per peer, whatever the number of chunks.

Buffers are packed 2-D tensors, rows in ascending chunk id, because FSSDP's MoE layer
materializes one layer's experts as one tensor per weight and indexes it by local slot:
`held_chunks[i]` is the expert of row i. The held buffer includes the owned chunks.

Asynchrony: calling a collective packs the send buffers, copies the local rows and posts
all sends and receives (gloo: async work on gloo's threads; NCCL: packing and unpacking
on the dedicated communication stream of `streams`, NCCL's kernels on its internal stream
ordered after it), then returns a `CollectiveHandle`. The results are
valid only after `handle.wait()`, which unpacks the received rows (and, for the reduce,
sums). Inputs must stay unchanged until then. Several collectives may be in flight at once
on different buffers, provided every rank launches them in the same order.

Reduction: in the gradients' dtype, in ascending device order of the contributing copies
(the owner's own copy at its place), regardless of message arrival order, so results are
bitwise reproducible run to run.

GPU: as for any NCCL P2P, each process must have called `torch.cuda.set_device` for its
GPU. The first call on an NCCL group runs one tiny all-reduce on every rank to create the
communicator (batched P2P must not be a group's first call unless every rank takes part).

Bytes: every call records this rank's sent/received bytes per peer into a `TrafficCounter`,
split intra/inter-node by the topology (by default one node). Ranks of the group are
devices of the placement by group rank.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.streams import CommStream, comm_stream
from megatron_patches.comm.traffic import TrafficCounter, default_counter
from megatron_patches.comm.transfers import Ownership, RankTransfers, plan_rank_transfers
from megatron_patches.placement.types import InstancePlacement, PlacementError, Topology

__all__ = ["CollectiveHandle", "SparseAllGather", "SparseReduceScatter"]


class CollectiveHandle:
    """An in-flight sparse collective; `wait()` completes it and returns its output buffer."""

    def __init__(self, stream: CommStream, finish: Callable[[], torch.Tensor]):
        self._stream = stream
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Block until the transfers are done, unpack (and reduce), return the output.

        On GPU this does not block the host on the kernels: the caller's current stream is
        made to wait for the communication stream. Calling it again returns the same tensor.
        """
        if self._result is None:
            with self._stream.finish():
                self._result = self._finish()
            self._finish = None
        return self._result


_NCCL_READY: set[str] = set()


def _post(ops: list[dist.P2POp], group: dist.ProcessGroup, device: torch.device) -> list:
    """Post a batch of P2P ops; returns their work objects (none for an empty batch)."""
    if device.type == "cuda" and group.group_name not in _NCCL_READY:
        # NCCL: the first batched P2P call on a group must involve every rank (it creates the
        # communicator), but a rank with nothing to exchange posts nothing. One tiny
        # all-reduce, which every rank calls, creates it instead.
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        _NCCL_READY.add(group.group_name)
    return dist.batch_isend_irecv(ops) if ops else []


class _SparseCollective:
    """Validation and planning shared by the gather and the reduce."""

    def __init__(self, owners, placement: InstancePlacement, group, chunk_numel: int, topology, traffic, kind: str):
        if not isinstance(placement, InstancePlacement):
            raise PlacementError(
                f"the instance placement must be an InstancePlacement, got {type(placement).__name__}"
            )
        ownership = Ownership.of(owners, placement.num_experts, chunk_numel)
        ownership.require_contained_in(placement)  # P0/P1 errors first: they are the caller's likelier mistake
        if group is None or not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"pass the process group explicitly (the ranks the placement's devices map to), got {group!r}"
            )
        world = dist.get_world_size(group)
        if world != placement.num_devices:
            raise ValueError(
                f"the placement spans {placement.num_devices} devices but the process group has {world} ranks; "
                "group rank d must be device d"
            )
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the process group it was given")
        self.topology = Topology.single_node(world) if topology is None else topology
        """Devices and nodes; classifies traffic as intra- or inter-node."""
        if self.topology.num_devices != world:
            raise ValueError(
                f"the topology has {self.topology.num_devices} devices but the process group {world} ranks"
            )
        self.group = group
        """The process group the transfers run in."""
        self.plan: RankTransfers = plan_rank_transfers(ownership, placement, rank)
        """This rank's transfers (the gather's direction)."""
        self.traffic = default_counter() if traffic is None else traffic
        """Where this rank's bytes are recorded."""
        self.kind = kind
        """The traffic kind the bytes are recorded under."""
        # Index tensors built once per collective (CPU); moved to the buffers' device per call.
        self._local_owned = torch.from_numpy(self.plan.local_owned_rows.copy())
        self._local_held = torch.from_numpy(self.plan.local_held_rows.copy())
        self._peer_rows = [
            (p, torch.from_numpy(p.owned_rows.copy()), torch.from_numpy(p.held_rows.copy())) for p in self.plan.peers
        ]

    @property
    def rank(self) -> int:
        """This process's rank in the group = its device in the placement."""
        return self.plan.rank

    @property
    def owned_chunks(self) -> np.ndarray:
        """Chunk of each row of this rank's owned buffer, ascending; int64."""
        return self.plan.owned_chunks

    @property
    def held_chunks(self) -> np.ndarray:
        """Chunk of each row of this rank's held buffer, ascending; int64."""
        return self.plan.held_chunks

    def _check(self, name: str, tensor, shape: tuple[int, int], chunks: np.ndarray, like=None) -> None:
        """Raise ValueError unless `tensor` is a tensor of `shape` (and dtype/device of `like`)."""
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            listed = chunks[:16].tolist() + (["..."] if chunks.size > 16 else [])
            raise ValueError(
                f"rank {self.rank}: {name} must have shape {shape} (one row per chunk {listed}), got {got}"
            )
        if like is not None and (tensor.dtype != like.dtype or tensor.device != like.device):
            raise ValueError(
                f"rank {self.rank}: {name} must have dtype {like.dtype} on {like.device} like the input, "
                f"got {tensor.dtype} on {tensor.device}"
            )

    def _buffers(self, given: torch.Tensor, out: torch.Tensor | None, reverse: bool) -> torch.Tensor:
        """Checks the input buffer and the output buffer to fill (allocated like the input if None);
        returns the latter. The gather reads the owned buffer and fills the held one; the reduce
        (reverse) reads the held gradients and fills the owned buffer."""
        plan = self.plan
        sides = [("owned", plan.owned_shape, plan.owned_chunks), ("held", plan.held_shape, plan.held_chunks)]
        (source, source_shape, source_chunks), (target, target_shape, target_chunks) = sides[::-1] if reverse else sides
        self._check(source, given, source_shape, source_chunks)
        if out is None:
            out = given.new_empty(target_shape)
        self._check(f"out ({target} buffer)", out, target_shape, target_chunks, like=given)
        return out

    def _gather_numel(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(peer_P, send_numel_P, recv_numel_P) of this rank's messages in the gather's direction."""
        return self.plan.gather_numel()

    def _record(self, element_size: int, reverse: bool) -> None:
        """Record this rank's bytes of one call: the gather's messages, or (reverse) the reduce's."""
        peer_P, send_numel_P, recv_numel_P = self._gather_numel()
        if reverse:
            send_numel_P, recv_numel_P = recv_numel_P, send_numel_P
        sent_P, recv_P = send_numel_P * element_size, recv_numel_P * element_size
        self.traffic.record(self.kind, self.rank, self.topology, peer_P, sent_P, recv_P)


class SparseAllGather(_SparseCollective):
    """SparseAllGather(P0, P1): copies every owned chunk to every device that holds it in P1.

    Args:
        owners: P0, a ShardLayout (or an InstancePlacement that is a partition) for whole chunks,
            or an ElementShardLayout (num_elements = chunk_numel) for slices of every chunk.
        placement: P1; with whole-chunk owners it must contain P0.
        group: the process group; group rank d is device d. Never the default group implicitly.
        chunk_numel: N, elements per chunk.
        topology: the devices' nodes, for intra/inter-node byte counts; None = one node.
        traffic: the counter to record bytes into; None = `traffic.default_counter()`.
        kind: the traffic kind bytes are recorded under.
    """

    def __init__(
        self,
        owners,
        placement: InstancePlacement,
        group: dist.ProcessGroup,
        chunk_numel: int,
        *,
        topology: Topology | None = None,
        traffic: TrafficCounter | None = None,
        kind: str = "spag",
    ):
        super().__init__(owners, placement, group, chunk_numel, topology, traffic, kind)

    def __call__(self, owned: torch.Tensor, out: torch.Tensor | None = None) -> CollectiveHandle:
        """Launch the gather.

        Args:
            owned: this rank's owned buffer [O, stop - start] (rows = `owned_chunks`).
            out: the held buffer to fill [H, N] (rows = `held_chunks`); allocated if None.

        Returns:
            A handle whose `wait()` returns the filled held buffer.
        """
        plan = self.plan
        out = self._buffers(owned, out, reverse=False)
        device = owned.device
        stream = comm_stream(device)
        ops: list[dist.P2POp] = []
        received: list[tuple[slice, torch.Tensor, torch.Tensor]] = []
        with stream.launch(owned, out):
            for peer, owned_rows, held_rows in self._peer_rows:
                if owned_rows.numel():
                    send = owned.index_select(0, owned_rows.to(device))
                    ops.append(dist.P2POp(dist.isend, send, group=self.group, group_peer=peer.peer))
                if held_rows.numel():
                    recv = owned.new_empty((held_rows.numel(), peer.peer_stop - peer.peer_start))
                    ops.append(dist.P2POp(dist.irecv, recv, group=self.group, group_peer=peer.peer))
                    received.append((slice(peer.peer_start, peer.peer_stop), held_rows.to(device), recv))
            works = _post(ops, self.group, device)
            if self._local_owned.numel():
                local = owned.index_select(0, self._local_owned.to(device))
                out[:, plan.start : plan.stop].index_copy_(0, self._local_held.to(device), local)
        self._record(owned.element_size(), reverse=False)

        def finish() -> torch.Tensor:
            for work in works:
                work.wait()
            for columns, held_rows, recv in received:
                out[:, columns].index_copy_(0, held_rows, recv)
            return out

        return CollectiveHandle(stream, finish)


class SparseReduceScatter(_SparseCollective):
    """SparseReduceScatter(P1, P0): the owner of every element gets the sum of all its copies.

    The mirror of `SparseAllGather(P0, P1)` (same arguments, the placement first): every holder
    of a chunk sends its copy's owned columns to the owner, which sums them in ascending device
    order. Arguments as for SparseAllGather; `kind` defaults to "sprs".
    """

    def __init__(
        self,
        placement: InstancePlacement,
        owners,
        group: dist.ProcessGroup,
        chunk_numel: int,
        *,
        topology: Topology | None = None,
        traffic: TrafficCounter | None = None,
        kind: str = "sprs",
    ):
        super().__init__(owners, placement, group, chunk_numel, topology, traffic, kind)

    def __call__(self, held: torch.Tensor, out: torch.Tensor | None = None) -> CollectiveHandle:
        """Launch the reduce.

        Args:
            held: this rank's copies' gradients [H, N] (rows = `held_chunks`).
            out: the owned buffer to overwrite with the sums [O, stop - start] (rows =
                `owned_chunks`); allocated if None.

        Returns:
            A handle whose `wait()` returns the summed owned buffer.
        """
        plan = self.plan
        out = self._buffers(held, out, reverse=True)
        device = held.device
        stream = comm_stream(device)
        ops: list[dist.P2POp] = []
        # (device, owned rows, contribution): summed in ascending device order by finish().
        contributions: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        with stream.launch(held, out):
            for peer, owned_rows, held_rows in self._peer_rows:
                if held_rows.numel():
                    send = held[:, peer.peer_start : peer.peer_stop].index_select(0, held_rows.to(device))
                    ops.append(dist.P2POp(dist.isend, send, group=self.group, group_peer=peer.peer))
                if owned_rows.numel():
                    recv = held.new_empty((owned_rows.numel(), plan.stop - plan.start))
                    ops.append(dist.P2POp(dist.irecv, recv, group=self.group, group_peer=peer.peer))
                    contributions.append((peer.peer, owned_rows.to(device), recv))
            works = _post(ops, self.group, device)
        self._record(held.element_size(), reverse=True)

        def finish() -> torch.Tensor:
            for work in works:
                work.wait()
            if self._local_owned.numel():
                local = held[:, plan.start : plan.stop].index_select(0, self._local_held.to(device))
                contributions.append((self.rank, self._local_owned.to(device), local))
            contributions.sort(key=lambda entry: entry[0])
            out.zero_()
            # Each call adds at most one contribution per row, so every element's additions
            # happen in the order of the calls: ascending device.
            for _, owned_rows, values in contributions:
                out.index_add_(0, owned_rows, values)
            return out

        return CollectiveHandle(stream, finish)
