"""One rank's expert slots in replicate mode: s flat weight vectors of the current placement.

Every iteration each of the G ranks runs s expert instances ("slots"). `slot_expert_RS[r, j]`
(from `placement.replicate.assign_slots`) names the expert class in slot j of rank r. Every
rank's row is sorted, so the slots of one class on a rank are adjacent; this module relies on it
to fill the slots in place (see `SlotWeights.fill_from_held`).

The slot buffer is one `torch.nn.Parameter` [s, N]: the MoE layer views slot j's row as the
expert's weight matrices, autograd accumulates every slot's gradient into `slots_SN.grad`, and
the gradient path of `ReplicatedExperts` consumes it.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_patches.compat import activations
from megatron_patches.placement.replicate import slot_placement
from megatron_patches.placement.types import InstancePlacement, PlacementError

__all__ = ["SlotWeights"]


class SlotWeights:
    """The [s, N] slot buffer of one rank and the slot assignment it currently holds.

    Args:
        slot_expert_RS: expert of every slot of every rank; int [G, s], every rank's row
            non-decreasing (as `assign_slots` makes it).
        rank: r, this rank.
        num_experts: E.
        expert_numel: N, elements of one expert's flat parameter vector.
        dtype: the slots' dtype (the working precision: bf16, fp16 or fp32).
        device: the slots' device.
    """

    def __init__(
        self,
        slot_expert_RS,
        rank: int,
        num_experts: int,
        expert_numel: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.rank = int(rank)
        """r."""
        self.num_experts = int(num_experts)
        """E."""
        self._adopt(*self._checked(slot_expert_RS, None))
        self.slots_SN = torch.nn.Parameter(
            torch.empty((self.slots_per_rank, int(expert_numel)), dtype=dtype, device=device)
        )
        """The slot weights [s, N] (contents valid once filled); row j = the expert `slot_expert_S[j]`."""
        activations.persistent([self.slots_SN])  # the slots are weights, not activations, when a matmul saves them

    def assign(self, slot_expert_RS) -> None:
        """Adopt a new slot assignment of the same G and s; the buffer's contents are not touched.

        Raises PlacementError, keeping the old assignment, if the new one is malformed or a
        rank's row is not sorted (which keeps one class's slots adjacent).
        """
        self._adopt(*self._checked(slot_expert_RS, self.slot_expert_RS.shape))

    def _checked(self, slot_expert_RS, shape) -> tuple[np.ndarray, InstancePlacement]:
        """The assignment as a read-only int64 array and its placement; raises PlacementError."""
        slots = np.array(slot_expert_RS, dtype=np.int64)
        if slots.ndim != 2:
            raise PlacementError(f"slot_expert_RS must be [ranks, slots], got shape {slots.shape}")
        if shape is not None and slots.shape != shape:
            raise PlacementError(
                f"slot_expert_RS has shape {slots.shape} but this rank's slots were built for {shape}"
            )
        if not 0 <= self.rank < slots.shape[0]:
            raise PlacementError(f"rank {self.rank} is not in [0, {slots.shape[0]})")
        placement = slot_placement(slots, self.num_experts)
        unsorted = np.argwhere(np.diff(slots, axis=1) < 0)
        if unsorted.size:
            r = int(unsorted[0][0])
            raise PlacementError(
                f"rank {r}'s slots hold experts {slots[r].tolist()}, not in ascending order; "
                "every rank's slots must be sorted (placement.replicate.assign_slots)"
            )
        slots.setflags(write=False)
        return slots, placement

    def _adopt(self, slots: np.ndarray, placement: InstancePlacement) -> None:
        self.slot_expert_RS = slots
        """Expert of every slot of every rank; int64 [G, s], read-only."""
        self.placement = placement
        """The instances of all ranks (counts per expert and rank)."""
        self.held_experts = np.unique(slots[self.rank])
        """Distinct experts in this rank's slots, ascending; int64 [H]."""
        self.held_row_S = np.searchsorted(self.held_experts, slots[self.rank])
        """For each slot, the index of its expert in `held_experts`; int64 [s], non-decreasing."""

    @property
    def num_ranks(self) -> int:
        """G."""
        return int(self.slot_expert_RS.shape[0])

    @property
    def slots_per_rank(self) -> int:
        """s."""
        return int(self.slot_expert_RS.shape[1])

    @property
    def slot_expert_S(self) -> np.ndarray:
        """Expert of each of this rank's slots; int64 [s], read-only."""
        return self.slot_expert_RS[self.rank]

    def fill_from_held(self) -> None:
        """Spread rows [0, H) of the buffer (one per held expert, ascending) over the s slots.

        A gather writes one row per distinct held expert into the first H rows; slot j needs row
        held_row_S[j] <= j. Copying from the last slot backwards never overwrites a row that a
        lower slot still needs, so no second buffer is required.
        """
        with torch.no_grad():
            for j in range(self.slots_per_rank - 1, -1, -1):
                row = int(self.held_row_S[j])
                if row != j:
                    self.slots_SN[j].copy_(self.slots_SN[row])
