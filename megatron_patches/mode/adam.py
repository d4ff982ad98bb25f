"""The Adam hyper-parameters the modes' own optimizers take (zebra's AdamW, replicate's expert
slices), as Megatron-LM's flags name them; one class for both."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AdamSettings"]


@dataclass(frozen=True)
class AdamSettings:
    """Adam hyper-parameters (Megatron's LR schedule sets lr and weight decay per step later)."""

    lr: float = 1e-3
    """--lr: peak learning rate (max_lr of every parameter group; the step's lr when none is given)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """--adam-beta1, --adam-beta2: decay rates of the first and second moment."""
    eps: float = 1e-8
    """--adam-eps: added to the denominator."""
    weight_decay: float = 0.0
    """--weight-decay: L2 penalty (added to the gradient), or decoupled decay with
    `decoupled_weight_decay` (of non-bias, non-1-D parameters where the optimizer masks)."""
    decoupled_weight_decay: bool = False
    """True: AdamW's decoupled decay (Megatron's Adam is AdamW-style: `from_args` sets it)."""
    min_lr: float = 0.0
    """--min-lr: floor of the learning-rate schedule."""
    clip_grad: float = 0.0
    """--clip-grad: global gradient-norm clipping threshold; 0 disables clipping."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"AdamSettings.lr must be finite and >= 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamSettings.betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps >= 0:
            raise ValueError(f"AdamSettings.eps must be >= 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"AdamSettings.weight_decay must be >= 0, got {self.weight_decay!r}")

    @classmethod
    def from_args(cls, args) -> "AdamSettings":
        """Megatron-LM's flags (its optimizer is AdamW-style: decoupled weight decay)."""
        return cls(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                   weight_decay=args.weight_decay, decoupled_weight_decay=True, min_lr=args.min_lr,
                   clip_grad=args.clip_grad)
