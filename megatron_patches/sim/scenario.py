"""The inputs every simulated system shares: workload, hardware, cost models and the scaled trace.

A trace records how tokens were routed, possibly for another batch size or rank count than the
one simulated. The simulator keeps the trace's routing *distribution* and rescales it to the
simulated batch: per iteration and layer the routed tokens become D x micro_batch_size x
seq_length x top-k, split in proportion to the trace (largest-remainder rounding, so counts
stay integers and sum exactly). Per-source loads are used when the trace has them for exactly
D ranks; otherwise every expert's tokens are split evenly over the D sources, as the placement
engine's replay does (`policies.even_source_loads`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from megatron_patches.config import ClusterConfig, ModelConfig
from megatron_patches.placement.collectives import ALGORITHMS
from megatron_patches.placement.policies import even_source_loads
from megatron_patches.placement.trace import Trace
from megatron_patches.sim.costs import (
    CommModel,
    ComputeModel,
    Hardware,
    KernelEfficiency,
    LinkParameters,
    MemoryModel,
    Precision,
    SimError,
    Workload,
)

__all__ = ["SPARSE_COLLECTIVES", "SimOptions", "Scenario", "build_scenario", "scale_counts"]

SPARSE_COLLECTIVES = (*ALGORITHMS, "ring")
"""How FSSDP's sparse collectives are priced: the runtime's algorithms (the default first), or ring."""


@dataclass(frozen=True)
class SimOptions:
    """Knobs of the simulated systems; None means "derive from the cost and memory model"."""

    overlap_degree: int | None = None
    """FSSDP's t (copies received while attention runs); None: DESIGN 4.2's formula."""
    memory_capacity: int | None = None
    """FSSDP's m (extra copies per device and layer); None: what fits in free memory."""
    reserved_slots: int | None = None
    """FlexMoE's reserved replica slots per device and layer; None: what fits in free memory."""
    slots_per_rank: int | None = None
    """Expert slots per rank and layer of replicate / static; None: ceil(E/D) + reserved_slots."""
    capacity_factor: float | None = None
    """Capacity factor of replicate / static; None: the model's, or 1.0 if it is dropless."""
    nic_sharing: bool = True
    """Collectives that cross nodes share the NICs (`Timeline.collective`'s nic_I): a gradient
    all-reduce or a gather in flight slows the all-to-all issued after it. False: every stream
    has the whole NIC to itself (the simulator before 2026-11-29; the closed-form tests of one
    collective use it)."""
    pad_to_capacity: bool = False
    """The capacity-limited systems (replicate, FlexMoE with a capacity) pad their experts' input
    to the capacity, as the replication paper's DeepSpeed-based system does (Megatron's
    --moe-pad-expert-input-to-capacity, which the replicate mode itself refuses): each instance
    computes its whole capacity (and keeps its activations), whatever was routed. Static,
    DeepSpeed's fixed-shape dispatch, always pads, and sends its fixed-size buffers
    (`baselines.deepspeed_dispatch`); the others' fixed-size buffers are not priced."""
    reshard_interval: int = 100
    """Iterations between FSSDP re-sharding and SmartMoE swaps (DESIGN 7: 100)."""
    zebra_microbatches: int = 4
    """R, micro-batches of a zebra iteration (zebra and zebra-asym; zebra-naive uses 1)."""
    memory_reserve_gb: float | None = None
    """Per-device memory kept free for the CUDA context and workspaces; None: the model's default."""
    fssdp_calibrate: bool = True
    """FSSDP's calibration after the gate (`--fssdp-calibrate`, on by default as in the runtime): with the actual loads, gather more
    copies when the saving beats the extra gather's time, as priced here (FasterMoE's shadowing is
    among the candidates)."""
    sparse_collectives: str = "hierarchical"
    """How FSSDP's gather / reduce are priced: as the runtime's `--fssdp-collectives` runs them,
    "hierarchical" (owner to one relay per node, then the relay to its node's holders, the two
    stages one after the other) or "flat" (owner to every holder), with the placement engine's
    byte accounting; or "ring" (pipelined ring broadcast / reduce over the holders, NCCL's
    algorithm, which the runtime does not run)."""

    def __post_init__(self) -> None:
        for name in ("overlap_degree", "memory_capacity", "reserved_slots"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise SimError(f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        for name in ("slots_per_rank", "reshard_interval", "zebra_microbatches"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SimError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.capacity_factor is not None and not (np.isfinite(self.capacity_factor) and self.capacity_factor > 0):
            raise SimError(f"--capacity-factor must be > 0, got {self.capacity_factor!r}")
        if self.sparse_collectives not in SPARSE_COLLECTIVES:
            raise SimError(f"--sparse-collectives must be one of {', '.join(SPARSE_COLLECTIVES)}, "
                           f"got {self.sparse_collectives!r}")
        if self.memory_reserve_gb is not None and not (
            np.isfinite(self.memory_reserve_gb) and self.memory_reserve_gb >= 0
        ):
            raise SimError(f"--memory-reserve-gb must be >= 0, got {self.memory_reserve_gb!r}")


@dataclass(frozen=True, eq=False)
class Scenario:
    """Everything a system simulation reads."""

    workload: Workload
    """Model and batch."""
    hardware: Hardware
    """The simulated devices."""
    compute: ComputeModel
    """Kernel times."""
    comm: CommModel
    """Collective times."""
    memory: MemoryModel
    """Memory per device."""
    loads_ILE: np.ndarray
    """Routed tokens per iteration, MoE layer and expert, scaled to the simulated batch; int64 [I, L, E]."""
    source_ILDE: np.ndarray
    """The same split by source device; int64 [I, L, D, E]."""
    trace_scale: float
    """Simulated routed tokens / the trace's, averaged over iterations and layers."""
    source_note: str
    """Where the per-source loads come from."""
    options: SimOptions = field(default_factory=SimOptions)
    """System knobs."""
    efficiency: KernelEfficiency = field(default_factory=KernelEfficiency)
    """The kernel efficiencies in use."""
    links: LinkParameters = field(default_factory=LinkParameters)
    """The link parameters in use."""
    precision_note: str = ""
    """Why the workload trains in its precision (the default's reason, or who asked for it)."""
    trace: Trace | None = None
    """The trace as read (before scaling), for scenarios on a subset of the devices (`on_gpu_type`)."""

    @property
    def num_iterations(self) -> int:
        """I."""
        return int(self.loads_ILE.shape[0])

    @property
    def num_layers(self) -> int:
        """L, MoE layers."""
        return int(self.loads_ILE.shape[1])

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.loads_ILE.shape[2])

    @property
    def num_devices(self) -> int:
        """D."""
        return self.hardware.num_devices

    @property
    def capacity_factor(self) -> float:
        """Capacity factor of the capacity-based systems."""
        if self.options.capacity_factor is not None:
            return self.options.capacity_factor
        return self.workload.model.moe_expert_capacity_factor or 1.0

    @property
    def capacity_set(self) -> bool:
        """The run sets a capacity (--capacity-factor, or the model's): the dropless baselines that
        the papers run at a capacity (FlexMoE) then drop over it too."""
        return self.options.capacity_factor is not None or self.workload.model.moe_expert_capacity_factor is not None

    def on_gpu_type(self, gpu_type: str) -> Scenario:
        """The same model, batch per GPU, precision, recompute, options and trace on only the
        devices of one GPU type (their node groups as one cluster); SimError when that cannot
        run (e.g. the type lacks the precision)."""
        cluster = self.hardware.cluster
        groups = tuple(g for g in cluster.nodes if g.gpu == gpu_type)
        if not groups:
            raise SimError(f"no {gpu_type} devices among {', '.join(dict.fromkeys(cluster.device_types))}")
        sub = dataclasses.replace(cluster, nodes=groups, gpu_types={gpu_type: cluster.gpu_types[gpu_type]})
        wl = self.workload
        return build_scenario(wl.model, sub, sub.num_devices, self.trace, wl.micro_batch_size, wl.seq_length,
                              self.efficiency, self.links, self.options, wl.precision, wl.recompute)

    def with_recompute(self, recompute: str) -> Scenario:
        """The same scenario under another activation recompute (what-if figures for messages)."""
        workload = dataclasses.replace(self.workload, recompute=recompute)
        return dataclasses.replace(
            self,
            workload=workload,
            compute=ComputeModel(workload, self.hardware, self.efficiency),
            memory=MemoryModel(workload, self.hardware, self.memory.reserved_bytes),
        )


def scale_counts(counts, target: int) -> np.ndarray:
    """Rescale integer counts so that every row (last axis) sums to `target`, proportionally.

    Largest-remainder rounding: every entry gets floor(x * target / row_sum) and the rows'
    leftover units go to the largest fractional parts (ties: lower index). A row that already
    sums to `target` is returned unchanged; an all-zero row becomes an even split.
    Returns int64 of the same shape.
    """
    counts = np.asarray(counts)
    if counts.dtype.kind in "iu" and np.all(counts.sum(axis=-1) == target):
        return counts.astype(np.int64)
    x = counts.astype(np.float64)
    K = x.shape[-1]
    rows = x.sum(axis=-1, keepdims=True)
    x = np.where(rows > 0, x, 1.0)
    rows = x.sum(axis=-1, keepdims=True)
    quota = x * (float(target) / rows)
    base = np.floor(quota)
    leftover = target - base.sum(axis=-1, keepdims=True)
    order = np.argsort(-(quota - base), axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(K), order.shape), axis=-1)
    return (base + (rank < leftover)).astype(np.int64)


def build_scenario(
    model: ModelConfig,
    cluster: ClusterConfig,
    gpus: int,
    trace: Trace,
    micro_batch_size: int = 1,
    seq_length: int | None = None,
    efficiency: KernelEfficiency | None = None,
    links: LinkParameters | None = None,
    options: SimOptions | None = None,
    precision: str | Precision | None = None,
    recompute: str = "none",
) -> Scenario:
    """Validate the inputs against each other and assemble the Scenario.

    precision: a name of PRECISIONS (Megatron-LM's rule for the gradient dtype), a Precision, or
    None for the default: bf16 where every simulated GPU supports it, else fp16
    (`Hardware.default_precision`). recompute: one of RECOMPUTE.
    Raises SimError when the GPU count does not fit the cluster, the precision does not run on
    its GPUs, or the trace's layers / experts do not match the model's MoE layers / experts.
    """
    hardware = Hardware.from_cluster(cluster, gpus)
    if precision is None:
        name, reason = hardware.default_precision()
        precision, precision_note = Precision(name), f"default: {reason}"
    else:
        precision, precision_note = Precision(precision) if isinstance(precision, str) else precision, "requested"
    hardware.check_precision(precision)
    workload = Workload(model, gpus, micro_batch_size, seq_length or model.seq_length, precision, recompute)
    if trace.num_layers != model.num_moe_layers or trace.num_experts != model.num_experts:
        raise SimError(
            f"the trace has {trace.num_layers} layers x {trace.num_experts} experts but the model has "
            f"{model.num_moe_layers} MoE layers x {model.num_experts} experts; record or generate the trace for "
            f"this model (tools/make_trace.py --layers {model.num_moe_layers} --experts {model.num_experts})"
        )
    efficiency = efficiency or KernelEfficiency()
    links = links or LinkParameters()
    options = options or SimOptions()
    target = workload.routed_tokens_per_layer
    routed_IL = trace.loads.sum(axis=2)
    scale = float(np.mean(target / np.maximum(routed_IL, 1)))
    D = gpus
    if trace.source_loads is not None and trace.num_ranks == D:
        I, L, _, E = trace.source_loads.shape
        flat = scale_counts(trace.source_loads.reshape(I, L, D * E), target)
        source = flat.reshape(I, L, D, E)
        loads = source.sum(axis=2)
        note = f"per-rank loads of the trace ({D} ranks)"
    else:
        loads = scale_counts(trace.loads, target)
        source = np.stack([even_source_loads(loads[i], D) for i in range(loads.shape[0])])
        if trace.source_loads is None:
            note = "even split over devices (the trace has no per-rank loads)"
        else:
            note = f"even split over devices (the trace has per-rank loads for {trace.num_ranks} ranks, not {D})"
    if options.memory_reserve_gb is None:
        memory = MemoryModel(workload, hardware)
    else:
        memory = MemoryModel(workload, hardware, options.memory_reserve_gb * 1e9)
    return Scenario(
        workload=workload,
        hardware=hardware,
        compute=ComputeModel(workload, hardware, efficiency),
        comm=CommModel(hardware, links),
        memory=memory,
        loads_ILE=loads,
        source_ILDE=source,
        trace_scale=scale,
        source_note=note,
        options=options,
        efficiency=efficiency,
        links=links,
        precision_note=precision_note,
        trace=trace,
    )
