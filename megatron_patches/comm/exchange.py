"""The one point-to-point exchange the modes move rows with: a message to each peer that has rows
for it, a preallocated buffer from each peer that has rows for us, all posted in one
`batch_isend_irecv` and waited, and the bytes counted per peer.

fssdp's re-shard (slots' weights and optimizer state), replicate's gradient fetch and its
periodic baseline's state moves, and zebra's expert moves on a re-plan all pack their rows per
peer and call this.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist

from megatron_patches.comm.traffic import TrafficCounter
from megatron_patches.placement.types import Topology

__all__ = ["exchange"]


def exchange(group, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], *,
             traffic: TrafficCounter | None = None, kind: str = "", topology: Topology | None = None) -> tuple[int, int]:
    """Send ``sends[peer]`` to every peer and fill ``recvs[peer]`` from it (a collective among
    the ranks that exchange: every message must have its matching buffer on the peer, of the same
    size). ``group``: the process group the peers are ranks of (None: the world, peers are global
    ranks). One message per peer and direction. With ``traffic``, this rank's bytes per peer are
    recorded under ``kind`` (device d of ``topology`` = group rank d). Returns this rank's
    (bytes sent, bytes received)."""
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), group=group, group_peer=peer) for peer, tensor in sends.items()]
    ops += [dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer) for peer, buffer in recvs.items()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    sent = {peer: tensor.numel() * tensor.element_size() for peer, tensor in sends.items()}
    received = {peer: buffer.numel() * buffer.element_size() for peer, buffer in recvs.items()}
    if traffic is not None:
        peers = sorted(set(sent) | set(received))
        traffic.record(kind, dist.get_rank(group), topology, peers, [sent.get(p, 0) for p in peers],
                       [received.get(p, 0) for p in peers])
    return sum(sent.values()), sum(received.values())
