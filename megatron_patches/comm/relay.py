"""Node-aware SparseAllGather and SparseReduceScatter: one copy per node crosses the network.

The flat collectives (`comm.sparse`) send every copy from its owner, so an expert held by k
devices of a remote node crosses that node's network link k times. These send it once per
node, to the node's relay for it, which forwards it over the node's own links
(`placement.collectives`: the relay choice, shared with the byte formulas and the simulator):

    gather   stage 1: owner -> holders on its node, and -> each other node's relay
             ring:    experts every device holds, when a ring is faster: one broadcast each
             stage 2: relay -> the other holders on its node
    reduce   stage 1: holders -> their node's relay (reverse of gather stage 2); the relay sums
             ring:    one reduce to the owner per ring expert
             stage 2: relays and the owner's node's holders -> owner (reverse of gather stage 1)

Same interface, buffers and byte recording as the flat classes (`RelayAllGather(shard,
placement, group, chunk_numel, topology=..., traffic=...)`; call -> handle -> wait), for
whole-chunk ownership (FSSDP). Each stage is one batched point-to-point call in the one group;
the ring experts are `dist.broadcast` / `dist.reduce` calls in that group (every rank holds
them, so the group is their holder set), in ascending expert order on every rank. Their bytes are
recorded as NCCL's pipelined ring moves them (each rank receives from rank - 1 and sends to
rank + 1, the ring starting at the owner: `placement.collectives`); gloo's broadcast and reduce
use their own algorithms, so on CPU the recorded ring bytes are the model's, not gloo's wire bytes.

Asynchrony: stage 1 is posted when the collective is called. Stage 2 reads what stage 1
received: on GPU it is posted at once, ordered after stage 1 on the communication stream
(NCCL's waits are stream waits, so the host does not block); on CPU (gloo) a wait blocks the
host, so stage 2 is posted in `wait()`. Every rank launches and waits its collectives at the
same points of the program, so the stage-2 messages of every pair of ranks are posted in the
same order on both sides.

Reduction order: a relay sums its node's copies in ascending device order (its own at its
place); the owner sums its node's copies and the relays' sums in ascending device order of the
sender; a ring expert's sum is the backend's reduce order. Deterministic run to run (for a fixed
backend and world), but not the flat collective's order (differences at rounding).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.sparse import CollectiveHandle, SparseAllGather, SparseReduceScatter, _post
from megatron_patches.comm.streams import comm_stream
from megatron_patches.comm.transfers import RelayTransfers, plan_relay_transfers
from megatron_patches.placement.collectives import copy_sources
from megatron_patches.placement.types import InstancePlacement, PlacementError, ShardLayout

__all__ = ["RelayAllGather", "RelayReduceScatter"]


def _relay_plan(collective, owners, placement: InstancePlacement) -> RelayTransfers:
    """The rank's plan: two point-to-point stages and the ring broadcasts (the flat plan's
    validation has run in the base class)."""
    if not isinstance(owners, ShardLayout):
        raise PlacementError(
            f"node-aware sparse collectives need whole-chunk owners (a ShardLayout), got {type(owners).__name__}"
        )
    sources = copy_sources(owners, placement, collective.topology, "hierarchical")
    return plan_relay_transfers(owners, placement, sources, collective.plan.chunk_numel, collective.rank)


def _ring_rows(relay: RelayTransfers, buffer: torch.Tensor, rows) -> list[torch.Tensor]:
    """The rows of `buffer` the ring collectives run on (views: a broadcast fills them in place)."""
    out = [buffer[row] for row in rows]
    if not all(row.is_contiguous() for row in out):
        raise ValueError(f"rank {relay.rank}: the ring broadcasts need a buffer with contiguous rows, got strides "
                         f"{tuple(buffer.stride())}")
    return out


def _index(rows, device: torch.device) -> torch.Tensor:
    # the plans' row arrays are read-only views (torch.from_numpy warns on those)
    return torch.as_tensor(np.array(rows, dtype=np.int64), device=device)


def _post_stage(stage, source: torch.Tensor, group, chunk_numel: int, reverse: bool) -> tuple[list, list]:
    """Post one stage's messages: in the gather's direction, send `source`'s send rows and receive
    the recv rows; reversed (the reduce), send the recv rows and receive for the send rows.
    Returns (work objects, [(peer, rows of this rank's buffer, received tensor)])."""
    device = source.device
    ops, received = [], []
    for message in stage:
        outgoing, incoming = (message.recv_rows, message.send_rows) if reverse else (message.send_rows, message.recv_rows)
        if outgoing.size:
            ops.append(dist.P2POp(dist.isend, source.index_select(0, _index(outgoing, device)), group=group,
                                  group_peer=message.peer))
        if incoming.size:
            recv = source.new_empty((incoming.size, chunk_numel))
            ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=message.peer))
            received.append((message.peer, _index(incoming, device), recv))
    return _post(ops, group, device), received


class RelayAllGather(SparseAllGather):
    """SparseAllGather(P0, P1) in two stages through one relay per (expert, remote node)."""

    def __init__(self, owners: ShardLayout, placement: InstancePlacement, group: dist.ProcessGroup, chunk_numel: int,
                 **kwargs):
        super().__init__(owners, placement, group, chunk_numel, **kwargs)
        self.relay = _relay_plan(self, owners, placement)
        """This rank's two-stage transfers (same owned and held buffers as the flat plan's)."""

    def _gather_numel(self):
        return self.relay.gather_numel()

    def __call__(self, owned: torch.Tensor, out: torch.Tensor | None = None) -> CollectiveHandle:
        relay = self.relay
        out = self._buffers(owned, out, reverse=False)
        device = owned.device
        stream = comm_stream(device)
        first, second = relay.stages
        posted: list = []

        def post(stage, source) -> None:
            posted.append(_post_stage(stage, source, self.group, relay.chunk_numel, reverse=False))

        def land() -> None:
            works, received = posted.pop(0)
            for work in works:
                work.wait()
            for _, rows, recv in received:
                out.index_copy_(0, rows, recv)

        with stream.launch(owned, out):
            post(first, owned)
            if relay.local_owned_rows.size:
                out.index_copy_(0, _index(relay.local_held_rows, device),
                                owned.index_select(0, _index(relay.local_owned_rows, device)))
            # the root broadcasts the row the local copy just filled; the others receive into theirs
            rings = [dist.broadcast(row, group=self.group, group_src=root, async_op=True)
                     for row, root in zip(_ring_rows(relay, out, relay.ring_held_rows), relay.ring_roots.tolist())]
            eager = device.type == "cuda"
            if eager:
                land()
                post(second, out)
        self._record(owned.element_size(), reverse=False)

        def finish() -> torch.Tensor:
            if not eager:
                land()
                post(second, out)
            for work in rings:
                work.wait()
            land()
            return out

        return CollectiveHandle(stream, finish)


class RelayReduceScatter(SparseReduceScatter):
    """SparseReduceScatter(P1, P0) in two stages: each remote node's copies summed at its relay."""

    def __init__(self, placement: InstancePlacement, owners: ShardLayout, group: dist.ProcessGroup, chunk_numel: int,
                 **kwargs):
        super().__init__(placement, owners, group, chunk_numel, **kwargs)
        self.relay = _relay_plan(self, owners, placement)
        """This rank's two-stage transfers (the gather's direction; the flat plan's buffers)."""

    def _gather_numel(self):
        return self.relay.gather_numel()

    def __call__(self, held: torch.Tensor, out: torch.Tensor | None = None) -> CollectiveHandle:
        relay = self.relay
        out = self._buffers(held, out, reverse=True)
        device = held.device
        stream = comm_stream(device)
        index = lambda rows: _index(rows, device)  # noqa: E731
        first, second = relay.stages
        posted: list = []
        sums = {}

        def post(stage, source) -> None:
            posted.append(_post_stage(stage, source, self.group, relay.chunk_numel, reverse=True))

        def land(target: torch.Tensor, own_rows, own_values) -> torch.Tensor:
            """Sum the received rows and this rank's own into `target` in ascending device order."""
            works, received = posted.pop(0)
            for work in works:
                work.wait()
            contributions = sorted([(self.rank, own_rows, own_values), *received], key=lambda entry: entry[0])
            rows = torch.cat([c[1] for c in contributions])
            if rows.numel():
                target.index_fill_(0, rows, 0)
            # each contribution adds at most once per row: every row's additions run in device order
            for _, rows, values in contributions:
                target.index_add_(0, rows, values)
            return target

        def relay_sums() -> torch.Tensor:
            """The held rows with this node's copies added in (relays), ready for the owners."""
            relayed = torch.cat([index(m.send_rows) for m in second]) if second else index(relay.local_held_rows[:0])
            partial_HN = held.clone() if relayed.numel() else held
            return land(partial_HN, relayed.unique(), held.index_select(0, relayed.unique()))

        def start_second() -> None:
            sums["partial"] = relay_sums()
            post(first, sums["partial"])

        with stream.launch(held, out):
            post(second, held)
            # ring reduces to the owners, on copies (a reduce may use its input as scratch)
            sums_R = [row.clone() for row in _ring_rows(relay, held, relay.ring_held_rows)]
            rings = [dist.reduce(row, group=self.group, group_dst=root, async_op=True)
                     for row, root in zip(sums_R, relay.ring_roots.tolist())]
            eager = device.type == "cuda"
            if eager:
                start_second()
        self._record(held.element_size(), reverse=True)

        def finish() -> torch.Tensor:
            if not eager:
                start_second()
            partial_HN = sums.pop("partial")
            out.zero_()
            land(out, index(relay.local_owned_rows), partial_HN.index_select(0, index(relay.local_held_rows)))
            for work, total, owned_row in zip(rings, sums_R, relay.ring_owned_rows.tolist()):
                work.wait()
                if owned_row >= 0:  # the ring's sum replaces the owner's own copy that `land` put there
                    out[owned_row].copy_(total)
            return out

        return CollectiveHandle(stream, finish)
