"""Pure planning of the sparse collectives: which rank sends which rows and columns to whom.

A logical buffer is C equal chunks of N elements (one chunk = one expert's flat parameters,
or its gradients). Two things describe where the data lives:

- the **ownership** P0 (`Ownership`): a partition of every chunk's elements over devices.
  Device d owns the columns [start_d, stop_d) of every chunk it owns. Two layouts of the
  placement engine are expressible this way:
  * expert-granular (FSSDP, `ShardLayout`): d owns whole chunks, columns [0, N), of the
    experts assigned to it;
  * element-granular (replicate mode, `ElementShardLayout`): every device owns slice d of
    *every* chunk (np.array_split bounds; a slice may be empty when N < D).
  Device d stores what it owns as an **owned buffer** of shape [O_d, stop_d - start_d]:
  one row per owned chunk, chunks ascending.
- the **instances** P1 (`InstancePlacement`): which devices hold a whole copy of which
  chunk. Device d stores its copies as a **held buffer** of shape [H_d, N]: one row per
  distinct chunk it holds, chunks ascending (the owned chunks included, so the MoE layer
  finds all its local experts in one packed tensor). Multiplicity in P1 (replicate mode's
  several slots of one expert on a rank) does not add rows: one copy serves all slots.

SparseAllGather(P0 -> P1) fills every held row: device o sends columns [start_o, stop_o) of
chunk c to every other device holding c. SparseReduceScatter(P1 -> P0) runs the same
transfers reversed: every holder of c sends those columns of its copy to o, which sums.

Between two devices r and p, everything of one collective travels as one message, rows in
ascending chunk order. Every rank derives its own part of the plan (`RankTransfers`) from
the same P0 and P1, so the sender's packing order and the receiver's unpacking order agree
without any metadata exchange. Planning is O(C x D) numpy per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_patches.placement.collectives import CopySources
from megatron_patches.placement.types import (
    ElementShardLayout,
    InstancePlacement,
    PlacementError,
    ShardLayout,
    check_int,
)

__all__ = ["Ownership", "PeerTransfer", "RankTransfers", "RelayTransfers", "StageMessage", "plan_rank_transfers",
           "plan_relay_transfers"]


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Ownership:
    """P0 of the sparse collectives: which device owns which columns of which chunk.

    Build it with `Ownership.of(layout, ...)`; the constructors below guarantee that the
    owned column ranges of every chunk tile [0, chunk_numel) exactly once, which is what makes
    every held row complete after a gather and every owned element a full sum after a reduce.
    """

    owns_CD: np.ndarray
    """owns_CD[c, d]: device d owns columns [start_D[d], stop_D[d]) of chunk c; bool [C, D], read-only."""
    start_D: np.ndarray
    """First column each device owns (of every chunk it owns); int64 [D], read-only."""
    stop_D: np.ndarray
    """One past the last column each device owns; int64 [D], read-only (stop == start: owns no elements)."""
    chunk_numel: int
    """N, elements per chunk."""
    element_granular: bool
    """True for slices of every chunk (ElementShardLayout), False for whole chunks (ShardLayout)."""

    @classmethod
    def of(cls, layout, num_chunks: int, chunk_numel: int) -> Ownership:
        """P0 from a placement-engine layout.

        Args:
            layout: a ShardLayout (whole chunks, one owner each), an InstancePlacement that is
                a partition (every chunk on exactly one device, once), or an ElementShardLayout
                (slice d of every chunk on device d; its num_elements must equal chunk_numel).
            num_chunks: C, the number of chunks (experts) of the buffer.
            chunk_numel: N, elements per chunk; >= 1.
        """
        num_chunks = check_int(num_chunks, "num_chunks", 1)
        chunk_numel = check_int(chunk_numel, "chunk_numel", 1)
        if isinstance(layout, InstancePlacement):
            layout = _partition_of(layout)
        if isinstance(layout, ShardLayout):
            if layout.num_experts != num_chunks:
                raise PlacementError(f"P0 covers {layout.num_experts} chunks but the buffer has {num_chunks}")
            owns_CD = layout.holds_ED().astype(bool)
            D = layout.num_devices
            return cls(
                _read_only(owns_CD),
                _read_only(np.zeros(D, dtype=np.int64)),
                _read_only(np.full(D, chunk_numel, dtype=np.int64)),
                chunk_numel,
                False,
            )
        if isinstance(layout, ElementShardLayout):
            if layout.num_elements != chunk_numel:
                raise PlacementError(
                    f"P0 slices chunks of {layout.num_elements} elements but the chunks have {chunk_numel}; "
                    "the ElementShardLayout must be built with num_elements = chunk_numel"
                )
            offsets = layout.offsets()
            return cls(
                _read_only(np.ones((num_chunks, layout.num_devices), dtype=bool)),
                _read_only(offsets[:-1].copy()),
                _read_only(offsets[1:].copy()),
                chunk_numel,
                True,
            )
        raise PlacementError(
            f"P0 must be a ShardLayout, an InstancePlacement that is a partition, or an ElementShardLayout; "
            f"got {type(layout).__name__}"
        )

    @property
    def num_chunks(self) -> int:
        """C."""
        return int(self.owns_CD.shape[0])

    @property
    def num_devices(self) -> int:
        """D."""
        return int(self.owns_CD.shape[1])

    @property
    def width_D(self) -> np.ndarray:
        """Columns owned per chunk by each device (the owned buffer's row length); int64 [D]."""
        return self.stop_D - self.start_D

    def owned_chunks(self, device: int) -> np.ndarray:
        """Chunks whose columns `device` owns, ascending (the rows of its owned buffer); int64."""
        return np.flatnonzero(self.owns_CD[:, device]).astype(np.int64)

    def require_contained_in(self, placement: InstancePlacement) -> None:
        """Raise PlacementError naming the first chunk whose owner holds no copy of it in P1.

        SparseAllGather requires P1 ⊇ P0 for whole-chunk ownership (FSSDP: an owner always
        keeps its expert usable). Slices of every chunk (replicate mode) are not instances, so
        nothing is required of them.
        """
        if placement.num_experts != self.num_chunks or placement.num_devices != self.num_devices:
            raise PlacementError(
                f"P1 has {placement.num_experts} chunks x {placement.num_devices} devices but P0 has "
                f"{self.num_chunks} chunks x {self.num_devices} devices"
            )
        if self.element_granular:
            return
        lacking = np.argwhere(self.owns_CD & ~placement.holds_ED())
        if lacking.size:
            c, d = (int(i) for i in lacking[0])
            raise PlacementError(
                f"chunk {c} is owned by device {d} in P0 but P1 holds no copy of it on device {d}; "
                "P1 must contain P0 (add the owner to the chunk's instances)"
            )


def _partition_of(placement: InstancePlacement) -> ShardLayout:
    """The ShardLayout of a placement that holds every chunk on exactly one device, once."""
    counts_ED = placement.counts_ED
    over = np.argwhere(counts_ED > 1)
    if over.size:
        c, d = (int(i) for i in over[0])
        raise PlacementError(
            f"chunk {c} has {int(counts_ED[c, d])} instances on device {d} in P0; "
            "P0 must assign every chunk to exactly one device, once"
        )
    shared = np.flatnonzero(counts_ED.sum(axis=1) > 1)
    if shared.size:
        c = int(shared[0])
        raise PlacementError(
            f"chunk {c} is on devices {np.flatnonzero(counts_ED[c]).tolist()} in P0; "
            "P0 must assign every chunk to exactly one device (a partition)"
        )
    return ShardLayout(np.argmax(counts_ED, axis=1), placement.num_devices)


@dataclass(frozen=True, eq=False)
class PeerTransfer:
    """What one rank exchanges with one peer in a SparseAllGather (a reduce-scatter reverses it).

    Rows index the rank's own buffers; both lists follow ascending chunk order, which is the
    order the peer packs or unpacks the same chunks in.
    """

    peer: int
    """The other device (group rank); never the rank itself."""
    owned_rows: np.ndarray
    """Rows of my owned buffer whose chunk the peer holds: gather sends them, reduce receives
    the peer's gradient for them. int64, read-only."""
    held_rows: np.ndarray
    """Rows of my held buffer whose chunk the peer owns: gather receives the peer's columns of
    them, reduce sends my gradient's columns of them. int64, read-only."""
    peer_start: int
    """First column the peer owns (of every chunk it owns)."""
    peer_stop: int
    """One past the last column the peer owns."""


@dataclass(frozen=True, eq=False)
class RankTransfers:
    """One rank's part of the plan SparseAllGather(P0 -> P1); SparseReduceScatter(P1 -> P0) reverses it."""

    rank: int
    """The device (group rank) this plan is for."""
    chunk_numel: int
    """N, elements per chunk (the held buffer's row length)."""
    owned_chunks: np.ndarray
    """Chunk of each row of the owned buffer, ascending; int64 [O], read-only."""
    held_chunks: np.ndarray
    """Chunk of each row of the held buffer, ascending; int64 [H], read-only."""
    start: int
    """First column this rank owns (of every chunk it owns)."""
    stop: int
    """One past the last column this rank owns."""
    local_owned_rows: np.ndarray
    """Owned-buffer rows of chunks this rank also holds (copied locally, no transfer); int64, read-only."""
    local_held_rows: np.ndarray
    """The held-buffer rows of the same chunks, in the same order; int64, read-only."""
    peers: tuple[PeerTransfer, ...]
    """One entry per peer with anything to exchange, ascending by peer."""

    @property
    def owned_shape(self) -> tuple[int, int]:
        """Shape of the owned buffer: [owned chunks, owned columns per chunk]."""
        return (int(self.owned_chunks.size), self.stop - self.start)

    @property
    def held_shape(self) -> tuple[int, int]:
        """Shape of the held buffer: [held chunks, chunk_numel]."""
        return (int(self.held_chunks.size), self.chunk_numel)

    def gather_numel(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Elements exchanged with each peer in the gather (the reduce swaps sent and received).

        Returns (peer_P, send_numel_P, recv_numel_P), int64 [P] over `peers`. A peer's row list
        is empty exactly when its message is empty (empty column ranges are planned out).
        """
        peer_P = np.array([p.peer for p in self.peers], dtype=np.int64)
        send_numel_P = np.array([p.owned_rows.size for p in self.peers], dtype=np.int64) * (self.stop - self.start)
        recv_numel_P = np.array([p.held_rows.size * (p.peer_stop - p.peer_start) for p in self.peers], dtype=np.int64)
        return peer_P, send_numel_P, recv_numel_P


def _check_rank(rank, num_devices: int) -> int:
    """`rank` as an int, or PlacementError unless it is a device of the placement."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_devices:
        raise PlacementError(f"rank {rank!r} is not a device of the placement, which has devices [0, {num_devices})")
    return int(rank)


def plan_rank_transfers(ownership: Ownership, placement: InstancePlacement, rank: int) -> RankTransfers:
    """Rank `rank`'s transfers for SparseAllGather(ownership -> placement).

    Checks the pre-condition P1 ⊇ P0 (whole-chunk ownership) and that the plan meets the
    post-conditions (`_check_postconditions`). Deterministic: rank r's message to p lists the
    same chunks in the same order as p's message from r (tests/comm checks all pairs).
    """
    ownership.require_contained_in(placement)
    rank = _check_rank(rank, ownership.num_devices)
    owns_CD = ownership.owns_CD
    holds_CD = placement.holds_ED()
    nonempty_D = ownership.width_D > 0

    owned_chunks = ownership.owned_chunks(rank)
    held_chunks = np.flatnonzero(holds_CD[:, rank]).astype(np.int64)
    owned_row_C = np.full(ownership.num_chunks, -1, dtype=np.int64)
    owned_row_C[owned_chunks] = np.arange(owned_chunks.size)
    held_row_C = np.full(ownership.num_chunks, -1, dtype=np.int64)
    held_row_C[held_chunks] = np.arange(held_chunks.size)

    # send_CP[c, p]: I own columns of c and p holds c; recv_CP[c, p]: I hold c and p owns columns of it.
    # Empty column ranges move nothing, so they take no part in any message.
    send_CP = owns_CD[:, rank, None] & holds_CD & nonempty_D[rank]
    recv_CP = holds_CD[:, rank, None] & owns_CD & nonempty_D[None, :]
    send_CP[:, rank] = False
    recv_CP[:, rank] = False
    local_C = owns_CD[:, rank] & holds_CD[:, rank] & nonempty_D[rank]

    peers = []
    for p in np.flatnonzero(send_CP.any(axis=0) | recv_CP.any(axis=0)):
        peers.append(
            PeerTransfer(
                peer=int(p),
                owned_rows=_read_only(owned_row_C[send_CP[:, p]]),
                held_rows=_read_only(held_row_C[recv_CP[:, p]]),
                peer_start=int(ownership.start_D[p]),
                peer_stop=int(ownership.stop_D[p]),
            )
        )
    plan = RankTransfers(
        rank=rank,
        chunk_numel=ownership.chunk_numel,
        owned_chunks=_read_only(owned_chunks),
        held_chunks=_read_only(held_chunks),
        start=int(ownership.start_D[rank]),
        stop=int(ownership.stop_D[rank]),
        local_owned_rows=_read_only(owned_row_C[local_C]),
        local_held_rows=_read_only(held_row_C[local_C]),
        peers=tuple(peers),
    )
    _check_postconditions(plan, placement)
    return plan


def _check_postconditions(plan: RankTransfers, placement: InstancePlacement) -> None:
    """Raise RuntimeError unless the plan fills every held row and sums every copy, exactly once.

    Gather: each held row's columns, local and received, must add up to N (the owners' column
    ranges tile a chunk). Reduce: each owned row with columns must receive one contribution per
    distinct holder of its chunk. Cheap (O(H + O + messages)); guards the planner, not the caller.
    """
    covered_H = np.zeros(plan.held_chunks.size, dtype=np.int64)
    covered_H[plan.local_held_rows] += plan.stop - plan.start
    copies_O = np.zeros(plan.owned_chunks.size, dtype=np.int64)
    copies_O[plan.local_owned_rows] += 1
    for peer in plan.peers:
        covered_H[peer.held_rows] += peer.peer_stop - peer.peer_start
        copies_O[peer.owned_rows] += 1
    short = np.flatnonzero(covered_H != plan.chunk_numel)
    if short.size:
        h = int(short[0])
        raise RuntimeError(
            f"transfer plan bug: chunk {int(plan.held_chunks[h])} on device {plan.rank} would get "
            f"{int(covered_H[h])} of {plan.chunk_numel} elements"
        )
    expected_O = placement.replicas_E()[plan.owned_chunks] if plan.stop > plan.start else copies_O
    wrong = np.flatnonzero(copies_O != expected_O)
    if wrong.size:
        o = int(wrong[0])
        raise RuntimeError(
            f"transfer plan bug: device {plan.rank} would sum {int(copies_O[o])} copies of chunk "
            f"{int(plan.owned_chunks[o])}, which has {int(expected_O[o])}"
        )


# ---- node-aware (relayed) plans: whole-chunk ownership, two stages and ring broadcasts --------


@dataclass(frozen=True, eq=False)
class StageMessage:
    """What one rank exchanges with one peer in one stage of a relayed gather (a reduce
    reverses it). Both row lists follow ascending chunk order, the peer's packing order."""

    peer: int
    """The other device (group rank); never the rank itself."""
    send_rows: np.ndarray
    """Rows this rank sends in the gather: of its owned buffer in the first stage (it owns the
    chunks), of its held buffer in the second (it relays copies it received). int64, read-only."""
    recv_rows: np.ndarray
    """Rows of this rank's held buffer the peer fills in the gather. int64, read-only."""


@dataclass(frozen=True, eq=False)
class RelayTransfers:
    """One rank's part of a relayed SparseAllGather: stage 1, owners send to the holders on their
    own node and to each other node's relay; then the ring broadcasts of the chunks every device
    holds, when the ring is faster; stage 2, relays send to their node's other holders
    (`placement.collectives`). SparseReduceScatter runs stage 2 reversed, the broadcasts as ring
    reduces, then stage 1 reversed."""

    rank: int
    """The device (group rank) this plan is for."""
    num_devices: int
    """D, the group's size."""
    chunk_numel: int
    """N, elements per chunk."""
    owned_chunks: np.ndarray
    """Chunk of each row of the owned buffer, ascending; int64 [O], read-only."""
    held_chunks: np.ndarray
    """Chunk of each row of the held buffer, ascending (owned chunks included); int64 [H], read-only."""
    local_owned_rows: np.ndarray
    """Owned-buffer rows (all of them: an owner holds its chunks)."""
    local_held_rows: np.ndarray
    """The held-buffer rows of the same chunks, in the same order."""
    stages: tuple[tuple[StageMessage, ...], tuple[StageMessage, ...]]
    """Stage 1's and stage 2's messages, ascending by peer (peers with something to exchange)."""
    ring_chunks: np.ndarray
    """Chunks broadcast along the ring of all devices (every device holds them), ascending;
    int64 [R], read-only. Every rank takes part in each broadcast, in this order."""
    ring_roots: np.ndarray
    """Their owners, the broadcasts' roots; int64 [R], read-only."""
    ring_held_rows: np.ndarray
    """Their rows in this rank's held buffer; int64 [R], read-only."""
    ring_owned_rows: np.ndarray
    """Their rows in this rank's owned buffer, -1 where another rank owns it; int64 [R], read-only."""

    def gather_numel(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(peer_P, send_numel_P, recv_numel_P) of the whole gather (both stages, one entry per
        message, then the ring broadcasts: from the ring predecessor rank - 1 unless this rank is
        the root, to the successor rank + 1 unless that is the root; the byte model of NCCL's
        ring), as `RankTransfers.gather_numel`; the reduce swaps sent and received."""
        messages = [m for stage in self.stages for m in stage]
        peer_P = np.array([m.peer for m in messages], dtype=np.int64)
        send_P = np.array([m.send_rows.size for m in messages], dtype=np.int64) * self.chunk_numel
        recv_P = np.array([m.recv_rows.size for m in messages], dtype=np.int64) * self.chunk_numel
        if self.ring_chunks.size:
            D = self.num_devices
            receives = int(np.count_nonzero(self.ring_roots != self.rank))
            sends = int(np.count_nonzero(self.ring_roots != (self.rank + 1) % D))
            peer_P = np.concatenate([peer_P, [(self.rank - 1) % D, (self.rank + 1) % D]])
            send_P = np.concatenate([send_P, [0, sends * self.chunk_numel]])
            recv_P = np.concatenate([recv_P, [receives * self.chunk_numel, 0]])
        return peer_P, send_P, recv_P


def plan_relay_transfers(shard: ShardLayout, placement: InstancePlacement, sources: CopySources, chunk_numel: int,
                         rank: int) -> RelayTransfers:
    """Rank `rank`'s transfers for SparseAllGather(shard -> placement) where device d gets chunk c
    from `sources.source_ED[c, d]` (`placement.collectives.copy_sources`).

    A point-to-point transfer is stage 1 when its source is the chunk's owner, stage 2 when it is a
    relay (which received the chunk in stage 1); the ring chunks (`sources.ring_E`) are broadcast
    in between. Checks that every held row is filled exactly once.
    """
    rank = _check_rank(rank, placement.num_devices)
    owner_C = shard.owner_E
    ring_C = np.asarray(sources.ring_E, dtype=bool)
    ring_chunks = np.flatnonzero(ring_C).astype(np.int64)
    source_ED = np.where(ring_C[:, None], -1, sources.source_ED)  # the broadcasts are not messages
    owned_chunks = np.flatnonzero(owner_C == rank).astype(np.int64)
    held_chunks = np.flatnonzero(placement.holds_ED()[:, rank]).astype(np.int64)
    owned_row_C = np.full(owner_C.size, -1, dtype=np.int64)
    owned_row_C[owned_chunks] = np.arange(owned_chunks.size)
    held_row_C = np.full(owner_C.size, -1, dtype=np.int64)
    held_row_C[held_chunks] = np.arange(held_chunks.size)
    from_owner_CD = source_ED == owner_C[:, None]
    relayed_CD = (source_ED >= 0) & ~from_owner_CD
    relay_sources = source_ED[relayed_CD]
    if not np.all(from_owner_CD[np.nonzero(relayed_CD)[0], relay_sources]):
        raise RuntimeError("transfer plan bug: a relay forwards a chunk it does not receive from the owner")
    stages = []
    for stage_CD, send_row_C in ((from_owner_CD, owned_row_C), (relayed_CD, held_row_C)):
        sends_CP = stage_CD & (source_ED == rank)        # I send chunk c to p
        recvs_CP = np.zeros_like(stage_CD)                # p sends chunk c to me
        senders_C = np.where(stage_CD[:, rank], source_ED[:, rank], -1)
        recvs_CP[np.flatnonzero(senders_C >= 0), senders_C[senders_C >= 0]] = True
        messages = []
        for p in np.flatnonzero(sends_CP.any(axis=0) | recvs_CP.any(axis=0)):
            messages.append(StageMessage(int(p), _read_only(send_row_C[sends_CP[:, p]]), _read_only(held_row_C[recvs_CP[:, p]])))
        stages.append(tuple(messages))
    local = np.arange(owned_chunks.size, dtype=np.int64)
    plan = RelayTransfers(rank, placement.num_devices, int(chunk_numel), _read_only(owned_chunks),
                          _read_only(held_chunks), _read_only(local), _read_only(held_row_C[owned_chunks]),
                          (stages[0], stages[1]), _read_only(ring_chunks), _read_only(owner_C[ring_chunks].astype(np.int64)),
                          _read_only(held_row_C[ring_chunks]), _read_only(owned_row_C[ring_chunks]))
    if np.any(plan.ring_held_rows < 0):
        raise RuntimeError("transfer plan bug: a ring chunk is not held by every device")
    filled_H = np.zeros(held_chunks.size, dtype=np.int64)
    filled_H[plan.local_held_rows] += 1
    filled_H[plan.ring_held_rows[plan.ring_roots != rank]] += 1
    for stage in plan.stages:
        for message in stage:
            filled_H[message.recv_rows] += 1
    wrong = np.flatnonzero(filled_H != 1)
    if wrong.size:
        h = int(wrong[0])
        raise RuntimeError(f"transfer plan bug: chunk {int(held_chunks[h])} on device {rank} would be filled "
                           f"{int(filled_H[h])} times")
    return plan
