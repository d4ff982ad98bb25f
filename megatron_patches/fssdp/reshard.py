"""Heterogeneous re-sharding (DESIGN 4.3): moving whole experts, weights and optimizer state.

Megatron gives every rank E/D local expert modules per MoE layer, L*E/D in all: their
parameters sit in Megatron's DDP buffer, their Adam state in Megatron's optimizer. FSSDP
uses these modules as *slots*: slot s = local expert s % (E/D) of the stage's MoE layer
s // (E/D), and a `SlotTable` says which (layer, expert) each slot holds. At start the table
is the identity (Megatron's EP layout, the even sharding). Heterogeneous sharding keeps every
rank's total at L*E/D experts but varies the count per layer, so a slot may hold an expert
of another layer: all MoE layers of a stage share one expert configuration (checked), hence
one parameter shape per slot.

Re-sharding from layout A to layout B moves every expert whose owner changes: its owner packs
the slot's weights and optimizer tensors into one byte row, all rows between two ranks travel
as one message (batched point-to-point on the FSSDP group), and the receiver unpacks each row
into a slot its departing experts freed. DDP, the optimizer and gradient clipping see the same
parameter objects as before, only their contents change; the gradient buffers are not moved
(re-sharding runs between iterations, when they are zero).

`plan_reshard` is pure planning (the same on every rank); `exchange_slots` runs the transfers
and `move_slots` moves the slots' weights with Megatron's optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.exchange import exchange
from megatron_patches.comm.groups import record_ring_allreduce
from megatron_patches.comm.traffic import TrafficCounter
from megatron_patches.compat.moe import OptimizerStateMissing, expert_optimizer_shard, shards_over_data_parallel
from megatron_patches.placement.types import ModelShardLayout, Topology

__all__ = ["ReshardMoves", "ShardedSlotState", "SlotTable", "exchange_slots", "move_slots", "optimizer_state_exists",
           "plan_reshard"]


@dataclass(frozen=True)
class SlotTable:
    """Which (layer, expert) each of one rank's expert slots holds."""

    held_S2: np.ndarray
    """held_S2[s] = (layer row, expert) held by slot s; int64 [S, 2]. Layer rows index the
    stage's MoE layers; slot s is local expert s % slots_per_layer of layer row s // slots_per_layer."""
    slots_per_layer: int
    """E/D: Megatron's local experts per layer and rank."""

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_devices: int, rank: int) -> "SlotTable":
        """Megatron's EP layout: slot (l, j) holds expert rank*E/D + j of layer l."""
        if num_experts % num_devices:
            raise ValueError(f"{num_experts} experts do not split evenly over {num_devices} ranks")
        per_layer = num_experts // num_devices
        rows = np.repeat(np.arange(num_layers, dtype=np.int64), per_layer)
        experts = np.tile(rank * per_layer + np.arange(per_layer, dtype=np.int64), num_layers)
        return cls(np.stack([rows, experts], axis=1), per_layer)

    def check(self, layout: ModelShardLayout, rank: int) -> None:
        """Raise ValueError unless the slots hold exactly the experts `layout` gives `rank`."""
        owned = np.argwhere(layout.owners_LE == rank)
        held = self.held_S2[np.lexsort((self.held_S2[:, 1], self.held_S2[:, 0]))]
        if owned.shape != held.shape or not np.array_equal(owned, held):
            raise ValueError(
                f"rank {rank}: the slots hold {held.tolist()} (layer, expert) but the shard layout gives it {owned.tolist()}"
            )

    def slots_of(self, row: int) -> np.ndarray:
        """The slots holding layer `row`'s experts, in ascending expert order (the order of the
        sparse collectives' owned buffer); int64."""
        slots = np.flatnonzero(self.held_S2[:, 0] == row)
        return slots[np.argsort(self.held_S2[slots, 1], kind="stable")].astype(np.int64)


@dataclass(frozen=True)
class ReshardMoves:
    """One rank's part of a re-shard from one ModelShardLayout to another."""

    send: tuple[tuple[int, np.ndarray], ...]
    """(peer, slots) per peer that receives experts from this rank; slots in the peer's order."""
    recv: tuple[tuple[int, np.ndarray], ...]
    """(peer, slots) per peer that sends experts here; slots to fill, in the sender's order."""
    table: SlotTable
    """This rank's slot table after the re-shard."""
    moved: int
    """Experts that change owner, over all ranks and layers (the same on every rank)."""


def plan_reshard(table: SlotTable, current: ModelShardLayout, proposed: ModelShardLayout, rank: int) -> ReshardMoves:
    """The transfers that take `rank` from `current` to `proposed` (identical inputs on every
    rank give matching sends and receives).

    Experts travel from their current owner to their proposed owner in ascending (layer,
    expert) order. Experts that stay keep their slot; a receiver fills the slots its departing
    experts free, in ascending slot order, with the arriving experts in ascending (layer,
    expert) order.
    """
    if current.owners_LE.shape != proposed.owners_LE.shape or current.num_devices != proposed.num_devices:
        raise ValueError(
            f"layouts differ in shape: {current.owners_LE.shape} over {current.num_devices} devices vs "
            f"{proposed.owners_LE.shape} over {proposed.num_devices}"
        )
    if not np.array_equal(current.counts_D(), proposed.counts_D()):
        raise ValueError(
            f"experts per rank must stay {current.counts_D().tolist()} (one slot each), the proposal has "
            f"{proposed.counts_D().tolist()}"
        )
    table.check(current, rank)
    moving_K2 = np.argwhere(current.owners_LE != proposed.owners_LE)  # ascending (layer, expert)
    source_K = current.owners_LE[moving_K2[:, 0], moving_K2[:, 1]]
    dest_K = proposed.owners_LE[moving_K2[:, 0], moving_K2[:, 1]]
    slot_of = {(int(l), int(e)): s for s, (l, e) in enumerate(table.held_S2)}
    send = []
    for peer in np.unique(dest_K[source_K == rank]):
        experts = moving_K2[(source_K == rank) & (dest_K == peer)]
        send.append((int(peer), np.array([slot_of[(int(l), int(e))] for l, e in experts], dtype=np.int64)))
    arriving = (dest_K == rank)
    freed = np.sort(np.array([slot_of[(int(l), int(e))] for l, e in moving_K2[source_K == rank]], dtype=np.int64))
    held_S2 = table.held_S2.copy()
    target_K = np.full(moving_K2.shape[0], -1, dtype=np.int64)
    target_K[arriving] = freed  # counts match: experts per rank are unchanged
    held_S2[target_K[arriving]] = moving_K2[arriving]
    recv = [(int(peer), target_K[arriving & (source_K == peer)]) for peer in np.unique(source_K[arriving])]
    new_table = SlotTable(held_S2, table.slots_per_layer)
    new_table.check(proposed, rank)
    return ReshardMoves(tuple(send), tuple(recv), new_table, int(moving_K2.shape[0]))


def exchange_slots(
    moves: ReshardMoves,
    slot_tensors: Callable[[int], list[torch.Tensor]],
    group: dist.ProcessGroup,
    topology: Topology,
    traffic: TrafficCounter,
    kind: str = "reshard",
) -> None:
    """Moves the contents of the slots per `moves` (a collective over `group`).

    Args:
        moves: this rank's part of the re-shard (`plan_reshard`).
        slot_tensors: slot -> the contiguous tensors that make up its content (weights and
            optimizer state), in an order and with sizes that are the same for every slot on
            every rank; they are overwritten in place on the receiving side.
        group: the process group; group rank d is device d of the layouts.
        topology: the devices' nodes, for intra/inter-node byte counts.
        traffic: where this rank's sent and received bytes are recorded under `kind`.
    """
    def pack(slots: np.ndarray) -> torch.Tensor:
        return torch.stack([torch.cat([t.reshape(-1).view(torch.uint8) for t in slot_tensors(int(s))]) for s in slots])

    row_bytes = sum(t.numel() * t.element_size() for t in slot_tensors(0))
    device = slot_tensors(0)[0].device
    # Rows are packed (copied) before anything is received: a slot may send its old content
    # and receive a new one in the same exchange.
    sends = {peer: pack(slots) for peer, slots in moves.send}
    recvs = {peer: torch.empty((slots.size, row_bytes), dtype=torch.uint8, device=device) for peer, slots in moves.recv}
    exchange(group, sends, recvs, traffic=traffic, kind=kind, topology=topology)
    for peer, slots in moves.recv:
        for slot, row in zip(slots, recvs[peer]):
            offset = 0
            for tensor in slot_tensors(int(slot)):
                size = tensor.numel() * tensor.element_size()
                tensor.view(-1).view(torch.uint8).copy_(row[offset : offset + size])
                offset += size


class ShardedSlotState:
    """Whole-expert rows for `exchange_slots` when a distributed optimizer shards the experts'
    optimizer state over the expert-data-parallel group (EDP > 1).

    Every FSSDP group re-shards alike, so position d of every group sends the same slots to
    position d' of its own group; but each of them keeps only a range of every slot's optimizer
    state (its shard of position d's gradient buffer), and the range it must keep of the arriving
    expert is its shard of the *receiving* slot. So the moving experts' state is made whole
    first: each rank writes its ranges into zero tensors of the whole parameters' size, and one
    all-reduce (sum) over the expert-data-parallel group completes them (every element is held by
    exactly one member, so the sum adds zeros only: exact). The rows then travel whole inside
    each group, and each receiver keeps its own range. The weights are whole on every rank
    already (the distributed optimizer all-gathers them after its step) and travel in place.

    Args (callables so that this module stays free of Megatron):
        slot_params: slot -> its parameters, in a fixed order.
        num_slots: this rank's expert slots (all of them: a rank may keep no element of some).
        shard_of: parameter -> (first element, tensors of the range) this rank's optimizer
            keeps, or None when it keeps no element of it (`compat.moe.expert_optimizer_shard`).
        edp_group: the expert-data-parallel group (position d of every FSSDP group).
    """

    def __init__(self, slot_params: Callable[[int], list[torch.nn.Parameter]], num_slots: int, shard_of,
                 edp_group: dist.ProcessGroup):
        self.slot_params, self.num_slots, self.shard_of, self.edp_group = slot_params, num_slots, shard_of, edp_group
        self.staged: dict[int, list[torch.Tensor]] = {}
        self.state_count: int | None = None
        """Optimizer tensors per parameter (Adam's two moments, and the fp32 main weights in
        mixed precision); found from a parameter this rank keeps a range of."""

    def _count(self) -> int:
        if self.state_count is None:
            for param in (p for slot in range(self.num_slots) for p in self.slot_params(slot)):
                shard = self.shard_of(param)
                if shard is not None:
                    self.state_count = len(shard.tensors)
                    break
            else:
                raise RuntimeError(
                    "fssdp re-shard: this rank's distributed optimizer keeps no element of any expert slot, so the "
                    "number of optimizer tensors per parameter is unknown here (fewer expert elements than "
                    "expert-data-parallel ranks?)"
                )
        return self.state_count

    def tensors(self, slot: int) -> list[torch.Tensor]:
        """The slot's row content: per parameter, the parameter itself, then its optimizer
        tensors whole (staged: zeros until `gather`)."""
        if slot not in self.staged:
            count = self._count()
            row = []
            for param in self.slot_params(slot):
                row.append(param.data.view(-1))
                row.extend(torch.zeros(param.numel(), dtype=torch.float32, device=param.device) for _ in range(count))
            self.staged[slot] = row
        return self.staged[slot]

    def _ranges(self, slot: int):
        """(staged whole tensor, first element, this rank's tensor of its range) of the slot."""
        staged = iter(self.tensors(slot))
        for param in self.slot_params(slot):
            next(staged)  # the parameter itself
            whole = [next(staged) for _ in range(self._count())]
            shard = self.shard_of(param)
            for full, part in zip(whole, () if shard is None else shard.tensors):
                if part.dtype != full.dtype:
                    raise RuntimeError(f"fssdp re-shard: optimizer state in {part.dtype}, staged in {full.dtype}")
                yield full, shard.start, part

    def gather(self, slots: list[int]) -> torch.Tensor | None:
        """Makes the optimizer state of `slots` (this rank's departing experts) whole on every
        member of the expert-data-parallel group; returns the all-reduced buffer (for its bytes),
        None without slots (then no member of the group has any: they re-shard alike)."""
        if not slots:
            return None
        for slot in slots:
            for full, start, part in self._ranges(slot):
                full[start:start + part.numel()].copy_(part)
        state = [t for slot in slots for i, t in enumerate(self.tensors(slot)) if i % (self._count() + 1)]
        flat = torch.cat(state)
        dist.all_reduce(flat, group=self.edp_group)
        offset = 0
        for tensor in state:
            tensor.copy_(flat[offset:offset + tensor.numel()])
            offset += tensor.numel()
        return flat

    def scatter(self, slots: list[int]) -> None:
        """Keeps this rank's range of the arriving experts' optimizer state."""
        for slot in slots:
            for full, start, part in self._ranges(slot):
                part.copy_(full[start:start + part.numel()])


def move_slots(moves: ReshardMoves, slot_modules: list, optimizer, group, edp_group, edp_topology: Topology,
               topology: Topology, traffic: TrafficCounter, param_sync: Callable | None) -> None:
    """Moves the slots' weights and Megatron's optimizer state per `moves`. With the distributed
    optimizer over several expert groups each rank keeps a range of every expert's state: the
    departing experts' state is made whole over the expert-data-parallel group first
    (`ShardedSlotState`; its bytes are `reshard_edp`, over ``edp_topology``, the group's nodes, which
    the runtime takes once at start-up). ``param_sync``: with
    --overlap-param-gather, waits for a parameter's all-gather (None otherwise)."""
    sending = [int(s) for _, slots in moves.send for s in slots]
    receiving = [int(s) for _, slots in moves.recv for s in slots]
    if param_sync is not None:
        # the last step's all-gather must land before the weights are read (departing) or
        # overwritten (arriving; a later wait would write the old ones back)
        for slot in sending + receiving:
            for param in slot_modules[slot].parameters():
                param_sync(param)
    first = next(slot_modules[0].parameters())
    if not shards_over_data_parallel(optimizer, first):
        exchange_slots(moves, lambda slot: _slot_tensors(slot_modules[slot], optimizer), group, topology, traffic)
        return
    staged = ShardedSlotState(lambda slot: list(slot_modules[slot].parameters()), len(slot_modules),
                              lambda param: expert_optimizer_shard(optimizer, param), edp_group)
    flat = staged.gather(sending)
    if flat is not None:
        record_ring_allreduce(traffic, "reshard_edp", flat, dist.get_rank(edp_group), dist.get_world_size(edp_group),
                              edp_topology)
    exchange_slots(moves, staged.tensors, group, topology, traffic)
    staged.scatter(receiving)


def _slot_tensors(expert, optimizer) -> list[torch.Tensor]:
    """A slot's content: each parameter, then the optimizer's tensors for it (whole: an optimizer
    that is not sharded over expert groups keeps every element)."""
    tensors = []
    for param in expert.parameters():
        tensors.append(param.data.view(-1))
        shard = expert_optimizer_shard(optimizer, param)
        if shard is None or shard.start or shard.tensors[0].numel() != param.numel():
            raise RuntimeError(f"fssdp re-shard: the optimizer keeps part of an expert parameter of shape "
                               f"{tuple(param.shape)} on this rank, but its state was taken as whole")
        tensors.extend(shard.tensors)
    return tensors


def optimizer_state_exists(slot_modules: list, optimizer) -> bool:
    """Whether the optimizer holds state for the experts on every rank of the job (the first
    step that is not skipped creates it everywhere at once; all-reduced all the same, so that
    every rank takes the same re-shard decision)."""
    exists = 1.0
    try:
        for param in slot_modules[0].parameters():
            expert_optimizer_shard(optimizer, param)
    except OptimizerStateMissing:
        exists = 0.0
    flag = torch.tensor([exists], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
