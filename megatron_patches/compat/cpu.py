"""CPU shims for Megatron-Core 0.16.1: neutralise its hard CUDA assumptions when CUDA is absent.

Megatron-Core is written for GPUs. On a CPU-only torch build a handful of calls raise
("Torch not compiled with CUDA enabled") or refuse CPU tensors. Each shim below covers
exactly one such assumption, names the Megatron-Core call sites it covers, and is applied
only by `apply_cpu_shims()`, which refuses to run when CUDA is available: GPU behaviour is
never changed. Every shim is idempotent and registered in `SHIMS` so that tests can check
each one individually (tests/compat/test_compat_cpu.py).

The approach is narrow patching of the exact functions Megatron calls (not a global
TorchFunctionMode device redirect, which was measured 13-20% slower per iteration, see
shared/notes/megatron-cpu.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Shim:
    """One neutralised CUDA assumption."""

    name: str
    """Short identifier used in logs and tests."""
    covers: str
    """The Megatron-Core 0.16.1 call sites (file:line) this shim makes work on CPU."""
    apply: Callable[[], None]
    """Installs the shim; must be idempotent."""


# ----------------------------------------------------------------------------------------
# 1. torch.cuda device queries, streams and events
# ----------------------------------------------------------------------------------------


class CpuStream:
    """Stand-in for torch.cuda.Stream on CPU: every operation is already synchronous."""

    def wait_stream(self, stream: "CpuStream") -> None:
        return None

    def wait_event(self, event: "CpuEvent") -> None:
        return None

    def record_event(self, event: "CpuEvent | None" = None) -> "CpuEvent":
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuEvent:
    """Stand-in for torch.cuda.Event on CPU (work is complete when it is enqueued)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream: CpuStream | None = None) -> None:
        return None

    def wait(self, stream: CpuStream | None = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DEFAULT_CPU_STREAM = CpuStream()


def _shim_device_and_streams() -> None:
    # `device=torch.cuda.current_device()` is Megatron's idiom for "the local device"; on CPU
    # the local device is the CPU, so answer with it (works as a factory `device=` argument
    # and in `.to(...)`).
    torch.cuda.current_device = lambda: CPU
    torch.cuda.Stream = CpuStream
    torch.cuda.Event = CpuEvent
    torch.cuda.current_stream = lambda device=None: _DEFAULT_CPU_STREAM
    torch.cuda.default_stream = lambda device=None: _DEFAULT_CPU_STREAM
    torch.cuda.synchronize = lambda device=None: None
    if not getattr(torch.Tensor.record_stream, "_megatron_patches_cpu", False):
        original_record_stream = torch.Tensor.record_stream

        def record_stream(tensor: torch.Tensor, stream) -> None:
            # Recording a tensor on a stream only matters to the CUDA caching allocator.
            if isinstance(stream, CpuStream):
                return None
            return original_record_stream(tensor, stream)

        record_stream._megatron_patches_cpu = True
        torch.Tensor.record_stream = record_stream


# ----------------------------------------------------------------------------------------
# 2. The model-parallel RNG tracker keeps CUDA generator states
# ----------------------------------------------------------------------------------------


def _shim_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    if getattr(mp_random, "_megatron_patches_cpu", False):
        return

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's RNG tracker over the CPU default generator instead of a CUDA one.

        Named states (data-parallel, tensor-parallel, expert-parallel) are kept and forked
        exactly as on GPU, so dropout inside tensor-parallel regions still differs per TP
        rank; only the generator they live in is the CPU's.
        """

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    # initialize_rng_tracker() instantiates the module-global name, so rebinding it makes
    # every tracker Megatron creates from now on a CPU one.
    mp_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mp_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    mp_random._megatron_patches_cpu = True


# ----------------------------------------------------------------------------------------
# 3. gloo collectives: all_to_all_single wants list split sizes
# ----------------------------------------------------------------------------------------


def _as_list(split_sizes):
    if isinstance(split_sizes, torch.Tensor):
        return [int(x) for x in split_sizes.tolist()]
    return split_sizes


def _shim_gloo_all_to_all_single() -> None:
    if getattr(dist.all_to_all_single, "_megatron_patches_cpu", False):
        return
    original = dist.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        return original(
            output,
            input,
            output_split_sizes=_as_list(output_split_sizes),
            input_split_sizes=_as_list(input_split_sizes),
            group=group,
            async_op=async_op,
        )

    all_to_all_single._megatron_patches_cpu = True
    dist.all_to_all_single = all_to_all_single
    torch.distributed.all_to_all_single = all_to_all_single


def _shim_gloo_uneven_all_gather() -> None:
    if getattr(dist.all_gather, "_megatron_patches_cpu", False):
        return
    original = dist.all_gather

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        # gloo requires equal shapes; Megatron gathers uneven first dimensions (tokens per
        # expert-TP rank). Pad every piece to the longest, gather, copy each piece back.
        shapes = {tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}
        if len(shapes) == 1 or async_op:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        original(gathered, padded, group=group)
        for out, full in zip(tensor_list, gathered):
            out.copy_(full[: out.shape[0]])
        return None

    all_gather._megatron_patches_cpu = True
    dist.all_gather = all_gather


# ----------------------------------------------------------------------------------------
# 4. CUDA device literals: device='cuda' in factories, Tensor.cuda(), pin_memory()
# ----------------------------------------------------------------------------------------


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor")


class _CpuTorchNamespace(types.ModuleType):
    """The `torch` module as seen by one Megatron module: factories place 'cuda' on the CPU.

    Installed as that module's global name `torch`, so only that module's own calls are
    affected and every other attribute is the real torch's. This costs one dict lookup per
    factory call, unlike a global TorchFunctionMode (13-20% slower per iteration).
    """

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    @staticmethod
    def _cpu_factory(factory):
        @functools.wraps(factory)
        def cpu_factory(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = CPU
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return cpu_factory

    def __getattr__(self, name):
        return getattr(torch, name)


# Megatron modules that create tensors with a literal device='cuda' on paths we run.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # :596, :983, :2138 total_num_tokens
    "megatron.core.optimizer.optimizer",  # :473-485, :907 found_inf / overflow buffers
    "megatron.core.optimizer.grad_scaler",  # :15-94 loss-scale tensors (fp16)
    "megatron.core.optimizer.clip_grads",  # :90-207 norm and zero-count buffers
    "megatron.core.transformer.moe.moe_utils",  # :998 aux-loss tracker values
    "megatron.core.transformer.utils",  # :35-40 attention masks
    "megatron.core.utils",  # :1207 local_multi_tensor_l2_norm (grad norm without Apex/TE)
)


class _TensorCudaToCpu(torch.overrides.TorchFunctionMode):
    """Makes `Tensor.cuda()` and `Tensor.pin_memory()` return the tensor itself.

    Entered only around the set-up / checkpoint functions in `_TENSOR_CUDA_SITES`, never
    around per-iteration code.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **(kwargs or {}))


def _inside(context) -> Callable:
    """Wrapper factory: `fn` runs inside a fresh `context()`; the wrapper is marked as a shim."""

    def make(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with context():
                return fn(*args, **kwargs)

        wrapper._megatron_patches_cpu = True
        return wrapper

    return make


def _wrap_methods(targets, make_wrapper) -> None:
    for cls, attr in targets:
        fn = cls.__dict__[attr]
        decorator = type(fn) if isinstance(fn, (staticmethod, classmethod)) else None
        raw = fn.__func__ if decorator else fn
        if getattr(raw, "_megatron_patches_cpu", False):
            continue
        wrapped = make_wrapper(raw)
        setattr(cls, attr, decorator(wrapped) if decorator else wrapped)


def _shim_cuda_literals() -> None:
    import importlib

    for module_name in _CUDA_LITERAL_MODULES:
        module = importlib.import_module(module_name)
        if not isinstance(module.torch, _CpuTorchNamespace):
            module.torch = _CpuTorchNamespace()

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    _wrap_methods(
        [
            # language_module.py:244 weight.data.cuda() when tying embeddings across PP stages
            (LanguageModule, "setup_embeddings_and_output_layer"),
            # distrib_optimizer.py:1089 send_tensor.cuda() when gathering optimizer state
            (DistributedOptimizer, "get_parameter_state_dp_zero"),
            # grad_scaler.py:140 state_dict['scale'].cuda(...) when an fp16 run resumes
            (DynamicGradScaler, "load_state_dict"),
        ],
        _inside(_TensorCudaToCpu),
    )


# ----------------------------------------------------------------------------------------
# 5. The mixed-precision / distributed optimizers compare x.type() with CUDA type names
# ----------------------------------------------------------------------------------------

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names():
    """While active, `tensor.type()` (no argument) reports CPU float tensors by CUDA names."""
    original = torch.Tensor.type

    def type_(tensor, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(tensor)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(tensor, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _shim_optimizer_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    _wrap_methods(
        [
            (distrib_optimizer.DistributedOptimizer, "__init__"),  # :361, :420, :582
            (optimizer.Float16OptimizerWithFloat16Params, "__init__"),  # :671, :690
        ],
        _inside(_cuda_type_names),
    )
    # clip_grads.py:167 asserts every grad is a 'torch.cuda.FloatTensor'; optimizer.py imported
    # the function by name, so both bindings are replaced.
    clip = clip_grads.clip_grad_by_total_norm_fp32
    if not getattr(clip, "_megatron_patches_cpu", False):
        clip = _inside(_cuda_type_names)(clip)
        clip_grads.clip_grad_by_total_norm_fp32 = clip
        optimizer.clip_grad_by_total_norm_fp32 = clip


# ----------------------------------------------------------------------------------------
# 6. Sequence parallel with torch LayerNorm (no Apex / TE on CPU)
# ----------------------------------------------------------------------------------------


def _shim_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__dict__["__new__"]
    if getattr(original_new, "_megatron_patches_cpu", False):
        return

    def __new__(cls, config, hidden_size, *args, **kwargs):
        # torch_norm.py:32 refuses sequence parallel. The norm itself is token-wise, so it
        # computes the same on a sequence shard; what SP needs is that its weight grads
        # (partial per TP rank) are summed over TP, which finalize_model_grads does for
        # params tagged `sequence_parallel` -- exactly what Megatron's fused norms tag.
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        with warnings.catch_warnings():
            # the copy's __post_init__ (model_parallel_config.py:440-445) warns that EP x TP needs
            # sequence parallelism, which the run does use: only this private copy turns it off
            warnings.filterwarnings("ignore", message="When using expert parallelism and tensor parallelism")
            plain = dataclasses.replace(config, sequence_parallel=False)
        norm = original_new(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__._megatron_patches_cpu = True
    WrappedTorchNorm.__new__ = __new__


SHIMS: list[Shim] = [
    Shim(
        "device_and_streams",
        "torch.cuda.current_device(): transformer/moe/experts.py:184,192, router.py:90-198, "
        "tensor_parallel/layers.py:261-1218, mappings.py:91-442, utils.py:631 (GlobalMemoryBuffer), "
        "distributed/param_and_grad_buffer.py:783-806; torch.cuda.Stream/stream/current_stream: "
        "transformer/moe/token_dispatcher.py:445,871-874, shared_experts.py:123-277; "
        "record_stream: moe/moe_utils.py:1098; default_stream: distributed/param_and_grad_buffer.py:422,529 "
        "(--overlap-grad-reduce); synchronize: pipeline_parallel/p2p_communication.py:242,398",
        _shim_device_and_streams,
    ),
    Shim(
        "rng_tracker",
        "tensor_parallel/random.py:41-110 (_get/_set_cuda_rng_state), :217-240 (add), :243-277 (fork)",
        _shim_rng_tracker,
    ),
    Shim(
        "gloo_all_to_all_single",
        "tensor_parallel/mappings.py _AllToAll (tensor split sizes; gloo needs lists)",
        _shim_gloo_all_to_all_single,
    ),
    Shim(
        "gloo_uneven_all_gather",
        "tensor_parallel/mappings.py:150 _gather_along_first_dim with output_split_sizes "
        "(expert-TP > 1: tokens per ETP rank differ; gloo needs equal shapes)",
        _shim_gloo_uneven_all_gather,
    ),
    Shim(
        "cuda_literals",
        "device='cuda' factories in pipeline_parallel/schedules.py:596,983,2138, "
        "optimizer/optimizer.py:473-485,907, grad_scaler.py:15-94, clip_grads.py:90-207, "
        "transformer/moe/moe_utils.py:998, transformer/utils.py:35-40, utils.py:1207; Tensor.cuda() in "
        "models/common/language_module/language_module.py:244, optimizer/distrib_optimizer.py:1089, "
        "optimizer/grad_scaler.py:140",
        _shim_cuda_literals,
    ),
    Shim(
        "optimizer_type_checks",
        "optimizer/distrib_optimizer.py:361,420,582, optimizer/optimizer.py:671,690, "
        "optimizer/clip_grads.py:167 ('torch.cuda.FloatTensor' type checks)",
        _shim_optimizer_type_checks,
    ),
]


SHIMS.append(
    Shim(
        "torch_norm_sequence_parallel",
        "transformer/torch_norm.py:32 (WrappedTorchNorm refuses --sequence-parallel without Apex/TE)",
        _shim_torch_norm_sequence_parallel,
    )
)


def import_megatron_with_eager_fusers() -> str:
    """Imports Megatron-Core with its `jit_fuser` the identity: on CPU Megatron's fused functions
    run as plain torch code. Call it before anything imports Megatron-Core; returns how its
    `jit_fuser` decorated them ("eager", or "torch.compile" where Megatron-Core was imported first).

    Why: megatron/core/jit.py makes `jit_fuser` torch.compile, which most of Megatron-Core's
    modules apply at import (fusions/*.py, activations.py) and a few at run time (the router's
    expert-bias update, GroupedMLP's glu). On CPU that costs ~2 s of importing TorchInductor per
    rank process, and dynamo traces and compiles (with a C++ compiler) the functions a run
    reaches, once per model built (measured: a tenth of a DeepSeek-V3-tiny run's training time).
    The fusions the kernels serve are off on CPU already (compat.mcore.transformer_config), and
    Megatron's own `disable_jit_fuser()` reaches only modules imported after it, hence the import
    here with torch.compile the identity. torch.compile is torch's own again on return.
    """
    import sys

    if "megatron.core.jit" in sys.modules:
        from megatron_patches.compat.mcore import jit_fuser_kind

        return jit_fuser_kind()
    if torch.cuda.is_available():
        raise RuntimeError("import_megatron_with_eager_fusers() called with CUDA available: GPU runs keep "
                           "Megatron's torch.compile fusions")

    def identity(model=None, **options):
        return model if model is not None else (lambda fn: fn)

    compile_ = torch.compile
    torch.compile = identity
    try:
        import megatron.core.jit
    finally:
        torch.compile = compile_
    megatron.core.jit.disable_jit_fuser()  # for the modules imported later (models, moe, ...)
    return "eager"


def apply_cpu_shims() -> list[str]:
    """Install every CPU shim; returns their names. Refuses when CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "apply_cpu_shims() called with CUDA available: the CPU shims must never change GPU behaviour"
        )
    for shim in SHIMS:
        shim.apply()
    return [shim.name for shim in SHIMS]
