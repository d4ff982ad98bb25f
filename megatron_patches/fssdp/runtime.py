"""The FSSDP runtime: plans, collectives and gradient flow for all MoE layers of a stage.

Ownership (the sharding phase): the FSSDP group is Megatron's expert-parallel group. With
expert tensor parallelism (ETP > 1) Megatron's EP groups hold one ETP rank each, so each
gathers, reduces and re-shards its own shard of every expert (copies and bytes in the records
are one group's: ETP-shard sized), and all plan alike from the world's loads. Every expert of
every MoE layer is owned by exactly one rank of the group and held in one of that rank's
*slots*, Megatron's local expert modules (`reshard`), with its gradient in Megatron's DDP
buffer and its Adam state in Megatron's optimizer, once per group. With more ranks than one
group needs (expert-data-parallel size EDP > 1) the stage has EDP FSSDP groups, HSDP-style:
sharded inside a group, replicated across groups. Each group gathers and reduces its own
copies; Megatron's DDP all-reduces the owners' gradients over the expert-data-parallel group
(the same position in every group), as it does in ep. Every plan input (the loads, t, m, the
two probed bandwidths) is reduced over the whole job, so every group computes the same plans
and the same re-shards, and position d holds the same experts in every group. At start the
slots hold EP's contiguous layout (the even sharding of DESIGN 4.3); every `reshard_interval`
iterations the heterogeneous sharding of the predicted loads is adopted when it lowers the
mean imbalance bound, moving weights and optimizer state between ranks
(`reshard.exchange_slots`). Non-expert parameters are untouched.

Checkpoints keep the experts under ep's per-expert keys and the placement as common state
(`fssdp/checkpoint.py`). What the runtime measures and chooses from it (bandwidths, m, the cost
model, t) is `fssdp/tuning.py`; its per-iteration figures are `fssdp/metrics.py`.

Per iteration (the materialization phase), every rank computes the same plan from the same
all-reduced loads: for each layer, `placement.fssdp.materialize(shard, predicted loads, t,
m)` and the SparseAllGather / SparseReduceScatter pair for it (`--fssdp-collectives`:
node-aware by default, `comm.relay`; flat, `comm.sparse`). With --fssdp-planner-thread a host
thread makes them in layer order while the forward runs, so only the first layer's plan, and any
plan not ready when its layer starts, are waited for (`plan_of`; the record's
`planner_exposed_s` has the training thread's share either way). Per layer the layer
(`layer.FSSDPMoELayer`) gathers the copies on the iteration's first micro-batch and keeps
them for the others (`forward_backward` scopes them; with re-materialization per micro-batch),
dispatches every micro-batch by `placement.fssdp.dispatch` and computes; the copies'
gradient, summed over the micro-batches, is reduced once into the owners' `main_grad` before
Megatron's finalize_model_grads runs (`attach` wraps it).

The sparse collectives run on a process group of their own (same ranks as the EP group), so
their point-to-point traffic never interleaves with Megatron's all-to-alls on the EP group.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_patches.comm.groups import node_layout
from megatron_patches.comm.relay import RelayAllGather, RelayReduceScatter
from megatron_patches.comm.sparse import SparseAllGather, SparseReduceScatter
from megatron_patches.comm.timing import DeviceTimer, nvtx_range
from megatron_patches.comm.traffic import TrafficCounter
from megatron_patches.compat import mcore
from megatron_patches.fssdp import metrics
from megatron_patches.fssdp.checkpoint import placement_state_dict, restore_placement
from megatron_patches.fssdp.config import FSSDPConfig
from megatron_patches.fssdp.layer import FSSDPMoELayer, LayerCopies, LayerPass
from megatron_patches.fssdp.metrics import IterationStats
from megatron_patches.fssdp.reshard import SlotTable, move_slots, optimizer_state_exists, plan_reshard
from megatron_patches.fssdp.tuning import FSSDPTuning, probe_bandwidths
from megatron_patches.mode.layer import with_moe_layer
from megatron_patches.mode.runtime import ModeRuntime, StepResult
from megatron_patches.placement import fssdp as planner
from megatron_patches.placement.loads import LoadTracker
from megatron_patches.placement.types import InstancePlacement, ModelShardLayout, ShardLayout, Topology, check_loads

__all__ = ["FSSDPRuntime", "FSSDPLayerPlan"]

@dataclass
class FSSDPLayerPlan:
    """One MoE layer's plan for one iteration."""

    index: int
    """Row of the layer in the stage's MoE layers."""
    shard: ShardLayout
    """Owners of the layer's experts."""
    placement: InstancePlacement
    """Who holds a copy this iteration (contains the shard)."""
    gather: SparseAllGather
    reduce: SparseReduceScatter
    regather: SparseAllGather | None
    """The backward's re-gather (re-materialization only)."""
    held_row_E: np.ndarray = field(init=False)
    """Row of expert e in this rank's held buffer, -1 if this rank holds no copy."""

    def __post_init__(self) -> None:
        self.held_row_E = np.full(self.shard.num_experts, -1, dtype=np.int64)
        self.held_row_E[self.gather.held_chunks] = np.arange(self.gather.held_chunks.size)


class FSSDPRuntime(ModeRuntime):
    """Coordinates FSSDP for the MoE layers of this pipeline stage (see module docstring)."""

    name = "fssdp"

    def __init__(self, config: FSSDPConfig, num_experts: int, moe_layer_numbers: list[int], on_gpu: bool):
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.moe_layer_numbers = list(moe_layer_numbers)
        """Global numbers of all MoE layers of the model (the load tracker covers all)."""
        self.on_gpu = on_gpu
        self.timer = DeviceTimer(self.device)
        """Times the stalls behind collectives, the expert compute and the non-MoE part of each
        layer on the compute stream (CUDA events on GPU, read once per iteration in
        `end_iteration`; the host clock on CPU)."""
        if parallel_state.get_expert_model_parallel_world_size() < 2:
            raise ValueError("fssdp mode needs an expert-parallel group of at least 2 ranks (copies go to the other ranks)")
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.edp_group = parallel_state.get_expert_data_parallel_group()
        """The same position in every FSSDP group of the stage (Megatron's expert-data-parallel
        group): owners' gradients are all-reduced over it by Megatron's DDP."""
        self.group = _dedicated_groups(dist.get_process_group_ranks(self.ep_group))
        """Process group of the sparse collectives (the EP group's ranks)."""
        ranks = dist.get_process_group_ranks(self.group)
        self.rank = dist.get_rank(self.group)
        self.num_devices = len(ranks)
        self.nodes, self.devices_per_node = node_layout(ranks)
        _check_same_node_layout(self.nodes, self.devices_per_node, ranks)
        self.edp_topology = Topology(*node_layout(dist.get_process_group_ranks(self.edp_group)), 1.0, 1.0)
        """Nodes of the expert-data-parallel group, for the re-shard's `reshard_edp` bytes (node_layout is
        a world-wide collective: taken here, where every rank passes, not inside a re-shard)."""
        self.traffic = TrafficCounter()
        self.tracker = LoadTracker.for_predictor(len(self.moe_layer_numbers), num_experts, config.load_window,
                                                  config.load_predictor)
        self.layers: list = []
        """This stage's FSSDP MoE layers, in forward order."""
        self.plans: dict[int, FSSDPLayerPlan] = {}
        """This iteration's plans made so far, by layer number (`plan_of` waits for the others)."""
        self._planning: dict[int, Future] = {}
        """The plans the planner thread has yet to hand over, by layer number."""
        self._planner = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="fssdp-planner")
                         if config.planner_thread else None)
        """--fssdp-planner-thread: plans the layers of an iteration in layer order while the
        layers before them run (one thread; the placement kernels release the GIL). None: every
        plan is made in `begin_iteration`, on the training thread."""
        self.pending: list = []
        """(layer copies, spRS handle) launched in the backward, not yet added into main_grad."""
        self.expert_param_sync = None
        """With --overlap-param-gather: waits for an owned expert parameter's all-gather (`wrap`)."""
        self.expert_grad_ready = None
        """With --overlap-grad-reduce: registers an owned expert parameter ready for DDP's reduce
        (`wrap`)."""
        self.shared: dict[int, LayerCopies] = {}
        """Each layer's copies during one forward_backward call (without re-materialization the
        micro-batches share them: one gather and one reduce per iteration), by layer number."""
        self.topology: Topology | None = None
        self.expert_numel = 0
        self.hidden_size = 0
        """The model's hidden size (bytes per dispatched token = hidden size x element size)."""
        self.element_size = 0
        self.tuning = FSSDPTuning(config, num_experts, self.device, lambda line: self._log.append(line))
        """t, m and the cost model: measured and chosen at run time."""
        self._iteration = 0
        """The iteration being run (begin_iteration's)."""
        self.stats: IterationStats | None = None
        self.layout: ModelShardLayout | None = None
        """Owners of every expert of this stage's MoE layers (rows = `layers`); set by attach."""
        self.table: SlotTable | None = None
        """What this rank's slots hold; set by attach (identity: EP's layout)."""
        self.slot_modules: list = []
        """Slot s = local expert s % (E/D) of `layers[s // (E/D)]` (Megatron's expert MLPs)."""
        self.module_paths: list[tuple[int, str]] = []
        """(model chunk, path of its MLP in the unwrapped chunk: "decoder.layers.K.mlp.", an MTP
        layer's "mtp.layers.K.transformer_layer.mlp.") of each of `layers` (checkpoint keys)."""
        self.optimizer = None
        """Megatron's optimizer (set by attach): re-sharding moves its expert state."""
        self._passes_of: dict[int, int] = {}
        """Forward passes of each of `layers` (by index) so far in this schedule run."""
        self._awaiting_above: dict[tuple[int, int], object] = {}
        """(layer index, pass number) -> that LayerPass, until the layer above's same pass takes it
        as its `below`."""

    # ---- set-up ----------------------------------------------------------------------------

    @classmethod
    def from_args(cls, args, moe_layer_numbers: list[int], on_gpu: bool) -> "FSSDPRuntime":
        return cls(FSSDPConfig.from_args(args), args.num_experts, moe_layer_numbers, on_gpu)

    def transformer_config(self, config):
        """Megatron's grouped experts off: the experts stay SequentialMLP modules (the owned
        parameters and the checkpoint form), and --moe-grouped-gemm groups the copies' compute."""
        config.moe_grouped_gemm = False
        return config

    def moe_spec(self, moe_layer_spec):
        """Megatron's MoE layer -> FSSDPMoELayer."""
        return with_moe_layer(moe_layer_spec, FSSDPMoELayer, runtime=self)

    def register_layer(self, layer) -> None:
        self.layers.append(layer)

    def wrap(self, models: list, config, args) -> tuple[list, object]:
        """ep's DDP and optimizer, and DDP's overlap hooks for the owned experts, which fssdp packs
        outside autograd (`mcore.packed_param_hooks`): `_gather_copies` waits for their
        parameter all-gather, `drain` registers their gradients ready once spRS has added the
        copies' (so each layer's expert buckets start reducing then, during the backward)."""
        chunks, optimizer = super().wrap(models, config, args)
        self.expert_param_sync, self.expert_grad_ready = mcore.packed_param_hooks(chunks)
        return chunks, optimizer

    def attach(self, models: list, config, optimizer) -> None:
        """Hooks the transformer layers holding FSSDP MoE layers; wraps finalize_model_grads;
        keeps Megatron's optimizer, whose expert state re-sharding moves with the weights.

        Call once, after the model, DDP and the optimizer are built, on every rank.
        """
        self.optimizer = optimizer
        paths = {id(module): (chunk, f"{name}.") for chunk, model in enumerate(models)
                 for name, module in model.named_modules()}
        moe = [layer for model in models for layer in mcore.transformer_layers(model) if layer.mlp in self.layers]
        if not moe:
            raise ValueError("fssdp mode: this pipeline stage has no FSSDP MoE layer (the layer spec was not injected)")
        for layer in moe:
            layer.register_forward_pre_hook(self._layer_start_hook(layer.mlp))
            layer.mlp.register_forward_pre_hook(self._moe_start_hook())
        self.layers = [layer.mlp for layer in moe]
        self.module_paths = [paths[id(layer.mlp)] for layer in moe]
        template = self.layers[0]
        for layer in self.layers:
            # one slot shape for all layers: a slot may receive an expert of any layer
            if layer.expert_layout != template.expert_layout:
                raise ValueError(
                    f"fssdp mode needs the same expert shapes in every MoE layer: layer {layer.layer_number} has "
                    f"{layer.expert_layout}, layer {template.layer_number} {template.expert_layout}"
                )
        self.expert_numel = template.expert_layout.numel
        self.hidden_size = template.config.hidden_size
        self.element_size = template.experts.local_experts[0].linear_fc1.weight.element_size()
        self.slot_modules = [expert for layer in self.layers for expert in layer.experts.local_experts]
        self.layout = ModelShardLayout.even(len(self.layers), self.num_experts, self.num_devices)
        self.table = SlotTable.identity(len(self.layers), self.num_experts, self.num_devices, self.rank)
        intra, inter = probe_bandwidths(self.group, self.rank, self.nodes, self.devices_per_node, self.expert_numel,
                                        self.device)
        self.topology = Topology(self.nodes, self.devices_per_node, intra, inter)
        self.tuning.attach(self.topology, self.expert_numel, self.element_size, self.hidden_size, len(self.layers))
        self._log.append(
            f"fssdp: probed point-to-point bandwidth {intra / 1e9:.2f} GB/s inside a node, {inter / 1e9:.2f} GB/s "
            f"between nodes ({self.nodes} node(s) x {self.devices_per_node} ranks; slowest rank of the job)"
        )
        if template.grouped_gemm:
            self._log.append("fssdp: grouped GEMM: each layer pass runs its held copies as two grouped matmuls")
        original = config.finalize_model_grads_func

        def finalize_model_grads(*args, **kwargs):
            self.drain()
            return original(*args, **kwargs)

        config.finalize_model_grads_func = finalize_model_grads
        if config.grad_sync_func is not None:
            # PP with an overlapped reduce: Megatron's schedule launches the stage's remaining
            # reduces (grad_sync_func, every bucket; with virtual stages one function per chunk,
            # called when the chunk's backward is done) before finalize_model_grads; the copies'
            # gradients go in first, without registering them ready (which would launch their
            # buckets' reduce a second time). The layers whose copies are still to come belong to
            # chunks whose reduce has not started.
            def drained_first(grad_sync):
                def grad_sync_func(*args, **kwargs):
                    self.drain(register_ready=False)
                    return grad_sync(*args, **kwargs)

                return grad_sync_func

            syncs = config.grad_sync_func
            config.grad_sync_func = ([drained_first(sync) for sync in syncs] if isinstance(syncs, list)
                                     else drained_first(syncs))

    @property
    def device(self) -> torch.device:
        """Where the model (and so the collectives' buffers) lives."""
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

    @property
    def expert_bytes(self) -> int:
        return self.expert_numel * self.element_size

    def _layer_start_hook(self, moe_layer):
        def hook(module, args):
            counted = self.stats is not None and module.training and not mcore.recomputing()
            self._non_moe_mark = self.timer.start("fssdp.non_moe" if counted else "fssdp.non_moe.untimed")
            moe_layer.start_gather()

        return hook

    def _moe_start_hook(self):
        def hook(module, args):
            self.timer.stop(self._non_moe_mark)

        return hook

    # ---- per iteration ---------------------------------------------------------------------

    def begin_iteration(self, iteration: int) -> None:
        """Plan every layer of this stage for the iteration (same plan on every rank)."""
        t, m = self.tuning.begin_iteration()  # auto t: the first iteration runs without copies and measures
        predicted_LE = self.tracker.predict()
        # calibration (once its cost model exists) gets the slots the predictor would misplace
        misprediction_L = self.tracker.misprediction() if self.config.calibrate and self.tuning.cost is not None else None
        self.traffic.reset()
        self._iteration = iteration
        self.stats = IterationStats(np.zeros((len(self.layers), self.num_devices), dtype=np.int64), t=t, m=m)
        rechoose = self.config.overlap_degree is None and planner.overlap_due(iteration, self.config.reshard_interval)
        if self.tuning.t is None or rechoose:  # auto t prices this iteration's loads at its end
            shape_LDE = (len(self.layers), self.num_devices, self.num_experts)
            self.stats.source_loads_LDE = np.zeros(shape_LDE, dtype=np.int64)
        if planner.reshard_due(iteration - 1, self.config.reshard_interval):
            self._reshard(iteration, predicted_LE, t)
        self.plans, self._planning = {}, {}
        for index, layer in enumerate(self.layers):
            row = self.moe_layer_numbers.index(layer.layer_number)
            reserve = 0 if misprediction_L is None else planner.calibration_reserve(m, misprediction_L[row])
            self.stats.reserved[layer.layer_number] = reserve
            job = (index, self.layout.layer(index), predicted_LE[row], t, m - reserve)
            if self._planner is None:
                plan, seconds = self._plan_layer(*job)
                self.plans[layer.layer_number] = plan
                self.stats.planner_s["materialize"] += seconds
                self.stats.planner_wait_s += seconds
            else:
                # The first layer's plan is needed as soon as the forward starts; the thread makes
                # the others while the layers before them run.
                self._planning[layer.layer_number] = self._planner.submit(self._plan_layer, *job)
        if self.layers:
            self.plan_of(self.layers[0].layer_number)

    def _plan_layer(self, index: int, shard: ShardLayout, predicted_E: np.ndarray, t: int,
                    m: int) -> tuple[FSSDPLayerPlan, float]:
        """Layer `index`'s plan before the gate and the seconds it took (on the planner thread
        with --fssdp-planner-thread, else inline)."""
        started = time.perf_counter()
        placement = planner.materialize(shard, predicted_E, t, m, self.topology)
        return self._layer_plan(index, shard, placement), time.perf_counter() - started

    def plan_of(self, layer_number: int) -> FSSDPLayerPlan:
        """This iteration's plan of a layer; waits for the planner thread if it is not made yet
        (the wait is planner time exposed on the training thread, `IterationStats.planner_wait_s`)."""
        plan = self.plans.get(layer_number)
        if plan is None:
            started = time.perf_counter()
            plan, seconds = self._planning.pop(layer_number).result()  # re-raises the planner's error
            self.stats.planner_wait_s += time.perf_counter() - started
            self.stats.planner_s["materialize"] += seconds
            self.plans[layer_number] = plan
        return plan

    def _reshard(self, iteration: int, predicted_LE: np.ndarray, t: int) -> None:
        """Heterogeneous re-sharding by `placement.fssdp.decide_reshard` (the simulator's rule
        too); when adopted, move the moved experts' weights and optimizer state.

        Runs between iterations (gradient buffers are zero, the optimizer has stepped), on
        every rank with the same inputs, so every rank takes the same decision. Deferred to the
        next interval while the optimizer has no state to move (every step so far skipped, e.g.
        fp16 loss-scale overflows at the start of a run): moving weights without it would leave
        the optimizer's lazily created state keyed to the wrong experts.
        """
        if self.optimizer is not None and not optimizer_state_exists(self.slot_modules, self.optimizer):
            self._log.append(
                f"fssdp: re-shard check at iteration {iteration} deferred to the next interval: the optimizer has "
                "no state yet (no step has been taken; every one so far was skipped, e.g. by fp16 loss-scale overflows)"
            )
            return
        rows = [self.moe_layer_numbers.index(layer.layer_number) for layer in self.layers]
        current = self.layout
        decision = planner.decide_reshard(current, predicted_LE[rows], self.topology, t)
        proposed, moved, now, then = decision.proposed, decision.moved, decision.bound_before, decision.bound_proposed
        self.stats.reshard = {"iteration": iteration, "adopted": decision.adopt, "moved": moved if decision.adopt else 0,
                              "bound_before": now, "bound_proposed": then}
        if not decision.adopt:
            self._log.append(
                f"fssdp: re-shard check at iteration {iteration}: layout kept (the proposal moves {moved} experts, "
                f"mean imbalance bound {now:.3f} now, {then:.3f} proposed)"
            )
            return
        if self.optimizer is None:
            raise RuntimeError(
                "fssdp: re-sharding moves optimizer state but no optimizer was attached; call "
                "FSSDPRuntime.attach(layers, config, optimizer) after building it (or pass --fssdp-reshard-interval 0)"
            )
        with self.timer.span("fssdp.reshard"):
            moves = plan_reshard(self.table, current, proposed, self.rank)
            move_slots(moves, self.slot_modules, self.optimizer, self.group, self.edp_group, self.edp_topology,
                       self.topology, self.traffic,
                       self.expert_param_sync)
        self.layout, self.table = proposed, moves.table
        self._log.append(
            f"fssdp: re-shard at iteration {iteration}: moved {moved} experts (weights and optimizer state), "
            f"mean imbalance bound {now:.3f} -> {then:.3f}; experts owned per layer and rank: "
            f"{proposed.counts_LD().tolist()}"
        )

    def held_experts(self, layer, prefix: str) -> list[tuple[str, torch.nn.Module, int]]:
        """(state-dict prefix, module, expert id) of every expert of `layer` held on this rank,
        for its sharded_state_dict; `prefix` is the one Megatron passes to the layer (the
        wrappers' "module." parts, then the layer's MLP path in its chunk). A slot may be in
        another MoE layer's module, and with virtual pipeline stages in another chunk: its key
        then says which (`mcore.in_chunk`), so the load puts the weights into that module."""
        row = self.layers.index(layer)
        chunk, path = self.module_paths[row]
        if not prefix.endswith(path):
            raise ValueError(f"fssdp: MoE layer {layer.layer_number}'s state-dict prefix {prefix!r} does not end in {path!r}")
        wrappers = prefix[: -len(path)]
        per_layer = self.table.slots_per_layer
        held = []
        for slot in self.table.slots_of(row):
            physical, local = divmod(int(slot), per_layer)
            slot_chunk, slot_path = self.module_paths[physical]
            module_prefix = f"{wrappers}{slot_path}experts.local_experts.{local}."
            if slot_chunk != chunk:
                module_prefix = mcore.in_chunk(slot_chunk, module_prefix)
            held.append((module_prefix, self.slot_modules[slot], int(self.table.held_S2[slot, 1])))
        return held

    def _gather(self, shard: ShardLayout, placement: InstancePlacement, kind: str):
        """spAG(shard -> placement) of --fssdp-collectives, recording under `kind`."""
        cls = RelayAllGather if self.config.collectives == "hierarchical" else SparseAllGather
        return cls(shard, placement, self.group, self.expert_numel, kind=kind, topology=self.topology, traffic=self.traffic)

    def _layer_plan(self, index: int, shard: ShardLayout, placement: InstancePlacement) -> FSSDPLayerPlan:
        reduce = RelayReduceScatter if self.config.collectives == "hierarchical" else SparseReduceScatter
        return FSSDPLayerPlan(
            index=index,
            shard=shard,
            placement=placement,
            gather=self._gather(shard, placement, "spag"),
            reduce=reduce(placement, shard, self.group, self.expert_numel, kind="sprs", topology=self.topology,
                          traffic=self.traffic),
            regather=self._gather(shard, placement, "spag_remat") if self.config.rematerialize else None,
        )

    def calibrate(self, copies, counts_DE: np.ndarray) -> None:
        """DESIGN 4.2 step 4 after the gate: with the actual loads (tokens per source rank and
        expert) and the memory left, add copies when the cost model says the extra
        (critical-path) gather pays off, and launch it."""
        cost = self.tuning.cost
        if cost is None:
            return  # the first iteration measures the expert time the cost model needs
        plan = copies.plan
        started = time.perf_counter()
        remaining_D = np.maximum((self.tuning.m or 0) - plan.placement.extra_copies_D(plan.shard), 0)
        placement, gathered = planner.calibrate(plan.placement, plan.shard, counts_DE.sum(axis=0), remaining_D,
                                                self.topology, cost, counts_DE)
        if gathered:
            delta = planner.calibration_gather(plan.shard, plan.placement, placement.holds_ED())
            extra = self._gather(plan.shard, delta, "spag_calibrate")
        if copies.layer.training:
            self.stats.planner_s["calibrate"] += time.perf_counter() - started
        if not gathered:
            return
        copies.calibration = (plan, extra, extra(copies.owned_ON))
        copies.plan = self._layer_plan(plan.index, plan.shard, placement)
        if copies.layer.training:
            self.stats.calibrations += 1
            self.stats.calibrated_copies[copies.layer.layer_number] += int(delta.extra_copies_D(plan.shard).sum())

    def end_iteration(self, step: StepResult) -> dict:
        """Feed the iteration's global processed loads to the predictor; the iteration's FSSDP
        metrics.

        Called on every rank (it all-reduces byte counters and times).
        """
        if self.pending:
            raise RuntimeError("fssdp: gradient reductions still in flight at the end of the iteration")
        for layer in self.layers:  # every plan in hand (and the thread idle) before the record reads them
            self.plan_of(layer.layer_number)
        stats = self.stats
        stats.add_times(self.timer.collect())  # one device synchronisation on GPU
        self.tracker.observe(step.processed_LE)
        self.tuning.end_iteration(self._iteration, stats.expert_s, stats.expert_tokens, stats.non_moe_s,
                                  self._probe_instance_seconds, self.layout, stats.source_loads_LDE)
        groups = {"fssdp": self.group, "edp": self.edp_group, "etp": parallel_state.get_expert_tensor_parallel_group()}
        return metrics.iteration_record(stats, self.traffic, self.layers, self.plans, groups, self.config.rematerialize,
                                        self.expert_numel, self.expert_bytes)

    def _probe_instance_seconds(self) -> float:
        """Forward time one more expert instance adds on this rank: the stage's first MoE layer
        runs 2 tokens as one instance and as two (`run_instances`, per instance or grouped as the
        run computes), the smallest of 5 runs each after a warm-up (the host clock; synchronised
        on GPU); the difference, at least 0. Copies split an expert's tokens but each adds this,
        which on small batches outweighs the split (`FSSDPCostModel.seconds_per_instance`). The
        runtime's, not the tuning's: it runs this stage's layer on its slot modules."""
        if not self.layers:
            return 0.0
        layer = self.layers[0]
        with torch.no_grad():
            row_N = layer.expert_layout.flatten(self.slot_modules[0])
            rows_RN = torch.stack([row_N, row_N])
            # fixed inputs, no random draw: the training's random streams (dropout masks) must not
            # depend on whether this probe ran (auto t or calibration)
            tokens_ND = torch.linspace(-1.0, 1.0, 2 * self.hidden_size, device=self.device).view(2, -1).to(row_N.dtype)
            probs_N = torch.ones(2, dtype=torch.float32, device=self.device)
            layouts = {1: (np.array([0]), np.array([2])), 2: (np.array([0, 1]), np.array([1, 1]))}
            best = {1: float("inf"), 2: float("inf")}
            for repeat in range(6):
                for instances, (row_G, counts_G) in layouts.items():
                    started = time.perf_counter()
                    layer.run_instances(rows_RN, row_G, counts_G, tokens_ND, probs_N)
                    if self.on_gpu:
                        torch.cuda.synchronize(self.device)
                    if repeat:
                        best[instances] = min(best[instances], time.perf_counter() - started)
        return max(best[2] - best[1], 0.0)

    # ---- forward ---------------------------------------------------------------------------

    def forward_backward(self, megatron_forward_backward, iterator, forward_only: bool) -> float:
        """Megatron's schedule; the copies gathered in it serve all its micro-batches and are
        released when it returns (the optimizer step changes the owners' weights)."""
        self.shared, self._awaiting_above, self._passes_of = {}, {}, {}
        try:
            loss = megatron_forward_backward(iterator, forward_only)
            unreduced = [c.layer.layer_number for c in self.shared.values() if c.backwards < c.passes]
            if not forward_only and unreduced:
                raise RuntimeError(
                    f"fssdp: MoE layers {unreduced} saw fewer backwards than the {self.config.microbatches} "
                    "micro-batches of the iteration, so their copies' gradients were never reduced"
                )
            return loss
        finally:
            self.shared, self._awaiting_above, self._passes_of = {}, {}, {}

    def start_pass(self, layer):
        """One forward of `layer`: its LayerPass on the iteration's copies of the layer (the
        first forward of the iteration launches spAG(l)), or, with re-materialization, on
        copies of its own."""
        if self.config.rematerialize:
            copies = self._gather_copies(layer, passes=1, keeps=layer is self.layers[-1])
        else:
            copies = self.shared.get(layer.layer_number)
            if copies is None:
                copies = self._gather_copies(layer, passes=self.config.microbatches, keeps=True)
                self.shared[layer.layer_number] = copies
        # the layer below in the same micro-batch's forward: the k-th pass of this rank's previous
        # MoE layer pairs with this layer's k-th (each chunk runs the micro-batches in order;
        # with virtual stages another micro-batch's passes may come between the two)
        index = self.layers.index(layer)
        number = self._passes_of.get(index, 0)
        self._passes_of[index] = number + 1
        layer_pass = LayerPass(layer, copies, below=self._awaiting_above.pop((index - 1, number), None))
        if index + 1 < len(self.layers):
            self._awaiting_above[(index, number)] = layer_pass
        return layer_pass

    def _gather_copies(self, layer, passes: int, keeps: bool) -> LayerCopies:
        """Launch spAG(l) of this iteration's plan over this rank's owned experts of `layer`."""
        plan = self.plan_of(layer.layer_number)
        slots = self.table.slots_of(plan.index)
        owned_ON = torch.empty((0, self.expert_numel), dtype=layer.experts.local_experts[0].linear_fc1.weight.dtype, device=self.device)
        if slots.size:
            if self.expert_param_sync is not None:
                for slot in slots:
                    for param in self.slot_modules[slot].parameters():
                        self.expert_param_sync(param)
            owned_ON = torch.stack([layer.expert_layout.flatten(self.slot_modules[slot]) for slot in slots])
        copies = LayerCopies(layer, plan, owned_ON, passes=passes, keeps_copies=keeps)
        with nvtx_range("fssdp.spag", self.device):
            copies.gather = plan.gather(owned_ON)
        return copies

    def reduce_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype the copies' gradients are summed and reduced in (fp32 with
        --accumulate-allreduce-grads-in-fp32, as Megatron's DDP; else the gradients')."""
        return torch.float32 if self.config.reduce_in_fp32 else grad_dtype

    def all_gather_counts(self, counts_E: torch.Tensor) -> np.ndarray:
        """Routed tokens per (source device, expert) of one layer; int64 [D, E], checked and
        read-only (`check_loads`), so that calibration and dispatch take it without copying."""
        parts = [torch.empty_like(counts_E, device=self.device) for _ in range(self.num_devices)]
        dist.all_gather(parts, counts_E.to(self.device), group=self.ep_group)
        return check_loads(torch.stack(parts).cpu().numpy(), "routed tokens per (source rank, expert)", 2)

    # ---- backward --------------------------------------------------------------------------

    def on_layer_backward(self, layer_pass) -> None:
        """The gradient reached layer l's MoE input. After the last backward on the copies
        (the iteration's last micro-batch): finish the reduces in flight, launch spRS(l) and
        (re-materialization) the re-gather of layer l-1."""
        copies = layer_pass.copies
        copies.backwards += 1
        if copies.grads < copies.backwards and copies.plan.gather.held_chunks.size == 0:
            copies.grads += 1  # no copy, so no gradient: nothing to add
        if copies.grads < copies.backwards:
            raise RuntimeError(
                f"fssdp: layer {copies.layer.layer_number}'s copies got no gradient before its MoE input did"
            )
        if copies.backwards < copies.passes:
            return
        self.drain()
        if copies.grad_HN is None:
            copies.grad_HN = torch.empty((0, self.expert_numel), dtype=self.reduce_dtype(copies.owned_ON.dtype), device=self.device)
        with nvtx_range("fssdp.sprs", self.device):
            handle = copies.plan.reduce(copies.grad_HN.contiguous())
        self.pending.append((copies, handle))
        below = layer_pass.below
        if below is not None:
            below = below.copies
            if not below.keeps_copies and below.regather is None and below.held_HN is None:
                below.regather = self.launch_regather(below)
        copies.held_HN = None

    def launch_regather(self, copies):
        return copies.plan.regather(copies.owned_ON)

    def drain(self, register_ready: bool = True) -> None:
        """Wait for the reduces in flight and add the owners' gradients into main_grad; with an
        overlapped DDP reduce (and `register_ready`), the owners' parameters are then ready for it."""
        for copies, handle in self.pending:
            with self.timer.span("fssdp.wait.sprs"):
                grads_ON = handle.wait()
            layer = copies.layer
            for row, slot in enumerate(self.table.slots_of(copies.plan.index)):
                layer.expert_layout.grads_into(self.slot_modules[slot], grads_ON[row])
                if self.expert_grad_ready is not None and register_ready:
                    for param in self.slot_modules[slot].parameters():
                        self.expert_grad_ready(param)
            copies.grad_HN = None
        self.pending = []

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, model_chunks, optimizer, common: dict) -> None:
        """ep's per-expert form (FSSDPMoELayer's sharded state dict, through `held_experts`) plus
        the placement under "fssdp" (`placement_state_dict`)."""
        mcore.save_checkpoint(directory, model_chunks, optimizer, {**common, "fssdp": self.placement_state_dict()})

    def load_checkpoint(self, directory: str, model_chunks, optimizer, template: dict, load_optim: bool,
                        strictness: str) -> tuple[dict, list[str]]:
        """Adopts the saved placement first: the slot table decides which slot module each
        expert's weights and optimizer state are read into."""
        notes = self.load_placement_state_dict(mcore.load_common_state(directory).get("fssdp"))
        loaded, more = super().load_checkpoint(directory, model_chunks, optimizer, template, load_optim, strictness)
        return loaded, notes + more

    def placement_state_dict(self) -> dict:
        """The placement as common state (`fssdp/checkpoint.py`); collective over the world."""
        return placement_state_dict([layer.layer_number for layer in self.layers], self.rank, self.table, self.layout,
                                    self.num_devices, self.tracker, self.tuning)

    def load_placement_state_dict(self, state: dict | None) -> list[str]:
        """Adopts a saved placement (after attach, before the weights are read); log notes
        (`fssdp/checkpoint.py` `restore_placement`)."""
        layout, table, notes = restore_placement(
            state, self.config, [layer.layer_number for layer in self.layers], self.moe_layer_numbers, self.rank,
            self.table, self.num_devices, self.num_experts, self.tracker, self.tuning)
        if layout is not None:
            self.layout, self.table = layout, table
        return notes

    # ---- metrics ---------------------------------------------------------------------------

    def a2a_remote_copies(self, loads) -> int:
        return self.stats.remote_copies

    def placed_layers(self, record: dict | None) -> list[dict] | None:
        """The owners' and the copies' tokens per rank: the dispatch plans' destinations."""
        return record["layers"]

    def progress(self, record: dict) -> tuple[str, float]:
        _, survival = super().progress(record)
        return metrics.progress_suffix(record[self.name]), survival

    def tensorboard_scalars(self, record: dict) -> dict[str, float]:
        return metrics.tensorboard_scalars(record[self.name])

    def memory_report(self) -> dict:
        """Owned expert shards and their optimizer state, bytes per rank of the group."""
        return metrics.memory_report(self.layers, self.optimizer, self.group, self.num_devices)


def _check_same_node_layout(nodes: int, per_node: int, ranks: list[int]) -> None:
    """Every FSSDP group must span the same nodes x devices: with several groups (expert-data-
    parallel > 1) each plans alone, and Megatron's DDP all-reduces the owners' gradients across
    groups, so the plans (which read the topology) must agree slot for slot."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (nodes, per_node, list(ranks)))
    layouts = {(n, p) for n, p, _ in everyone}
    if len(layouts) > 1:
        shown = "; ".join(sorted({f"ranks {r}: {n} node(s) x {p}" for n, p, r in everyone}))
        raise ValueError(
            f"fssdp mode: the expert-parallel groups span different node layouts ({shown}); every group must "
            "span the same number of nodes and ranks per node (launch the same number of ranks on every node "
            "and choose --expert-model-parallel-size as a multiple or a divisor of the ranks per node)"
        )


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_GROUPS_WORLD: dist.ProcessGroup | None = None
"""The default group `_GROUPS` were made under: groups die with it (destroy_process_group), and
one process may train again under a new one (tests/support/multirun.py)."""


def _dedicated_groups(own_ranks: list[int]) -> dist.ProcessGroup:
    """A new process group per EP group (created on every rank in the same order); returns ours."""
    global _GROUPS_WORLD
    if _GROUPS_WORLD is not dist.group.WORLD:
        _GROUPS.clear()
        _GROUPS_WORLD = dist.group.WORLD
    key = tuple(own_ranks)
    if key not in _GROUPS:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, key)
        for ranks in sorted(set(everyone)):
            group = dist.new_group(ranks=list(ranks))
            if ranks == key:
                _GROUPS[key] = group
    return _GROUPS[key]
