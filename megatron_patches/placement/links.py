"""Bytes moved per device by link class, and the time they take on a topology's links.

`CommBytes` is what every byte formula returns (`placement.accounting`) and what the simulator
prices (`sim.costs.CommModel`); `transfer_seconds` is the planner's own time model of it, which
`placement.collectives` uses to choose between the relays and a ring and FSSDP's cost model
uses for gathers and all-to-alls. Below both so that the collectives' choice and the formulas
share one model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement import kernels
from megatron_patches.placement.types import Topology

__all__ = ["CommBytes", "transfer_seconds"]


@dataclass(frozen=True)
class CommBytes:
    """Bytes sent and received per device, split by link class. All int64 [D]."""

    sent_intra_D: np.ndarray
    """Bytes each device sends to devices on its own node."""
    sent_inter_D: np.ndarray
    """Bytes each device sends to devices on other nodes."""
    recv_intra_D: np.ndarray
    """Bytes each device receives from devices on its own node."""
    recv_inter_D: np.ndarray
    """Bytes each device receives from devices on other nodes."""

    @classmethod
    def from_transfers(cls, src_K, dst_K, bytes_K, topology: Topology) -> CommBytes:
        """Aggregate point-to-point transfers (src -> dst, bytes); transfers to self are free."""
        src_K = np.asarray(src_K, dtype=np.int64)
        dst_K = np.asarray(dst_K, dtype=np.int64)
        bytes_K = np.broadcast_to(np.asarray(bytes_K, dtype=np.float64), src_K.shape)
        # float sums are exact for byte counts below 2**53 (8 PiB)
        return cls(*kernels.link_sums(src_K, dst_K, bytes_K, topology.node_of).astype(np.int64))

    def reversed(self) -> CommBytes:
        """The same transfers in the opposite direction (e.g. combine after dispatch, spRS after spAG)."""
        return CommBytes(self.recv_intra_D, self.recv_inter_D, self.sent_intra_D, self.sent_inter_D)

    def __add__(self, other: CommBytes) -> CommBytes:
        return CommBytes(
            self.sent_intra_D + other.sent_intra_D,
            self.sent_inter_D + other.sent_inter_D,
            self.recv_intra_D + other.recv_intra_D,
            self.recv_inter_D + other.recv_inter_D,
        )

    @property
    def sent_D(self) -> np.ndarray:
        """Bytes sent per device, both link classes."""
        return self.sent_intra_D + self.sent_inter_D

    @property
    def recv_D(self) -> np.ndarray:
        """Bytes received per device, both link classes."""
        return self.recv_intra_D + self.recv_inter_D

    @property
    def intra(self) -> int:
        """Total bytes over intra-node links (each byte counted once, at the sender)."""
        return int(self.sent_intra_D.sum())

    @property
    def inter(self) -> int:
        """Total bytes over inter-node links (each byte counted once, at the sender)."""
        return int(self.sent_inter_D.sum())

    @property
    def total(self) -> int:
        """Total bytes moved between devices."""
        return self.intra + self.inter


def transfer_seconds(comm: CommBytes, topology: Topology) -> float:
    """Time of a set of point-to-point transfers on the topology's links: the busiest device's
    intra-node bytes (sent or received) over the intra-node bandwidth, or its inter-node bytes over
    the inter-node bandwidth, whichever is longer. No latency, no NIC sharing (the simulator's
    `CommModel` adds both)."""
    return float(kernels.transfer_seconds(comm.sent_intra_D, comm.sent_inter_D, comm.recv_intra_D, comm.recv_inter_D,
                                          topology.intra_node_bw, topology.inter_node_bw))
