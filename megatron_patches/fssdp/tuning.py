"""What fssdp measures at run time and chooses from it: the probed bandwidths, the memory
capacity m, the cost model and the overlap degree t (DESIGN 4.2).

- Bandwidths: a ring exchange at attach, inside a node and between nodes, the slowest rank's.
- m (auto): on CPU from --fssdp-memory-budget-mb at the first iteration; on GPU the first
  iteration runs without copies and measures its activation peak, m is what free memory leaves.
- The cost model (calibration and auto t): the first iteration's measured expert time per token,
  a probed per-instance time, the gather and all-to-all over the probed bandwidths, the reduce
  beyond what the backward hides.
- t (auto): priced on the loads of the first iteration and again at `planner.overlap_due`'s
  (powers of 4, then before every re-shard check).

Every figure is reduced over the whole job (minimum, maximum or sum), so every FSSDP group
plans with the same t, m and topology.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_patches.comm.timing import DeviceMemory
from megatron_patches.fssdp.config import FSSDPConfig
from megatron_patches.placement import fssdp as planner
from megatron_patches.placement.accounting import dispatch_bytes, sparse_all_gather_seconds, transfer_seconds
from megatron_patches.placement.types import ModelShardLayout, ShardLayout, Topology

__all__ = ["FSSDPTuning", "probe_bandwidths"]


def probe_bandwidths(group, rank: int, nodes: int, devices_per_node: int, expert_numel: int,
                     device: torch.device) -> tuple[float, float]:
    """(intra-node, inter-node) point-to-point bytes/s: a ring exchange of 8 experts' bytes
    among the ranks of each node, then among the same-position ranks of every node; median
    of 5 after a warm-up, minimum over every rank of the job (every FSSDP group must derive
    the same t and plans). One node: both are the intra-node figure; one rank per node: both
    the inter-node one. The two figures let t (`gather_bandwidth` with the node-aware
    collectives) and calibration's gather price see that a copy within a node is cheaper."""
    G, N = devices_per_node, nodes
    node, local = divmod(rank, G)
    rings = {}
    if G > 1:
        rings["intra"] = (node * G + (local + 1) % G, node * G + (local - 1) % G)
    if N > 1:
        rings["inter"] = (((node + 1) % N) * G + local, ((node - 1) % N) * G + local)
    measured = {kind: _ring_bandwidth(group, *peers, expert_numel, device) for kind, peers in rings.items()}
    bw = torch.tensor([measured.get("intra", measured.get("inter")), measured.get("inter", measured.get("intra"))],
                      dtype=torch.float64)
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)  # the world: every FSSDP group plans with the same topology
    intra, inter = bw.tolist()
    return intra, inter


def _ring_bandwidth(group, right: int, left: int, expert_numel: int, device: torch.device) -> float:
    """Bytes/s of sending 8 experts' bytes to group position `right` while receiving from `left`."""
    send = torch.ones(8 * expert_numel, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    ranks = dist.get_process_group_ranks(group)
    samples = []
    for _ in range(6):
        started = time.perf_counter()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, ranks[right], group=group),
                                        dist.P2POp(dist.irecv, recv, ranks[left], group=group)])
        for work in works:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return send.numel() * send.element_size() / float(np.median(samples[1:]))


class FSSDPTuning:
    """t, m and the cost model of one fssdp run (see the module docstring). ``log``: takes a line for
    the runtime's log (rank 0 prints it)."""

    def __init__(self, config: FSSDPConfig, num_experts: int, device: torch.device, log: Callable[[str], None]) -> None:
        self.config = config
        self.num_experts = num_experts
        self.device = device
        self._log = log
        self.t: int | None = config.overlap_degree
        """The overlap degree (None: auto, not chosen yet)."""
        self.m: int | None = config.memory_capacity
        """The memory capacity (None: auto, not measured yet)."""
        self.cost: planner.FSSDPCostModel | None = None
        """The cost model of calibration and auto t, from the first iteration's measured times."""
        self._memory_base: int | None = None
        """GPU, auto m: bytes held when the measuring (first) iteration started."""
        self.topology: Topology | None = None
        self.expert_numel = self.element_size = self.hidden_size = 0
        self.layers_alive = 0

    def attach(self, topology: Topology, expert_numel: int, element_size: int, hidden_size: int,
               num_layers: int) -> None:
        """The model's figures (known once the layers are built) and the probed topology."""
        self.topology = topology
        self.expert_numel, self.element_size, self.hidden_size = expert_numel, element_size, hidden_size
        self.layers_alive = min(2 if self.config.rematerialize else num_layers, num_layers)
        """MoE layers whose copies are alive at once (re-materialization: the one in use and the
        one being re-gathered)."""

    @property
    def expert_bytes(self) -> int:
        return self.expert_numel * self.element_size

    def begin_iteration(self) -> tuple[int, int]:
        """The (t, m) this iteration plans with: 0 while auto t or auto m (GPU) measures."""
        if self.m is None and self.device.type != "cuda":
            self.m = self._budget_memory_capacity()
        if self.m is None and self._memory_base is None:
            # auto m on GPU: this iteration runs without copies and measures its activation peak
            DeviceMemory.reset_peak(self.device)
            self._memory_base = DeviceMemory.read(self.device).allocated
        return (0 if self.t is None else self.t), (0 if self.m is None else self.m)

    def end_iteration(self, iteration: int, expert_s: float, expert_tokens: int, non_moe_s: list[float],
                      instance_s, layout: ModelShardLayout, source_loads_LDE: np.ndarray | None) -> None:
        """After an iteration: auto m from its memory peak, the cost model from its times (the first
        time it is needed), auto t from its loads when they were kept. ``instance_s``: probes one
        more expert instance's seconds (called only when the cost model is built); ``layout``: the
        owners of the stage's MoE layers."""
        if self.m is None:
            self.m = self._measured_memory_capacity()
        if self.cost is None and (self.config.calibrate or self.config.overlap_degree is None):
            self.cost = self._measured_cost(expert_s, expert_tokens, _min_over_world(non_moe_s), instance_s())
        if source_loads_LDE is not None:
            # auto t: chosen after the first iteration, again after iterations 4, 16, 64, ... and
            # before every re-shard check (`planner.overlap_due`: loads drift as the router trains)
            shards = [layout.layer(index) for index in range(layout.num_layers)]
            self.t = self._auto_overlap_degree(iteration, shards, source_loads_LDE)

    # ---- the cost model --------------------------------------------------------------------

    def _measured_cost(self, expert_s: float, expert_tokens: int, t_non_moe: float,
                       instance_s: float) -> planner.FSSDPCostModel:
        """The cost model (t by cost, calibration) from the first iteration's measurements, the
        same on every rank: expert time per token (slowest rank) and per instance (the probe),
        the gather and the all-to-all over the probed bandwidth with this run's collective
        algorithm, and the copies' reduce beyond what attention backward (estimated as twice
        `t_non_moe`, the measured non-MoE forward time) and the MoE backward hide."""
        local = torch.tensor([expert_s / max(expert_tokens, 1), instance_s], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        # a copy serves the forward and the backward (two GEMMs per forward GEMM): 3x the measured
        # forward; the layer's backward outside the experts (twice its forward) hides the reduce
        seconds, per_instance = ((1.0 + planner.BACKWARD_OVER_FORWARD) * float(v) for v in local.tolist())
        cost = self.cost_model(seconds, planner.BACKWARD_OVER_FORWARD * t_non_moe, per_instance)
        self._log(
            f"fssdp: cost model: {seconds * 1e6:.2f} us per token copy (measured) and {per_instance * 1e6:.1f} us per "
            f"expert instance (probed; expert forward + backward), {self.expert_bytes} bytes per extra copy over "
            f"{self.topology.intra_node_bw / 1e9:.2f} GB/s ({self.config.collectives} collectives), its reduce "
            f"{cost.reduce_ratio:g}x that beyond {cost.reduce_hidden_s * 1e3:.2f} ms of attention backward and the MoE "
            f"backward, the all-to-all at {self.hidden_size * self.element_size} bytes per token"
        )
        return cost

    def cost_model(self, seconds_per_token: float, hidden_bwd: float,
                   seconds_per_instance: float) -> planner.FSSDPCostModel:
        """The cost model from the three measured figures (kept in checkpoints)."""
        reduce_ratio = (4 if self.config.reduce_in_fp32 else self.element_size) / self.element_size
        topology, algorithm, expert_bytes = self.topology, self.config.collectives, float(self.expert_bytes)
        token_bytes = self.hidden_size * self.element_size
        return planner.FSSDPCostModel(
            seconds_per_token=seconds_per_token,
            seconds_per_instance=seconds_per_instance,
            expert_bytes=expert_bytes,
            gather_seconds=lambda shard, placement: sparse_all_gather_seconds(shard, placement, expert_bytes, topology,
                                                                              algorithm),
            reduce_ratio=reduce_ratio,
            reduce_hidden_s=hidden_bwd,
            dispatch_seconds=lambda plan: 4.0 * transfer_seconds(dispatch_bytes(plan, topology, token_bytes), topology),
        )

    # ---- t ---------------------------------------------------------------------------------

    def _auto_overlap_degree(self, iteration: int, shards: list[ShardLayout], source_loads_LDE: np.ndarray) -> int:
        """Auto t at the end of this iteration, by cost (`planner.choose_overlap_degree`): t = 0,
        the powers of two up to E and DESIGN 4.2's hidden t (what the measured non-MoE time hides
        at the probed bandwidth) priced on this iteration's loads, with calibration's copies when
        the run calibrates; the cheapest is kept. The prices are summed over every rank (each
        prices its pipeline stage's layers), so every rank takes the same t. The times are the
        first iteration's (the cost model's); the loads are this iteration's, so a later choice
        follows the router."""
        cost = self.cost
        t_non_moe = cost.reduce_hidden_s / planner.BACKWARD_OVER_FORWARD  # `_measured_cost` set it from it
        bw = planner.gather_bandwidth(self.topology, self.config.collectives)
        hidden_t = planner.overlap_degree(t_non_moe, bw, self.expert_bytes, self.num_experts)
        candidates = planner.overlap_candidates(hidden_t, self.num_experts)
        local = planner.overlap_prices(shards, source_loads_LDE, candidates, self.m, self.topology, cost,
                                       t_non_moe, calibrated=self.config.calibrate)
        prices = torch.from_numpy(local)
        dist.all_reduce(prices)
        choice = planner.choose_overlap_degree(candidates, prices.numpy() / dist.get_world_size(), hidden_t)
        change = "" if self.t is None else " (unchanged)" if choice.t == self.t else f" (was {self.t})"
        self._log(
            f"fssdp: auto overlap degree t = {choice.t}{change} from iteration {iteration + 1} (hidden t = "
            f"{hidden_t}: non-MoE time {t_non_moe * 1e3:.2f} ms per layer, bandwidth {bw / 1e9:.2f} GB/s, expert "
            f"{self.expert_bytes} bytes, {self.num_experts} experts; priced on iteration {iteration}'s loads with "
            f"m = {self.m}, per rank's stage: {choice.table()})"
        )
        return choice.t

    # ---- m ---------------------------------------------------------------------------------

    def _budget_memory_capacity(self) -> int:
        """CPU, auto m: --fssdp-memory-budget-mb over the layers alive and the bytes of one copy."""
        budget = torch.tensor([self.config.memory_budget_bytes / self.layers_alive], dtype=torch.float64)
        dist.all_reduce(budget, op=dist.ReduceOp.MIN)
        copy_bytes = 2 * self.expert_bytes
        m = planner.memory_capacity(float(budget.item()), copy_bytes)
        self._log(
            f"fssdp: auto memory capacity m = {m} (--fssdp-memory-budget-mb: {budget.item() / 2**20:.1f} MiB per "
            f"layer with copies alive, {self.layers_alive} such layers, {copy_bytes} bytes per copy: weights "
            "and gradient)"
        )
        return m

    def _measured_memory_capacity(self) -> int:
        """GPU, auto m, after the first iteration (run without copies): free memory minus its
        activation peak x (1 + margin), per layer alive, over the bytes of one copy; the
        minimum over every rank of the job, so every FSSDP group plans with the same m."""
        memory = DeviceMemory.read(self.device)
        peak = max(memory.peak - self._memory_base, 0)
        figures = torch.tensor([memory.free, peak], dtype=torch.float64)  # host tensors: the group's gloo side
        every = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
        dist.all_gather(every, figures)
        copy_bytes = 2 * self.expert_bytes
        margin = self.config.memory_margin
        per_rank = [planner.memory_capacity_after_activations(float(f), float(p), margin, self.layers_alive, copy_bytes)
                    for f, p in (e.tolist() for e in every)]
        m = min(per_rank)
        r = per_rank.index(m)
        free, peak = (float(x) for x in every[r].tolist())
        self._log(
            f"fssdp: auto memory capacity m = {m} (rank {r}, the tightest: {free / 2**20:.0f} MiB free after "
            f"iteration 1 - activation peak {peak / 2**20:.0f} MiB x (1 + --fssdp-memory-margin {margin}) = "
            f"{(free - peak * (1 + margin)) / 2**20:.0f} MiB over {self.layers_alive} layers with copies alive, "
            f"{copy_bytes} bytes per copy: weights and gradient)"
        )
        return m


def _min_over_world(samples: list[float]) -> float:
    """The mean of this rank's samples (0 without any), the minimum over every rank of the job."""
    local = torch.tensor([float(np.mean(samples)) if samples else 0.0], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MIN)
    return float(local.item())
