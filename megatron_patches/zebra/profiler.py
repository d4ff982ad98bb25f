"""Zebra profiler: per-micro-batch times and memory of one device type, for Asym-EA (DESIGN 4.8).

One run measures one device type (``tools/profile_moe.py`` is the command line) and merges a
``DeviceProfile`` into the profile file that ``placement.zebra.load_zebra_profile`` reads. It
builds real Megatron-Core modules from the model config with the same layer spec the training
script uses (``compat.mcore.layer_specs``: local modules on CPU, Transformer Engine on a GPU that
has it), on a world of one process, and times them with the token counts one micro-batch really
brings in zebra mode (DESIGN 4.7):

- An attention rank runs B sequences of S tokens per micro-batch (B = --micro-batch-size, as in
  Megatron: sequences per data-parallel rank and micro-batch), so T = B*S tokens.
- The attention block's gate routes every token to k experts. An expert therefore receives on
  average M*T*k/n tokens per micro-batch (the tokens of all M attention ranks), and an expert rank
  holds n/N experts per layer.

What is timed (forward, then backward; the median over --repeats, after --warmup untimed rounds):

``attention`` (T_A^attn, ``DeviceProfile.t_attention_s``): everything an attention rank computes
    for one layer and one micro-batch: input norm, self-attention (QKV, core attention, output
    projection), bias-dropout-add, pre-MLP norm, the router (gate logits, top-k, probabilities),
    the dispatcher's permutation of tokens and probabilities by expert (what is dispatched), and
    after the combine the un-permutation of the experts' outputs and the bias-dropout-add onto the
    residual (the layer output). The backward starts from the three gradients an attention rank
    holds: of the layer output (from the next layer), and of the dispatched tokens and
    probabilities (returned by the expert ranks). Not timed: the all-to-alls, the rotary table
    (computed once per model forward), the embedding and the head.
``expert`` (T_E, ``DeviceProfile.t_experts_s``): one expert MLP (``megatron.core.transformer.mlp.MLP``
    with ``is_expert=True``: fc1, activation scaled by the routing probability, fc2) on M*T*k/n
    tokens (rounded, at least 1), forward and backward (input, probabilities and weights),
    multiplied by the n/N experts of one expert rank. Megatron's SequentialMLP runs local experts
    one after another, so n/N times one expert is what an expert rank computes.

Memory (bytes, the figures the slots come from; all in ``details`` of the profile file):

- Model states are computed exactly from parameter counts (``numel`` of the built expert; the
  non-expert model from ``config.count_parameters``, exact for Megatron-Core 0.16.1) times the
  bytes per parameter of training with Megatron's DDP and Adam: fp32 4 (weight) + 4 (gradient)
  + 8 (Adam m, v) = 16; bf16/fp16 2 + 4 (fp32 main gradient) + 12 (fp32 master weight, m, v) = 18.
  No distributed optimizer is assumed.
- Activations are the bytes of the distinct storages autograd saves for the backward during one
  forward (``torch.autograd.graph.saved_tensors_hooks``), parameters, the attention mask and the
  rotary table excluded (those are held once, not per layer and micro-batch). On a GPU the bytes
  the forward leaves allocated are measured too (``torch.cuda.memory_allocated``) and the larger
  of both is used, since fused kernels may keep tensors outside autograd's saved tensors; the
  peak during forward + backward above both gives the transient workspace. On CPU the transient
  workspace is not measurable and counts as 0.
- The head's activations (final output layer logits and the cross entropy, one micro-batch: an
  attention rank runs the head's forward and backward back to back) are measured the same way.
- Capacity: --memory-gb, or the device's: free GPU memory after CUDA initialisation, or the
  machine's physical memory on CPU.

Slots (``DeviceProfile.expert_slots_as_*``): one slot is one expert of one layer with its
state and the activations of all R micro-batches (the zig-zag schedule runs every layer's forward
for all micro-batches before the backward). Expert GPU: (capacity - transient) // slot. Attention
GPU: (capacity - non-expert states - L*R attention activations - head activations - transient)
// slot, at least 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from megatron_patches.config.models import ModelConfig, count_parameters, padded_vocab_size
from megatron_patches.config.run import ParallelConfig, RunSettings, router_pre_softmax
from megatron_patches.placement.zebra import PROFILE_FORMAT, DeviceProfile, ZebraShape, save_device_profile

__all__ = [
    "DEVICES",
    "DTYPES",
    "ROLES",
    "AttentionBlock",
    "DeviceMeasurement",
    "PartTiming",
    "ProfileError",
    "ProfileRequest",
    "SavedBytes",
    "bytes_per_parameter",
    "check_profile_file",
    "megatron_session",
    "profile_device",
    "transformer_config",
    "write_profile",
]

DEVICES = ("cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROLES = ("attention", "expert", "both")
"""--role: which role's figures to measure. "expert" skips the attention block (an expert GPU
need not be able to run it); "attention" still times the experts, since T_E^attn is measured on
the attention GPU."""


class ProfileError(ValueError):
    """A profiler request that cannot be measured; the message names the flag, the value and what is valid."""


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProfileError(f"{name}={value!r} is invalid; expected an integer >= {minimum}")


@dataclass(frozen=True)
class ProfileRequest:
    """What to measure: the model, the zebra group shape, the micro-batch and the device.

    Field names follow the flags of tools/profile_moe.py; ``__post_init__`` checks every value
    before any work and raises ProfileError naming the flag.
    """

    model: ModelConfig
    """The model (configs/models/*.yaml); every layer must be MoE."""
    attention_ranks: int
    """M (--attention-ranks): attention ranks per ZP group."""
    expert_ranks: int
    """N (--expert-ranks): expert ranks per ZP group; must divide the expert count."""
    microbatches: int
    """R (--microbatches): micro-batches per iteration; their activations are alive together."""
    seq_length: int
    """S (--seq-length): tokens per sequence; at most the model's max_position_embeddings."""
    micro_batch_size: int
    """B (--micro-batch-size): sequences per attention rank and micro-batch."""
    device: str
    """--device: "cpu" or "cuda" (the current CUDA device)."""
    device_type: str
    """--device-type: the name the profile is stored under, as the cluster config's gpu_types spell it."""
    role: str = "both"
    """--role: "attention", "expert" or "both" (see ROLES)."""
    dtype: str = "fp32"
    """--dtype: parameter and activation dtype, a key of DTYPES."""
    repeats: int = 5
    """--repeats: timed rounds per part; the median is reported."""
    warmup: int = 2
    """--warmup: untimed rounds before them (allocator, kernel selection, caches)."""
    memory_bytes: int | None = None
    """--memory-gb x 1e9: the memory budget of one device; None = the device's own (see module doc)."""
    seed: int = 1234
    """Seed of the weights and the synthetic inputs."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ProfileError(f"model must be a ModelConfig, got {type(self.model).__name__}")
        if self.model.num_experts is None:
            raise ProfileError("--model-config describes a dense model (num_experts is null); zebra needs an MoE model")
        if self.model.num_moe_layers != self.model.num_layers:
            raise ProfileError(
                f"--model-config has {self.model.num_moe_layers} MoE layers of {self.model.num_layers} "
                f"(moe_layer_freq={self.model.moe_layer_freq!r}); the profile prices every layer as MoE (the dense "
                f"layers zebra trains on its attention ranks are not in its cost model yet); valid: moe_layer_freq 1"
            )
        for field_name, what in (("moe_shared_expert_intermediate_size", "a shared expert"),
                                 ("multi_latent_attention", "multi-latent attention"),
                                 ("mtp_num_layers", "multi-token prediction layers")):
            value = getattr(self.model, field_name)
            if value:
                raise ProfileError(
                    f"--model-config has {what} ({field_name}={value!r}); the profile times Megatron's standard "
                    f"attention block and the routed experts only, so it would price {what} as free (zebra trains "
                    f"it, its cost model does not have it yet); valid: a model without it")
        for name in ("attention_ranks", "expert_ranks", "microbatches", "seq_length", "micro_batch_size",
                     "repeats"):
            _check_int(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        _check_int("--warmup", self.warmup, 0)
        n, big_n, m = self.model.num_experts, self.expert_ranks, self.attention_ranks
        if n % big_n:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ProfileError(
                f"--expert-ranks={big_n} does not divide the model's {n} experts; valid: {divisors}"
            )
        if m % big_n and big_n % m:
            raise ProfileError(
                f"--attention-ranks={m} and --expert-ranks={big_n}: Asym-EA, which the profile is for, "
                "needs M to divide N or N to divide M"
            )
        limit = self.model.max_position_embeddings
        if self.seq_length > limit:
            raise ProfileError(
                f"--seq-length={self.seq_length} exceeds the model's max_position_embeddings={limit}; "
                f"valid: 1..{limit}"
            )
        if self.device not in DEVICES:
            raise ProfileError(f"--device={self.device!r} is invalid; valid: {list(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ProfileError("--device=cuda, but no CUDA device is available; use --device cpu")
        if self.device == "cpu" and torch.cuda.is_available():
            raise ProfileError(
                "--device=cpu while CUDA is available: Megatron's CPU shims would change GPU behaviour; "
                "hide the GPUs (CUDA_VISIBLE_DEVICES=) to profile the CPU"
            )
        if not isinstance(self.device_type, str) or not self.device_type.strip():
            raise ProfileError(f"--device-type={self.device_type!r} is invalid; expected a non-empty name, "
                               "e.g. the cluster config's GPU type (A40-48GB)")
        if self.role not in ROLES:
            raise ProfileError(f"--role={self.role!r} is invalid; valid: {list(ROLES)}")
        if self.dtype not in DTYPES:
            raise ProfileError(f"--dtype={self.dtype!r} is invalid; valid: {list(DTYPES)}")
        if self.dtype == "fp16" and self.device == "cpu":
            raise ProfileError("--dtype=fp16 needs --device cuda (CPU kernels lack fp16); use fp32 or bf16")
        if self.memory_bytes is not None:
            _check_int("--memory-gb x 1e9 (bytes)", self.memory_bytes, 1)

    @property
    def shape(self) -> ZebraShape:
        """(L, n, M, N) of the profile file."""
        return ZebraShape(self.model.num_layers, self.model.num_experts, self.attention_ranks, self.expert_ranks)

    @property
    def tokens_per_attention_rank(self) -> int:
        """T = B*S: tokens one attention rank runs per micro-batch."""
        return self.micro_batch_size * self.seq_length

    @property
    def mean_tokens_per_expert(self) -> float:
        """M*T*k/n: tokens one expert receives per micro-batch on average (all M attention ranks)."""
        routed = self.attention_ranks * self.tokens_per_attention_rank * self.model.moe_router_topk
        return routed / self.model.num_experts

    @property
    def tokens_per_expert(self) -> int:
        """The mean rounded to whole tokens (at least 1): what the expert is timed with."""
        return max(1, round(self.mean_tokens_per_expert))

    @property
    def experts_per_expert_rank(self) -> int:
        """n/N: experts of one layer on one expert rank."""
        return self.model.num_experts // self.expert_ranks

    def workload(self) -> dict:
        """What the times depend on beyond the shape; equal for every device type of one file."""
        return {
            "model": self.model.to_dict(),
            "seq_length": self.seq_length,
            "micro_batch_size": self.micro_batch_size,
            "microbatches": self.microbatches,
            "dtype": self.dtype,
        }


def bytes_per_parameter(dtype: str) -> int:
    """Weight + gradient + Adam state bytes per parameter under Megatron's DDP and optimizer.

    fp32: 4 + 4 + 8 (m, v). bf16/fp16: 2 + 4 (DDP accumulates gradients in fp32,
    compat.mcore.wrap_ddp) + 12 (fp32 master weight, m, v).
    """
    if dtype not in DTYPES:
        raise ProfileError(f"dtype={dtype!r} is invalid; valid: {list(DTYPES)}")
    return 16 if dtype == "fp32" else 18


# --------------------------------------------------------------------------------------------
# Megatron on a world of one
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def megatron_session(device: str, seed: int) -> Iterator[None]:
    """Megatron-Core ready to build modules in this process: a default process group of one rank
    (created here unless one exists), the compat layer, model parallel state (all sizes 1) and
    seeded RNGs, in the training loop's order. Undone on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_patches.compat import mcore, prepare_megatron

    use_cuda = device == "cuda"
    created = None
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ProfileError(
                f"the profiler runs on one process, but the default process group has "
                f"{dist.get_world_size()} ranks; run tools/profile_moe.py without torchrun"
            )
    else:
        created = tempfile.TemporaryDirectory(prefix="profile_moe_")
        if use_cuda:
            torch.cuda.set_device(torch.cuda.current_device())
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            init_method=f"file://{os.path.join(created.name, 'store')}",
            rank=0,
            world_size=1,
        )
    try:
        if parallel_state.model_parallel_is_initialized():
            raise ProfileError("Megatron's model parallel state is already initialised in this process")
        prepare_megatron(use_cuda)
        mcore.initialize_model_parallel(1, 1, 1, 1)
        try:
            torch.manual_seed(seed)
            mcore.seed_model_parallel_rng(seed)
            yield
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        if created is not None:
            dist.destroy_process_group()
            created.cleanup()


def transformer_config(request: ProfileRequest):
    """The TransformerConfig the training script builds for this model on one rank (TP = PP = EP =
    1), with the training flags' defaults for everything the model config does not set."""
    from megatron_patches.compat import mcore

    run = RunSettings(
        moe_router_pre_softmax=router_pre_softmax(False, request.model.moe_router_topk),
        bf16=request.dtype == "bf16",
        fp16=request.dtype == "fp16",
    )
    return mcore.transformer_config(request.model, ParallelConfig(), run, on_gpu=request.device == "cuda")


# --------------------------------------------------------------------------------------------
# The measured parts
# --------------------------------------------------------------------------------------------


class AttentionBlock(torch.nn.Module):
    """The non-expert part of one MoE transformer layer, as an attention rank runs it.

    Built from the MoE layer spec's own submodules (norms, self-attention, bias-dropout-adds,
    the MoE block's router) plus Megatron's all-to-all token dispatcher for the permutation
    before the dispatch and the un-permutation after the combine; ``dispatch`` and ``combine``
    follow TransformerLayer._forward_attention / _forward_mlp and MoELayer.forward for a layer
    without cross-attention, the all-to-alls left out.
    """

    def __init__(self, config, layer_spec, pg_collection) -> None:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        sub = layer_spec.submodules
        moe = sub.mlp.submodules
        self.config = config
        self.hidden_dropout = config.hidden_dropout
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(sub.input_layernorm, **norm_kwargs)
        self.self_attention = build_module(
            sub.self_attention, config=config, layer_number=1, pg_collection=pg_collection
        )
        self.self_attn_bda = build_module(sub.self_attn_bda)
        self.pre_mlp_layernorm = build_module(sub.pre_mlp_layernorm, **norm_kwargs)
        self.router = moe.router(config=config, pg_collection=pg_collection)
        self.router.set_layer_number(1)
        self.mlp_bda = build_module(sub.mlp_bda)
        experts = config.num_moe_experts
        self.dispatcher = MoEAlltoAllTokenDispatcher(
            experts, list(range(experts)), config=config, pg_collection=pg_collection
        )

    def dispatch(self, hidden_SBH, attention_mask, rotary_pos_emb):
        """Layer input -> (residual, permuted tokens, permuted probabilities): what is dispatched."""
        residual_SBH = hidden_SBH
        attention = self.self_attention(
            self.input_layernorm(hidden_SBH), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        hidden_SBH = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
            attention, residual_SBH, self.hidden_dropout
        )
        normed_SBH = self.pre_mlp_layernorm(hidden_SBH)
        probs_TE, routing_map_TE = self.router(normed_SBH)
        tokens_XH, probs_X = self.dispatcher.dispatch_preprocess(normed_SBH, routing_map_TE, probs_TE)
        return hidden_SBH, tokens_XH, probs_X

    def combine(self, residual_SBH, expert_output_XH):
        """Experts' outputs (permuted order, probabilities already applied) -> layer output."""
        moe_SBH = self.dispatcher.combine_postprocess(expert_output_XH)
        return self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
            (moe_SBH, None), residual_SBH, self.hidden_dropout
        )


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while the context is active.

    Storages of ``excluded`` tensors (parameters, masks, tables held once per model) do not count.
    """

    def __init__(self, excluded: Sequence[torch.Tensor]) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in excluded}
        self._storages: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield

    @property
    def total(self) -> int:
        return sum(self._storages.values())


@dataclass(frozen=True)
class PartTiming:
    """Forward and backward times of one measured part, in seconds (timed rounds only)."""

    forward_s: tuple[float, ...]
    """Each timed round's forward."""
    backward_s: tuple[float, ...]
    """Each timed round's backward."""

    @property
    def forward_median_s(self) -> float:
        return statistics.median(self.forward_s)

    @property
    def backward_median_s(self) -> float:
        return statistics.median(self.backward_s)

    @property
    def median_s(self) -> float:
        """Median of forward + backward per round."""
        return statistics.median(f + b for f, b in zip(self.forward_s, self.backward_s))


@dataclass(frozen=True)
class PartMemory:
    """What one forward of a part keeps for its backward, and its transient peak, in bytes."""

    saved_bytes: int
    """Distinct storages autograd saved (SavedBytes)."""
    retained_bytes: int | None
    """GPU: memory the forward left allocated (outputs included); None on CPU."""
    peak_bytes: int | None
    """GPU: peak allocation during forward + backward above the start; None on CPU."""

    @property
    def activation_bytes(self) -> int:
        """Per micro-batch and layer: saved tensors, or on a GPU what the forward left allocated
        if that is more."""
        return max(self.saved_bytes, self.retained_bytes or 0)

    @property
    def transient_bytes(self) -> int:
        """Workspace beyond the activations at the peak (0 where not measurable)."""
        if self.peak_bytes is None:
            return 0
        return max(0, self.peak_bytes - self.activation_bytes)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_rounds(
    forward: Callable[[], object],
    backward: Callable[[object], None],
    request: ProfileRequest,
    label: str,
    progress: Callable[[str], None],
) -> PartTiming:
    """Run warm-up then timed rounds of forward and backward; CUDA events on GPU, perf_counter on CPU."""
    forward_s, backward_s = [], []
    for round_index in range(request.warmup + request.repeats):
        if request.device == "cuda":
            start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            outputs = forward()
            middle.record()
            backward(outputs)
            end.record()
            torch.cuda.synchronize()
            f, b = start.elapsed_time(middle) / 1e3, middle.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            outputs = forward()
            t1 = time.perf_counter()
            backward(outputs)
            t2 = time.perf_counter()
            f, b = t1 - t0, t2 - t1
        del outputs
        if round_index >= request.warmup:
            forward_s.append(f)
            backward_s.append(b)
            what = f"round {round_index - request.warmup + 1}/{request.repeats}"
        else:
            what = f"warm-up {round_index + 1}/{request.warmup}"
        progress(f"  {label} {what}: forward {f * 1e3:.3f} ms, backward {b * 1e3:.3f} ms")
    return PartTiming(tuple(forward_s), tuple(backward_s))


def _measure_memory(
    forward: Callable[[], object], backward: Callable[[object], None], excluded: Sequence[torch.Tensor], device: str
) -> PartMemory:
    """One untimed round with the saved-tensor hooks (and on GPU the allocator's counters)."""
    counter = SavedBytes(excluded)
    _synchronize(device)
    if device == "cuda":
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with counter.counting():
        outputs = forward()
    retained = peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        retained = torch.cuda.memory_allocated() - start
    backward(outputs)
    del outputs
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    return PartMemory(counter.total, retained, peak)


def _parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters())


def _randn(shape, dtype, device, generator, requires_grad=False) -> torch.Tensor:
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    return values.to(device=device, dtype=dtype).requires_grad_(requires_grad)


@dataclass(frozen=True)
class DeviceMeasurement:
    """Everything one profiler run measured and derived, for one device type."""

    request: ProfileRequest
    """What was measured."""
    attention: PartTiming | None
    """The attention block; None with --role expert."""
    attention_memory: PartMemory | None
    """Its activations; None with --role expert."""
    head_memory: PartMemory | None
    """The head's activations (output layer + cross entropy), one micro-batch; None with --role expert."""
    expert: PartTiming
    """One expert on ``request.tokens_per_expert`` tokens."""
    expert_memory: PartMemory
    """Its activations."""
    expert_parameters: int
    """Parameters of one built expert (numel)."""
    attention_block_parameters: int | None
    """Parameters of the built attention block (numel), for the check against count_parameters."""
    capacity_bytes: int
    """The memory budget of one device (see the module docstring)."""
    profile: DeviceProfile
    """The derived entry of the profile file."""
    memory: dict
    """The byte figures behind the slots (see ``_slots``)."""

    def details(self) -> dict:
        """JSON-able record of the measurement, stored in the profile file's "details"."""
        r = self.request

        def part(timing: PartTiming | None, memory: PartMemory | None) -> dict | None:
            if timing is None:
                return None
            return {
                "forward_median_s": timing.forward_median_s,
                "backward_median_s": timing.backward_median_s,
                "median_s": timing.median_s,
                "forward_s": list(timing.forward_s),
                "backward_s": list(timing.backward_s),
                **({} if memory is None else dataclasses.asdict(memory)),
            }

        return {
            "device": r.device,
            "device_name": torch.cuda.get_device_name() if r.device == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(),
            "role": r.role,
            "repeats": r.repeats,
            "warmup": r.warmup,
            "tokens_per_attention_rank": r.tokens_per_attention_rank,
            "mean_tokens_per_expert": r.mean_tokens_per_expert,
            "tokens_per_expert": r.tokens_per_expert,
            "experts_per_expert_rank": r.experts_per_expert_rank,
            "attention": part(self.attention, self.attention_memory),
            "expert": part(self.expert, self.expert_memory),
            "head": None if self.head_memory is None else dataclasses.asdict(self.head_memory),
            "expert_parameters": self.expert_parameters,
            "attention_block_parameters": self.attention_block_parameters,
            "capacity_bytes": self.capacity_bytes,
            "memory": self.memory,
        }


def _capacity_bytes(request: ProfileRequest) -> int:
    if request.memory_bytes is not None:
        return request.memory_bytes
    if request.device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    import psutil

    return int(psutil.virtual_memory().total)


def _slots(
    request: ProfileRequest,
    expert_parameters: int,
    expert_memory: PartMemory,
    attention_memory: PartMemory | None,
    head_memory: PartMemory | None,
    capacity: int,
) -> tuple[dict, int | None, int | None]:
    """(byte figures, slots as attention GPU, slots as expert GPU); None for a role not profiled."""
    per_param = bytes_per_parameter(request.dtype)
    R, L = request.microbatches, request.model.num_layers
    slot = expert_parameters * per_param + R * expert_memory.activation_bytes
    figures = {"bytes_per_parameter": per_param, "expert_slot_bytes": slot}
    as_expert = as_attention = None
    if request.role in ("expert", "both"):
        usable = capacity - expert_memory.transient_bytes
        figures["expert_role_usable_bytes"] = usable
        as_expert = max(0, usable // slot)
    if request.role in ("attention", "both"):
        counts = count_parameters(request.model)
        non_expert = counts["total"] - counts["experts"]
        resident = (
            non_expert * per_param
            + L * R * attention_memory.activation_bytes
            + head_memory.activation_bytes
            + max(attention_memory.transient_bytes, head_memory.transient_bytes, expert_memory.transient_bytes)
        )
        figures.update(non_expert_parameters=non_expert, attention_role_resident_bytes=resident)
        as_attention = max(0, (capacity - resident) // slot)
    return figures, as_attention, as_expert


def profile_device(request: ProfileRequest, progress: Callable[[str], None] = lambda line: None) -> DeviceMeasurement:
    """Build, time and measure the parts on this device; derive the DeviceProfile.

    Needs a process with no model parallel state (see ``megatron_session``); ``progress`` gets
    one line per step.
    """
    with megatron_session(request.device, request.seed):
        return _profile(request, progress)


def _profile(request: ProfileRequest, progress: Callable[[str], None]) -> DeviceMeasurement:
    """The measurement in stages: one expert; on attention devices the attention block, then the
    output head; the slots that fit; the profile. The inputs come from one generator in that order."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_patches.compat import mcore

    device = torch.device("cuda", torch.cuda.current_device()) if request.device == "cuda" else torch.device("cpu")
    capacity = _capacity_bytes(request)
    config = transformer_config(request)
    use_te = request.device == "cuda" and mcore.have_transformer_engine()
    _, layer_spec = mcore.layer_specs(request.model.model_family, config, use_te)
    setup = _Setup(config, layer_spec, ProcessGroupCollection.use_mpu_process_groups(), device, DTYPES[request.dtype],
                   torch.Generator().manual_seed(request.seed))
    progress(
        f"profiling {request.device_type} ({request.device}, {request.dtype}, {'TE' if use_te else 'local'} modules), "
        f"role {request.role}: L={request.model.num_layers} n={request.model.num_experts} "
        f"k={request.model.moe_router_topk} "
        f"M={request.attention_ranks} N={request.expert_ranks} R={request.microbatches}, "
        f"micro-batch {request.micro_batch_size} x {request.seq_length} tokens"
    )
    expert_parameters, expert_timing, expert_memory = _measure_expert(request, setup, progress)
    attention_timing = attention_memory = head_memory = None
    block_parameters = None
    if request.role in ("attention", "both"):
        block_parameters, attention_timing, attention_memory, hidden_SBH = _measure_attention(request, setup, progress)
        head_memory = _measure_head(request, setup, hidden_SBH, progress)

    figures, as_attention, as_expert = _slots(request, expert_parameters, expert_memory, attention_memory, head_memory,
                                              capacity)
    profile = DeviceProfile(
        device_type=request.device_type,
        t_attention_s=None if attention_timing is None else attention_timing.median_s,
        t_experts_s=request.experts_per_expert_rank * expert_timing.median_s,
        expert_slots_as_attention=as_attention,
        expert_slots_as_expert=as_expert,
    )
    return DeviceMeasurement(
        request=request,
        attention=attention_timing,
        attention_memory=attention_memory,
        head_memory=head_memory,
        expert=expert_timing,
        expert_memory=expert_memory,
        expert_parameters=expert_parameters,
        attention_block_parameters=block_parameters,
        capacity_bytes=capacity,
        profile=profile,
        memory=figures,
    )


@dataclass
class _Setup:
    """What every stage of one measurement builds with."""

    config: object
    """The TransformerConfig of the request."""
    layer_spec: object
    """Megatron's transformer layer spec (TE or local modules)."""
    pg_collection: object
    device: torch.device
    dtype: torch.dtype
    generator: torch.Generator
    """Every random input, drawn in the stages' order."""


def _measure_expert(request: ProfileRequest, setup: _Setup, progress: Callable[[str], None]):
    """One expert, as SequentialMLP builds each of its local experts, on the request's tokens per
    expert: (its parameters, its timing, its memory)."""
    from megatron.core.transformer.mlp import MLP

    config, device, dtype, generator = setup.config, setup.device, setup.dtype, setup.generator
    H = config.hidden_size
    expert_spec = setup.layer_spec.submodules.mlp.submodules.experts
    expert = MLP(config, expert_spec.submodules, ffn_hidden_size=config.moe_ffn_hidden_size, is_expert=True,
                 tp_group=setup.pg_collection.expt_tp).to(device)
    expert_parameters = sum(p.numel() for p in expert.parameters())
    T_e = request.tokens_per_expert
    tokens_TH = _randn((T_e, H), dtype, device, generator, requires_grad=True)
    probs_T = torch.rand(T_e, generator=generator).to(device=device, dtype=dtype).requires_grad_(True)
    grad_TH = _randn((T_e, H), dtype, device, generator)

    def expert_forward():
        return expert(tokens_TH, probs_T)[0]

    def expert_backward(output_TH):
        output_TH.backward(grad_TH)

    progress(f"expert: one expert MLP ({expert_parameters:,} parameters) on {T_e} tokens "
             f"(mean {request.mean_tokens_per_expert:.2f}), x {request.experts_per_expert_rank} experts per "
             "expert rank")
    expert_timing = _time_rounds(expert_forward, expert_backward, request, "expert", progress)
    expert_memory = _measure_memory(expert_forward, expert_backward, _parameters(expert), request.device)
    progress(f"expert: {expert_timing.median_s * 1e3:.3f} ms per expert (forward + backward), "
             f"{expert_memory.activation_bytes:,} activation bytes per micro-batch")
    return expert_parameters, expert_timing, expert_memory


def _measure_attention(request: ProfileRequest, setup: _Setup, progress: Callable[[str], None]):
    """The attention block (norms, self-attention, router, permutation and the combine) on one
    micro-batch: (its parameters, its timing, its memory, the hidden states the head runs on)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config, device, dtype, generator = setup.config, setup.device, setup.dtype, setup.generator
    H = config.hidden_size
    block = AttentionBlock(config, setup.layer_spec, setup.pg_collection).to(device)
    block_parameters = sum(p.numel() for p in block.parameters())
    S, B = request.seq_length, request.micro_batch_size
    hidden_SBH = _randn((S, B, H), dtype, device, generator, requires_grad=True)
    excluded = _parameters(block)
    rotary_pos_emb = None
    if request.model.position_embedding_type == "rope":
        rotary = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=request.model.rotary_percent,
            rotary_interleaved=config.rotary_interleaved,
            seq_len_interpolation_factor=request.model.rotary_seq_len_interpolation_factor,
            rotary_base=request.model.rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=setup.pg_collection.cp,
        )
        rotary_pos_emb = rotary(S).to(device)
        excluded.append(rotary_pos_emb)
    if request.model.model_family == "bert":
        attention_mask = torch.zeros(B, 1, S, S, dtype=torch.bool, device=device)  # no padding
    elif request.device == "cpu":
        # The causal mask the GPT dataset provides ([b, 1, s, s], True = masked), one for all b:
        # Megatron's own default mask is created on "cuda".
        attention_mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), diagonal=1)[None, None]
    else:
        # On a GPU the causal attention builds its mask itself (TE from the mask type); an
        # explicit one would take S*S bytes (1 GiB at 32K tokens).
        attention_mask = None
    if attention_mask is not None:
        excluded.append(attention_mask)
    dispatched = S * B * request.model.moe_router_topk
    # Gradients of the layer output (from the next layer) and of the dispatched tokens and
    # probabilities (returned by the expert ranks); the probabilities' dtype is the router's.
    grad_output_SBH = _randn((S, B, H), dtype, device, generator)
    grad_sent_XH = _randn((dispatched, H), dtype, device, generator)
    grad_sent_probs_X = torch.randn(dispatched, generator=generator).to(device)
    expert_output_XH = _randn((dispatched, H), dtype, device, generator, requires_grad=True)

    def attention_forward():
        residual_SBH, sent_XH, sent_probs_X = block.dispatch(hidden_SBH, attention_mask, rotary_pos_emb)
        output_SBH = block.combine(residual_SBH, expert_output_XH)
        return output_SBH, sent_XH, sent_probs_X

    def attention_backward(outputs):
        output_SBH, sent_XH, sent_probs_X = outputs
        torch.autograd.backward(
            (output_SBH, sent_XH, sent_probs_X),
            (grad_output_SBH, grad_sent_XH, grad_sent_probs_X.to(sent_probs_X.dtype)),
        )

    progress(f"attention: norms + self-attention + router + permutation ({block_parameters:,} parameters) "
             f"on {S * B} tokens")
    attention_timing = _time_rounds(attention_forward, attention_backward, request, "attention", progress)
    attention_memory = _measure_memory(attention_forward, attention_backward, excluded, request.device)
    progress(f"attention: {attention_timing.median_s * 1e3:.3f} ms (forward + backward), "
             f"{attention_memory.activation_bytes:,} activation bytes per micro-batch")
    return block_parameters, attention_timing, attention_memory, hidden_SBH


def _measure_head(request: ProfileRequest, setup: _Setup, hidden_SBH: torch.Tensor, progress: Callable[[str], None]):
    """The output head's activation memory on one micro-batch (its time is the attention ranks'
    and small beside the layers')."""
    from megatron.core import tensor_parallel

    config, device = setup.config, setup.device
    S, B = request.seq_length, request.micro_batch_size
    vocab = padded_vocab_size(request.model.vocab_size, request.model.make_vocab_size_divisible_by)
    output_layer = tensor_parallel.ColumnParallelLinear(
        config.hidden_size, vocab, config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
        gather_output=False, tp_group=setup.pg_collection.tp,
    ).to(device)
    labels_SB = torch.randint(0, request.model.vocab_size, (S, B), generator=setup.generator).to(device)

    def head_forward():
        logits_SBV, _ = output_layer(hidden_SBH)
        return tensor_parallel.vocab_parallel_cross_entropy(logits_SBV, labels_SB).sum()

    head_excluded = _parameters(output_layer) + [labels_SB]
    head_memory = _measure_memory(head_forward, lambda loss: loss.backward(), head_excluded, request.device)
    progress(f"head: {head_memory.activation_bytes:,} activation bytes per micro-batch (vocabulary {vocab})")
    return head_memory


def write_profile(path: str | os.PathLike, measurement: DeviceMeasurement) -> None:
    """Merge the measured device type into the profile file (placement.zebra.save_device_profile)."""
    request = measurement.request
    save_device_profile(path, request.shape, measurement.profile, workload=request.workload(),
                        details=measurement.details())


def check_profile_file(path: str | os.PathLike, request: ProfileRequest) -> None:
    """Fail before any work if ``path`` cannot take this request's measurements: an existing file
    of another shape or workload, or a folder that does not exist."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ProfileError(f"--out={os.fspath(path)!r}: the folder {folder} does not exist")
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ProfileError(f"--out={os.fspath(path)!r} exists but is not a readable JSON profile: {err}") from None
    if data.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"--out={os.fspath(path)!r} is not a zebra profile (format {data.get('format')!r}, "
                           f"expected {PROFILE_FORMAT!r})")
    if data.get("shape") != request.shape.to_dict():
        raise ProfileError(f"--out={os.fspath(path)!r} holds a profile for shape {data.get('shape')}, this run "
                           f"measures {request.shape.to_dict()}; write to another file")
    wanted = json.loads(json.dumps(request.workload()))
    if data.get("workload") != wanted:
        differing = sorted(k for k in set(wanted) | set(data.get("workload") or {})
                           if (data.get("workload") or {}).get(k) != wanted.get(k))
        raise ProfileError(f"--out={os.fspath(path)!r} was profiled under another workload (differs in {differing}); "
                           "times under other conditions are not comparable: write to another file")
