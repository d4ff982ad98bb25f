"""Baseline placement algorithms the product is compared against (DESIGN 4.9).

Pure numpy planners, like the rest of `placement/`:
- EP: Megatron expert parallelism, experts evenly and statically distributed (`EPLayout`).
- FasterMoE-style shadowing: after the gate, broadcast the most popular experts to every
  device when a cost model says it pays off (`fastermoe_shadow`).
- SmartMoE-style swapping: periodically exchange experts between devices so heavy experts
  share a device with light ones; no replication (`smartmoe_swap`).
- FlexMoE-style replicate / relocate: add replicas of the most loaded experts into reserved
  slots, or take a slot from a lightly loaded replicated expert (`flexmoe_adjust`).
- DeepSpeed-MoE's static replication: its layout (`static_replication`) and its group-local,
  per-source-capped, padded dispatch (`deepspeed_dispatch`).

The systems that rearrange experts move weights *and* optimizer state, which is what makes
rearrangement expensive. `ByteModel` makes the per-parameter byte counts explicit (Adam mixed
precision by default) and `moved_bytes` turns a list of `ExpertMove`s into parameter and
optimizer bytes split by intra- / inter-node links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_patches.placement.replicate import TokenSpread, instance_capacity, slot_placement
from megatron_patches.placement.types import (
    DispatchPlan,
    InstancePlacement,
    PlacementError,
    Topology,
    check_int,
    check_loads,
    even_shares,
)

__all__ = [
    "ByteModel",
    "ExpertMove",
    "MovedBytes",
    "moved_bytes",
    "EPLayout",
    "ep_group_size",
    "split_evenly",
    "ShadowCostModel",
    "ShadowDecision",
    "fastermoe_shadow",
    "smartmoe_swap",
    "ep_layout_moves",
    "flexmoe_adjust",
    "DEEPSPEED_MIN_CAPACITY",
    "deepspeed_slot_counts",
    "deepspeed_slots",
    "static_replication",
    "deepspeed_dispatch",
]


# ---------------------------------------------------------------------------------------------
# Byte model and rearrangement accounting


@dataclass(frozen=True)
class ByteModel:
    """How many bytes one expert and one token occupy (defaults: Adam with bf16 mixed precision).

    Rearranging an expert moves its weights and its optimizer state (master weights and Adam
    moments, ~6x the bf16 weights). Gradients are not moved: rearrangement happens between
    iterations, after the optimizer step, when the gradient buffers hold nothing worth keeping.
    Gradient bytes matter for the traffic that synchronises gradients of replicas.
    """

    params_per_expert: int
    """Parameters of one expert (all its weight matrices and biases); >= 1."""
    weight_bytes_per_param: float = 2.0
    """Bytes per parameter of the working weights (bf16: 2)."""
    grad_bytes_per_param: float = 2.0
    """Bytes per parameter of a gradient (bf16: 2)."""
    optimizer_bytes_per_param: float = 12.0
    """Bytes per parameter of optimizer state: fp32 master weight + Adam m + Adam v = 4 + 4 + 4."""
    token_bytes: int = 1536
    """Bytes of one token's activation sent by the all-to-all (hidden size x 2 for bf16)."""

    def __post_init__(self) -> None:
        params = check_int(self.params_per_expert, "ByteModel.params_per_expert", 1)
        object.__setattr__(self, "params_per_expert", params)
        for name in ("weight_bytes_per_param", "grad_bytes_per_param", "optimizer_bytes_per_param"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value) or value < 0:
                raise PlacementError(f"ByteModel.{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.weight_bytes_per_param <= 0:
            raise PlacementError(f"ByteModel.weight_bytes_per_param must be > 0, got {self.weight_bytes_per_param}")
        object.__setattr__(self, "token_bytes", check_int(self.token_bytes, "ByteModel.token_bytes", 1))

    @classmethod
    def from_expert_bytes(cls, expert_bytes: int, **overrides) -> ByteModel:
        """The byte model of an expert whose working weights take `expert_bytes` bytes.

        Unless `token_bytes` is given, the hidden size h is derived from the DESIGN's expert
        shape (an FFN with d_ffn = 2 h, so params = 2 * h * 2h = 4 h^2) and a token is h bf16
        values. GPT-MoE-S (h = 768) has 2.36M-parameter experts of 4718592 bf16 bytes.
        """
        check_int(expert_bytes, "expert_bytes", 1)
        weight_bytes = float(overrides.get("weight_bytes_per_param", 2.0))
        if weight_bytes <= 0:
            raise PlacementError(f"weight_bytes_per_param must be > 0, got {weight_bytes}")
        params = max(1, int(round(expert_bytes / weight_bytes)))
        if "token_bytes" not in overrides:
            hidden = max(1, int(round(math.sqrt(params / 4))))
            overrides["token_bytes"] = 2 * hidden
        return cls(params_per_expert=params, **overrides)

    @property
    def expert_weight_bytes(self) -> float:
        """Bytes of one expert's working weights."""
        return self.params_per_expert * self.weight_bytes_per_param

    @property
    def expert_grad_bytes(self) -> float:
        """Bytes of one expert's gradients."""
        return self.params_per_expert * self.grad_bytes_per_param

    @property
    def expert_optimizer_bytes(self) -> float:
        """Bytes of one expert's optimizer state."""
        return self.params_per_expert * self.optimizer_bytes_per_param


@dataclass(frozen=True)
class ExpertMove:
    """One expert's weights + optimizer state copied from one device to another.

    A relocation is a move plus dropping the source copy; adding a replica is a move that keeps
    the source copy. Either way the bytes on the wire are the same.
    """

    layer: int
    """MoE layer of the expert."""
    expert: int
    """Expert id within the layer."""
    src: int
    """Device the state is copied from."""
    dst: int
    """Device the state is copied to (!= src)."""


@dataclass(frozen=True)
class MovedBytes:
    """Bytes a rearrangement puts on the wire, by what is moved and which link class carries it."""

    param_intra: float = 0.0
    """Weight bytes between devices of one node."""
    param_inter: float = 0.0
    """Weight bytes between devices of different nodes."""
    optimizer_intra: float = 0.0
    """Optimizer-state bytes between devices of one node."""
    optimizer_inter: float = 0.0
    """Optimizer-state bytes between devices of different nodes."""

    @property
    def param(self) -> float:
        """All weight bytes."""
        return self.param_intra + self.param_inter

    @property
    def optimizer(self) -> float:
        """All optimizer-state bytes."""
        return self.optimizer_intra + self.optimizer_inter

    @property
    def total(self) -> float:
        """Everything moved."""
        return self.param + self.optimizer

    def __add__(self, other: MovedBytes) -> MovedBytes:
        return MovedBytes(
            self.param_intra + other.param_intra,
            self.param_inter + other.param_inter,
            self.optimizer_intra + other.optimizer_intra,
            self.optimizer_inter + other.optimizer_inter,
        )


def moved_bytes(
    moves: list[ExpertMove], topology: Topology, byte_model: ByteModel, with_optimizer: bool = True
) -> MovedBytes:
    """Bytes of a list of expert moves, split by intra- / inter-node link.

    `with_optimizer=False` is for systems whose optimizer state never moves (only weights
    travel), e.g. FasterMoE's shadows, which are transient copies.
    """
    if not moves:
        return MovedBytes()
    src = np.array([topology.check_device(m.src, "move source") for m in moves], dtype=np.int64)
    dst = np.array([topology.check_device(m.dst, "move destination") for m in moves], dtype=np.int64)
    same = np.flatnonzero(src == dst)
    if same.size:
        m = moves[int(same[0])]
        raise PlacementError(f"move of layer {m.layer} expert {m.expert} has source == destination == device {m.src}")
    n_intra = int(np.count_nonzero(topology.same_node(src, dst)))
    n_inter = len(moves) - n_intra
    opt = byte_model.expert_optimizer_bytes if with_optimizer else 0.0
    return MovedBytes(
        param_intra=n_intra * byte_model.expert_weight_bytes,
        param_inter=n_inter * byte_model.expert_weight_bytes,
        optimizer_intra=n_intra * opt,
        optimizer_inter=n_inter * opt,
    )


# ---------------------------------------------------------------------------------------------
# Expert parallelism


@dataclass(frozen=True, eq=False)
class EPLayout:
    """Megatron expert parallelism over D devices, possibly with expert data parallelism.

    The devices split into D / g consecutive groups of g = min(E, D) devices (Megatron's
    default rank order puts the EP dimension inside DP). Each group holds every expert exactly
    once, the same way in every group, and a token only travels inside its source's group:
    - D | E: one group of D devices, E / D experts per device (plain EP);
    - E | D (more devices than experts): D / E groups of E devices, one expert per device,
      every expert replicated D / E times and its gradients all-reduced over the replicas.
    Any other (E, D) is refused, as Megatron refuses it (num_moe_experts % ep_size == 0 and
    ep_size must divide the world). Every device of a group owns the same number of experts,
    which SmartMoE's swaps preserve.
    """

    owner_E: np.ndarray
    """owner_E[e] = position of expert e's device inside its group, in [0, g); int64 [E]."""
    num_devices: int
    """D, devices in total."""

    def __post_init__(self) -> None:
        owner = check_loads(self.owner_E, "EPLayout.owner_E", 1)
        E, D = owner.size, self.num_devices
        D = check_int(D, "EPLayout.num_devices", 1)
        object.__setattr__(self, "num_devices", D)
        g = ep_group_size(E, D)
        bad = np.flatnonzero(owner >= g)
        if bad.size:
            e = int(bad[0])
            raise PlacementError(f"EP expert {e} sits at group position {int(owner[e])}, which is not in [0, {g})")
        per_D = np.bincount(owner, minlength=g)
        uneven = np.flatnonzero(per_D != E // g)
        if uneven.size:
            d = int(uneven[0])
            raise PlacementError(
                f"EP group position {d} holds {int(per_D[d])} experts; every device of an EP group must hold {E // g}"
            )
        object.__setattr__(self, "owner_E", owner)

    @classmethod
    def even(cls, num_experts: int, num_devices: int) -> EPLayout:
        """Megatron's static layout: expert e at group position e // (E / g)."""
        g = ep_group_size(num_experts, num_devices)
        return cls(np.arange(num_experts, dtype=np.int64) // (num_experts // g), num_devices)

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.owner_E.size)

    @property
    def group_size(self) -> int:
        """g = min(E, D), devices per EP group."""
        return min(self.num_experts, self.num_devices)

    @property
    def num_groups(self) -> int:
        """D / g, the expert-data-parallel degree (replicas of every expert)."""
        return self.num_devices // self.group_size

    def devices_E_G(self) -> np.ndarray:
        """holders[e, k] = device holding expert e in group k; int64 [E, D/g]."""
        return self.owner_E[:, None] + self.group_size * np.arange(self.num_groups, dtype=np.int64)[None, :]

    def placement(self) -> InstancePlacement:
        """The instance placement: expert e on its group position in every group."""
        counts_ED = np.zeros((self.num_experts, self.num_devices), dtype=np.int64)
        counts_ED[np.arange(self.num_experts)[:, None], self.devices_E_G()] = 1
        return InstancePlacement(counts_ED)

    def dispatch(self, source_loads_SE) -> DispatchPlan:
        """Every token goes to its expert's device inside the source's group (S must equal D)."""
        source_loads_SE = _check_sources(source_loads_SE, self.num_experts, self.num_devices)
        s_K, e_K = np.nonzero(source_loads_SE)
        dest_K = (s_K // self.group_size) * self.group_size + self.owner_E[e_K]
        # valid by construction; validating a quarter-million entries at D = 1,024 cost more than this
        return DispatchPlan.trusted(s_K.astype(np.int64), e_K.astype(np.int64), dest_K.astype(np.int64),
                                    source_loads_SE[s_K, e_K], self.num_devices, self.num_experts, self.num_devices)


def ep_group_size(num_experts: int, num_devices: int) -> int:
    """g = min(E, D) if D | E or E | D; else PlacementError saying what would be valid."""
    E, D = int(num_experts), int(num_devices)
    if E < 1 or D < 1:
        raise PlacementError(f"EP needs >= 1 expert and >= 1 device, got E={E}, D={D}")
    if E % D and D % E:
        raise PlacementError(
            f"EP with {E} experts over {D} devices is impossible: the device count must divide the expert count "
            f"or be a multiple of it (e.g. D in {[d for d in range(1, 2 * E + 1) if E % d == 0 or d % E == 0][:8]}...)"
        )
    return min(E, D)


def _check_sources(source_loads_SE, num_experts: int, num_devices: int) -> np.ndarray:
    """Validate per-source loads of the baselines, whose token sources are the D devices."""
    source_loads_SE = check_loads(source_loads_SE, "source_loads_SE", 2)
    if source_loads_SE.shape != (num_devices, num_experts):
        raise PlacementError(
            f"source loads have shape {source_loads_SE.shape}; expected (D={num_devices} sources, E={num_experts} experts)"
        )
    return source_loads_SE


def split_evenly(source_loads_SE, holds_ED) -> DispatchPlan:
    """Split every (source, expert)'s tokens evenly over all holders of the expert.

    n tokens over r holders give each n // r; the n mod r remaining tokens go to the holders
    at positions s mod r, s mod r + 1, ... (mod r) in ascending device order (`even_shares`
    with the source id as offset), so different sources favour different holders and every
    holder ends within one token per source of the mean. This is the dispatch of replicated
    baselines without locality preference (FlexMoE).
    """
    source_loads_SE = check_loads(source_loads_SE, "source_loads_SE", 2)
    holds_ED = np.asarray(holds_ED, dtype=bool)
    S, E = source_loads_SE.shape
    if holds_ED.ndim != 2 or holds_ED.shape[0] != E:
        raise PlacementError(f"holds_ED must have shape (E={E}, D), got {holds_ED.shape}")
    D = holds_ED.shape[1]
    r_E = holds_ED.sum(axis=1)
    missing = np.flatnonzero(r_E == 0)
    if missing.size:
        raise PlacementError(f"expert {int(missing[0])} has no holder; cannot dispatch its tokens")
    # holders of every expert, expert-major, devices ascending: hd_H[start_E[e] : start_E[e] + r_E[e]]
    _, hd_H = np.nonzero(holds_ED)
    start_E = np.cumsum(r_E) - r_E
    s_P, e_P = np.nonzero(source_loads_SE)
    r_P = r_E[e_P]
    pair_K, pos_K, tokens_K = even_shares(source_loads_SE[s_P, e_P], r_P, s_P % r_P)
    return DispatchPlan(s_P[pair_K], e_P[pair_K], hd_H[start_E[e_P[pair_K]] + pos_K], tokens_K, S, E, D)


# ---------------------------------------------------------------------------------------------
# FasterMoE-style shadowing


@dataclass(frozen=True)
class ShadowCostModel:
    """FasterMoE's estimate of one MoE layer's time as a function of the shadowed experts.

    time(shadowed) = seconds_per_token * max device compute load
                   + a2a_seconds_per_token * max tokens a device receives from other devices
                   + shadow_seconds * number of shadowed experts.
    The broadcast of a shadowed expert sits on the critical path (it starts after the gate),
    which is why shadowing everything does not pay off.
    """

    seconds_per_token: float
    """Expert compute of one routed token, forward + backward, seconds."""
    a2a_seconds_per_token: float
    """All-to-all time per token arriving from another device (dispatch + combine, forward + backward)."""
    shadow_seconds: float
    """Broadcasting one expert's weights to every device and reducing its gradients back, seconds."""

    def __post_init__(self) -> None:
        for name in ("seconds_per_token", "a2a_seconds_per_token", "shadow_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value) or value < 0:
                raise PlacementError(f"ShadowCostModel.{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_hardware(cls, byte_model: ByteModel, topology: Topology, device_flops: float = 100e12) -> ShadowCostModel:
        """Costs from expert size, link bandwidths and a sustained device rate (FLOP/s).

        A token costs 6 FLOP per expert parameter (2 forward, 4 backward). Broadcasts and the
        all-to-all run at the slowest link class in use (inter-node when there are several
        nodes). The all-to-all moves each token 4 times (dispatch and combine, forward and
        backward). 100 TFLOP/s is a sustained bf16 rate of an A100-class GPU.
        """
        if not np.isfinite(device_flops) or device_flops <= 0:
            raise PlacementError(f"device_flops must be a positive FLOP/s rate, got {device_flops!r}")
        bw = topology.inter_node_bw if topology.nodes > 1 else topology.intra_node_bw
        return cls(
            seconds_per_token=6.0 * byte_model.params_per_expert / device_flops,
            a2a_seconds_per_token=4.0 * byte_model.token_bytes / bw,
            shadow_seconds=(byte_model.expert_weight_bytes + byte_model.expert_grad_bytes) / bw,
        )


@dataclass(frozen=True, eq=False)
class ShadowDecision:
    """What FasterMoE-style shadowing decided for one layer and iteration."""

    shadowed_E: np.ndarray
    """Boolean [E]: expert is broadcast to every device for this iteration."""
    placement: InstancePlacement
    """EP placement plus the shadows."""
    dispatch: DispatchPlan
    """Tokens of shadowed experts stay on their source; the rest follow EP."""
    estimated_seconds: float
    """The cost model's layer time for the chosen shadow set."""
    ep_estimated_seconds: float
    """The cost model's layer time without shadowing, for comparison."""


def fastermoe_shadow(layout: EPLayout, source_loads_SE, cost: ShadowCostModel) -> ShadowDecision:
    """Choose the experts to shadow from the *actual* loads, as FasterMoE does after the gate.

    Candidates are the top-k experts by load for k = 0..E (shadowing a light expert before a
    heavier one never helps the max); every prefix is evaluated in one vectorised pass and the
    cheapest k wins, ties going to fewer shadows. A shadowed expert is computed where its
    tokens are, so it removes that expert's tokens from the all-to-all entirely.
    """
    E, D = layout.num_experts, layout.num_devices
    source_loads_SE = _check_sources(source_loads_SE, E, D)
    ep_plan = layout.dispatch(source_loads_SE)
    # per-expert contribution to device compute and to remote tokens received, under EP
    load_ED = ep_plan.received_ED().astype(np.float64)
    remote = ep_plan.source_K != ep_plan.dest_K
    remote_ED = np.bincount(
        ep_plan.expert_K[remote] * D + ep_plan.dest_K[remote], weights=ep_plan.tokens_K[remote], minlength=E * D
    ).reshape(E, D)
    local_ED = source_loads_SE.T.astype(np.float64)  # a shadowed expert runs on each source's own tokens
    order = np.argsort(-source_loads_SE.sum(axis=0), kind="stable")
    zeros = np.zeros((1, D))
    # rows k = 0..E: device loads with the top-k experts shadowed; [E+1, D]
    compute_KD = load_ED.sum(axis=0)[None, :] + np.concatenate(
        (zeros, np.cumsum(local_ED[order] - load_ED[order], axis=0))
    )
    inbound_KD = remote_ED.sum(axis=0)[None, :] - np.concatenate((zeros, np.cumsum(remote_ED[order], axis=0)))
    time_K = (
        cost.seconds_per_token * compute_KD.max(axis=1)
        + cost.a2a_seconds_per_token * inbound_KD.max(axis=1)
        + cost.shadow_seconds * np.arange(E + 1)
    )
    k = int(np.argmin(time_K))
    shadowed_E = np.zeros(E, dtype=bool)
    shadowed_E[order[:k]] = True
    counts_ED = layout.placement().counts_ED.copy()
    counts_ED[shadowed_E] = 1
    keep = ~shadowed_E[ep_plan.expert_K]
    s_P, e_P = np.nonzero(source_loads_SE * shadowed_E[None, :])
    dispatch = DispatchPlan(
        np.concatenate((ep_plan.source_K[keep], s_P)),
        np.concatenate((ep_plan.expert_K[keep], e_P)),
        np.concatenate((ep_plan.dest_K[keep], s_P)),
        np.concatenate((ep_plan.tokens_K[keep], source_loads_SE[s_P, e_P])),
        D,
        E,
        D,
    )
    return ShadowDecision(shadowed_E, InstancePlacement(counts_ED), dispatch, float(time_K[k]), float(time_K[0]))


# ---------------------------------------------------------------------------------------------
# SmartMoE-style swapping


def smartmoe_swap(layout: EPLayout, loads_E, max_swaps: int | None = None) -> tuple[EPLayout, int]:
    """Swap experts between devices of an EP group to pair heavy experts with light ones.

    Repeatedly takes the most loaded group position h (by predicted load) and, trying partners
    from the least loaded up, the first partner l with a pair (a on h, b on l) whose exchange
    narrows the gap: 0 < load_a - load_b < load_h - load_l. Among such pairs it picks the
    one bringing both devices closest to their mean. Each swap strictly lowers the sum of
    squared device loads, so the loop ends; `max_swaps` (default E) bounds the work per call.
    Expert counts per device stay equal (no replication), as in SmartMoE. Returns the new
    layout and the number of swaps made.
    """
    E = layout.num_experts
    loads_E = np.asarray(loads_E, dtype=np.float64)
    if loads_E.shape != (E,) or not np.all(np.isfinite(loads_E)) or (loads_E < 0).any():
        raise PlacementError(f"loads_E must be {E} finite non-negative loads, got shape {loads_E.shape}")
    limit = E if max_swaps is None else int(max_swaps)
    if limit < 0:
        raise PlacementError(f"max_swaps must be >= 0, got {max_swaps}")
    g = layout.group_size
    owner = layout.owner_E.copy()
    dev_G = np.bincount(owner, weights=loads_E, minlength=g)
    swaps = 0
    while swaps < limit:
        h = int(np.argmax(dev_G))
        on_h = np.flatnonzero(owner == h)
        best = None
        for l in np.argsort(dev_G, kind="stable"):
            gap = dev_G[h] - dev_G[l]
            if l == h or gap <= 0:
                break
            on_l = np.flatnonzero(owner == l)
            x_AB = loads_E[on_h][:, None] - loads_E[on_l][None, :]  # load moved from h to l by swapping a, b
            ok_AB = (x_AB > 0) & (x_AB < gap)
            if ok_AB.any():
                a, b = np.unravel_index(int(np.argmin(np.where(ok_AB, np.abs(x_AB - gap / 2), np.inf))), x_AB.shape)
                best = (int(on_h[a]), int(on_l[b]), int(l), float(x_AB[a, b]))
                break
        if best is None:
            break
        a, b, l, x = best
        owner[a], owner[b] = l, h
        dev_G[h] -= x
        dev_G[l] += x
        swaps += 1
    return EPLayout(owner, layout.num_devices), swaps


def ep_layout_moves(old: EPLayout, new: EPLayout, layer: int) -> list[ExpertMove]:
    """The moves turning `old` into `new`: each expert that changed position moves in every group."""
    if old.num_experts != new.num_experts or old.num_devices != new.num_devices:
        raise PlacementError(
            f"EP layouts differ in shape: E={old.num_experts}/{new.num_experts}, D={old.num_devices}/{new.num_devices}"
        )
    old_EG, new_EG = old.devices_E_G(), new.devices_E_G()
    e_M, k_M = np.nonzero(old_EG != new_EG)
    return [ExpertMove(layer, int(e), int(old_EG[e, k]), int(new_EG[e, k])) for e, k in zip(e_M, k_M)]


# ---------------------------------------------------------------------------------------------
# FlexMoE-style replicate / relocate


def flexmoe_adjust(
    placement: InstancePlacement,
    loads_E,
    slots_per_device: int,
    topology: Topology,
    layer: int = 0,
    max_ops: int | None = None,
) -> tuple[InstancePlacement, list[ExpertMove]]:
    """Incrementally replicate the most loaded experts into free slots, relocating when full.

    Device loads are predicted with each expert's load split evenly over its replicas. One
    operation at a time: take the most loaded device and, on it, the expert with the highest
    per-replica load (that is not yet everywhere). Add a replica on the least loaded device
    that has a free slot and lacks the expert; if no device has a free slot, relocate: on the
    least loaded device that lacks the expert and holds a replicated expert, drop that
    device's replica of lowest per-replica load and use the slot. An operation is kept only
    if it lowers (max device load, sum of squared device loads) lexicographically; the first
    one that does not ends the call, and `max_ops` (default E * D) bounds it. Every kept
    operation strictly lowers a quantity over finitely many placements, so the loop ends.

    Moves are the net change: a replica that exists afterwards but not before is copied
    (weights and optimizer state) from a device that held the expert before, on the same
    node when there is one (lowest device id first); a replica added and dropped again within
    the call moves nothing. Returns the new placement and the moves.
    """
    E, D = placement.num_experts, placement.num_devices
    if topology.num_devices != D:
        raise PlacementError(f"topology has {topology.num_devices} devices but the placement has {D}")
    loads_E = np.asarray(loads_E, dtype=np.float64)
    if loads_E.shape != (E,) or not np.all(np.isfinite(loads_E)) or (loads_E < 0).any():
        raise PlacementError(f"loads_E must be {E} finite non-negative loads, got shape {loads_E.shape}")
    if placement.counts_ED.max() > 1:
        raise PlacementError("FlexMoE placements hold at most one instance of an expert per device")
    placement.check_slot_limit(slots_per_device)
    limit = E * D if max_ops is None else int(max_ops)
    holds_ED = placement.holds_ED().copy()

    def objective(h_ED: np.ndarray) -> tuple[float, float]:
        dev_D = (loads_E / h_ED.sum(axis=1)) @ h_ED
        return float(dev_D.max()), float((dev_D**2).sum())

    current = objective(holds_ED)
    for _ in range(limit):
        r_E = holds_ED.sum(axis=1)
        per_E = loads_E / r_E
        dev_D = per_E @ holds_ED
        hot_dev = int(np.argmax(dev_D))
        cand_E = holds_ED[:, hot_dev] & (r_E < D)
        if not cand_E.any():
            break
        hot = int(np.argmax(np.where(cand_E, per_E, -np.inf)))
        lacks_D = ~holds_ED[hot]
        free_D = slots_per_device - holds_ED.sum(axis=0)
        trial = holds_ED.copy()
        target_D = lacks_D & (free_D > 0)
        if target_D.any():
            dst = int(np.argmin(np.where(target_D, dev_D, np.inf)))
        else:
            # a replica we may drop: on a device lacking `hot`, of another expert with > 1 replicas
            victim_ED = holds_ED & (r_E > 1)[:, None] & lacks_D[None, :]
            victim_ED[hot] = False
            if not victim_ED.any():
                break
            dst = int(np.argmin(np.where(victim_ED.any(axis=0), dev_D, np.inf)))
            victim = int(np.argmin(np.where(victim_ED[:, dst], per_E, np.inf)))
            trial[victim, dst] = False
        trial[hot, dst] = True
        candidate = objective(trial)
        if candidate >= current:
            break
        holds_ED, current = trial, candidate
    before_ED = placement.holds_ED()
    moves = []
    for e, dst in zip(*np.nonzero(holds_ED & ~before_ED)):
        holders = np.flatnonzero(before_ED[e])
        local = holders[topology.same_node(holders, dst)]
        moves.append(ExpertMove(layer, int(e), int(local[0]) if local.size else int(holders[0]), int(dst)))
    return InstancePlacement(holds_ED.astype(np.int64)), moves


# ---------------------------------------------------------------------------------------------
# DeepSpeed-style static replication


DEEPSPEED_MIN_CAPACITY = 4
"""DeepSpeed's `MoE(min_capacity=4)`: its gate never gives an expert fewer rows per source."""


def deepspeed_slot_counts(num_experts: int, num_ranks: int) -> list[int]:
    """The slots per rank s DeepSpeed-MoE can lay out, ascending: an expert-parallel group of
    ep_size = E / s ranks holds all E experts, s on each, and the ranks are whole groups, so
    s | E and (E / s) | ranks. 16 experts on 16 ranks: [1, 2, 4, 8, 16]."""
    E = check_int(num_experts, "num_experts", 1)
    G = check_int(num_ranks, "num_ranks", 1)
    return [s for s in range(1, E + 1) if E % s == 0 and G % (E // s) == 0]


def deepspeed_slots(num_experts: int, num_ranks: int, slots_per_rank: int, chosen: bool) -> int:
    """Static replication's s: `slots_per_rank` when chosen (refused unless DeepSpeed can lay it
    out), else the most slots DeepSpeed can lay out within that many (the memory budget)."""
    valid = deepspeed_slot_counts(num_experts, num_ranks)
    s = check_int(slots_per_rank, "slots_per_rank", 1)
    rule = (f"DeepSpeed's expert-parallel groups need s | E and E/s | ranks; valid s for {num_experts} "
            f"experts on {num_ranks} ranks: {', '.join(map(str, valid))}")
    if chosen:
        if s not in valid:
            raise PlacementError(f"static replication cannot use {s} slots per rank: {rule}")
        return s
    within = [v for v in valid if v <= s]
    if not within:
        raise PlacementError(f"static replication needs at least {valid[0]} slots per rank and the memory "
                             f"budget holds {s}: {rule}")
    return within[-1]


def static_replication(num_experts: int, num_ranks: int, slots_per_rank: int) -> InstancePlacement:
    """DeepSpeed-MoE's static replication: E/s consecutive ranks hold every expert once.

    Slot j of rank r holds expert (r*s + j) mod E: DeepSpeed-MoE's expert-parallel groups of
    ep_size = E/s consecutive ranks, rank i of a group holding experts i*s .. i*s + s - 1, and a
    class's replicas one per group (its expert-data-parallel group, ranks e//s, e//s + E/s, ...),
    whose gradients are all-reduced every iteration (`StaticPolicy`). The replication paper's
    baseline (16 ranks x 4 slots, 16 classes) gives 4 instances of each class on 4 different
    ranks. s must be one DeepSpeed can lay out (`deepspeed_slot_counts`). The placement never
    changes, so nothing moves; tokens are routed within the group (`deepspeed_dispatch`).
    """
    E = check_int(num_experts, "num_experts", 1)
    G = check_int(num_ranks, "num_ranks", 1)
    s = deepspeed_slots(E, G, slots_per_rank, chosen=True)
    slot_expert_RS = (np.arange(G * s, dtype=np.int64) % E).reshape(G, s)
    return slot_placement(slot_expert_RS, E)


def deepspeed_dispatch(source_loads_SE, slots_per_rank: int, capacity_factor: float) -> TokenSpread:
    """DeepSpeed-MoE's dispatch on `static_replication`'s layout: group-local, capped per source, padded.

    DeepSpeed's gate gives every source C = max(ceil(cf x a / E), DEEPSPEED_MIN_CAPACITY) rows
    per expert (a: the assignments of a source's micro-batch, tokens x top-k; every rank's batch
    has one shape, so one C, from the largest source). A source keeps the first C of its tokens
    for each expert and drops the rest, whatever other sources leave unused. It sends its
    [E, C, hidden] buffer, padding included, by an all-to-all within its expert-parallel group:
    expert e's rows go to the group's rank e // s. So every instance computes ep_size x C rows
    (`TokenSpread.capacity`), and the dispatch plan holds C rows for every (source, expert),
    the padding sent with the tokens (`kept_K` the tokens among them).
    """
    loads_SE = check_loads(source_loads_SE, "source_loads_SE", 2)
    G, E = loads_SE.shape
    s = deepspeed_slots(E, G, slots_per_rank, chosen=True)
    ep = E // s
    rows = max(instance_capacity(capacity_factor, int(loads_SE.sum(axis=1).max(initial=0)), E, 1),
               DEEPSPEED_MIN_CAPACITY)
    kept_SE = np.minimum(loads_SE, rows)
    source_K = np.repeat(np.arange(G, dtype=np.int64), E)
    expert_K = np.tile(np.arange(E, dtype=np.int64), G)
    dest_K = source_K // ep * ep + expert_K // s  # the holder of the expert in the source's group
    plan = DispatchPlan.trusted(source_K, expert_K, dest_K, np.full(G * E, rows, dtype=np.int64), G, E, G)
    # each group's holder of e processes what the group's ep sources kept of e
    kept_gE = kept_SE.reshape(G // ep, ep, E).sum(axis=1)
    expert_gE = np.broadcast_to(np.arange(E), kept_gE.shape)
    processed_ED = np.zeros((E, G), dtype=np.int64)
    processed_ED[expert_gE, np.arange(0, G, ep)[:, None] + expert_gE // s] = kept_gE
    kept_K = kept_SE.ravel()
    kept_K.setflags(write=False)
    return TokenSpread(processed_ED, (loads_SE - kept_SE).sum(axis=0), ep * rows, plan, kept_K)
