"""Tests of the CPU shims in megatron_patches/compat/cpu.py, one group per shim.

For every shim in `SHIMS`:
- a behaviour test, in this process after `apply_cpu_shims()`: the replaced torch.cuda / Megatron
  call now does the right thing on CPU (values checked, not only "no exception");
- a necessity test: a fresh process forks one child per shim (two ranks for the gloo one); the
  child installs every shim *except* that one, calls the Megatron function the shim covers,
  and records the error (type, message and the innermost Megatron frame); then it installs
  the missing shim and calls again, which must work. One process serves all shims, so the
  Megatron imports are paid once (`necessity` fixture).
Also: `apply_cpu_shims` is idempotent, and both it and `prepare_megatron` refuse to run when
CUDA is available.
"""

from __future__ import annotations

import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from support.mp import run_forked, run_ranks, single_rank_group
from megatron_patches.compat import cpu, fixes

SHIM_NAMES = [shim.name for shim in cpu.SHIMS]
MEGATRON_CORE = Path(tensor_parallel.__file__).resolve().parents[1]
NOT_COMPILED = "Torch not compiled with CUDA enabled"


# ----------------------------------------------------------------------------------------
# Small Megatron objects shared by the behaviour and the necessity checks
# ----------------------------------------------------------------------------------------


def _config(**overrides) -> TransformerConfig:
    """A tiny CPU TransformerConfig (no fused kernels: they need Apex/TE)."""
    fields = dict(
        num_layers=1,
        hidden_size=16,
        ffn_hidden_size=32,
        num_attention_heads=2,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _ensure_model_parallel() -> None:
    """Megatron's parallel state over the world (size 1 or 2 here): TP = PP = EP = 1."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _tiny_gpt_and_optimizer(distributed: bool, bf16: bool = False):
    """A 1-layer GPT in Megatron DDP with Megatron's optimizer over plain torch Adam:
    DistributedOptimizer (distributed=True) or, for bf16, Float16OptimizerWithFloat16Params."""
    _ensure_model_parallel()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = _config(bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8)
    if bf16:
        model = Float16Module(config, model)  # as Megatron-LM wraps half-precision models
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=bf16),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distributed, bf16=bf16, params_dtype=dtype),
        [ddp],
    )
    return ddp, optimizer


def _a2a_uneven(world_size: int, rank: int):
    """Megatron's all_to_all with tensor split sizes (as its dispatcher passes them).

    Rank r sends (r + 1 + j) rows of value 100 r + j to rank j, so every rank can check what
    it received. Returns (received, expected)."""
    from megatron.core.tensor_parallel.mappings import all_to_all

    send_counts = torch.tensor([rank + 1 + j for j in range(world_size)])
    recv_counts = torch.tensor([j + 1 + rank for j in range(world_size)])
    chunks = [torch.full((int(n), 3), 100.0 * rank + j) for j, n in enumerate(send_counts)]
    received = all_to_all(dist.group.WORLD, torch.cat(chunks), recv_counts, send_counts)
    expected = torch.cat([torch.full((int(n), 3), 100.0 * j + rank) for j, n in enumerate(recv_counts)])
    return received, expected


# ----------------------------------------------------------------------------------------
# Necessity: the Megatron calls each shim covers, run without that shim
# ----------------------------------------------------------------------------------------


def _global_memory_buffer():
    from megatron.core.utils import GlobalMemoryBuffer

    return GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "shim-test")


def _alltoall_dispatcher():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    _ensure_model_parallel()
    config = _config(num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True)
    return MoEAlltoAllTokenDispatcher(2, [0, 1], config, ProcessGroupCollection.use_mpu_process_groups())


def _seed_rng_tracker():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # force_reset: the tracker instance is created once per process; a fresh one picks up
    # whichever tracker class is installed now.
    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)


def _megatron_all_to_all():
    received, expected = _a2a_uneven(dist.get_world_size(), dist.get_rank())
    assert torch.equal(received, expected), (received, expected)


def _gather_uneven(world_size: int, rank: int):
    """Megatron's gather along the first dimension with output split sizes (expert-TP > 1):
    rank r contributes r + 2 rows of value r. Returns (gathered, expected)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    sizes = [r + 2 for r in range(world_size)]
    local = torch.full((sizes[rank], 3), float(rank))
    gathered = gather_from_sequence_parallel_region(local, group=dist.group.WORLD, output_split_sizes=sizes)
    expected = torch.cat([torch.full((n, 3), float(r)) for r, n in enumerate(sizes)])
    return gathered, expected


def _megatron_uneven_gather():
    gathered, expected = _gather_uneven(dist.get_world_size(), dist.get_rank())
    assert torch.equal(gathered, expected), (gathered, expected)


def _causal_mask():
    from megatron.core.transformer.utils import get_default_causal_mask

    return get_default_causal_mask(4)


def _grad_norm_fp32():
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    return get_grad_norm_fp32([torch.ones(3)])


def _grad_scaler_round_trip():
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=1, hysteresis=1)
    scaler.load_state_dict(scaler.state_dict())
    return scaler


def _clip_grad_by_total_norm():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)


def _build_distributed_optimizer():
    _tiny_gpt_and_optimizer(distributed=True)


def _build_bf16_optimizer():
    _tiny_gpt_and_optimizer(distributed=False, bf16=True)


def _torch_norm_with_sequence_parallel():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm(_config(tensor_model_parallel_size=2, sequence_parallel=True), 16)


# shim name -> (ranks, [(Megatron call, function, text the stock error must contain)])
NECESSITY_CHECKS = {
    "device_and_streams": (
        1,
        [
            ("GlobalMemoryBuffer.get_tensor", _global_memory_buffer, NOT_COMPILED),
            ("MoEAlltoAllTokenDispatcher()", _alltoall_dispatcher, "torch.cuda.Stream requires CUDA support"),
        ],
    ),
    "rng_tracker": (1, [("model_parallel_cuda_manual_seed", _seed_rng_tracker, NOT_COMPILED)]),
    "gloo_all_to_all_single": (
        2,
        [("mappings.all_to_all (uneven, tensor split sizes)", _megatron_all_to_all, "incompatible function arguments")],
    ),
    "gloo_uneven_all_gather": (
        2,
        [("mappings.gather_from_sequence_parallel_region (uneven output_split_sizes)", _megatron_uneven_gather, "invalid tensor size")],
    ),
    "cuda_literals": (
        1,
        [
            ("transformer.utils.get_default_causal_mask", _causal_mask, NOT_COMPILED),
            ("clip_grads.get_grad_norm_fp32", _grad_norm_fp32, NOT_COMPILED),
            ("DynamicGradScaler.load_state_dict (fp16 resume)", _grad_scaler_round_trip, NOT_COMPILED),
        ],
    ),
    "optimizer_type_checks": (
        1,
        [
            ("clip_grads.clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm, "== 'torch.cuda.FloatTensor'"),
            ("DistributedOptimizer()", _build_distributed_optimizer, "Wrapped parameters must be one of"),
            ("Float16OptimizerWithFloat16Params() (bf16)", _build_bf16_optimizer, "Wrapped parameters must be one of"),
        ],
    ),
    "torch_norm_sequence_parallel": (
        1,
        [("WrappedTorchNorm(sequence_parallel=True)", _torch_norm_with_sequence_parallel, "sequence parallel not supported by torch LayerNorm")],
    ),
}


def _attempt(fn) -> dict:
    """Runs fn; on error, the error text plus the innermost Megatron-Core frame (file, line, source)."""
    try:
        fn()
        return {"ok": True}
    except Exception as error:  # recorded, not raised: every check of every shim must run
        frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve().is_relative_to(MEGATRON_CORE)]
        where = None
        if frames:
            where = {
                "file": Path(frames[-1].filename).resolve().relative_to(MEGATRON_CORE).as_posix(),
                "line": frames[-1].lineno,
                "source": frames[-1].line,
            }
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "where": where}


def _without_then_with(name: str) -> dict:
    """In a forked rank: every shim but `name`, run its checks; then install it and run again."""
    for shim in cpu.SHIMS:
        if shim.name != name:
            shim.apply()
    _, checks = NECESSITY_CHECKS[name]
    without = {label: _attempt(fn) for label, fn, _ in checks}
    next(shim for shim in cpu.SHIMS if shim.name == name).apply()
    with_shim = {label: _attempt(fn) for label, fn, _ in checks}
    return {"without": without, "with": with_shim}


def necessity_checks() -> dict:
    """Entry point of the necessity process: one verdict per shim (JSON)."""
    verdicts = {}
    for shim in cpu.SHIMS:
        ranks, _ = NECESSITY_CHECKS.get(shim.name, (1, []))
        try:
            verdicts[shim.name] = run_forked(ranks, _without_then_with, timeout=120, args=(shim.name,))
        except Exception as error:  # one shim's crash must not hide the others' verdicts
            verdicts[shim.name] = {"crashed": str(error)[-4000:]}
    return verdicts


@pytest.fixture(scope="module")
def necessity():
    return run_ranks(1, __file__, "necessity_checks", timeout=300, gloo=False)[0]


def test_every_shim_has_a_necessity_check():
    assert sorted(NECESSITY_CHECKS) == sorted(SHIM_NAMES)
    for shim in cpu.SHIMS:
        assert shim.covers and callable(shim.apply), shim


@pytest.mark.multirank
@pytest.mark.parametrize("name", SHIM_NAMES)
def test_shim_is_necessary_and_sufficient(necessity, name):
    verdict = necessity[name]
    assert isinstance(verdict, list), verdict.get("crashed")
    shim = next(s for s in cpu.SHIMS if s.name == name)
    _, checks = NECESSITY_CHECKS[name]
    for rank_verdict in verdict:
        for label, _, expected in checks:
            without, with_shim = rank_verdict["without"][label], rank_verdict["with"][label]
            assert not without["ok"], f"{label} works without the {name} shim: the shim is not needed for it"
            message = without["error"] + " " + str((without["where"] or {}).get("source"))
            assert expected in message, f"{label} without {name}: {without}"
            # The call fails inside the Megatron file that the shim's `covers` names.
            where = without["where"]
            assert where is not None and Path(where["file"]).name in shim.covers, (label, without, shim.covers)
            assert with_shim == {"ok": True}, f"{label} with the {name} shim installed: {with_shim}"


# ----------------------------------------------------------------------------------------
# Behaviour, in this process
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shims():
    """CPU shims installed in this process and a single-rank gloo world with Megatron's parallel state;
    also the device-independent fix a router needs without Transformer Engine (compat/fixes.py fix 6),
    which every run installs beside the shims."""
    names = cpu.apply_cpu_shims()
    fixes._fix_te_general_gemm_without_te()
    with single_rank_group():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield names
        finally:
            parallel_state.destroy_model_parallel()


def test_apply_returns_every_shim_in_order(shims):
    assert shims == SHIM_NAMES
    assert SHIM_NAMES == [
        "device_and_streams",
        "rng_tracker",
        "gloo_all_to_all_single",
        "gloo_uneven_all_gather",
        "cuda_literals",
        "optimizer_type_checks",
        "torch_norm_sequence_parallel",
    ]


def _patched_objects() -> dict:
    """The wrappers and replacement objects the shims install (a second apply must keep them)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return {
        "Stream": torch.cuda.Stream,
        "record_stream": torch.Tensor.record_stream,
        "tracker": mp_random.CudaRNGStatesTracker,
        "all_to_all_single": dist.all_to_all_single,
        "transformer.utils.torch": transformer_utils.torch,
        "setup_embeddings": LanguageModule.__dict__["setup_embeddings_and_output_layer"],
        "DistributedOptimizer.__init__": distrib_optimizer.DistributedOptimizer.__dict__["__init__"],
        "clip": clip_grads.clip_grad_by_total_norm_fp32,
        "optimizer.clip": optimizer.clip_grad_by_total_norm_fp32,
        "WrappedTorchNorm.__new__": WrappedTorchNorm.__dict__["__new__"],
    }


def test_apply_is_idempotent(shims):
    before = _patched_objects()
    assert cpu.apply_cpu_shims() == SHIM_NAMES
    after = _patched_objects()
    changed = [key for key in before if after[key] is not before[key]]
    assert changed == [], f"re-applying the shims replaced {changed} again (wrappers would stack)"
    # Wrappers wrap the original, never a previous wrapper.
    assert not getattr(dist.all_to_all_single.__wrapped__, "_megatron_patches_cpu", False)
    assert torch.device(torch.cuda.current_device()) == torch.device("cpu")


@pytest.mark.parametrize("apply", ["apply_cpu_shims", "prepare_megatron"])
def test_refuses_when_cuda_is_available(monkeypatch, apply):
    from megatron_patches.compat import prepare_megatron

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    call = cpu.apply_cpu_shims if apply == "apply_cpu_shims" else lambda: prepare_megatron(use_cuda=False)
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES" if apply == "prepare_megatron" else "never change GPU behaviour"):
        call()


# --- 1. device_and_streams ---------------------------------------------------------------


def test_current_device_is_the_cpu_and_a_factory_device(shims):
    device = torch.cuda.current_device()
    assert torch.device(device) == torch.device("cpu")
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).to(torch.cuda.current_device()).device.type == "cpu"
    buffer = _global_memory_buffer()
    assert buffer.shape == (2, 3) and buffer.device.type == "cpu"


def test_streams_and_events_are_synchronous_no_ops(shims):
    stream = torch.cuda.Stream()
    event = torch.cuda.Event(enable_timing=True)
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    assert stream.query() and event.query()
    assert isinstance(stream.record_event(), cpu.CpuEvent)
    assert stream.record_event(event) is event
    for call in (stream.synchronize, event.synchronize, event.record, event.wait, torch.cuda.synchronize):
        assert call() is None
    stream.wait_stream(torch.cuda.current_stream())
    stream.wait_event(event)
    x = torch.arange(4.0)
    with torch.cuda.stream(stream):
        y = x * 2
    x.record_stream(torch.cuda.current_stream())
    assert torch.equal(y, torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_alltoall_dispatcher_runs_its_stream_code_on_cpu(shims):
    """MoE forward/backward with the all-to-all dispatcher: it creates a side stream, copies
    the token counts on it, records and waits on an event (token_dispatcher.py:445, :871-890)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = _config(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=4).submodules.mlp
    layer = MoELayer(config, spec.submodules)
    hidden = torch.randn(6, 2, 16, requires_grad=True)
    output, _ = layer(hidden)
    output.square().sum().backward()
    assert output.shape == hidden.shape and torch.isfinite(hidden.grad).all()
    assert type(layer.token_dispatcher.cuda_dtoh_stream) is cpu.CpuStream
    assert type(layer.token_dispatcher.d2h_event) is cpu.CpuEvent, "the side-stream copy path did not run"


# --- 2. rng_tracker ------------------------------------------------------------------------


def _draws(generator_seed: int, n: int, skip: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(generator_seed)
    torch.rand(skip, generator=generator)
    return torch.rand(n, generator=generator)


def test_rng_tracker_named_states_fork_the_cpu_generator(shims):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    seed = 1234
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    tracker = get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    states = tracker.get_states()
    # Megatron's seeds (random.py:412-429) at TP = EP = ETP rank 0: data seed, seed + 2718, seed + 1024.
    assert sorted(states) == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]
    names = sorted(states)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.equal(states[a], states[b]), f"{a} and {b} share a state"

    torch.manual_seed(99)
    with tracker.fork():
        first = torch.rand(3)
    outer = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)
    with tracker.fork("expert-parallel-rng"):
        expert = torch.rand(3)
    with tracker.fork("data-parallel-rng"):
        data = torch.rand(3)
    assert torch.equal(first, _draws(seed + 2718, 3))
    assert torch.equal(second, _draws(seed + 2718, 3, skip=3)), "fork() must advance its named state"
    assert torch.equal(expert, _draws(seed + 1024, 3))
    assert torch.equal(data, _draws(seed, 3))
    # The default (outer) CPU generator continued as if no fork had happened.
    assert torch.equal(outer, _draws(99, 3))
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("no-such-state"):
            pass


def test_activation_checkpoint_replays_dropout_under_the_tracker(shims):
    """tensor_parallel.checkpoint saves and restores the tracker's states with the shimmed
    _get/_set_cuda_rng_state, so the recomputed dropout mask equals the original one."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    def block(x):
        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x, p=0.5, training=True) * x

    model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    x = torch.randn(64, requires_grad=True)
    block(x).sum().backward()
    plain_grad = x.grad.clone()
    x.grad = None
    model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    tensor_parallel.checkpoint(block, False, x).sum().backward()
    assert torch.equal(x.grad, plain_grad)
    assert (plain_grad == 0).any() and (plain_grad != 0).any()


# --- 3. gloo_all_to_all_single ------------------------------------------------------------


def test_all_to_all_single_accepts_tensor_split_sizes(shims):
    rows = torch.arange(12.0).reshape(4, 3)
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows, output_split_sizes=torch.tensor([4]), input_split_sizes=torch.tensor([4]))
    assert torch.equal(out, rows)
    received, expected = _a2a_uneven(1, 0)
    assert torch.equal(received, expected)


# (The two-rank exchange with uneven tensor splits is the "with" half of the necessity check.)


def test_all_gather_keeps_equal_shapes_on_the_stock_path_and_pads_uneven_ones(shims):
    gathered, expected = _gather_uneven(1, 0)
    assert torch.equal(gathered, expected)
    # Equal shapes (and async) go straight to gloo; uneven ones are padded and trimmed
    # (the two-rank uneven gather is the "with" half of its necessity check).
    out = [torch.empty(2, 3)]
    dist.all_gather(out, torch.ones(2, 3))
    assert torch.equal(out[0], torch.ones(2, 3))


# --- 4. cuda_literals ---------------------------------------------------------------------


def test_megatron_cuda_literals_create_cpu_tensors(shims):
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.transformer.utils import get_default_causal_mask, get_sliding_window_causal_mask

    mask = _causal_mask()
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).triu(1))
    assert get_sliding_window_causal_mask(4, 4, (1, 0)).device.type == "cpu"
    assert get_default_causal_mask(3).shape == (3, 3)
    # Norm without Apex/TE: local multi-tensor L2 norm on CPU, hand-checked.
    assert math.isclose(get_grad_norm_fp32([torch.full((4,), 3.0), torch.full((9,), 1.0)]), math.sqrt(4 * 9 + 9), rel_tol=1e-6)
    scaler = DynamicGradScaler(
        initial_scale=8.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, hysteresis=1
    )
    scaler.update(found_inf=True)
    assert scaler.scale.device.type == "cpu" and scaler.scale.item() == 4.0
    resumed = _grad_scaler_round_trip()
    resumed.load_state_dict(scaler.state_dict())  # an fp16 run resuming its loss scale
    assert resumed.scale.device.type == "cpu" and resumed.scale.item() == 4.0


def test_no_pipelining_schedule_counts_tokens_on_cpu(shims):
    """schedules.py:596 creates its token counter with device='cuda'."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp, _ = _tiny_gpt_and_optimizer(distributed=False)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(2, 8)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch, positions, None, labels=batch)
        return output, lambda output: (output.mean(), {"loss": output.mean().detach()})

    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[ddp],
        num_microbatches=1,
        seq_length=8,
        micro_batch_size=2,
        forward_only=True,
    )
    with torch.no_grad():
        expected = ddp(tokens, positions, None, labels=tokens).mean()
    torch.testing.assert_close(results[0]["loss"], expected)


def test_cuda_literals_are_redirected_only_inside_megatron_modules(shims):
    import importlib

    from megatron.core.transformer import utils as transformer_utils

    for module_name in cpu._CUDA_LITERAL_MODULES:
        assert isinstance(importlib.import_module(module_name).torch, cpu._CpuTorchNamespace), module_name
    namespace = transformer_utils.torch
    assert isinstance(namespace, cpu._CpuTorchNamespace)
    assert namespace.empty(2, device="cuda:0", pin_memory=True).device.type == "cpu"
    assert namespace.nn is torch.nn, "non-factory attributes must be the real torch's"
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.zeros(1, device="cuda")  # the global torch is untouched


def test_tensor_cuda_and_pin_memory_are_identity_only_in_wrapped_sites(shims):
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    x = torch.ones(2)
    with cpu._TensorCudaToCpu():
        assert x.cuda() is x and x.pin_memory() is x
    with pytest.raises((AssertionError, RuntimeError)):
        x.cuda()
    for cls, name in [(LanguageModule, "setup_embeddings_and_output_layer"), (DistributedOptimizer, "get_parameter_state_dp_zero")]:
        assert getattr(cls.__dict__[name], "_megatron_patches_cpu", False), name


# --- 5. optimizer_type_checks -------------------------------------------------------------


@pytest.mark.parametrize(
    "distributed, bf16, optimizer_type",
    [(True, False, "DistributedOptimizer"), (False, True, "Float16OptimizerWithFloat16Params")],
)
def test_megatron_optimizers_build_and_step_on_cpu(shims, distributed, bf16, optimizer_type):
    ddp, optimizer = _tiny_gpt_and_optimizer(distributed=distributed, bf16=bf16)
    assert [type(sub).__name__ for sub in optimizer.chained_optimizers] == [optimizer_type]
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    losses = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful and grad_norm > 0
        losses.append(loss.item())
    assert losses[2] < losses[0], losses
    # The type-name redirect is scoped to the wrapped calls.
    assert torch.ones(1).type() == "torch.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"


def test_clip_grad_by_total_norm_scales_cpu_grads(shims):
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.tensor([3.0, 0.0, 4.0])
    params[1].grad = torch.tensor([0.0, 0.0])
    from megatron.core.optimizer import clip_grads, optimizer

    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6, 0.0, 0.8]), rtol=1e-5, atol=0)
    assert torch.ones(1).type() == "torch.FloatTensor"


# --- 6. torch_norm_sequence_parallel ------------------------------------------------------


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_torch_norm_with_sequence_parallel_builds_and_tags_params(shims, normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(tensor_model_parallel_size=2, sequence_parallel=True, normalization=normalization)
    norm = WrappedTorchNorm(config, 16)
    params = list(norm.parameters())
    assert params and all(getattr(p, "sequence_parallel", False) for p in params)
    assert config.sequence_parallel, "the caller's config must not be changed"
    x = torch.randn(5, 16)
    reference = torch.nn.LayerNorm(16, eps=config.layernorm_epsilon) if normalization == "LayerNorm" else torch.nn.RMSNorm(16, eps=config.layernorm_epsilon)
    torch.testing.assert_close(norm(x), reference(x))

    plain = WrappedTorchNorm(_config(normalization=normalization), 16)
    assert not any(getattr(p, "sequence_parallel", False) for p in plain.parameters())


def test_torch_norm_with_sequence_parallel_does_not_warn_under_expert_parallelism(shims):
    """EP x TP with sequence parallelism: the shim's private copy of the config (SP off) used to
    make Megatron warn "sequence parallelism must be used" on every rank, for a run that uses it."""
    import warnings

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True, num_moe_experts=4,
                     expert_tensor_parallel_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        WrappedTorchNorm(config, 16)
    assert not [w for w in caught if "sequence parallelism must be used" in str(w.message)], [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:  # Megatron's own warning still reaches a run without SP
        warnings.simplefilter("always")
        _config(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=False, num_moe_experts=4,
                expert_tensor_parallel_size=1)
    assert [w for w in caught if "sequence parallelism must be used" in str(w.message)]


EAGER_IMPORT = """
import sys, torch
compile_ = torch.compile
from megatron_patches.compat.cpu import import_megatron_with_eager_fusers
first = import_megatron_with_eager_fusers()
from megatron_patches.compat.mcore import jit_fuser_kind
print(first, import_megatron_with_eager_fusers(), jit_fuser_kind())
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
from megatron.core.transformer.moe.router import TopKRouter
plain = [fn for fn in (bias_swiglu, TopKRouter._apply_expert_bias) if type(fn).__name__ == "function"
         and not hasattr(fn, "_torchdynamo_orig_callable")]
print(len(plain), torch.compile is compile_, "torch._inductor.compile_fx" in sys.modules)
"""


def test_megatron_imported_on_cpu_fuses_nothing_and_leaves_torch_compile_alone():
    """On CPU the training script imports Megatron-Core with its jit_fuser the identity: the
    functions it decorates at import (the fusions) and the ones imported after (the router's
    expert-bias update) stay plain functions, TorchInductor is never imported, and torch.compile
    is torch's own again afterwards. In a fresh process (this one imported Megatron already)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", EAGER_IMPORT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["eager", "eager", "eager", "2", "True", "False"], out.stdout
    # a process that imported Megatron-Core first keeps its torch.compile, and says so
    late = subprocess.run([sys.executable, "-c", "import megatron.core; from megatron_patches.compat.cpu import "
                           "import_megatron_with_eager_fusers as f; print(f())"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert late.stdout.split() == ["torch.compile"], (late.stdout, late.stderr[-2000:])
