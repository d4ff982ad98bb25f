"""Cost model of the simulator: compute, communication and memory of one training step.

Compute: every kernel class (dense GEMMs, expert GEMMs, attention core, memory-bound element-wise
work, the optimizer step) takes max(FLOPs / (peak x efficiency), bytes / (memory bandwidth x
efficiency)) on the device that runs it, the peak rates coming from the cluster config's GPU
types. The efficiencies are `KernelEfficiency` parameters with the defaults justified below; a
measured profile overrides them (`KernelEfficiency.with_overrides`).

Communication: a collective moves `CommBytes` (per device: bytes sent / received, intra- and
inter-node, as the placement engine's accounting counts them). It takes a launch latency plus
the busiest of: any device's intra-node outbound or inbound bytes over its link, and any node's
inter-node outbound or inbound bytes (summed over the node's devices, who share one NIC) over
the NIC. Collectives in this model finish on all members at once.

Precision (`Precision`: fp32, fp16 or bf16, as Megatron-LM trains in each) sets the element
size of weights, materialized copies and replicas, gradients, all-to-all tokens and activations,
the optimizer state per parameter, and the compute peak: half precision runs its GEMMs at the
GPU's FP16/BF16 tensor-core peak, fp32 at its TF32 tensor-core peak where it has one (see
`Hardware.gemm_peaks_D`) and at its FP32 peak otherwise; fused (flash) attention needs half
precision.

Memory: parameters, gradients and optimizer state (Adam, Megatron's distributed optimizer for
the dense parameters), expert instances and copies, and activations (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", MLSys 2023, Table 2 and
section 4, with the activation recompute of `Workload.recompute`: none, selective or full; see
`MemoryModel.activation_bytes`), plus a fixed reserve for the CUDA context and workspaces.

Units: seconds, bytes, FLOP; per-device arrays carry the suffix `_D`, per-node `_N`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from megatron_patches.config import ClusterConfig, ConfigError, ModelConfig, count_parameters, expert_parameter_count
from megatron_patches.config.models import padded_vocab_size
from megatron_patches.placement.accounting import CommBytes, dispatch_bytes
from megatron_patches.placement.baselines import ByteModel
from megatron_patches.placement.fssdp import BACKWARD_OVER_FORWARD
from megatron_patches.placement.policies import all_ranks_allreduce_bytes
from megatron_patches.placement.types import Topology

__all__ = [
    "SimError",
    "KernelEfficiency",
    "LinkParameters",
    "Hardware",
    "select_devices",
    "Workload",
    "ComputeModel",
    "CommModel",
    "MemoryModel",
    "MemoryNeed",
    "PRECISIONS",
    "Precision",
    "RECOMPUTE",
    "ring_broadcast_bytes",
    "all_ranks_allreduce_steps",
    "all_to_all_bytes",
]


class SimError(ValueError):
    """A simulator input is invalid or the simulated setup is impossible; the message says what would be valid."""


PRECISIONS = ("fp32", "fp16", "bf16")
"""The training precisions the simulator models (Megatron-LM: no flag, --fp16, --bf16)."""

RECOMPUTE = ("none", "selective", "full")
"""Activation recompute (Megatron-LM's --recompute-granularity; "none" = not set)."""


@dataclass(frozen=True)
class Precision:
    """The number formats of one training precision, as Megatron-LM trains in it.

    fp32: weights, gradients and activations in fp32; the optimizer steps the fp32 weights
    themselves, so the Adam state is m and v only: 4 + 4 + 8 = 16 B per parameter.
    fp16 / bf16 (mixed precision, Micikevicius et al. 2018, in Megatron-LM's form: Float16Module
    and the mixed-precision / distributed optimizer): weights, activations, all-to-all tokens and
    materialized copies / replicas in 2-byte elements; fp32 main weights, m and v (12 B per
    parameter, with their owners); gradients in fp32 (4 B) when accumulated in fp32, which
    Megatron-LM forces for bf16 (--accumulate-allreduce-grads-in-fp32), else in fp16 (2 B,
    Megatron-LM's fp16 default). So fp32 and fp16 need 16 B per parameter, bf16 18 B; gradient
    traffic (DDP all-reduce, fssdp's spRS, replicate's reduction) moves the gradient bytes.
    """

    name: str
    """"fp32", "fp16" or "bf16"."""
    fp32_gradients: bool | None = None
    """Whether gradients are accumulated and reduced in fp32; None: Megatron-LM's rule (fp32 and
    bf16 yes, fp16 only with --accumulate-allreduce-grads-in-fp32)."""

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise SimError(f"precision {self.name!r} is unknown; valid: {', '.join(PRECISIONS)}")
        if self.fp32_gradients is None:
            object.__setattr__(self, "fp32_gradients", self.name != "fp16")
        elif self.name != "fp16" and not self.fp32_gradients:
            raise SimError(f"{self.name} gradients are always fp32 in Megatron-LM; only fp16 can keep 2-byte gradients")

    @property
    def half(self) -> bool:
        """fp16 or bf16: 2-byte model elements, fp32 main weights, tensor-core rates."""
        return self.name != "fp32"

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight, activation or token element: 2 in half precision, 4 in fp32."""
        return 2 if self.half else 4

    @property
    def grad_bytes_per_param(self) -> float:
        """Bytes of one gradient element (and of gradient traffic per parameter)."""
        return 4.0 if self.fp32_gradients else 2.0

    @property
    def optimizer_bytes_per_param(self) -> float:
        """Adam state per parameter: fp32 main weight + m + v in half precision (12), m + v in fp32 (8)."""
        return 12.0 if self.half else 8.0

    @property
    def optimizer_step_bytes_per_param(self) -> float:
        """Bytes the fused Adam step reads and writes per parameter (the step is memory-bound):
        the gradient read, the fp32 weight, m and v read and written (3 x 8), and in half
        precision the 2-byte model weight written back. bf16: 4 + 24 + 2 = 30, fp16: 2 + 24 + 2
        = 28, fp32: 4 + 24 = 28."""
        return self.grad_bytes_per_param + 24.0 + (self.element_bytes if self.half else 0.0)

    def describe(self) -> str:
        """e.g. "bf16: 2 B weights/activations/tokens, 4 B gradients, 12 B main weight + Adam per parameter"."""
        state = "fp32 main weight + Adam" if self.half else "Adam m + v"
        return (f"{self.name}: {self.element_bytes} B weights/activations/tokens, {self.grad_bytes_per_param:g} B "
                f"gradients, {self.optimizer_bytes_per_param:g} B {state} per parameter")


# ---------------------------------------------------------------------------------------------
# Parameters of the cost model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelEfficiency:
    """Achieved fraction of the device's peak rates per kernel class, plus a launch overhead.

    Defaults are set from published measurements rather than tuned to any result of this
    simulator: cuBLAS FP16/BF16 GEMMs with K, N of 768-4096 reach 50-70% of the tensor-core
    peak on V100 / A100 (NVIDIA's "Matrix multiplication background" guide; Megatron-LM reports
    47-52% model FLOPs utilisation end to end on A100, which includes the slower non-GEMM work);
    FlashAttention-2 reaches 50-73% of peak forward and ~45-65% backward on A100 (Dao, 2023);
    element-wise PyTorch kernels stream at 60-80% of HBM bandwidth.
    """

    dense_gemm: float = 0.55
    """Fraction of peak FLOP/s of the dense GEMMs (QKV, output projection, gate, dense MLP,
    head) and of the unfused attention GEMMs."""
    expert_gemm: float = 0.55
    """Fraction of peak FLOP/s an expert GEMM approaches when it processes many tokens."""
    expert_half_tokens: float = 128.0
    """Tokens at which an expert GEMM reaches half of `expert_gemm`: efficiency is
    expert_gemm x n / (n + expert_half_tokens) for n tokens. A GEMM with M = n rows fills the
    tensor cores' 128-256 row tiles only for n in the hundreds, which is where cuBLAS reaches
    half of its large-matrix rate."""
    flash_attention: float = 0.45
    """Fraction of peak FLOP/s of fused (FlashAttention-2) attention, forward and backward."""
    memory: float = 0.7
    """Fraction of peak memory bandwidth of memory-bound kernels (softmax without fused
    attention, norms, residuals, activations, token permutation, the optimizer step)."""
    kernel_launch_s: float = 8e-6
    """Fixed cost per expert GEMM group (launches and synchronisation of one expert's fc1,
    activation and fc2), seconds; CUDA kernel launches cost 3-10 us each."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise SimError(f"KernelEfficiency.{f.name} must be a finite number, got {value!r}")
            if f.name in ("dense_gemm", "expert_gemm", "flash_attention", "memory") and not 0 < value <= 1:
                raise SimError(f"KernelEfficiency.{f.name} is a fraction of peak and must be in (0, 1], got {value!r}")
            if value < 0:
                raise SimError(f"KernelEfficiency.{f.name} must be >= 0, got {value!r}")
            object.__setattr__(self, f.name, float(value))

    def with_overrides(self, overrides: dict[str, float]) -> KernelEfficiency:
        """A copy with some fields replaced; SimError naming an unknown field and the valid ones."""
        valid = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise SimError(f"unknown kernel efficiency parameter(s) {unknown}; valid: {valid}")
        return dataclasses.replace(self, **overrides)


@dataclass(frozen=True)
class LinkParameters:
    """Achieved fraction of link bandwidth and per-collective latencies.

    NCCL's bus bandwidth in nccl-tests reaches ~80-90% of the NVLink / NVSwitch line rate and
    ~85-95% of an InfiniBand / RoCE NIC's rate for messages of several MB; small-message
    latencies are ~5-15 us inside a node and ~15-30 us across nodes.
    """

    intra_efficiency: float = 0.8
    """Fraction of the intra-node link bandwidth a collective achieves."""
    inter_efficiency: float = 0.85
    """Fraction of the NIC line rate a collective achieves."""
    intra_latency_s: float = 10e-6
    """Launch latency of a collective (or one ring step) that stays inside nodes, seconds."""
    inter_latency_s: float = 25e-6
    """Launch latency of a collective (or one ring step) that crosses nodes, seconds."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise SimError(f"LinkParameters.{f.name} must be a finite number >= 0, got {value!r}")
            if f.name.endswith("efficiency") and not 0 < value <= 1:
                raise SimError(f"LinkParameters.{f.name} must be in (0, 1], got {value!r}")
            object.__setattr__(self, f.name, float(value))


# ---------------------------------------------------------------------------------------------
# Hardware: the simulated devices
# ---------------------------------------------------------------------------------------------


def select_devices(cluster: ClusterConfig, gpus: int) -> ClusterConfig:
    """The first `gpus` devices of the cluster as a cluster of their own.

    Valid counts: up to one node's GPUs on the first node, or a whole number of nodes taken
    in the config's order (the placement Topology needs the same device count on every node).
    """
    layout = ", ".join(f"{g.count} x {g.gpus_per_node} {g.gpu}" for g in cluster.nodes)
    whole = []
    total = 0
    for g in cluster.nodes:
        for _ in range(g.count):
            total += g.gpus_per_node
            whole.append(total)
    first = cluster.nodes[0]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise SimError(f"--gpus must be a positive integer, got {gpus!r}")
    if gpus > cluster.num_devices:
        raise SimError(
            f"--gpus {gpus}: cluster {cluster.name} has only {cluster.num_devices} GPUs ({layout} per node group); "
            f"valid: 1..{first.gpus_per_node} on one node or whole nodes {whole}"
        )
    if gpus <= first.gpus_per_node:
        return dataclasses.replace(cluster, nodes=(dataclasses.replace(first, count=1, gpus_per_node=gpus),))
    if gpus not in whole:
        raise SimError(
            f"--gpus {gpus}: cluster {cluster.name} ({layout}) cannot be cut at {gpus} GPUs; "
            f"valid: 1..{first.gpus_per_node} on one node or whole nodes {whole}"
        )
    groups, left = [], gpus
    for g in cluster.nodes:
        take = min(g.count, left // g.gpus_per_node)
        if take:
            groups.append(dataclasses.replace(g, count=take))
        left -= take * g.gpus_per_node
    return dataclasses.replace(cluster, nodes=tuple(groups))


@dataclass(frozen=True, eq=False)
class Hardware:
    """Per-device rates and links of the simulated devices (device d = rank d, node-major)."""

    cluster: ClusterConfig
    """The selected devices as a cluster (see `select_devices`)."""
    topology: Topology
    """The placement engine's view of the same devices (what the planners see)."""
    peak_flops_D: np.ndarray
    """Dense FP16/BF16 tensor-core peak per device, FLOP/s; float [D]."""
    fp32_peak_D: np.ndarray
    """Dense FP32 peak (CUDA cores) per device, FLOP/s; NaN where the cluster file does not state it; float [D]."""
    tf32_peak_D: np.ndarray
    """Dense TF32 tensor-core peak per device, FLOP/s; NaN on GPUs without TF32 tensor cores; float [D]."""
    hbm_bw_D: np.ndarray
    """Memory bandwidth per device, bytes/s; float [D]."""
    memory_D: np.ndarray
    """Device memory, bytes; float [D]."""
    flash_D: np.ndarray
    """Whether fused (flash) attention runs on the device; bool [D]."""
    memory_efficient_D: np.ndarray
    """Whether the systems run a memory-efficient attention kernel there where flash does not
    (`GpuType.memory_efficient_attention`); bool [D]."""
    intra_bw_D: np.ndarray
    """Intra-node link bandwidth per device and direction, bytes/s; float [D]."""
    nic_bw_N: np.ndarray
    """NIC line rate per node and direction, bytes/s; float [N]."""
    node_of_D: np.ndarray
    """Node of each device; int64 [D]."""

    @classmethod
    def from_cluster(cls, cluster: ClusterConfig, gpus: int) -> Hardware:
        """The first `gpus` devices of `cluster` (validated by `select_devices`)."""
        sub = select_devices(cluster, gpus)
        try:
            topology = sub.to_topology()
        except ConfigError as err:
            raise SimError(str(err)) from None
        gpu_D = [sub.gpu_types[t] for t in sub.device_types]
        nic_N, intra_D = [], []
        for g in sub.nodes:
            nic_N += [g.inter_node_gbps * 1e9 / 8] * g.count
            intra_D += [g.intra_node_bw_gb_s * 1e9] * g.num_devices
        return cls(
            cluster=sub,
            topology=topology,
            peak_flops_D=np.array([g.peak_fp16_tflops * 1e12 for g in gpu_D]),
            fp32_peak_D=np.array([np.nan if g.peak_fp32_tflops is None else g.peak_fp32_tflops * 1e12 for g in gpu_D]),
            tf32_peak_D=np.array([np.nan if g.peak_tf32_tflops is None else g.peak_tf32_tflops * 1e12 for g in gpu_D]),
            hbm_bw_D=np.array([g.hbm_gb_s * 1e9 for g in gpu_D]),
            memory_D=np.array([g.memory_gb * 1e9 for g in gpu_D]),
            flash_D=np.array([g.flash_attention for g in gpu_D], dtype=bool),
            memory_efficient_D=np.array([g.memory_efficient_attention for g in gpu_D], dtype=bool),
            intra_bw_D=np.array(intra_D, dtype=np.float64),
            nic_bw_N=np.array(nic_N, dtype=np.float64),
            node_of_D=topology.node_of.copy(),
        )

    @property
    def num_devices(self) -> int:
        """D."""
        return int(self.peak_flops_D.size)

    @property
    def probed_topology(self) -> Topology:
        """The topology as the FSSDP runtime's bandwidth probe measures it, which sets its t
        (`fssdp.tuning.probe_bandwidths`): every rank exchanges with its node-mate and, at the
        same time as every other position, with its same-position peer on the next node, so a
        node's G devices share its NIC: inter-node = the slowest NIC / G (at most the slowest
        intra-node link), intra-node = the slowest link. `topology` keeps the NIC rate a single
        pair of devices gets, the right figure for one transfer alone."""
        per_node = self.topology.devices_per_node
        intra = float(self.intra_bw_D.min())
        inter = min(float(self.nic_bw_N.min()) / per_node, intra) if self.topology.nodes > 1 else intra
        return dataclasses.replace(self.topology, intra_node_bw=intra, inter_node_bw=inter)

    @property
    def device_types(self) -> tuple[str, ...]:
        """GPU type name per device."""
        return self.cluster.device_types

    def describe(self) -> str:
        """e.g. "cluster_a: 4 x 8 V100-SXM2-32GB"."""
        groups = " + ".join(f"{g.count} x {g.gpus_per_node} {g.gpu}" for g in self.cluster.nodes)
        return f"{self.cluster.name}: {groups}"

    def check_precision(self, precision: Precision) -> None:
        """SimError naming the GPU type (and the cluster file and key) that cannot train in `precision`.

        bf16 needs native bf16 (Ampere or newer: V100 and T4 have none); fp32 needs the
        cluster file's FP32 rate.
        """
        for name in dict.fromkeys(self.device_types):
            gpu = self.cluster.gpu_types[name]
            where = f"gpu_types.{name} of {self.cluster.source}"
            if precision.name == "bf16" and gpu.bf16 is None:
                raise SimError(f"precision bf16: cluster {self.cluster.name} does not say whether the {name} supports "
                               f"bf16; add `bf16: true` or `bf16: false` to {where}")
            if precision.name == "bf16" and not gpu.bf16:
                raise SimError(f"precision bf16: the {name} (cluster {self.cluster.name}) has no bf16 support; "
                               f"use --precision fp16 (with loss scaling) or fp32")
            if precision.name == "fp32" and gpu.peak_fp32_tflops is None:
                raise SimError(f"precision fp32: cluster {self.cluster.name} gives no FP32 rate for the {name}; "
                               f"add peak_fp32_tflops to {where}")

    def default_precision(self) -> tuple[str, str]:
        """bf16 where every simulated GPU supports it, else fp16; and the reason, for the output."""
        types = list(dict.fromkeys(self.device_types))
        gpus = [self.cluster.gpu_types[t] for t in types]
        if all(g.bf16 for g in gpus):
            return "bf16", f"every simulated GPU ({', '.join(types)}) supports bf16"
        lacking = [f"the {g.name} has no bf16" if g.bf16 is False else f"the cluster file does not say whether the "
                   f"{g.name} supports bf16" for g in gpus if not g.bf16]
        return "fp16", "; ".join(lacking)

    def gemm_peaks_D(self, precision: Precision) -> tuple[np.ndarray, np.ndarray]:
        """(GEMM peak, batched-matmul peak of unfused attention) per device for `precision`, FLOP/s; float [D] each.

        Half precision: the FP16/BF16 tensor-core peak for both. fp32: Transformer Engine (the
        --transformer-impl on GPU) runs its GEMMs (projections, MLP, experts, output layer)
        with cuBLASLt's CUBLAS_COMPUTE_32F_FAST_TF32 for fp32 inputs ("default to tf32",
        transformer_engine/common/gemm/cublaslt_gemm.cu), so they run at the TF32 tensor-core
        peak where the GPU has one (Ampere and newer) and at the FP32 peak on Volta / Turing;
        unfused attention's batched matmuls are PyTorch's (baddbmm, bmm), whose
        torch.backends.cuda.matmul.allow_tf32 is off by default and set by neither
        Megatron-Core nor this project, so they run at the FP32 peak. The kernel efficiencies
        apply unchanged (an assumption: large cuBLAS TF32 and FP32 GEMMs reach a similar
        fraction of their peaks as FP16 ones). Validates the precision first (`check_precision`).
        """
        self.check_precision(precision)
        if precision.half:
            return self.peak_flops_D, self.peak_flops_D
        return np.where(np.isnan(self.tf32_peak_D), self.fp32_peak_D, self.tf32_peak_D), self.fp32_peak_D

    def fused_attention_D(self, precision: Precision) -> np.ndarray:
        """Whether fused (flash) attention runs on each device in `precision`; bool [D].

        FlashAttention-2 and cuDNN's fused attention take fp16 / bf16 inputs only; in fp32
        Transformer Engine falls back to unfused attention (and Megatron-Core's local attention
        is always unfused).
        """
        return self.flash_D & precision.half

    def scoreless_attention_D(self, precision: Precision) -> np.ndarray:
        """Whether attention on each device keeps no [s, s] scores for the backward; bool [D]:
        fused (flash) attention in half precision, or the memory-efficient kernel where the
        cluster file says the systems run it (xFormers' CUTLASS kernel and PyTorch SDPA's
        efficient backend take fp16 and fp32, so in any precision). The memory-efficient
        kernel's time is the unfused path's: xFormers reports no speedup over the unfused
        attention on V100 (facebookresearch/xformers#762) and, on A100, a backward 55% slower
        than FlashAttention's (#362), so only its memory is modelled."""
        return self.fused_attention_D(precision) | self.memory_efficient_D


# ---------------------------------------------------------------------------------------------
# Workload: what one device computes per iteration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Workload:
    """The model and the batch one training iteration processes on D data-parallel devices."""

    model: ModelConfig
    """The model (Megatron-LM flag names)."""
    num_devices: int
    """D: every device is a data-parallel rank and an expert-parallel rank."""
    micro_batch_size: int
    """Sequences per device per iteration (no gradient accumulation)."""
    seq_length: int
    """Tokens per sequence."""
    precision: Precision = Precision("bf16")
    """Number formats of weights, gradients, tokens and activations (`Precision`)."""
    recompute: str = "none"
    """Activation recompute: "none", "selective" (core attention) or "full" (every transformer
    layer, one checkpoint each: Megatron's --recompute-method uniform --recompute-num-layers 1)."""

    def __post_init__(self) -> None:
        if self.model.num_experts is None:
            raise SimError("the model config has num_experts = None; the simulator needs an MoE model")
        if not isinstance(self.precision, Precision):
            raise SimError(f"precision must be a Precision, got {self.precision!r}")
        if self.recompute not in RECOMPUTE:
            raise SimError(f"recompute {self.recompute!r} is unknown; valid: {', '.join(RECOMPUTE)}")
        for name in ("num_devices", "micro_batch_size", "seq_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise SimError(f"{name} must be a positive integer, got {value!r}")

    @property
    def tokens_per_device(self) -> int:
        """Tokens each device embeds and runs attention on: micro_batch_size x seq_length."""
        return self.micro_batch_size * self.seq_length

    @property
    def routed_tokens_per_layer(self) -> int:
        """Tokens routed to experts per MoE layer over all devices: D x tokens x top-k."""
        return self.num_devices * self.tokens_per_device * self.model.moe_router_topk

    @property
    def expert_params(self) -> int:
        """Parameters of one expert."""
        return expert_parameter_count(self.model)

    @property
    def byte_model(self) -> ByteModel:
        """Expert and token sizes for the placement engine in the workload's precision: weights,
        gradients and optimizer state per parameter, tokens of hidden_size elements."""
        p = self.precision
        return ByteModel(
            params_per_expert=self.expert_params,
            weight_bytes_per_param=p.element_bytes,
            grad_bytes_per_param=p.grad_bytes_per_param,
            optimizer_bytes_per_param=p.optimizer_bytes_per_param,
            token_bytes=p.element_bytes * self.model.hidden_size,
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Transformer layer index of every MoE layer, ascending (trace layer k is moe_layers[k])."""
        return tuple(i for i, moe in enumerate(self.model.moe_layer_pattern) if moe)

    def dense_params(self) -> dict[str, int]:
        """Non-expert parameters: per transformer layer ("per_layer", a list) and the rest ("outer":
        embeddings, output layer, final norm, BERT heads)."""
        m = self.model
        counts = count_parameters(m)
        h = m.hidden_size
        norm = 2 * h if m.normalization == "LayerNorm" else h
        per_layer = []
        attention = counts["attention"] // m.num_layers
        router = m.num_experts * h + (m.num_experts if m.add_bias_linear else 0)
        dense_layers = m.num_layers - m.num_moe_layers
        dense_mlp = counts["dense_mlp"] // dense_layers if dense_layers else 0
        for moe in m.moe_layer_pattern:
            per_layer.append(attention + 2 * norm + (router if moe else dense_mlp))
        outer = counts["total"] - counts["experts"] - sum(per_layer)
        return {"per_layer": per_layer, "outer": outer}


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------


class ComputeModel:
    """Forward and backward time of every kernel class on every device.

    Backward costs twice the forward FLOPs and bytes (a GEMM's input gradient and weight
    gradient are each a GEMM of the forward's size) except fused attention, whose backward
    recomputes the scores: 2.5x the forward FLOPs (FlashAttention-2's count). Activation
    recompute adds forward work to the backward; the schedules add it (`core_attention_fwd_D`
    for selective recompute, a whole layer's forward for full recompute).

    Memory-bound work moves elements of the workload's precision (`Precision.element_bytes`);
    the loss's softmax is fp32 in every precision. GEMM rates follow `Hardware.gemm_peaks_D`;
    `peak_flops_D` is the GEMM peak per device in the workload's precision (FLOP/s, float [D]).
    """

    BACKWARD = BACKWARD_OVER_FORWARD
    """Backward over forward time of GEMM work (`placement.fssdp.BACKWARD_OVER_FORWARD`)."""
    FLASH_BACKWARD = 2.5
    SCORE_PASSES = 4
    """Passes over the s x s score matrix per head in unfused attention forward: QK^T writes it,
    the softmax reads and writes it, the AV GEMM reads it."""
    ELEMENTWISE_ELEMENTS_PER_HIDDEN = 16
    """Elements moved per token and hidden unit by a layer's element-wise work in forward (32 B
    in bf16): two norms (read + write: 4), two residual adds (read 2, write 1: 6), two
    bias/dropout passes (read, write, mask: ~6)."""
    PERMUTE_ELEMENTS_PER_HIDDEN = 4
    """Elements moved per routed token and hidden unit to permute tokens into expert order and
    back (read + write, twice)."""
    LOSS_BYTES_PER_VOCAB = 12
    """Bytes per token and vocabulary entry of the fp32 softmax cross-entropy (3 passes x 4 B)."""

    def __init__(self, workload: Workload, hardware: Hardware, efficiency: KernelEfficiency) -> None:
        if workload.num_devices != hardware.num_devices:
            raise SimError(f"workload has {workload.num_devices} devices, hardware {hardware.num_devices}")
        self.workload = workload
        self.hw = hardware
        self.eff = efficiency
        self.peak_flops_D, bmm_peak_D = hardware.gemm_peaks_D(workload.precision)
        self._element = float(workload.precision.element_bytes)
        self._fused_D = hardware.fused_attention_D(workload.precision)
        self._gemm_rate_D = self.peak_flops_D * efficiency.dense_gemm
        self._bmm_rate_D = bmm_peak_D * efficiency.dense_gemm
        self._mem_rate_D = hardware.hbm_bw_D * efficiency.memory

    def _roofline(self, flops: float, bytes_: float) -> np.ndarray:
        """max(FLOPs at the dense GEMM rate, bytes at the memory rate) per device; float [D]."""
        return np.maximum(flops / self._gemm_rate_D, bytes_ / self._mem_rate_D)

    def _attention_parts_D(self) -> tuple[np.ndarray, np.ndarray]:
        """(projections, core attention) forward time of one layer per device; float [D] each."""
        m, n = self.workload.model, self.workload.tokens_per_device
        s, h = self.workload.seq_length, m.hidden_size
        q_width = m.num_attention_heads * m.kv_channels
        kv_width = 2 * m.query_groups * m.kv_channels
        projections = (2.0 * n * h * (q_width + kv_width) + 2.0 * n * q_width * h) / self._gemm_rate_D
        core_full = 4.0 * n * s * q_width  # QK^T and AV over all s keys, per token
        causal = m.model_family == "gpt"  # fused kernels skip the masked half; unfused ones compute it
        flash_core = core_full * (0.5 if causal else 1.0) / (self.peak_flops_D * self.eff.flash_attention)
        score_bytes = n * m.num_attention_heads * s * self._element * self.SCORE_PASSES
        unfused_core = np.maximum(core_full / self._bmm_rate_D, score_bytes / self._mem_rate_D)
        return projections, np.where(self._fused_D, flash_core, unfused_core)

    def attention_fwd_D(self) -> np.ndarray:
        """One layer's attention block forward (QKV, core attention, output projection) per device; float [D]."""
        projections, core = self._attention_parts_D()
        return projections + core

    def attention_bwd_D(self) -> np.ndarray:
        """One layer's attention block backward per device, without recompute; float [D]."""
        projections, core = self._attention_parts_D()
        return self.BACKWARD * projections + np.where(self._fused_D, self.FLASH_BACKWARD, self.BACKWARD) * core

    def core_attention_fwd_D(self) -> np.ndarray:
        """One layer's core attention forward (QK^T, softmax, AV, or the fused kernel) per device;
        float [D]. Selective recompute runs it once more in the backward: Megatron-Core checkpoints
        core attention whenever "core_attn" is among the recompute modules, fused kernel or not
        (Attention.checkpoint_core_attention)."""
        return self._attention_parts_D()[1]

    def other_fwd_D(self, moe: bool) -> np.ndarray:
        """One layer's non-attention, non-expert forward per device: norms, residuals, and the
        gate plus token permutation (MoE layer) or the dense MLP (dense layer); float [D]."""
        m, n = self.workload.model, self.workload.tokens_per_device
        h, e = m.hidden_size, self._element
        t = self._roofline(0.0, n * h * self.ELEMENTWISE_ELEMENTS_PER_HIDDEN * e)
        if moe:
            gate = self._roofline(2.0 * n * h * m.num_experts, e * n * h)
            permute = self._roofline(0.0, n * m.moe_router_topk * h * self.PERMUTE_ELEMENTS_PER_HIDDEN * e)
            return t + gate + permute
        ffn = m.ffn_hidden_size
        fc1_out = 2 * ffn if m.swiglu else ffn
        mlp = self._roofline(2.0 * n * h * (fc1_out + ffn), n * 2.0 * (fc1_out + ffn) * e)
        return t + mlp

    def head_fwd_D(self) -> np.ndarray:
        """Embedding lookup, final norm, output projection and loss forward per device; float [D]."""
        m, n = self.workload.model, self.workload.tokens_per_device
        vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
        projection = 2.0 * n * m.hidden_size * vocab / self._gemm_rate_D
        loss = n * vocab * self.LOSS_BYTES_PER_VOCAB / self._mem_rate_D
        return projection + loss

    def expert_fwd(self, tokens_ED: np.ndarray) -> np.ndarray:
        """Expert forward time per device for tokens per (expert, device); float [..., D].

        Accepts any leading shape [..., E, D]. Per expert with n > 0 tokens on a device: a
        launch overhead, max(GEMM time at efficiency expert_gemm x n / (n + n_half), time to
        stream the expert's weights), and the activation function's memory traffic (read the
        fc1 output, write its activation: 2 f elements, 3 f with swiglu's two halves).
        """
        m = self.workload.model
        n = np.asarray(tokens_ED, dtype=np.float64)
        P = float(self.workload.expert_params)
        peak = self.peak_flops_D * self.eff.expert_gemm
        # 2P n FLOP at efficiency n / (n + n_half) is 2P (n + n_half) FLOP at full efficiency
        gemm = 2.0 * P * (n + self.eff.expert_half_tokens) / peak
        weights = self._element * P / self._mem_rate_D
        act_bytes_per_token = (3.0 if m.swiglu else 2.0) * m.moe_ffn_hidden_size * self._element
        act = n * act_bytes_per_token / self._mem_rate_D
        per_expert = np.where(n > 0, self.eff.kernel_launch_s + np.maximum(gemm, weights) + act, 0.0)
        return per_expert.sum(axis=-2)

    def expert_instance_overhead_s(self) -> float:
        """What `expert_fwd` charges an instance beyond its tokens' FLOPs, forward and backward
        (x (1 + BACKWARD), as the backward's two GEMMs), on the slowest device: the launch and the larger of
        the small-batch GEMM inefficiency (n_half tokens' FLOPs) and streaming the weights (for
        FSSDP's cost model, which prices tokens at the full-efficiency FLOP rate)."""
        P = float(self.workload.expert_params)
        gemm = 2.0 * P * self.eff.expert_half_tokens / (self.peak_flops_D * self.eff.expert_gemm)
        weights = self._element * P / self._mem_rate_D
        return float(np.max((1.0 + self.BACKWARD) * (self.eff.kernel_launch_s + np.maximum(gemm, weights))))

    def optimizer_D(self, params_D) -> np.ndarray:
        """Adam step time per device for the parameters it updates; float [D]."""
        step_bytes = self.workload.precision.optimizer_step_bytes_per_param
        return np.asarray(params_D, dtype=np.float64) * step_bytes / self._mem_rate_D


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------


class CommModel:
    """Time of a collective from the bytes every device sends and receives (see module docstring)."""

    def __init__(self, hardware: Hardware, links: LinkParameters) -> None:
        self.hw = hardware
        self.links = links
        D, N = hardware.num_devices, hardware.nic_bw_N.size
        self._node_DN = np.zeros((D, N))
        self._node_DN[np.arange(D), hardware.node_of_D] = 1.0
        self._intra_D = hardware.intra_bw_D * links.intra_efficiency
        self._nic_N = hardware.nic_bw_N * links.inter_efficiency

    def transfer_time(self, sent_intra, sent_inter, recv_intra, recv_inter, steps=1) -> np.ndarray:
        """Seconds of collectives given per-device bytes, each array of shape [..., D].

        latency x steps + max(device intra-node out / in over its link, node NIC out / in over
        the NIC). The latency is the inter-node one when any byte crosses nodes, the intra-node
        one when bytes move only inside nodes, and 0 when nothing moves. Returns shape [...].
        """
        latency, intra, nic = self.transfer_parts(sent_intra, sent_inter, recv_intra, recv_inter, steps)
        return latency + np.maximum(intra, nic)

    def transfer_parts(self, sent_intra, sent_inter, recv_intra, recv_inter, steps=1):
        """The three terms of `transfer_time`, each of shape [...]: (latency x steps, the busiest
        device's intra-node link time, the busiest node's NIC time). The collective takes the
        latency plus the larger of the other two: the breakdown reports them to show which link
        bounds it."""
        sent_intra, sent_inter, recv_intra, recv_inter = (
            np.asarray(x, dtype=np.float64) for x in (sent_intra, sent_inter, recv_intra, recv_inter)
        )
        intra = np.maximum(sent_intra, recv_intra) / self._intra_D
        nic = np.maximum(sent_inter @ self._node_DN, recv_inter @ self._node_DN) / self._nic_N
        crosses = sent_inter.sum(axis=-1) > 0
        moves = crosses | (sent_intra.sum(axis=-1) > 0)
        latency = np.where(crosses, self.links.inter_latency_s, np.where(moves, self.links.intra_latency_s, 0.0))
        return latency * steps, intra.max(axis=-1), nic.max(axis=-1)

    def time(self, comm: CommBytes, steps=1) -> float:
        """Seconds of one collective moving `comm`."""
        t = self.transfer_time(comm.sent_intra_D, comm.sent_inter_D, comm.recv_intra_D, comm.recv_inter_D, steps)
        return float(t)

    def nic_seconds(self, comm: CommBytes) -> float:
        """Seconds the busiest node's NIC carries `comm` at its full rate (`transfer_parts`' NIC term)."""
        return float(self.transfer_parts(comm.sent_intra_D, comm.sent_inter_D, comm.recv_intra_D,
                                         comm.recv_inter_D)[2])

    def dense_allreduce(self, buffer_bytes: float) -> tuple[CommBytes, float]:
        """An all-reduce of `buffer_bytes` over all devices and its time: the ring's transfers
        (the placement engine's `all_ranks_allreduce_bytes`) and NCCL's latency-bound steps
        (`all_ranks_allreduce_steps`), each paying the latency."""
        comm = all_ranks_allreduce_bytes(buffer_bytes, self.hw.topology)
        return comm, self.time(comm, steps=all_ranks_allreduce_steps(self.hw.topology))


def all_ranks_allreduce_steps(topology: Topology) -> int:
    """Latency-bound steps of an all-reduce over every device as NCCL runs it: the fewer of its
    ring's, 2 (D - 1), and its double binary tree's (NCCL 2.4 on: a chain through each node's g
    GPUs and binary trees over the N nodes, walked up by the reduce and down by the broadcast),
    2 (g - 1 + ceil(log2 N)). The trees keep the ring's full bandwidth (NVIDIA, "Massively Scale
    Your Deep Learning Training with NCCL 2.4", 2019), so the ring's bytes stand for both. At
    2 nodes of 1 GPU both are 2 steps; at 256 nodes of 8 the ring's 4,094 steps, 102 ms at 25 us
    each for every dense gradient bucket, made 2,048 GPUs look latency-bound (until 2026-12-01)."""
    D, N, g = topology.num_devices, int(topology.nodes), topology.devices_per_node
    tree = 2 * (g - 1 + (N - 1).bit_length())  # (N - 1).bit_length() = ceil(log2 N)
    return max(min(2 * (D - 1), tree), 1)


def all_to_all_bytes(plans, topology: Topology, token_bytes: float) -> np.ndarray:
    """Per-device bytes of the dispatch all-to-alls of several layers' plans; float [L, 4, D].

    Rows: sent intra-node, sent inter-node, received intra-node, received inter-node: the
    accounting's `dispatch_bytes` of each plan (tokens kept on their source are free), which
    fssdp's compact plans answer without their entries (`DispatchPlan.link_tokens`). At 1,024
    devices the dense [S, D] traffic this was computed from before cost 20 ms a layer, most of
    a simulated iteration (Qwen3-30B-A3B on 1,024 H100s)."""
    rows = [dispatch_bytes(plan, topology, token_bytes) for plan in plans]
    return np.array([[c.sent_intra_D, c.sent_inter_D, c.recv_intra_D, c.recv_inter_D] for c in rows], dtype=np.float64)


def ring_broadcast_bytes(holds_RD, root_R, buffer_bytes, topology: Topology) -> CommBytes:
    """Bytes of pipelined ring broadcasts (NCCL's algorithm), one per row.

    Row r broadcasts a buffer from device root_R[r] to every device d with holds_RD[r, d]: the
    holders, in ascending id order (node-major, so a ring crosses each node boundary once),
    form a ring rotated to start at the root, and the buffer travels over its k - 1 edges
    root -> next -> ... (each holder receives it once and forwards it once, the last one only
    receives). A ring reduce to the root moves the same bytes backwards: `.reversed()`. The
    total equals k - 1 point-to-point copies from the root; only the links that carry them differ.

    Args:
        holds_RD: bool [rows, D]; every row's root must be among its holders.
        root_R: int [rows].
        buffer_bytes: bytes per row's buffer: a number or float [rows].
        topology: the devices.
    """
    holds = np.asarray(holds_RD, dtype=bool)
    root = np.asarray(root_R, dtype=np.int64)
    rows, D = holds.shape
    if not np.all(holds[np.arange(rows), root]):
        raise SimError("ring_broadcast_bytes: every root must be one of its row's holders")
    size_R = np.broadcast_to(np.asarray(buffer_bytes, dtype=np.float64), (rows,))
    r_H, d_H = np.nonzero(holds)  # row-major, devices ascending within a row
    k_R = holds.sum(axis=1)
    start_R = np.cumsum(k_R) - k_R
    pos_H = np.arange(r_H.size) - start_R[r_H]
    root_pos_R = np.cumsum(holds, axis=1)[np.arange(rows), root] - 1  # root's position in its ring
    # ring position relative to the root: 0 = root, k - 1 = the last receiver
    rel_H = (pos_H - root_pos_R[r_H]) % k_R[r_H]
    sends = rel_H < k_R[r_H] - 1
    nxt_H = d_H[start_R[r_H] + (pos_H + 1) % k_R[r_H]]
    return CommBytes.from_transfers(d_H[sends], nxt_H[sends], size_R[r_H[sends]], topology)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryNeed:
    """What the tightest device of one role needs with balanced loads, by part, against its memory."""

    what: str
    """Who needs it, e.g. "EP" or "zebra (expert ranks)"."""
    gpu: str
    """GPU type of the tightest device."""
    parts: dict[str, float]
    """Bytes by part (weights/gradients/optimizer, experts, activations, reserve, ...)."""
    capacity: float
    """The device's memory, bytes."""

    @property
    def need(self) -> float:
        """Total bytes."""
        return float(sum(self.parts.values()))

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity

    def describe(self) -> str:
        """e.g. "EP needs 17.9 GB per device (experts 2.8 GB, ...); a V100-SXM2-16GB has 16 GB"."""
        parts = ", ".join(f"{name} {value / 1e9:.1f} GB" for name, value in self.parts.items())
        return (f"{self.what} needs {self.need / 1e9:.1f} GB per device ({parts}); a {self.gpu} has "
                f"{self.capacity / 1e9:.0f} GB")


class MemoryModel:
    """Bytes resident on each device at the peak of an iteration (end of the forward pass).

    Weights, gradients and optimizer state follow the workload's `Precision`; activations follow
    its precision and its activation recompute (`activation_bytes`).
    """

    RESERVED_BYTES = 1.5e9
    """Default reserve: CUDA context (~0.3-0.5 GB), NCCL buffers, cuBLAS workspaces and
    allocator fragmentation."""

    def __init__(self, workload: Workload, hardware: Hardware, reserved_bytes: float = RESERVED_BYTES) -> None:
        self.workload = workload
        self.hw = hardware
        self.reserved_bytes = float(reserved_bytes)
        self._element = float(workload.precision.element_bytes)
        self._scoreless_D = hardware.scoreless_attention_D(workload.precision)

    def dense_parts(self, optimizer_ranks: int | None = None) -> dict[str, float]:
        """Non-expert parameters' bytes on one device: {"parameters", "gradients", "optimizer
        state"}; weights and gradients on every device, optimizer state sharded over
        `optimizer_ranks` (default: the D data-parallel ranks, as the distributed optimizer shards it)."""
        dense = self.workload.dense_params()
        params = sum(dense["per_layer"]) + dense["outer"]
        b = self.workload.byte_model
        ranks = self.workload.num_devices if optimizer_ranks is None else optimizer_ranks
        return {"parameters": params * b.weight_bytes_per_param, "gradients": params * b.grad_bytes_per_param,
                "optimizer state": params * b.optimizer_bytes_per_param / ranks}

    def by_part(self, dense: dict, expert_params, expert_optimizer_params, activations) -> dict[str, np.ndarray]:
        """A device's bytes by part, parameters, gradients and optimizer state apart for the dense
        model and for the experts, plus activations and the reserve; arrays broadcast alike.

        dense: `dense_parts()` (or zeros where a device holds no dense model); expert_params:
        parameters of the expert instances the device holds, owned or copies (weights and
        gradients); expert_optimizer_params: those whose optimizer state it keeps.
        """
        b = self.workload.byte_model
        experts = np.asarray(expert_params, dtype=np.float64)
        optimizer = np.asarray(expert_optimizer_params, dtype=np.float64)
        acts = np.asarray(activations, dtype=np.float64)
        zero = np.zeros(np.broadcast_shapes(experts.shape, optimizer.shape, acts.shape))
        return {
            "dense parameters": zero + dense["parameters"],
            "dense gradients": zero + dense["gradients"],
            "dense optimizer state": zero + dense["optimizer state"],
            "expert parameters": zero + experts * b.weight_bytes_per_param,
            "expert gradients": zero + experts * b.grad_bytes_per_param,
            "expert optimizer state": zero + optimizer * b.optimizer_bytes_per_param,
            "activations": zero + acts,
            "reserve": zero + self.reserved_bytes,
        }

    def dense_bytes(self) -> float:
        """Non-expert parameters: weights and gradients on every device, optimizer state sharded
        over the D data-parallel ranks by the distributed optimizer (`dense_parts` summed)."""
        return float(sum(self.dense_parts().values()))

    def layer_bytes_per_token_D(self) -> tuple[np.ndarray, np.ndarray]:
        """(attention block + norms, the attention scores among them) that one layer keeps per
        token without recompute, bytes; float [D] each.

        Korthikanti et al. Table 2 with e-byte elements and 1-byte dropout masks (e = 2 gives
        the paper's figures): attention (5 e + 1) h (QKV input, Q and K, V, projection input,
        dropout mask: 11 h at e = 2) plus the scores (2 e + 1) a s (softmax output, its dropout
        mask and output: 5 a s at e = 2), norms 2 e h (4 h). Fused attention keeps no scores
        (O(1) statistics per row), and runs only in half precision (`Hardware.fused_attention_D`);
        nor does a memory-efficient kernel where the cluster file has one
        (`Hardware.scoreless_attention_D`).
        """
        m = self.workload.model
        e, h, a, s = self._element, m.hidden_size, m.num_attention_heads, self.workload.seq_length
        scores_D = np.where(self._scoreless_D, 0.0, (2.0 * e + 1.0) * a * s)
        return (7.0 * e + 1.0) * h + scores_D, scores_D

    def dense_mlp_bytes_per_token(self) -> float:
        """A dense layer's MLP activations per token: (9 e + 1) h for a 4h MLP (input e h, fc1 and
        GeLU outputs 4 e h each, dropout mask h: 19 h at e = 2, Korthikanti Table 2), scaled by
        ffn / 4h (x 1.5 with swiglu's doubled fc1)."""
        m = self.workload.model
        h = m.hidden_size
        return (9.0 * self._element + 1.0) * h * m.ffn_hidden_size / (4 * h) * (1.5 if m.swiglu else 1.0)

    def input_bytes(self, tokens) -> np.ndarray:
        """What a checkpointed layer keeps under full recompute: its input, e h bytes per token."""
        return np.asarray(tokens, dtype=np.float64) * self._element * self.workload.model.hidden_size

    def kept_activation_bytes(self, full_UD, scores_UD, inputs_UD, repeats: int = 1) -> np.ndarray:
        """Activation bytes kept for the backward under the workload's recompute; float [..., D].

        The units (axis -2) are what one checkpoint covers (a transformer layer, or a layer's
        part on one zebra role for one micro-batch), each occurring `repeats` times; per unit
        its activations without recompute (full), the attention scores among them, and its
        input. Korthikanti et al. section 4 (memory) and Megatron-Core's recompute:
        - none: every unit keeps everything: repeats x sum(full);
        - selective: core attention is recomputed, so the scores are not kept:
          repeats x sum(full - scores) (the same as none where fused attention keeps no scores);
        - full: every unit keeps only its input, and the backward of one unit at a time holds
          that unit's recomputed activations: repeats x sum(inputs) + max(full). The recomputed
          unit keeps its scores, so with unfused attention at long sequences full recompute can
          need more than selective.
        Inputs broadcast against full_UD.
        """
        full_UD = np.asarray(full_UD, dtype=np.float64)
        recompute = self.workload.recompute
        if recompute == "none":
            return repeats * full_UD.sum(axis=-2)
        if recompute == "selective":
            return repeats * (full_UD - np.broadcast_to(scores_UD, full_UD.shape)).sum(axis=-2)
        return repeats * np.broadcast_to(inputs_UD, full_UD.shape).sum(axis=-2) + full_UD.max(axis=-2)

    def activation_bytes(self, processed_tokens_LD) -> np.ndarray:
        """Activations kept for the backward per device; float [..., D] for tokens [..., L, D].

        One unit per transformer layer (`kept_activation_bytes`): n tokens x
        `layer_bytes_per_token_D`, plus the experts' activations of the tokens the device
        processes in that layer (MoE layer, `expert_activation_bytes`) or the dense MLP's
        (`dense_mlp_bytes_per_token`); its input is n e h. Plus the fp32 logits of the loss
        (4 V per token), which no recompute covers.
        """
        m, n = self.workload.model, self.workload.tokens_per_device
        layer_D, scores_D = self.layer_bytes_per_token_D()
        experts_LD = self.expert_activation_bytes(processed_tokens_LD)
        mlp_D = np.full_like(layer_D, n * self.dense_mlp_bytes_per_token())
        moe_index = {j: k for k, j in enumerate(self.workload.moe_layers)}
        units = [experts_LD[..., moe_index[j], :] if j in moe_index else mlp_D for j in range(m.num_layers)]
        full_JD = n * layer_D + np.stack(np.broadcast_arrays(*units), axis=-2)
        kept = self.kept_activation_bytes(full_JD, n * scores_D, self.input_bytes(n))
        return kept + self.logits_bytes(n)

    def logits_bytes(self, tokens: float) -> float:
        """The fp32 logits the loss keeps for `tokens` tokens (4 B per vocabulary entry)."""
        m = self.workload.model
        return 4.0 * tokens * padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)

    def expert_activation_bytes(self, routed_tokens) -> np.ndarray:
        """Activations of `routed_tokens` processed by experts (any shape), without recompute:
        input e h, fc1 and activation outputs 2 e f (3 e f with swiglu) per token (2 h + 4 f at
        e = 2)."""
        m = self.workload.model
        per_token = self._element * (m.hidden_size + (3.0 if m.swiglu else 2.0) * m.moe_ffn_hidden_size)
        return np.asarray(routed_tokens, dtype=np.float64) * per_token

    def expert_bytes_per_instance(self, with_optimizer: bool) -> float:
        """One expert's weights and gradients, plus its optimizer state when it owns one
        (bytes per parameter from the placement engine's ByteModel)."""
        b = self.workload.byte_model
        per_param = b.weight_bytes_per_param + b.grad_bytes_per_param
        if with_optimizer:
            per_param += b.optimizer_bytes_per_param
        return self.workload.expert_params * per_param

    def free_bytes_D(self, expert_instances_D, processed_tokens_LD) -> np.ndarray:
        """Device memory left after the dense model, owned experts (with optimizer state),
        activations and the reserve; float [D] (negative when over budget)."""
        used = (
            self.dense_bytes()
            + np.asarray(expert_instances_D, dtype=np.float64) * self.expert_bytes_per_instance(True)
            + self.activation_bytes(processed_tokens_LD)
            + self.reserved_bytes
        )
        return self.hw.memory_D - used
