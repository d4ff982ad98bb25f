"""The decoupled optimizer of replicate mode: rank r's slice r of every expert, never moving.

Every expert's parameters are one flat vector of N elements. Rank r of G owns elements
[start_r, stop_r) of every expert (`ElementShardLayout(N, G)`, np.array_split bounds): the fp32
master weights and the Adam state (exp_avg, exp_avg_sq, step) of that slice. Whatever the
placement of the slots, these slices stay where they are: rebalancing moves no optimizer
state (DESIGN 4.6 (c), (d)).

The step is torch's own functional Adam (`torch.optim.adam.adam`, the code behind
`torch.optim.Adam`, with the same default choice of implementation), applied to the [E, n_r]
slice tensor. Adam is elementwise, so stepping slices gives the values `torch.optim.Adam`
gives on the full vectors (tests/replicate checks it bit for bit).

Offload (`--replicate-offload-optimizer`): the master weights and the Adam state live in host
memory and the step runs on the host; gradients are copied to the host before the step and the
updated weights back to the device when they are pushed into the slots. On a CPU-only machine
host and device are the same and the copies cost nothing, but they are the same calls.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from megatron_patches.mode.adam import AdamSettings
from megatron_patches.placement.types import ElementShardLayout

__all__ = ["ExpertSlices"]


class ExpertSlices:
    """Rank r's slice of every expert's fp32 master weights and Adam state.

    Args:
        weights_EN: the full initial flat weights of all E experts [E, N] (any float dtype and
            device; e.g. built from (seed, layer, expert)). Only slice r is kept.
        rank: r, this rank's position in the replicate group.
        num_ranks: G.
        adam: the optimizer's hyper-parameters.
        device: where gradients come from and weights go to (the slots' device).
        offload: keep the master weights and Adam state in host memory and step there.
        decay_mask_N: bool [N], the elements weight decay applies to (Megatron decays weight
            matrices, not biases); None = every element.
    """

    def __init__(
        self,
        weights_EN: torch.Tensor,
        rank: int,
        num_ranks: int,
        *,
        adam: AdamSettings,
        device: torch.device | str,
        offload: bool = False,
        decay_mask_N: torch.Tensor | None = None,
    ):
        if not isinstance(weights_EN, torch.Tensor) or weights_EN.dim() != 2 or not weights_EN.is_floating_point():
            got = (
                f"{tuple(weights_EN.shape)} {weights_EN.dtype}" if isinstance(weights_EN, torch.Tensor) else weights_EN
            )
            raise ValueError(f"weights_EN must be a floating-point [experts, elements] tensor, got {got}")
        E, N = weights_EN.shape
        if E < 1 or N < 1:
            raise ValueError(f"weights_EN needs >= 1 expert and >= 1 element, got shape {(E, N)}")
        self.layout = ElementShardLayout(N, num_ranks)
        """Who owns which elements of every expert: rank r owns slice r."""
        self.rank = int(rank)
        """r."""
        self.start, self.stop = self.layout.bounds(self.rank)
        """This rank's slice [start, stop) of every expert's flat vector."""
        self.adam = adam
        """The optimizer's hyper-parameters."""
        self.offload = bool(offload)
        """Whether the state lives in host memory (the step then runs on the host)."""
        self.device = torch.device(device)
        """The compute device: gradients arrive and weights leave here."""
        self.state_device = torch.device("cpu") if self.offload else self.device
        """Where the master weights and Adam state live."""
        # Pinned host memory lets the copies to and from a GPU run without staging.
        pin = self.offload and self.device.type == "cuda"
        master = weights_EN[:, self.start : self.stop].detach().to(self.state_device, torch.float32, copy=True)
        self.master_En = master.pin_memory() if pin else master
        """fp32 master weights of this slice of every expert [E, n_r]."""
        self.exp_avg_En = torch.zeros_like(self.master_En)
        """Adam's first moment [E, n_r]."""
        self.exp_avg_sq_En = torch.zeros_like(self.master_En)
        """Adam's second moment [E, n_r]."""
        self.step_count = torch.tensor(0.0, dtype=torch.float32)
        """Adam steps taken (all experts step together), a float32 CPU scalar like torch.optim.Adam's."""
        if decay_mask_N is not None and (decay_mask_N.dtype != torch.bool or tuple(decay_mask_N.shape) != (N,)):
            raise ValueError(f"decay_mask_N must be a bool [{N}] tensor, got {decay_mask_N.dtype} {tuple(decay_mask_N.shape)}")
        self.decay_mask_n = None if decay_mask_N is None else decay_mask_N[self.start : self.stop].to(self.state_device)
        """Which elements of this slice weight decay applies to; None = all."""

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.master_En.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """[E, n_r], the shape of every per-slice tensor (gradients included)."""
        return tuple(self.master_En.shape)

    def state_bytes(self) -> int:
        """Bytes of master weights and Adam moments this rank holds (DESIGN 5's optimizer memory)."""
        return 3 * self.master_En.numel() * self.master_En.element_size()

    def step(self, grad_En: torch.Tensor, lr: float | None = None) -> None:
        """One Adam step of every expert's slice with the summed gradient slice [E, n_r].

        The gradient may be of any float dtype (it is used in fp32) and on the compute device;
        with offload it is copied to the host first. lr overrides `adam.lr` for this step.
        """
        if not isinstance(grad_En, torch.Tensor) or tuple(grad_En.shape) != self.shape:
            got = tuple(grad_En.shape) if isinstance(grad_En, torch.Tensor) else type(grad_En).__name__
            raise ValueError(f"rank {self.rank}: the gradient slice must have shape {self.shape}, got {got}")
        grad = grad_En.to(self.state_device, torch.float32)
        cfg = self.adam
        lr = cfg.lr if lr is None else float(lr)
        weight_decay = cfg.weight_decay
        if weight_decay and self.decay_mask_n is not None:
            if not cfg.decoupled_weight_decay:
                raise ValueError("a weight-decay mask needs decoupled weight decay (AdamW), as Megatron uses")
            # AdamW's first operation is param *= 1 - lr * wd; on the masked elements only, then
            # the step without decay: the same values as torch's AdamW on separate param groups.
            keep = torch.tensor(1.0 - lr * weight_decay, dtype=torch.float32)
            self.master_En.mul_(torch.where(self.decay_mask_n, keep, torch.ones((), dtype=torch.float32)))
            weight_decay = 0.0
        adam(
            [self.master_En],
            [grad],
            [self.exp_avg_En],
            [self.exp_avg_sq_En],
            [],
            [self.step_count],
            decoupled_weight_decay=cfg.decoupled_weight_decay,
            amsgrad=False,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            lr=lr,
            weight_decay=weight_decay,
            eps=cfg.eps,
            maximize=False,
        )

    def weights(self, dtype: torch.dtype) -> torch.Tensor:
        """The current weights of this slice of every expert in `dtype` on the compute device [E, n_r].

        Read-only: for fp32 without offload it is the master tensor itself, not a copy.
        """
        return self.master_En.to(self.device, dtype, non_blocking=False).contiguous()
