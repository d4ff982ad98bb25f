"""The replicate runtime: per-iteration expert replication for all MoE layers of a stage.

DESIGN 4.6 inside Megatron-Core training. The replicate group is Megatron's expert-parallel
group of G ranks. With expert tensor parallelism (ETP > 1) each ETP rank's EP group replicates
its own shard of every expert (Megatron's EP groups hold one ETP rank each; all place alike
from the world's loads), and the records' bytes are one such group's. With more ranks than one
group needs (expert-data-parallel size EDP > 1) the stage has EDP replicate groups,
HSDP-style: each routes its own tokens over its own slots; rank r of every group owns the same
slice r, whose summed gradient is all-reduced over the expert-data-parallel group (the same
position in every group) before Adam, so the slices stay identical across groups. Placements
come from world-wide loads, so every group places alike. Per MoE layer and rank:

- `ReplicatedExperts` (experts.py) holds the s slots (the instances this rank runs), slice r of
  every expert's fp32 master weights and Adam state (never moving), and moves the gradients
  and the updated weights;
- Megatron's local experts stay in the module, frozen: the initial weights come from them
  (deterministic per global expert id, identical to ep mode's), and they are the checkpoint form.

Per iteration, on every rank in the same order:

    route (each micro-batch, each layer)   counts [G, E] all-reduced; tokens spread over the
                                           instances under the capacity; the overflow dropped
    k-th backward through a layer's slots  its gradient reduce starts (steps (a), (b)
                                           asynchronous), while the layers below run backward
    finalize_model_grads (wrapped)         reduces completed: summed slices [E, n_r] (all-reduced
                                           over the groups when EDP > 1), x 1/DP like
                                           Megatron's DDP; their squared norm is added to
                                           Megatron's grad norm (clipping sees every parameter once)
    end_iteration                          Adam on the slices (same lr and clip factor as
                                           Megatron's step), the next placement from the
                                           popularity (policy), weights pushed into its slots

The placement is the same on every rank: it comes from all-reduced counts only.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_patches.comm.exchange import exchange
from megatron_patches.comm.groups import all_reduce_recorded, node_layout, record_ring_allreduce
from megatron_patches.comm.traffic import TrafficCounter
from megatron_patches.comm.virtual import tokens_from_source
from megatron_patches.compat import mcore
from megatron_patches.mode.layer import with_moe_layer
from megatron_patches.mode.runtime import ModeRuntime, StepResult
from megatron_patches.placement.loads import LoadTracker
from megatron_patches.placement.replicate import popularity_slots, slot_placement, spread_tokens
from megatron_patches.placement.types import ShardLayout, Topology
from megatron_patches.replicate import checkpoint, metrics
from megatron_patches.replicate.config import ReplicateConfig
from megatron_patches.replicate.experts import STATE_NAMES, PendingReduce, ReplicatedExperts
from megatron_patches.replicate.layer import ReplicateMoELayer
from megatron_patches.replicate.metrics import IterationStats
from megatron_patches.mode.adam import AdamSettings

__all__ = ["ReplicateRuntime"]

# Megatron's clip factor: max_norm / (total_norm + 1e-6), applied when below 1
# (megatron/core/optimizer/clip_grads.py, clip_grad_by_total_norm_fp32).
CLIP_EPS = 1.0e-6


class ReplicateRuntime(ModeRuntime):
    """Coordinates replicate mode for the MoE layers of this pipeline stage (see module docstring)."""

    name = "replicate"

    def __init__(self, config: ReplicateConfig, num_experts: int, moe_layer_numbers: list[int], on_gpu: bool, adam: AdamSettings):
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.moe_layer_numbers = list(moe_layer_numbers)
        """Global numbers of all MoE layers of the model (the load tracker covers all)."""
        self.on_gpu = on_gpu
        self.adam = adam
        """The expert optimizer's hyper-parameters (Megatron's Adam settings)."""
        # Megatron's EP group is the replicate group: every collective of the mode runs in it or
        # in Megatron's other groups, so replicate adds no communicator (DESIGN 4.6 (b)).
        self.group = parallel_state.get_expert_model_parallel_group()
        """The replicate group (all G ranks; its rank d is device d of the placements)."""
        own = tuple(dist.get_process_group_ranks(self.group))
        self.num_devices = len(own)
        """G, ranks of the replicate group."""
        if self.num_devices < 2:
            raise ValueError("replicate mode needs an expert-parallel group of at least 2 ranks")
        self.rank = dist.get_rank(self.group)
        nodes, per_node = node_layout(own)
        self.topology = Topology(nodes, per_node, 1.0, 1.0)
        """Devices and nodes of the group (bandwidths unused: only the byte split intra/inter)."""
        self.edp_group = parallel_state.get_expert_data_parallel_group()
        """This position in every replicate group of the stage (Megatron's expert-data-parallel group)."""
        edp_ranks = dist.get_process_group_ranks(self.edp_group)
        self.edp_size, self.edp_rank = len(edp_ranks), dist.get_rank(self.edp_group)
        self.edp_topology = Topology(*node_layout(edp_ranks), 1.0, 1.0)
        """Nodes of the expert-data-parallel group, for the byte split of grad_edp."""
        if num_experts > self.num_devices * config.slots_per_rank:
            raise ValueError(
                f"replicate mode: {num_experts} experts need at least one slot each, but {self.num_devices} ranks x "
                f"{config.slots_per_rank} slots = {self.num_devices * config.slots_per_rank}"
            )
        self.traffic = TrafficCounter()
        self.tracker = LoadTracker.for_predictor(len(self.moe_layer_numbers), num_experts, config.load_window,
                                                  config.load_predictor)
        self.layers: list = []
        """This stage's replicate MoE layers, in forward order."""
        self.experts: dict[int, ReplicatedExperts] = {}
        """Layer number -> the layer's slots, slices and traffic engine."""
        self.grads: dict[int, torch.Tensor] = {}
        """Layer number -> this iteration's summed gradient slices [E, n_r] (after the backward)."""
        self.pending: dict[int, PendingReduce] = {}
        """Layer number -> its gradient reduce, started in the backward and not yet finished."""
        self.stats: IterationStats | None = None
        slots = self.num_devices * config.slots_per_rank
        if slots == num_experts:
            self._log.append(
                f"replicate: ranks x slots = {self.num_devices} x {config.slots_per_rank} = {slots} = --num-experts, so "
                "every expert gets exactly one instance and every policy places the experts alike (DESIGN 4.6: at least "
                "one instance each); raise --replicate-slots-per-rank to leave room for replicas"
            )

    # ---- set-up ----------------------------------------------------------------------------

    @classmethod
    def from_args(cls, args, moe_layer_numbers: list[int], on_gpu: bool) -> "ReplicateRuntime":
        # The experts' optimizer takes Megatron's Adam settings (AdamW: decoupled weight decay).
        return cls(ReplicateConfig.from_args(args), args.num_experts, moe_layer_numbers, on_gpu, AdamSettings.from_args(args))

    def transformer_config(self, config):
        """Megatron's per-expert capacity off: replicate applies the capacity per expert instance
        itself (DESIGN 4.6). Megatron's grouped experts off: the experts stay SequentialMLP
        modules (the checkpoint form), and --moe-grouped-gemm groups the slots' compute."""
        config.moe_expert_capacity_factor = None
        config.moe_grouped_gemm = False
        return config

    def moe_spec(self, moe_layer_spec):
        """Megatron's MoE layer -> ReplicateMoELayer."""
        return with_moe_layer(moe_layer_spec, ReplicateMoELayer, runtime=self)

    def register_layer(self, layer) -> None:
        self.layers.append(layer)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

    @property
    def slots_per_rank(self) -> int:
        return self.config.slots_per_rank

    def initial_slots(self) -> np.ndarray:
        """Every class gets G*s/E instances (the remainder to the lowest ids): static replication."""
        return popularity_slots(np.ones(self.num_experts), self.num_devices, self.slots_per_rank)

    def attach(self, models: list, config, optimizer) -> None:
        """Builds every layer's slots and slices; wraps finalize_model_grads and the grad norm.

        Call once on every rank, after the model, DDP and the optimizer are built.
        """
        moe = [layer.mlp for model in models for layer in mcore.transformer_layers(model) if layer.mlp in self.layers]
        if not moe:
            raise ValueError("replicate mode: this pipeline stage has no replicate MoE layer (the layer spec was not injected)")
        self.layers = moe
        if moe[0].grouped_gemm:
            self._log.append("replicate: grouped GEMM: each layer pass runs its slots as two grouped matmuls")
        slots = self.initial_slots()
        for layer in moe:
            layout = layer.expert_layout
            owned_ON = torch.stack([layout.flatten(expert) for expert in layer.experts.local_experts])
            parts = [torch.empty_like(owned_ON) for _ in range(self.num_devices)]
            dist.all_gather(parts, owned_ON, group=self.group)
            weights_EN = torch.cat(parts)  # EP's contiguous layout: rank d owns experts [d E/G, (d+1) E/G)
            # Megatron decays weight matrices, not biases or 1-D parameters.
            decay_N = torch.cat(
                [torch.full((shape.numel(),), len(shape) > 1 and not name.endswith("bias")) for name, shape in zip(layout.names, layout.shapes)]
            )
            self.experts[layer.layer_number] = ReplicatedExperts(
                weights_EN,
                slots,
                self.group,
                adam=self.adam,
                device=self.device,
                offload=self.config.offload_optimizer,
                topology=self.topology,
                traffic=self.traffic,
                decay_mask_N=decay_N,
                reduce_dtype=torch.float32 if self.config.reduce_in_fp32 else None,
            )
        for index, layer in enumerate(moe):
            self.experts[layer.layer_number].slots.slots_SN.register_post_accumulate_grad_hook(
                self._start_reduce_hook(index, layer.layer_number))
        original = config.finalize_model_grads_func

        def finalize_model_grads(*args, **kwargs):
            result = original(*args, **kwargs)
            self.reduce_gradients()
            return result

        config.finalize_model_grads_func = finalize_model_grads
        # Loss scaling (fp16): the slices' gradients are unscaled and inf-checked with Megatron's,
        # before the grad norm (which then counts them unscaled).
        mcore.add_outside_gradients(optimizer, lambda: list(self.grads.values()))
        mcore.add_grad_norm_term(optimizer, self.grad_norm_sq)

    # ---- per iteration ---------------------------------------------------------------------

    def begin_iteration(self, iteration: int) -> None:
        self.traffic.reset()
        L = len(self.layers)
        self.stats = IterationStats(
            np.zeros((L, self.num_experts), dtype=np.int64),
            np.zeros((L, self.num_experts, self.num_devices), dtype=np.int64),
            np.stack([self.experts[layer.layer_number].slots.slot_expert_RS for layer in self.layers]),
            np.zeros(L, dtype=np.int64),
        )
        self.grads, self.pending = {}, {}
        for experts in self.experts.values():
            experts.slots.slots_SN.grad = None

    def route(self, layer, counts_E: torch.Tensor) -> np.ndarray:
        """This source's tokens per (expert, destination rank) for one micro-batch of `layer`; int64 [E, G].

        Collective over the group: the counts of every source are all-reduced (one [G, E]
        buffer, each rank filling its row), then every rank computes the same spread.
        """
        counts_GE = torch.zeros((self.num_devices, self.num_experts), dtype=torch.int64, device=self.device)
        counts_GE[self.rank] = counts_E.to(self.device)
        all_reduce_recorded(counts_GE, self.group, kind="popularity", traffic=self.traffic, topology=self.topology)
        started = time.perf_counter()
        loads_GE = counts_GE.cpu().numpy()
        placement = self.experts[layer.layer_number].slots.placement
        # Dropless: a capacity factor of G*s makes an instance's capacity every token of the layer.
        factor = self.config.capacity_factor or float(self.num_devices * self.slots_per_rank)
        spread = spread_tokens(placement, loads_GE, factor, self.slots_per_rank)
        tokens_ED = tokens_from_source(spread.plan, self.rank, spread.kept_K)
        if layer.training and not mcore.recomputing():  # a recomputed forward routes the same tokens again
            index = self.layers.index(layer)
            self.stats.routed_LE[index] += loads_GE.sum(axis=0)
            self.stats.processed_LED[index] += spread.processed_ED
            self.stats.remote_copies += int(spread.kept_K[spread.plan.source_K != spread.plan.dest_K].sum())
            self.stats.seconds["metadata"] += time.perf_counter() - started
        return tokens_ED

    def _start_reduce_hook(self, index: int, layer_number: int):
        """After autograd adds a backward's gradient to a layer's slots: at the iteration's k-th
        (the gradient is complete), steps (a) and (b) of its reduce start, so its all-reduces run
        during the backward of the layers below. Every rank of the group reaches the layers'
        k-th backwards in the same order, so the collectives are issued alike."""

        def hook(slots_SN: torch.Tensor) -> None:
            self.stats.backwards_L[index] += 1
            if self.stats.backwards_L[index] == self.config.microbatches:
                self.pending[layer_number] = self.experts[layer_number].start_reduce(slots_SN.grad)

        return hook

    def reduce_gradients(self) -> None:
        """After the backward: every layer's reduce finished -> summed slices, scaled as Megatron's DDP."""
        # DDP divides every gradient by the data-parallel size (the loss is a per-replica mean).
        scale = 1.0 / parallel_state.get_data_parallel_world_size()
        for index, layer in enumerate(self.layers):
            experts = self.experts[layer.layer_number]
            backwards = self.stats.backwards_L[index]
            if backwards not in (0, self.config.microbatches):
                raise RuntimeError(
                    f"replicate: layer {layer.layer_number}'s slots received gradients from {backwards} backward passes "
                    f"this iteration, expected {self.config.microbatches} (one per micro-batch)"
                )
            if layer.layer_number not in self.pending:  # no backward reached the slots: zero gradients
                self.pending[layer.layer_number] = experts.start_reduce(torch.zeros_like(experts.slots.slots_SN))
            grad_En = experts.finish_reduce(self.pending.pop(layer.layer_number))
            if self.edp_size > 1:  # the other groups' tokens: same slice, same position
                dist.all_reduce(grad_En, group=self.edp_group)
                record_ring_allreduce(self.traffic, "grad_edp", grad_En, self.edp_rank, self.edp_size, self.edp_topology)
            self.grads[layer.layer_number] = grad_En.mul_(scale)

    def grad_norm_sq(self) -> float:
        """Squared norm of every expert gradient, for Megatron's grad norm (collective over the
        world; called by the optimizer step after the gradients are unscaled)."""
        return self._once_world_wide(lambda t: t.double().square().sum(), self.grads.values())

    def outside_params_norm_sq(self) -> float:
        """Squared norm of every expert's weights (the slices' fp32 master weights), each element once."""
        return self._once_world_wide(lambda t: t.double().square().sum(),
                                     [self.experts[layer.layer_number].slices.master_En for layer in self.layers])

    def outside_zeros_in_grad(self) -> int:
        """Zero elements of every expert's gradient (this iteration's summed slices), each once."""
        return int(self._once_world_wide(lambda t: (t == 0).sum().double(), self.grads.values()))

    def _once_world_wide(self, reduce, tensors) -> float:
        """sum(reduce(t)) over every slice of the first replicate group, all-reduced over the world.

        The slices partition every expert's elements within a group and are equal across the
        groups of a stage: counting the first group's only, the world-wide sum counts every
        expert parameter exactly once."""
        local = torch.zeros((), dtype=torch.float64)
        if self.edp_rank == 0:
            for tensor in tensors:
                local += reduce(tensor).cpu()
        total = local.to(self.device)
        dist.all_reduce(total)
        return float(total.item())

    def end_iteration(self, step: StepResult) -> dict:
        """Step the experts' slices like Megatron stepped its parameters (same lr, same clip
        factor from the total grad norm, which includes the experts' term; nothing when Megatron
        skipped its step), place the next iteration from the routed loads and push the weights
        into its slots; returns the iteration's replicate metrics."""
        iteration, update_ok, grad_norm, lr, clip_grad = step.iteration, step.update_ok, step.grad_norm, step.lr, step.clip_grad
        if len(self.grads) != len(self.layers):
            raise RuntimeError("replicate: the iteration ended before every layer's expert gradients were reduced")
        seconds = self.stats.seconds
        started = time.perf_counter()
        self.tracker.observe(step.routed_LE)
        next_slots = self._next_slots(iteration)
        seconds["scheduler"] += time.perf_counter() - started
        factor = 1.0
        if clip_grad > 0 and grad_norm is not None:
            factor = min(1.0, clip_grad / (float(grad_norm) + CLIP_EPS))
        started = time.perf_counter()
        for layer in self.layers:
            experts = self.experts[layer.layer_number]
            if update_ok:
                grad_En = self.grads[layer.layer_number]
                experts.step(grad_En.mul_(factor) if factor < 1.0 else grad_En, lr)
            if self.config.policy == "periodic":
                moved = time.perf_counter()
                self._move_state_with_experts(experts, next_slots[layer.layer_number])
                seconds["rearrange"] += time.perf_counter() - moved
            experts.push(next_slots[layer.layer_number])
        seconds["optimizer"] += time.perf_counter() - started - seconds["rearrange"]
        self.grads = {}
        groups = {"replicate": self.group, "edp": self.edp_group, "etp": parallel_state.get_expert_tensor_parallel_group()}
        return metrics.iteration_record(self.stats, self.traffic, self.layers, groups, self.config.policy,
                                        self.slots_per_rank, self.config.microbatches)

    def _next_slots(self, iteration: int) -> dict[int, np.ndarray]:
        """The slot assignment of every layer for the next iteration, by the policy."""
        policy = self.config.policy
        out = {}
        predicted_LE = self.tracker.predict()
        for layer in self.layers:
            current = self.experts[layer.layer_number].slots.slot_expert_RS
            if policy == "static" or (policy == "periodic" and iteration % self.config.rebalance_interval != 0):
                out[layer.layer_number] = current
                continue
            row = self.moe_layer_numbers.index(layer.layer_number)
            out[layer.layer_number] = popularity_slots(predicted_LE[row], self.num_devices, self.slots_per_rank)
        return out

    def _move_state_with_experts(self, experts: ReplicatedExperts, next_slots_RS: np.ndarray) -> None:
        """The periodic baseline's extra cost (FlexMoE's): optimizer state travels with a re-placed expert.

        FlexMoE keeps an expert's fp32 master weights and Adam moments with its replicas, so a
        rank that gains a class receives that state. Here the state never has to move (the
        slices stay put), so this sends exactly those bytes (every rank's slice of the three
        rows, by batched point-to-point, one message per pair of ranks) and discards them on
        arrival: the baseline's bytes and time are real, its numerics are those of the
        decoupled optimizer.
        """
        current_ED = experts.slots.placement.counts_ED > 0
        gained_ED = (slot_placement(next_slots_RS, self.num_experts).counts_ED > 0) & ~current_ED
        if not gained_ED.any():
            return
        sl = experts.slices
        state_3En = torch.stack([sl.master_En, sl.exp_avg_En, sl.exp_avg_sq_En]).to(experts.slots.slots_SN.device)
        width = sl.layout.offsets()
        sends, recvs = {}, {}
        from_peer = np.flatnonzero(gained_ED[:, self.rank])
        for peer in range(self.num_devices):
            if peer == self.rank:
                continue
            # ranks with an empty slice (N < G) have nothing to send or receive
            to_peer = np.flatnonzero(gained_ED[:, peer]) if sl.shape[1] else np.empty(0, dtype=np.int64)
            if to_peer.size:
                sends[peer] = state_3En[:, torch.from_numpy(to_peer)]
            n_peer = int(width[peer + 1] - width[peer])
            if from_peer.size and n_peer:
                recvs[peer] = state_3En.new_empty((3, from_peer.size, n_peer))
        exchange(self.group, sends, recvs, traffic=self.traffic, kind="rearrange", topology=self.topology)

    # ---- checkpoints -------------------------------------------------------------------------
    #
    # The checkpoint form is ep mode's: every expert lives in the frozen Megatron local expert
    # that EP's contiguous layout gives it (group rank d = EP rank d holds experts
    # [d E/G, (d+1) E/G)), whose sharded keys are ep's, and its Adam state goes under ep's
    # optimizer keys (compat.moe.ep_optimizer_sharded_state_dict). The placement (slot
    # assignment per layer, popularity history) travels as common state, so a resumed run places
    # its next iteration as the uninterrupted one would.

    def save_checkpoint(self, directory: str, model_chunks, optimizer, common: dict) -> None:
        checkpoint.save(directory, model_chunks, optimizer, common, self)

    def load_checkpoint(self, directory: str, model_chunks, optimizer, template: dict, load_optim: bool,
                        strictness: str) -> tuple[dict, list[str]]:
        notes: list[str] = []
        loaded = checkpoint.load(directory, model_chunks, optimizer, template, load_optim, strictness, self, notes)
        return loaded, notes

    def expert_params(self) -> list[torch.nn.Parameter]:
        """The frozen Megatron expert parameters of this stage's replicate layers, in model order."""
        return [p for layer in self.layers for p in layer.experts.parameters()]

    def _owner_layout(self, layer) -> ShardLayout:
        """EP's layout of the layer's experts; checks that it is the layout of the frozen modules."""
        shard = ShardLayout.even(self.num_experts, self.num_devices)
        mine = shard.experts_of(self.rank).tolist()
        if mine != list(layer.local_expert_indices):
            raise RuntimeError(
                f"replicate rank {self.rank} holds Megatron's local experts {list(layer.local_expert_indices)} of layer "
                f"{layer.layer_number}, but EP's contiguous layout gives it {mine} (the replicate group must be the EP group)"
            )
        return shard

    def export_experts(self) -> tuple[dict, float]:
        """Every expert's current weights into its frozen local expert module, and its optimizer state.

        Collective over the replicate group (the whole experts are gathered from the slices on
        their EP owner). The modules receive the fp32 master weights cast to their dtype.

        Returns (expert parameter -> {"fp32_param", "exp_avg", "exp_avg_sq"}: fp32 tensors of
        the parameter's shape, the experts' Adam step count).
        """
        out, step = {}, 0.0
        for layer in self.layers:
            owned = self.experts[layer.layer_number].gather_to_owners(self._owner_layout(layer))
            step = owned["step"]
            layout = layer.expert_layout
            for i, module in enumerate(layer.experts.local_experts):
                views = {name: layout.views(owned[name][i]) for name in STATE_NAMES}
                for name, param in module.named_parameters():
                    with torch.no_grad():
                        param.copy_(views["weights"][name])
                    out[param] = {
                        "fp32_param": views["weights"][name],
                        "exp_avg": views["exp_avg"][name],
                        "exp_avg_sq": views["exp_avg_sq"][name],
                    }
        return out, step

    def import_experts(self, state: dict | None, step: float | None) -> None:
        """Sets every expert's slices from the frozen local expert modules and fills the slots.

        Collective over the replicate group. The master weights come from state[param]
        ["fp32_param"] where given, else from the module (cast to fp32); the Adam moments from
        state[param]["exp_avg"/"exp_avg_sq"], or zeros (with step 0) when `state` is None.

        Args:
            state: expert parameter -> {name: tensor of its shape}, or None (fresh moments).
            step: the experts' Adam step count (ignored when `state` is None).
        """
        for layer in self.layers:
            layout = layer.expert_layout
            rows = {name: [] for name in STATE_NAMES}
            for module in layer.experts.local_experts:
                params = dict(module.named_parameters())
                saved = {n: {} if state is None else state[params[n]] for n in layout.names}
                for name in STATE_NAMES:
                    key = "fp32_param" if name == "weights" else name
                    if all(key in saved[n] for n in layout.names):
                        rows[name].append(torch.cat([saved[n][key].reshape(-1).float() for n in layout.names]))
                    elif name == "weights":  # no fp32 copy in the checkpoint (fp32 training): the module's
                        rows[name].append(layout.flatten(module).float())
                    else:
                        rows[name].append(torch.zeros(layout.numel))
            experts = self.experts[layer.layer_number]
            held = {name: torch.stack([row.to(self.device) for row in values]) for name, values in rows.items()}
            experts.scatter_from_owners(self._owner_layout(layer), held, 0.0 if state is None else float(step or 0.0))

    def placement_state_dict(self) -> dict:
        """The slot assignment of every MoE layer of the model and the popularity history (plain
        numbers, identical on every rank). Collective over the world (each pipeline stage adds
        its own layers)."""
        mine = {layer.layer_number: self.experts[layer.layer_number].slots.slot_expert_RS.tolist() for layer in self.layers}
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, mine)
        slots = {}
        for stage in stages:
            slots.update(stage)
        tracker = self.tracker.state_dict()
        # Plain lists and ints: Megatron reads common state with torch.load(weights_only=True).
        return {
            "slots": dict(sorted(slots.items())),
            "observed": int(tracker["observed"]),
            "history_loads": tracker["history_loads"].tolist(),
        }

    def load_placement_state_dict(self, state: dict) -> list[str]:
        """Adopts a saved placement (before `import_experts` fills the slots); returns log notes.

        A placement saved with another number of ranks, slots or MoE layers does not apply: the
        run then starts from static replication with no popularity history, and says so.
        """
        saved = {int(k): np.asarray(v, dtype=np.int64) for k, v in state["slots"].items()}
        shape = (self.num_devices, self.slots_per_rank)
        loads_LE = (len(self.moe_layer_numbers), self.num_experts)
        history = np.asarray(state["history_loads"], dtype=np.int64)
        if history.size == 0:
            history = history.reshape(0, *loads_LE)
        mismatch = [n for n in self.moe_layer_numbers if n not in saved or saved[n].shape != shape]
        if mismatch or history.shape[1:] != loads_LE:
            return [
                f"replicate: the saved placement does not fit {self.num_devices} ranks x {self.slots_per_rank} slots "
                f"and {len(self.moe_layer_numbers)} MoE layers; starting from static replication"
            ]
        for layer in self.layers:
            self.experts[layer.layer_number].slots.assign(saved[layer.layer_number])
        self.tracker.load_state_dict({"observed": state["observed"], "history_loads": history})
        return [f"replicate: restored the placement and {self.tracker.num_observed} observed iterations of popularity"]

    # ---- metrics ---------------------------------------------------------------------------

    def a2a_remote_copies(self, loads) -> int:
        return self.stats.remote_copies

    def placed_layers(self, record: dict | None) -> list[dict] | None:
        """The slots' tokens per rank: the dispatch plans' destinations."""
        return record["layers"]

    def progress(self, record: dict) -> tuple[str, float]:
        return metrics.progress(record[self.name])

    def tensorboard_scalars(self, record: dict) -> dict[str, float]:
        return metrics.tensorboard_scalars(record[self.name])

    def memory_report(self) -> dict:
        """Slots and the slices' optimizer state, bytes per rank of the group."""
        return metrics.memory_report(list(self.experts.values()), self.device, self.group, self.num_devices)
