"""Zebra systems on heterogeneous pools: naive disaggregation, zig-zag (ZP) and ZP + Asym-EA.

The pool's first GPU type (the config lists the newer GPUs first) holds the M attention ranks,
the other type the N expert ranks (DESIGN 4.7). The global batch is the one EP processes on the
same pool (D x micro_batch_size sequences), split evenly over the attention ranks and into R
micro-batches; every micro-batch carries the iteration's trace loads / R.

Precision and activation recompute follow the workload. Recompute is per role: an attention
rank checkpoints its attention block (keeps each layer's input per micro-batch and re-runs
attention and gate in the backward, or only core attention with selective recompute), an
expert rank checkpoints its experts (keeps the tokens it received and re-runs the experts in the
backward). Each role keeps its own inputs, so no all-to-all is repeated, unlike EP, where the
whole layer including the all-to-alls is one checkpoint.

Planning and scheduling are the placement engine's: `placement.zebra.build_schedule` gives the
Theorem-1 task order of both roles and `simulate_schedule` runs it; `asym_ea` plans the
offloading from a profile that this module derives from the cost model (`zebra_profile`:
per-micro-batch attention and expert times on each GPU type, expert slots from free memory),
and `expert_owners` places the experts. The cost model supplies the task durations per
iteration and layer: attention blocks on the attention GPU type, each role's expert work as the
busiest rank of the role computes it with the trace's loads, and the bipartite all-to-alls from
the bytes between attention ranks and expert owners. After the schedule come the parts it does
not model: the gradient all-reduce of the first layer's and the embedding's dense parameters
among the attention ranks (the rest overlaps the backward) and the optimizer step.

Breakdown: a role's compute-stream idle time is blamed on the dependency that ended last: the
all-to-all it waited for ("all_to_all") or, before that all-to-all could start, the other role
("straggler_wait", i.e. pipeline bubbles); idle at the end of the iteration is "straggler_wait".
Per-layer times are each layer's span from its first to its last task, forward plus backward;
with the zig-zag, spans of neighbouring layers overlap.
"""

from __future__ import annotations

import numpy as np

from megatron_patches.placement import zebra as zp
from megatron_patches.placement.policies import ring_allreduce_bytes
from megatron_patches.placement.types import InstancePlacement
from megatron_patches.sim.costs import MemoryNeed, SimError
from megatron_patches.sim.report import SystemResult, imbalance_rows
from megatron_patches.sim.scenario import Scenario

__all__ = ["ZebraPools", "asym_layout_problem", "zebra_profile", "zebra_memory_needs", "simulate_zebra_system"]


class ZebraPools:
    """Which devices of the scenario's pool are attention ranks and which expert ranks.

    Attributes:
        attention_type, expert_type: the two GPU type names, in device order.
        M, N: attention and expert ranks (devices of each type).
        attention, expert: their device ids; int64 [M] and [N] (attention ranks first).
        shape: the placement engine's ZebraShape (L, n, M, N).
    Raises SimError unless the pool has exactly two GPU types, the first type's devices come
    first, every layer is MoE and N <= the expert count. Plain zebra takes any M:N and uneven
    expert blocks when N does not divide the experts; Asym-EA needs more (`asym_layout_problem`).
    """

    def __init__(self, scn: Scenario) -> None:
        types = scn.hardware.device_types
        kinds = list(dict.fromkeys(types))
        if len(kinds) != 2:
            raise SimError(
                f"zebra systems need a pool of two GPU types (attention GPUs listed first), but "
                f"{scn.hardware.describe()} has {len(kinds)} type(s): {kinds}"
            )
        model = scn.workload.model
        if model.num_moe_layers != model.num_layers:
            raise SimError(f"the simulator's zebra systems price every layer as MoE (dense layers on the attention "
                           f"ranks are not modelled yet); the model has {model.num_moe_layers} of "
                           f"{model.num_layers} (moe_layer_freq {model.moe_layer_freq})")
        self.attention_type, self.expert_type = kinds
        self.M = types.count(self.attention_type)
        self.N = types.count(self.expert_type)
        if types[: self.M] != (self.attention_type,) * self.M:
            raise SimError(f"zebra needs the {self.attention_type} GPUs first in the pool's device order")
        self.attention = np.arange(self.M)
        self.expert = np.arange(self.M, self.M + self.N)
        try:
            self.shape = zp.ZebraShape(scn.num_layers, scn.num_experts, self.M, self.N)
        except ValueError as err:
            raise SimError(f"zebra on {scn.hardware.describe()}: {err}") from None


def _tokens_per_microbatch(scn: Scenario, pools: ZebraPools, R: int) -> float:
    """Tokens one attention rank processes in one micro-batch."""
    return scn.workload.num_devices * scn.workload.tokens_per_device / (pools.M * R)


def _attention_rank_parts(scn: Scenario, pools: ZebraPools, R: int) -> dict[str, float]:
    """Memory of an attention rank without experts, by part: the dense model (optimizer state
    sharded over the M attention ranks), the attention activations of all its micro-batches
    under the workload's recompute (one unit per layer and micro-batch), the logits of one
    micro-batch (the head runs forward and backward back to back), the reserve."""
    mem = scn.memory
    per_mb = _tokens_per_microbatch(scn, pools, R)
    layer_D, scores_D = mem.layer_bytes_per_token_D()
    a = int(pools.attention[0])
    full_LD = np.full((scn.workload.model.num_layers, 1), per_mb * layer_D[a])
    layers = float(mem.kept_activation_bytes(full_LD, per_mb * scores_D[a], mem.input_bytes(per_mb), R)[0])
    return {k: float(v) for k, v in
            mem.by_part(mem.dense_parts(pools.M), 0.0, 0.0, layers + mem.logits_bytes(per_mb)).items()}


def _expert_rank_activation_bytes(scn: Scenario, pools: ZebraPools, R: int) -> float:
    """Activations of an expert rank with balanced loads: its n/N experts' tokens of all M
    attention ranks, one unit per layer and micro-batch, under the workload's recompute."""
    mem = scn.memory
    per_mb = _tokens_per_microbatch(scn, pools, R)
    per_rank = pools.shape.experts_per_expert_rank
    tokens = per_mb * pools.M * scn.workload.model.moe_router_topk / scn.num_experts * per_rank
    full_LD = np.full((scn.num_layers, 1), float(mem.expert_activation_bytes(tokens)))
    return float(mem.kept_activation_bytes(full_LD, 0.0, mem.input_bytes(tokens), R)[0])


def asym_layout_problem(scn: Scenario) -> str | None:
    """Why Asym-EA cannot plan chunks on this pool (M | N or N | M, and N | experts), or None."""
    pools = ZebraPools(scn)
    try:
        zp.chunk_sizes(pools.shape)
    except ValueError as err:
        return f"zebra-asym on {scn.hardware.describe()}: {err}"
    return None


def zebra_memory_needs(scn: Scenario, spec) -> list[MemoryNeed]:
    """What the attention and the expert ranks need with balanced loads and no Asym-EA (which can
    only move experts onto attention ranks with room for them)."""
    pools = ZebraPools(scn)
    R = 1 if spec.zebra_mode == "naive" else scn.options.zebra_microbatches
    mem = scn.memory
    experts = pools.shape.experts_per_expert_rank * scn.num_layers * scn.workload.expert_params
    no_dense = dict.fromkeys(("parameters", "gradients", "optimizer state"), 0.0)
    expert_parts = {k: float(v) for k, v in
                    mem.by_part(no_dense, experts, experts, _expert_rank_activation_bytes(scn, pools, R)).items()}
    hw = scn.hardware
    return [
        MemoryNeed(f"{spec.name} (attention ranks)", pools.attention_type, _attention_rank_parts(scn, pools, R),
                   float(hw.memory_D[pools.attention[0]])),
        MemoryNeed(f"{spec.name} (expert ranks)", pools.expert_type, expert_parts, float(hw.memory_D[pools.expert[0]])),
    ]


def _attention_recompute_D(scn: Scenario) -> np.ndarray:
    """Forward time an attention rank's layer backward repeats under the workload's recompute, per
    device for the workload's tokens per device (callers scale it to a micro-batch): nothing
    (none), core attention (selective), the attention block, norms and gate (full); float [D]."""
    c, recompute = scn.compute, scn.workload.recompute
    if recompute == "selective":
        return c.core_attention_fwd_D()
    if recompute == "full":
        return c.attention_fwd_D() + c.other_fwd_D(True)
    return np.zeros(scn.num_devices)


def _expert_passes(scn: Scenario) -> float:
    """Expert compute per iteration in forwards: forward 1 + backward BACKWARD, plus the
    recomputed forward under full recompute."""
    return 1.0 + scn.compute.BACKWARD + (1.0 if scn.workload.recompute == "full" else 0.0)


def zebra_profile(scn: Scenario, pools: ZebraPools, R: int) -> zp.ZebraProfile:
    """The Asym-EA profile as the cost model predicts it (what a profiler run would measure).

    Per micro-batch, forward + backward (+ the recomputed forward): attention block + norms +
    gate on each GPU type; one expert rank's n/N experts with balanced loads (the tokens of all M
    attention ranks) on each type. Slots: experts (weights, gradients, optimizer state) that fit in the free memory of a
    GPU of each role after its other residents and activations (balanced loads).
    """
    c, mem = scn.compute, scn.memory
    per_mb = _tokens_per_microbatch(scn, pools, R)
    scale = per_mb / scn.workload.tokens_per_device
    attn_D = (c.attention_fwd_D() + c.attention_bwd_D() + (1 + c.BACKWARD) * c.other_fwd_D(True)
              + _attention_recompute_D(scn)) * scale
    per_rank = pools.shape.experts_per_expert_rank
    tokens_per_expert = per_mb * pools.M * scn.workload.model.moe_router_topk / scn.num_experts
    experts_D = c.expert_fwd(np.full((per_rank, scn.num_devices), tokens_per_expert)) * _expert_passes(scn)
    expert_bytes = mem.expert_bytes_per_instance(True)
    attention_role = sum(_attention_rank_parts(scn, pools, R).values())
    expert_role = _expert_rank_activation_bytes(scn, pools, R) + mem.reserved_bytes

    def device(index: int) -> zp.DeviceProfile:
        memory = scn.hardware.memory_D[index]
        return zp.DeviceProfile(
            device_type=scn.hardware.device_types[index],
            t_attention_s=float(attn_D[index]),
            t_experts_s=float(experts_D[index]),
            expert_slots_as_attention=int(max(memory - attention_role, 0) // expert_bytes),
            expert_slots_as_expert=int(max(memory - expert_role, 0) // expert_bytes),
        )

    try:
        return zp.profile_from_devices(pools.shape, device(int(pools.attention[0])), device(int(pools.expert[0])))
    except ValueError as err:
        raise SimError(f"zebra profile: {err}") from None


def _plan(scn: Scenario, pools: ZebraPools, mode: str, R: int) -> tuple[zp.AsymEAPlan, zp.ZebraProfile]:
    profile = zebra_profile(scn, pools, R)
    try:
        if mode == "asym":
            return zp.asym_ea(profile), profile
        return zp.resolve_asym_ea("off", pools.shape, profile), profile
    except ValueError as err:
        hint = "" if mode == "asym" else "; zebra-asym offloads experts to the attention GPUs"
        raise SimError(f"zebra ({mode}) on {scn.hardware.describe()}: {err}{hint}") from None


def _comm_counters(scn: Scenario, pools: ZebraPools, owners_E: np.ndarray, R: int) -> np.ndarray:
    """Bytes per routed token of each expert in each per-device counter of one all-to-all; float [4, E, D].

    Every attention rank sends 1/M of an expert's tokens (of one micro-batch) to the expert's
    owner; tokens that stay on an attention rank owning the expert are free. Counters: sent
    intra-node, sent inter-node, received intra-node, received inter-node.
    """
    E, D, M = scn.num_experts, scn.num_devices, pools.M
    per_token = scn.workload.byte_model.token_bytes / (M * R)
    e = np.repeat(np.arange(E), M)
    src = np.tile(pools.attention, E)
    dst = owners_E[e]
    moved = src != dst
    intra = moved & scn.hardware.topology.same_node(src, dst)
    inter = moved & ~intra
    out = np.zeros((4, E, D))
    for c, (mask, device) in enumerate(((intra, src), (inter, src), (intra, dst), (inter, dst))):
        np.add.at(out[c], (e[mask], device[mask]), per_token)
    return out


def _activation_bytes_ID(scn: Scenario, pools: ZebraPools, R: int, expert_tokens_ILD: np.ndarray) -> np.ndarray:
    """Activations per iteration and device under the workload's recompute; float [I, D].

    Units per layer and micro-batch: an attention rank's attention block (per-micro-batch
    tokens), and every device's experts (expert_tokens_ILD: tokens its experts process per
    micro-batch). One recompute at a time, so the live recomputed unit is the largest of both
    kinds. Plus the logits of one micro-batch on attention ranks.
    """
    mem = scn.memory
    I, L, D = expert_tokens_ILD.shape
    per_mb = _tokens_per_microbatch(scn, pools, R)
    layer_D, scores_D = mem.layer_bytes_per_token_D()
    attention_D = np.zeros(D, dtype=bool)
    attention_D[pools.attention] = True
    # units [I, U = 2 L, D]: the attention blocks of the L layers, then the experts of the L layers
    full_IUD = np.concatenate([np.broadcast_to(np.where(attention_D, per_mb * layer_D, 0.0), (I, L, D)),
                               mem.expert_activation_bytes(expert_tokens_ILD)], axis=1)
    scores_IUD = np.concatenate([np.broadcast_to(np.where(attention_D, per_mb * scores_D, 0.0), (I, L, D)),
                                 np.zeros((I, L, D))], axis=1)
    inputs_IUD = np.concatenate([np.broadcast_to(np.where(attention_D, mem.input_bytes(per_mb), 0.0), (I, L, D)),
                                 mem.input_bytes(expert_tokens_ILD)], axis=1)
    logits_D = np.where(attention_D, mem.logits_bytes(per_mb), 0.0)
    return mem.kept_activation_bytes(full_IUD, scores_IUD, inputs_IUD, R) + logits_D


def simulate_zebra_system(scn: Scenario, spec) -> SystemResult:
    """Simulate zebra-naive (R = 1), zebra (ZP) or zebra-asym (ZP + Asym-EA) over the trace, in
    named stages: the plan, the expert and all-to-all task times per iteration, the task order
    simulated per iteration, the gradient sum and optimizer after it, the memory."""
    pools = ZebraPools(scn)
    R = 1 if spec.zebra_mode == "naive" else scn.options.zebra_microbatches
    plan, profile = _plan(scn, pools, spec.zebra_mode, R)
    I, L, E, D = scn.num_iterations, scn.num_layers, scn.num_experts, scn.num_devices
    c = scn.compute
    owners_LE = np.stack([zp.expert_owners(plan, l) for l in range(L)])  # group-local rank = device id
    tokens_ILE = scn.loads_ILE / R  # every micro-batch carries 1/R of the iteration's tokens
    tokens_ILED = np.zeros((I, L, E, D))
    tokens_ILED[:, np.arange(L)[:, None], np.arange(E)[None, :], owners_LE] = tokens_ILE
    comm_IL, a2a_parts, a2a_bytes = _all_to_all_times(scn, pools, owners_LE, R)
    iteration_I, busy, idle, layer_IL = _run_schedules(scn, pools, plan, R, c.expert_fwd(tokens_ILED), comm_IL)
    grad_s, ring, owned_D, optimizer_D = _after_the_schedule(scn, pools, owners_LE)
    optimizer_s = float(optimizer_D.max())
    iteration_I = iteration_I + grad_s + optimizer_s

    breakdown_I = {
        "attention": busy["attention"].mean(axis=1),
        "other": busy["other"].mean(axis=1),
        "expert_compute_mean": busy["expert"].mean(axis=1),
        "expert_compute_max": busy["expert"].max(axis=1),
        "straggler_wait": idle["straggler_wait"].mean(axis=1) + float((optimizer_s - optimizer_D).mean()),
        "all_to_all": idle["all_to_all"].mean(axis=1),
        "exposed_collectives": np.full(I, grad_s),
        "rearrangement": np.zeros(I),
        "optimizer": np.full(I, float(optimizer_D.mean())),
    }
    # device load of a layer: tokens processed by the experts on each device that holds some
    processed_ILD = tokens_ILED.sum(axis=2) * R
    holds_LD = np.stack([np.bincount(owners_LE[l], minlength=D) > 0 for l in range(L)])
    imbalance_IL = np.stack(
        [imbalance_rows(processed_ILD[:, l][:, holds_LD[l]]) for l in range(L)], axis=1
    )
    # the dense model (optimizer state sharded over the M attention ranks) lives on the attention ranks only
    on_attention_D = np.zeros(D)
    on_attention_D[pools.attention] = 1.0
    dense = {k: on_attention_D * v for k, v in scn.memory.dense_parts(pools.M).items()}
    owned_params_D = owned_D * scn.workload.expert_params
    memory_parts_D = scn.memory.by_part(dense, owned_params_D, owned_params_D,
                                        _activation_bytes_ID(scn, pools, R, tokens_ILED.sum(axis=2)).max(axis=0))
    memory_D = sum(memory_parts_D.values())
    peak = int(np.argmax(memory_D))
    return SystemResult(
        name=spec.name,
        description=spec.description,
        iteration_s_I=iteration_I,
        breakdown_I=breakdown_I,
        layer_s_IL=layer_IL,
        moe_layer_s_IL=None,
        exposed_by_kind_I={"dense_grad_allreduce": np.full(I, grad_s)},
        expert_compute_D=busy["expert"].mean(axis=0),
        all_to_all_parts=dict(zip(("latency", "intra_node_link", "inter_node_nic"), a2a_parts.tolist())),
        memory_parts={"device": peak, **{k: float(v[peak]) for k, v in memory_parts_D.items()}},
        imbalance_IL=imbalance_IL,
        survival_IL=np.ones((I, L)),
        memory_D=memory_D,
        memory_limit_D=scn.hardware.memory_D,
        traffic={"all_to_all": a2a_bytes, "dense_grad_allreduce": np.array([ring.intra, ring.inter], dtype=float)},
        details={
            "attention_ranks": pools.M,
            "attention_gpu": pools.attention_type,
            "expert_ranks": pools.N,
            "expert_gpu": pools.expert_type,
            "microbatches": R,
            "offload_chunks_per_layer": list(plan.offload_chunks_L),
            "gradient_sync_s": grad_s,
            "optimizer_s": optimizer_s,
            "profile": profile.to_dict(),
        },
    )


def _all_to_all_times(scn: Scenario, pools: ZebraPools, owners_LE: np.ndarray,
                      R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per iteration and layer, one all-to-all task's seconds [I, L]; the all-to-all's seconds per
    iteration split into latency, intra-node link and NIC [3]; its bytes per iteration [intra,
    inter] (dispatch and combine, forward and backward, R micro-batches; counted at the sender)."""
    I, L = scn.num_iterations, scn.num_layers
    comm_IL = np.zeros((I, L))
    a2a_parts = np.zeros(3)
    a2a_bytes = np.zeros(2)
    for l in range(L):
        per_token_CED = _comm_counters(scn, pools, owners_LE[l], R)
        counters = np.einsum("ie,ced->cid", scn.loads_ILE[:, l].astype(np.float64), per_token_CED)  # [4, I, D]
        comm_IL[:, l] = scn.comm.transfer_time(*counters)
        a2a_parts += 4.0 * R * np.array([x.mean() for x in scn.comm.transfer_parts(*counters)])
        a2a_bytes += 4.0 * R * np.array([counters[0].sum(axis=1).mean(), counters[1].sum(axis=1).mean()])
    return comm_IL, a2a_parts, a2a_bytes


def _run_schedules(scn: Scenario, pools: ZebraPools, plan, R: int, expert_ILD: np.ndarray,
                   comm_IL: np.ndarray) -> tuple[np.ndarray, dict, dict, np.ndarray]:
    """The Theorem-1 task order simulated once per iteration with that iteration's task times:
    (makespan [I], busy seconds per device {attention, other, expert} [I, D], idle seconds per
    device {all_to_all, straggler_wait} [I, D], per-layer spans [I, L]). ``expert_ILD``: one
    micro-batch's expert forward seconds per device."""
    I, L, D = scn.num_iterations, scn.num_layers, scn.num_devices
    c = scn.compute
    scale = _tokens_per_microbatch(scn, pools, R) / scn.workload.tokens_per_device
    a_rank = pools.attention
    attention_f = scale * c.attention_fwd_D()[a_rank].max()
    att_f = float((scale * (c.attention_fwd_D() + c.other_fwd_D(True)))[a_rank].max())
    att_b = float((scale * (c.attention_bwd_D() + c.BACKWARD * c.other_fwd_D(True)
                            + _attention_recompute_D(scn)))[a_rank].max())
    expert_b = _expert_passes(scn) - 1.0  # an E task's backward in forwards (with its recompute)
    head = c.head_fwd_D() * scale
    head_f, head_b = float(head[a_rank].max()), float((c.BACKWARD * head)[a_rank].max())
    att_share = float(attention_f) / att_f  # attention's part of an A task, the rest is norms and gate
    e_exp_IL = expert_ILD[:, :, pools.expert].max(axis=2)
    e_att_IL = expert_ILD[:, :, pools.attention].max(axis=2)
    schedule = zp.build_schedule(L, R, [l for l, o in enumerate(plan.offload_chunks_L) if o > 0])
    all_ids = list({t.id: None for queue in schedule.values() for t in queue})
    layer_ids = {(l, ph): [t for t in all_ids if f"_{ph}({l}," in t] for l in range(L) for ph in ("F", "B")}

    iteration_I = np.zeros(I)
    busy = {name: np.zeros((I, D)) for name in ("attention", "other", "expert")}
    idle = {name: np.zeros((I, D)) for name in ("all_to_all", "straggler_wait")}
    layer_IL = np.zeros((I, L))
    for i in range(I):

        def duration(task: zp.Task) -> float:
            if task.kind == "A":
                if task.layer == L:
                    return head_f if task.phase == "F" else head_b
                return att_f if task.phase == "F" else att_b
            if task.kind == "E":
                t = e_exp_IL[i, task.layer] if task.role == "expert" else e_att_IL[i, task.layer]
                return t if task.phase == "F" else expert_b * t
            return comm_IL[i, task.layer]

        times = zp.simulate_schedule(schedule, duration)
        makespan = max(end for _, end in times.values())
        iteration_I[i] = makespan
        for role, ranks in (("attention", pools.attention), ("expert", pools.expert)):
            free = 0.0
            for task in schedule[(role, "compute")]:
                start, end = times[task.id]
                gap = start - free
                if gap > 0:
                    # the dependency that ended last is an all-to-all: the compute stream's own
                    # predecessor ended at `free`; before the all-to-all started, the other role was busy
                    comm_start = times[max(task.deps, key=lambda d: times[d][1])][0]
                    before = min(max(comm_start - free, 0.0), gap)
                    idle["straggler_wait"][i, ranks] += before
                    idle["all_to_all"][i, ranks] += gap - before
                span = end - start
                if task.kind == "E":
                    busy["expert"][i, ranks] += span
                elif task.layer == L:
                    busy["other"][i, ranks] += span
                else:
                    busy["attention"][i, ranks] += span * att_share
                    busy["other"][i, ranks] += span * (1 - att_share)
                free = end
            idle["straggler_wait"][i, ranks] += makespan - free
        for (l, _), ids in layer_ids.items():
            layer_IL[i, l] += max(times[t][1] for t in ids) - min(times[t][0] for t in ids)
    return iteration_I, busy, idle, layer_IL


def _after_the_schedule(scn: Scenario, pools: ZebraPools, owners_LE: np.ndarray):
    """After the schedule: the dense gradients of the first layer and the embeddings summed among
    the attention ranks (the other layers' reduction overlaps the backward), then the optimizer.
    (the gradient sum's seconds, its ring bytes, experts owned per device [D], optimizer seconds
    per device [D])."""
    L, D = scn.num_layers, scn.num_devices
    dense = scn.workload.dense_params()
    holders = np.zeros((1, D), dtype=np.int64)
    holders[0, pools.attention] = 1
    grad_bytes = (dense["per_layer"][0] + dense["outer"]) * scn.workload.byte_model.grad_bytes_per_param
    ring = ring_allreduce_bytes(InstancePlacement(holders), grad_bytes, scn.hardware.topology)
    grad_s = scn.comm.time(ring, steps=2 * (pools.M - 1)) if pools.M > 1 else 0.0
    owned_D = np.stack([np.bincount(owners_LE[l], minlength=D) for l in range(L)]).sum(axis=0)
    params_D = owned_D * float(scn.workload.expert_params)
    params_D[pools.attention] += (sum(dense["per_layer"]) + dense["outer"]) / pools.M
    return grad_s, ring, owned_D, scn.compute.optimizer_D(params_D)
