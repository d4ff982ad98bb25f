"""FSSDP planning (DESIGN 4.2-4.4): materialization, calibration, heterogeneous sharding, dispatch.

FSSDP keeps exactly one owner per expert (the shard layout) and, every iteration and layer,
materializes extra copies of the experts predicted to be busy so that their tokens can be
processed on several devices. This package decides

- how many copies may be fetched while attention runs (`overlap_degree`, t), how many are
  worth fetching (`choose_overlap_degree`: t by cost) and how many fit in memory
  (`memory_capacity`, m);
- which experts get copies on which devices (`materialize`, DESIGN 4.2) and whether one more
  gather after the gate pays off (`calibrate`, 4.2 step 4);
- who owns which expert of every layer (`heterogeneous_shard`, 4.3; `even_shard`) and how
  well a layout can be balanced at best (`shard_imbalance_bound`);
- where each source device sends the tokens of each expert (`dispatch`, 4.4), with the
  tokens of a replicated expert split to even out device loads (`balanced_quotas`).

Where DESIGN leaves a choice open (which device gets a copy, where a top-t expert is
owned, how many tokens each holder takes) the choice is load-aware; the docstrings say where
this departs from DESIGN's literal text and what was measured.

All functions are pure and deterministic: every rank computes the same plan from the same
(all-reduced) loads. Ties left after the documented rules go to the lower expert / node / device id.
"""


from megatron_patches.placement.fssdp.capacity import (
    gather_bandwidth,
    overlap_degree,
    memory_capacity,
    memory_capacity_after_activations,
)
from megatron_patches.placement.fssdp.materialize import (
    proportional_copies,
    calibration_reserve,
    materialize,
)
from megatron_patches.placement.fssdp.quotas import (
    clear_quota_memo,
    balanced_quotas,
)
from megatron_patches.placement.fssdp.calibrate import (
    FSSDPCostModel,
    BACKWARD_OVER_FORWARD,
    MOE_BACKWARD_SHARE,
    calibration_gather,
    calibrate,
)
from megatron_patches.placement.fssdp.overlap import (
    overlap_candidates,
    OverlapChoice,
    overlap_prices,
    choose_overlap_degree,
)
from megatron_patches.placement.fssdp.shard import (
    even_shard,
    shard_slots_D,
    heterogeneous_shard,
    shard_imbalance_bound,
    overlap_due,
    reshard_due,
    ReshardDecision,
    decide_reshard,
)
from megatron_patches.placement.fssdp.dispatch import (
    dispatch,
)

__all__ = [
    "BACKWARD_OVER_FORWARD",
    "FSSDPCostModel",
    "MOE_BACKWARD_SHARE",
    "OverlapChoice",
    "ReshardDecision",
    "balanced_quotas",
    "calibrate",
    "calibration_gather",
    "calibration_reserve",
    "choose_overlap_degree",
    "clear_quota_memo",
    "decide_reshard",
    "dispatch",
    "even_shard",
    "gather_bandwidth",
    "heterogeneous_shard",
    "materialize",
    "memory_capacity",
    "memory_capacity_after_activations",
    "overlap_candidates",
    "overlap_degree",
    "overlap_prices",
    "proportional_copies",
    "overlap_due",
    "reshard_due",
    "shard_imbalance_bound",
    "shard_slots_D",
]
