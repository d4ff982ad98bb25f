"""FSSDP mode settings, from the command line (`--fssdp-*`, `--moe-load-window`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FSSDPConfig:
    """How FSSDP materializes expert copies (DESIGN 4.2-4.5)."""

    overlap_degree: int | None
    """t: expert copies a device may receive per layer while attention runs. None = auto:
    measured in the first iteration (which runs without copies) from the non-MoE time of a
    layer, the point-to-point bandwidth between the ranks and the bytes of one expert."""
    memory_capacity: int | None
    """m: extra expert copies a device may hold per layer. None = auto: the free memory per
    MoE layer over the bytes of one expert (GPU: free device memory after the first
    iteration, minus a 10% reserve; CPU: `memory_budget_bytes`)."""
    memory_budget_bytes: int
    """CPU only, for m = auto: bytes of host memory a rank may spend on expert copies."""
    reshard_interval: int
    """Iterations between heterogeneous re-sharding decisions; 0 = never."""
    rematerialize: bool
    """Free a layer's copies right after its forward and gather them again for its backward."""
    calibrate: bool
    """After the gate, re-plan with the actual loads; gather once more if it pays off."""
    load_window: int
    """Iterations averaged to predict the next iteration's expert loads (DESIGN 4.1)."""

    @classmethod
    def from_args(cls, args) -> "FSSDPConfig":
        return cls(
            overlap_degree=None if args.fssdp_overlap_degree == "auto" else int(args.fssdp_overlap_degree),
            memory_capacity=None if args.fssdp_memory_capacity == "auto" else int(args.fssdp_memory_capacity),
            memory_budget_bytes=int(args.fssdp_memory_budget_mb * 2**20),
            reshard_interval=args.fssdp_reshard_interval,
            rematerialize=args.fssdp_rematerialize,
            calibrate=args.fssdp_calibrate,
            load_window=args.moe_load_window,
        )
