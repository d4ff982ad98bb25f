"""Replicate mode settings, from the command line (`--replicate-*`, `--moe-expert-capacity-factor`,
`--moe-load-window`)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("adaptive", "static", "flexmoe")
"""adaptive: new replica counts every iteration from the predicted popularity (DESIGN 4.6);
static: every class keeps ranks x slots / E instances (the DeepSpeed-style baseline);
flexmoe: new replica counts only every `rebalance_interval` iterations, moving optimizer state
with the experts (the FlexMoE-style baseline, DESIGN 4.9)."""


@dataclass(frozen=True)
class ReplicateConfig:
    """How replicate mode places expert instances (DESIGN 4.6, 4.9)."""

    slots_per_rank: int
    """s: expert instances every rank runs per MoE layer (G x s instances per layer in all)."""
    capacity_factor: float | None
    """Tokens one instance may process = capacity_factor x tokens routed in the layer / (G x s),
    rounded up; the excess is dropped (the token passes through the residual, as in Megatron).
    None = dropless: every instance may take every token."""
    offload_optimizer: bool
    """Keep the experts' fp32 master weights and Adam state in host memory and step there."""
    load_window: int
    """Iterations of popularity averaged for the next placement (1 = the last iteration only)."""
    policy: str
    """adaptive, static or flexmoe (see `POLICIES`)."""
    rebalance_interval: int
    """flexmoe only: iterations between re-placements (10, 50, 100 in the FlexMoE comparison)."""

    def __post_init__(self) -> None:
        values = (
            f"slots_per_rank={self.slots_per_rank}, capacity_factor={self.capacity_factor}, load_window={self.load_window}, "
            f"policy={self.policy!r}, rebalance_interval={self.rebalance_interval}"
        )
        if self.slots_per_rank < 1:
            raise ValueError(f"ReplicateConfig: slots_per_rank must be >= 1 ({values})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"ReplicateConfig: capacity_factor must be > 0 or None ({values})")
        if self.load_window < 1:
            raise ValueError(f"ReplicateConfig: load_window must be >= 1 ({values})")
        if self.policy not in POLICIES:
            raise ValueError(f"ReplicateConfig: policy must be one of {POLICIES} ({values})")
        if self.rebalance_interval < 1:
            raise ValueError(f"ReplicateConfig: rebalance_interval must be >= 1 ({values})")

    @classmethod
    def from_args(cls, args) -> "ReplicateConfig":
        return cls(
            slots_per_rank=args.replicate_slots_per_rank,
            capacity_factor=args.moe_expert_capacity_factor,
            offload_optimizer=args.replicate_offload_optimizer,
            load_window=args.moe_load_window,
            policy=args.replicate_policy,
            rebalance_interval=args.replicate_rebalance_interval,
        )
