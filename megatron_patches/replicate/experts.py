"""The per-iteration communication of one replicate-mode MoE layer's experts (DESIGN 4.6).

One `ReplicatedExperts` per MoE layer and rank, over the replicate group of G ranks (group
rank = device of the placement). Per iteration, in this order on every rank:

    global_E = experts.popularity(local_counts_E)          # after the router: one small all-reduce
    ... forward and backward of the slot experts (experts.slots.slots_SN) ...
    grad_En = experts.reduce_gradients(experts.slots.slots_SN.grad)   # (a), (b); or start_reduce
                                                             # when the slots' gradient is complete,
                                                             # finish_reduce after the backward
    experts.step(grad_En, lr)                                # (d): Adam on the owned slices
    experts.push(next_slot_expert_RS)                        # (e): into the next placement's slots

Gradient path, for the slots' current placement P (E experts, N elements each, rank r owns
the n_r elements of slice r of every expert):
(a) intra-rank: the slots of one class on this rank are summed into one representative row;
(b) a sparse reduce-scatter to the slice owners (`comm.sparse.SparseReduceScatter(P, slices)`,
    one batched point-to-point exchange over the replicate group, which is Megatron's EP group):
    every holder of a class sends each other rank r its representative's slice r, and r sums
    the holders' slices in ascending rank order. No process group beyond the EP group exists
    for it, so the job's communicator count does not grow with the ranks (the design up to
    2026-11-28 all-reduced among the holders over one pre-registered group per contiguous rank
    range, N (N - 1) / 2 of them: 523,776 at 1,024 ranks, and then fetched the slices).
Weight push: `SparseAllGather(ElementShardLayout(N, G), P')` sends every rank's updated slices
straight into the rows of the next placement P'; the old slot contents are overwritten.

Bytes (recorded per rank in a `TrafficCounter`, intra/inter-node by the `Topology`), with
H_r = distinct classes on rank r, m_e = ranks holding class e, b = bytes per element:
- "popularity": a ring all-reduce of E counts (`comm.groups.ring_allreduce_numel`);
- "grad_reduce_scatter": sum over ranks r of sum over held classes of (N - n_r) b (every
  other rank's slice of each representative), i.e. sum over classes of m_e N - sum over its
  holders of n_r;
- "weight_scatter": sum over ranks of H_r (N - n_r) b for P' (every held class's other slices).
These are the simulator's formulas (`placement.policies.ReplicatePolicy.traffic`:
grad_reduce_scatter, weight_scatter), which tests/replicate checks against the measured
counters. When every rank's s slots hold distinct classes (H_r = s), the weights move
s N (G - 1) elements, static replication's volume with the optimizer sharded over all G ranks
(DESIGN's s N G for large G), and the gradients the same s N (G - 1), whatever the popularity
(the mirror of the push); several slots of one class on a rank only lower both. The path before
moved N (s G - E) elements more (its all-reduce returned every holder the full sum).

Checkpoints: `gather_to_owners(shard)` assembles whole experts (master weights and Adam moments)
on the ranks an expert-granular layout names, e.g. Megatron EP's `ShardLayout.even`, so they can
be saved per expert like ep mode's; `scatter_from_owners` is the inverse. Both are the sparse
collectives between the element slices and that layout (bytes under "rep_checkpoint").

Every method is collective over the replicate group: all ranks call it in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.groups import all_reduce_recorded
from megatron_patches.comm.sparse import CollectiveHandle, SparseAllGather, SparseReduceScatter
from megatron_patches.comm.traffic import TrafficCounter, default_counter
from megatron_patches.placement.types import ElementShardLayout, InstancePlacement, ShardLayout, Topology
from megatron_patches.mode.adam import AdamSettings
from megatron_patches.replicate.slices import ExpertSlices
from megatron_patches.replicate.slots import SlotWeights

__all__ = ["STATE_NAMES", "PendingReduce", "ReplicatedExperts"]

STATE_NAMES = ("weights", "exp_avg", "exp_avg_sq")
"""The per-expert tensors of a placement-independent checkpoint, in packing order (fp32 master
weights and Adam's two moments); the step count is one number for all experts."""


@dataclass
class PendingReduce:
    """A layer's gradient reduce between `start_reduce` and `finish_reduce`."""

    handle: CollectiveHandle
    """Step (b)'s reduce-scatter, launched; `wait()` returns this rank's slices [E, n_r]."""


class ReplicatedExperts:
    """Slot weights, owned optimizer slices and the gradient / weight traffic of one MoE layer.

    Construction is collective over `group` (every rank, same arguments but its own rank). The
    slots are filled locally from `weights_EN` for the initial placement.

    Args:
        weights_EN: full initial flat weights of all E experts [E, N] (identical on every rank).
        slot_expert_RS: the first iteration's slot assignment, int [G, s] (`assign_slots`).
        group: the replicate group (Megatron's EP group); group rank d is device d of the
            placements. Every collective of the layer runs in it: no other group is made.
        adam: the expert optimizer's hyper-parameters.
        slot_dtype: the slots' (working weights' and gradients') dtype; None = weights_EN's.
        device: the slots' device; None = weights_EN's.
        offload: keep the optimizer state in host memory (`--replicate-offload-optimizer`).
        topology: devices = group ranks, for intra/inter-node byte counts; None = one node.
        traffic: the counter bytes are recorded into; None = `traffic.default_counter()`.
        decay_mask_N: bool [N], elements weight decay applies to (`ExpertSlices`); None = all.
        reduce_dtype: the dtype replica gradients are summed and sent in; None = the slots'.
            fp32 under --bf16 (and --fp16 with --accumulate-allreduce-grads-in-fp32), as Megatron's
            DDP reduces its gradients.
    """

    def __init__(
        self,
        weights_EN: torch.Tensor,
        slot_expert_RS,
        group: dist.ProcessGroup,
        *,
        adam: AdamSettings,
        slot_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        offload: bool = False,
        topology: Topology | None = None,
        traffic: TrafficCounter | None = None,
        decay_mask_N: torch.Tensor | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        if group is None or not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"pass the replicate process group explicitly, got {group!r}")
        self.group = group
        """The replicate group (every collective of the layer runs in it)."""
        self.rank = dist.get_rank(group)
        """This rank's device in the placements."""
        G = dist.get_world_size(group)
        self.topology = Topology.single_node(G) if topology is None else topology
        """Devices and nodes of the group, for the byte counters."""
        if self.topology.num_devices != G:
            raise ValueError(f"the topology has {self.topology.num_devices} devices but the group {G} ranks")
        self.traffic = default_counter() if traffic is None else traffic
        """Where the bytes of every phase are recorded."""
        device = weights_EN.device if device is None else torch.device(device)
        self.slices = ExpertSlices(
            weights_EN, self.rank, G, adam=adam, device=device, offload=offload, decay_mask_N=decay_mask_N
        )
        """This rank's never-moving slices of the master weights and Adam state."""
        E, N = weights_EN.shape
        self.slots = SlotWeights(
            slot_expert_RS, self.rank, E, N, dtype=weights_EN.dtype if slot_dtype is None else slot_dtype, device=device
        )
        """This rank's slot buffer and the assignment it holds."""
        self.reduce_dtype = self.slots.slots_SN.dtype if reduce_dtype is None else reduce_dtype
        """The dtype of the replica-gradient reduction (and of the returned gradient slices)."""
        if self.slots.num_ranks != G:
            raise ValueError(f"slot_expert_RS has {self.slots.num_ranks} ranks but the group {G}")
        with torch.no_grad():
            self.slots.slots_SN.copy_(weights_EN[torch.from_numpy(self.slots.slot_expert_S.copy())])
        if device.type == "cuda":
            # NCCL: the batched P2P of the fetch must not be the group's first call while some ranks
            # post nothing; one all-reduce every rank joins creates the communicator first.
            dist.all_reduce(torch.zeros(1, device=device), group=group)

    @property
    def num_experts(self) -> int:
        """E."""
        return self.slots.num_experts

    @property
    def expert_numel(self) -> int:
        """N."""
        return int(self.slots.slots_SN.shape[1])

    def popularity(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Sum this rank's tokens per expert class over the group, in place; returns counts_E.

        counts_E: [E] on the slots' device (int64 for exact counts). Bytes go to "popularity".
        """
        if not isinstance(counts_E, torch.Tensor) or tuple(counts_E.shape) != (self.num_experts,):
            got = tuple(counts_E.shape) if isinstance(counts_E, torch.Tensor) else type(counts_E).__name__
            raise ValueError(f"counts_E must be a [{self.num_experts}] tensor, got {got}")
        all_reduce_recorded(counts_E, self.group, kind="popularity", traffic=self.traffic, topology=self.topology)
        return counts_E

    def reduce_gradients(self, grad_SN: torch.Tensor) -> torch.Tensor:
        """Steps (a) and (b): from this rank's slot gradients to its slice of every expert's summed gradient.

        Args:
            grad_SN: the gradient of every slot [s, N] in the slots' dtype and device (e.g.
                `slots.slots_SN.grad`); not modified.
        Returns:
            [E, n_r]: row e = elements [start_r, stop_r) of the sum over all instances of e.
        """
        return self.finish_reduce(self.start_reduce(grad_SN))

    def start_reduce(self, grad_SN: torch.Tensor) -> "PendingReduce":
        """Step (a) and the launch of step (b)'s reduce-scatter (asynchronous); `finish_reduce`
        waits for it. The runtime starts a layer's reduce as soon as its slots' gradient is
        complete (during the backward of the layers below)."""
        slots = self.slots
        if not isinstance(grad_SN, torch.Tensor) or grad_SN.shape != slots.slots_SN.shape:
            got = tuple(grad_SN.shape) if isinstance(grad_SN, torch.Tensor) else type(grad_SN).__name__
            raise ValueError(
                f"rank {self.rank}: grad_SN must have the slots' shape {tuple(slots.slots_SN.shape)}, got {got}"
            )
        if grad_SN.dtype != slots.slots_SN.dtype or grad_SN.device != slots.slots_SN.device:
            raise ValueError(
                f"rank {self.rank}: grad_SN must be {slots.slots_SN.dtype} on {slots.slots_SN.device}, "
                f"got {grad_SN.dtype} on {grad_SN.device}"
            )
        device = grad_SN.device
        # (a) one representative per held class, rows in ascending class order (the placement's
        # held chunks); a lone slot's row is copied exactly (0 + x).
        rep_HN = grad_SN.new_zeros((slots.held_experts.size, grad_SN.shape[1]), dtype=self.reduce_dtype)
        rep_HN.index_add_(0, torch.from_numpy(slots.held_row_S.copy()).to(device), grad_SN.to(self.reduce_dtype))
        # (b) every representative's slice r to its owner r, summed there in ascending rank order
        reduce = SparseReduceScatter(slots.placement, self.slices.layout, self.group, self.expert_numel,
                                     topology=self.topology, traffic=self.traffic, kind="grad_reduce_scatter")
        return PendingReduce(reduce(rep_HN))

    def finish_reduce(self, pending: "PendingReduce") -> torch.Tensor:
        """Waits for step (b) of `pending`: [E, n_r], as `reduce_gradients`."""
        return pending.handle.wait()

    def step(self, grad_En: torch.Tensor, lr: float | None = None) -> None:
        """Step (d): Adam on this rank's slices with the summed gradient slices [E, n_r]."""
        self.slices.step(grad_En, lr)

    def push(self, slot_expert_RS) -> None:
        """Step (e): put the updated weights into the slots of the next placement.

        Every rank sends its slice of every class to the other ranks that hold the class in
        `slot_expert_RS` (the next iteration's assignment, int [G, s]); the slot buffer is
        overwritten in place. Bytes go to "weight_scatter".
        """
        slots = self.slots
        slots.assign(slot_expert_RS)
        gather = SparseAllGather(
            self.slices.layout,
            slots.placement,
            self.group,
            self.expert_numel,
            topology=self.topology,
            traffic=self.traffic,
            kind="weight_scatter",
        )
        held = slots.slots_SN.detach()[: slots.held_experts.size]
        gather(self.slices.weights(slots.slots_SN.dtype), out=held).wait()
        slots.fill_from_held()

    def _owners_placement(self, shard: ShardLayout) -> InstancePlacement:
        """The placement of the 3 E state chunks (chunk k E + e = tensor k of expert e) on their owners."""
        if not isinstance(shard, ShardLayout) or shard.num_experts != self.num_experts:
            raise ValueError(f"shard must be a ShardLayout of {self.num_experts} experts, got {shard!r}")
        if shard.num_devices != self.slices.layout.num_devices:
            raise ValueError(
                f"shard spans {shard.num_devices} devices but the group has {self.slices.layout.num_devices}"
            )
        return InstancePlacement(np.tile(shard.holds_ED(), (len(STATE_NAMES), 1)))

    def gather_to_owners(self, shard: ShardLayout) -> dict[str, torch.Tensor]:
        """Whole experts' optimizer state on the ranks `shard` names (for a per-expert checkpoint).

        Returns {name: fp32 [O, N]} for `STATE_NAMES` on the compute device, row i = expert
        `shard.experts_of(rank)[i]` (O may be 0), plus "step": the step count (a float).
        """
        placement = self._owners_placement(shard)
        sl = self.slices
        owned = torch.cat([sl.master_En, sl.exp_avg_En, sl.exp_avg_sq_En]).to(sl.device)
        layout = ElementShardLayout(self.expert_numel, sl.layout.num_devices)
        gather = SparseAllGather(
            layout,
            placement,
            self.group,
            self.expert_numel,
            topology=self.topology,
            traffic=self.traffic,
            kind="rep_checkpoint",
        )
        rows = gather(owned).wait().chunk(len(STATE_NAMES))
        return {**dict(zip(STATE_NAMES, rows)), "step": float(sl.step_count.item())}

    def scatter_from_owners(self, shard: ShardLayout, state: dict[str, torch.Tensor], step: float) -> None:
        """Set every slice from whole experts held by the ranks `shard` names, then refill the slots.

        Args:
            shard: who holds which experts' rows (as in `gather_to_owners`).
            state: {name: [O, N]} for `STATE_NAMES`, rows = `shard.experts_of(rank)` ascending.
            step: the Adam step count of all experts.
        """
        missing = [name for name in STATE_NAMES if name not in state]
        if missing:
            raise ValueError(f"state lacks {missing}; it needs {list(STATE_NAMES)}")
        placement = self._owners_placement(shard)
        sl = self.slices
        held = torch.cat([state[name].to(sl.device, torch.float32) for name in STATE_NAMES])
        layout = ElementShardLayout(self.expert_numel, sl.layout.num_devices)
        reduce = SparseReduceScatter(
            placement,
            layout,
            self.group,
            self.expert_numel,
            topology=self.topology,
            traffic=self.traffic,
            kind="rep_checkpoint",
        )
        # One copy per chunk: the "sum" is that copy.
        owned = reduce(held).wait().to(sl.state_device)
        for target, values in zip((sl.master_En, sl.exp_avg_En, sl.exp_avg_sq_En), owned.chunk(len(STATE_NAMES))):
            target.copy_(values)
        sl.step_count.fill_(float(step))
        self.push(self.slots.slot_expert_RS)
