"""Bytes each rank sends and receives, per kind of traffic and per link class (DESIGN 5).

Every sparse collective records, on each rank, the bytes of the messages that rank sends
and receives, split into intra-node and inter-node by the `Topology` (device d = group rank
d, node-major). Local copies are free. Summed over ranks, the counters equal the formulas of
`placement.accounting` exactly (tests/comm checks it), so the logged bytes and the planned
bytes mean the same thing.

A `TrafficCounter` is per process. Metrics code reads it once per iteration (`sent_over`: summed
over the mode's group) and `reset()`s it; the mode decides which counter a collective records into (by default the
process-wide `default_counter()`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.placement.types import Topology

__all__ = ["LinkBytes", "TrafficCounter", "default_counter"]


@dataclass
class LinkBytes:
    """Bytes one rank moved for one kind of traffic."""

    sent_intra: int = 0
    """Bytes sent to devices on the same node."""
    sent_inter: int = 0
    """Bytes sent to devices on other nodes."""
    recv_intra: int = 0
    """Bytes received from devices on the same node."""
    recv_inter: int = 0
    """Bytes received from devices on other nodes."""

    @property
    def sent(self) -> int:
        """Bytes sent over both link classes."""
        return self.sent_intra + self.sent_inter

    @property
    def received(self) -> int:
        """Bytes received over both link classes."""
        return self.recv_intra + self.recv_inter

    def as_dict(self) -> dict[str, int]:
        """The four counters by name (for JSON logs)."""
        return {
            "sent_intra": self.sent_intra,
            "sent_inter": self.sent_inter,
            "recv_intra": self.recv_intra,
            "recv_inter": self.recv_inter,
        }


class TrafficCounter:
    """Per-kind byte counters of this rank ("spag", "sprs", ...)."""

    def __init__(self) -> None:
        self._kinds: dict[str, LinkBytes] = {}

    def record(self, kind: str, rank: int, topology: Topology, peer_P, sent_bytes_P, recv_bytes_P) -> None:
        """Add one collective's messages as seen by `rank`.

        Args:
            kind: the traffic kind, e.g. "spag".
            rank: this rank's device in `topology`.
            topology: classifies each peer as intra- or inter-node relative to `rank`.
            peer_P: the peers messages went to or came from; int [P].
            sent_bytes_P, recv_bytes_P: bytes sent to / received from each peer; int [P].
        """
        peer_P = np.asarray(peer_P, dtype=np.int64)
        sent_P = np.asarray(sent_bytes_P, dtype=np.int64)
        recv_P = np.asarray(recv_bytes_P, dtype=np.int64)
        intra_P = topology.same_node(rank, peer_P)
        entry = self._kinds.setdefault(kind, LinkBytes())
        entry.sent_intra += int(sent_P[intra_P].sum())
        entry.sent_inter += int(sent_P[~intra_P].sum())
        entry.recv_intra += int(recv_P[intra_P].sum())
        entry.recv_inter += int(recv_P[~intra_P].sum())

    def get(self, kind: str) -> LinkBytes:
        """The counters of one kind (all zero if nothing of that kind was recorded); a copy."""
        entry = self._kinds.get(kind, LinkBytes())
        return LinkBytes(entry.sent_intra, entry.sent_inter, entry.recv_intra, entry.recv_inter)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """All counters as {kind: {"sent_intra": ..., ...}}, kinds sorted."""
        return {kind: self._kinds[kind].as_dict() for kind in sorted(self._kinds)}

    def sent_over(self, kinds: tuple[str, ...], group) -> dict[str, dict[str, int]]:
        """Collective over ``group``: the bytes its ranks sent per kind, summed, in the records'
        form {kind: {"intra": ..., "inter": ...}} (a kind nothing recorded counts 0)."""
        local = [count for kind in kinds for count in (self.get(kind).sent_intra, self.get(kind).sent_inter)]
        summed = torch.tensor(local, dtype=torch.float64)  # a host tensor: every group has gloo beside NCCL
        dist.all_reduce(summed, group=group)
        values = summed.tolist()
        return {kind: {"intra": int(values[2 * i]), "inter": int(values[2 * i + 1])} for i, kind in enumerate(kinds)}

    def reset(self) -> None:
        """Forget everything recorded so far (e.g. at the start of an iteration)."""
        self._kinds.clear()


_DEFAULT = TrafficCounter()


def default_counter() -> TrafficCounter:
    """The process-wide counter collectives record into unless given another."""
    return _DEFAULT
