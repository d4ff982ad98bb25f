"""The training loop: Megatron-Core parts applied in one visible order, the MoE mode through its
ModeRuntime steps (megatron_patches/mode/runtime.py).

    set up    distributed init -> Megatron compat -> the arguments printed
    build     model-parallel groups (TP, PP (x VP), EP x ETP; DP is what remains) + RNG -> tokenizer +
              data -> mode runtime -> model chunks (the mode's layer spec; one per virtual
              pipeline stage) -> DDP -> optimizer -> LR schedule -> mode.attach -> optional resume
    train     per iteration: mode.begin_iteration -> forward/backward (Megatron's pipeline
              schedules) -> optimizer step -> mode.end_iteration -> metrics, eval, checkpoints
    finish    load trace, summary line, process groups torn down

Megatron-Core ships no `megatron.training`; this is the lean equivalent built from its parts.
"""

from __future__ import annotations

import datetime
import gc
import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_patches.compat import activations, mcore, prepare_megatron
from megatron_patches.config.models import moe_layer_numbers, padded_vocab_size
from megatron_patches.data import datasets
from megatron_patches.mode.runtime import ModeRuntime, StepResult
from megatron_patches.placement.trace import write_trace
from megatron_patches.training import checkpoint, checkpoint_dirs, metrics, modes, outputs
from megatron_patches.training.arguments import without_effect
from megatron_patches.training.exits import ExitConditions
from megatron_patches.training.flag_docs import describe_args
from megatron_patches.training.flops import model_flops_per_iteration
from megatron_patches.training.model import build_model
from megatron_patches.training.steps import forward_step_for, mean_loss_over_world
from megatron_patches.training.watchdog import StallWatchdog


def log0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


class NonFiniteTraining(RuntimeError):
    """The loss or a gradient was not finite on more steps than --max-nonfinite-steps allows;
    every rank raises it at the same iteration (the decision is world-wide)."""


@dataclass
class Summary:
    iterations: int
    first_loss: float
    last_loss: float
    mean_iteration_s: float
    tokens_per_s: float
    eval_loss: float | None
    balance: str | None = None
    """Rank 0: the run's imbalance (metrics.balance_summary); None on the other ranks."""


def pretrain(args) -> Summary:
    set_up(args)
    run = build(args)
    try:
        history = train(args, run)
    except NonFiniteTraining:
        tear_down()
        raise
    write_load_trace(args, run, history)
    return finish(args, history)


# ----------------------------------------------------------------------------------------
# Set up: processes
# ----------------------------------------------------------------------------------------


def set_up(args) -> None:
    init_distributed(args.use_cuda, args.distributed_backend, args.distributed_timeout_minutes)
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)  # Megatron-LM's setup_logging: the root logger
    shims = prepare_megatron(args.use_cuda)
    mcore.forget_loss_trackers()  # sized by an earlier run in this process, if any
    if args.run_dir:
        # a person reads a short summary; every value stays in the run folder
        if dist.get_rank() == 0:
            outputs.write_arguments(args.run_dir, describe_args(args))
        log0(f"run folder: {args.run_dir} (every flag value in {outputs.ARGUMENTS}; {outputs.PLOT} at the end)")
    else:
        log0(describe_args(args))
    log0(layout_summary(args))
    if args.kernel_choices_not_applied:
        log0(f"GPU kernel choices, not applied on CPU (same arithmetic, no such kernels here): "
             f"{', '.join(args.kernel_choices_not_applied)}")
    if args.flags_without_effect:
        log0(f"accepted without effect: {', '.join(without_effect(args.flags_without_effect))}")
    log0(f"device: {'cuda' if args.use_cuda else 'cpu'} | world {dist.get_world_size()} | CPU shims: {', '.join(shims) or 'none'}"
         f" | Megatron's jit_fuser: {mcore.jit_fuser_kind()}")


def layout_summary(args) -> str:
    """The model's shape, the mode and the parallel layout, as one line."""
    vp = args.virtual_pipeline_model_parallel_size
    virtual = f" ({vp} virtual stages per pipeline rank)" if vp else ""
    return (f"layout: {args.model_family} {args.num_layers} layers x hidden {args.hidden_size}, {args.num_experts} "
            f"experts top-{args.moe_router_topk}, seq "
            f"{args.seq_length} | mode {args.moe_parallel_mode} | world {args.world_size} = TP {args.tensor_model_parallel_size} "
            f"x PP {args.pipeline_model_parallel_size} x DP {args.data_parallel_size}{virtual} | EP {args.expert_model_parallel_size} "
            f"x ETP {args.expert_tensor_parallel_size} | global batch {args.global_batch_size} | model from "
            f"{args.model_source}")


def init_distributed(use_cuda: bool, backend: str, timeout_minutes: int) -> None:
    """torch.distributed from torchrun's environment, or a world of one for a plain process.

    With NCCL the default group also gets gloo for host tensors ("cpu:gloo,cuda:nccl", and
    every group made from it likewise): the loop's small bookkeeping collectives (losses,
    counts, byte counters, planning inputs) reduce host tensors, which NCCL alone refuses
    ("No backend type associated with device type cpu", seen on an H200).
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def seed_everything(args) -> None:
    """Megatron-LM: the same seed on all DP ranks, offset per PP stage."""
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    mcore.seed_model_parallel_rng(seed)


def resolve_default_corpus(args) -> None:
    """With neither --data-path nor --mock-data, train on the embedded real corpus."""
    if args.data_path or args.mock_data:
        return
    from megatron_patches.data.corpus import ensure_default_corpus

    if dist.get_rank() == 0:
        paths = ensure_default_corpus(args.model_family)
    dist.barrier()
    if dist.get_rank() != 0:
        paths = ensure_default_corpus(args.model_family)
    args.data_path = [str(paths.data_prefix)]
    args.tokenizer_type = paths.tokenizer_type
    args.vocab_file = str(paths.vocab_file)
    args.merge_file = str(paths.merge_file) if paths.merge_file else None
    log0(f"data: embedded corpus {paths.data_prefix} ({paths.num_documents} documents, {paths.num_tokens} tokens, {paths.tokenizer_type})")


def build_data(args):
    """(tokenizer, padded vocab size, train dataset, validation dataset)."""
    resolve_default_corpus(args)
    tokenizer = datasets.build_tokenizer(args)
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    train_ds, valid_ds, _ = datasets.build_datasets(args, tokenizer)
    return tokenizer, vocab, train_ds, valid_ds


# ----------------------------------------------------------------------------------------
# Build: parallel groups, data, mode, model, optimizer, resume
# ----------------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything the train stage needs, built once."""

    mode: ModeRuntime
    models: list[torch.nn.Module]
    """This rank's model chunks, unwrapped: one, or one per virtual pipeline stage."""
    chunks: list[torch.nn.Module]
    """The same chunks as the loop trains them (the mode's wrappers: Megatron's DDP in ep)."""
    optimizer: object
    scheduler: object
    layer_numbers: list[int]
    """1-based global numbers of every MoE layer of the model (not only this stage's)."""
    train_iter: datasets.BatchIterator
    valid_iter: datasets.BatchIterator
    state: dict
    """iteration, consumed_train_samples, consumed_valid_samples (the checkpointed loop state)."""
    dtypes: dict[str, str]
    """precision_dtypes: parameters, main weights, gradients."""
    precision: str
    """The start-up precision line (precision_summary)."""
    flops_per_iteration: float
    """Model FLOPs of one iteration, as Megatron-LM counts them (training/flops.py)."""


def build(args) -> Run:
    # Parallelisms, in one order: TP, PP, EP (x ETP), DP is what remains.
    mcore.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
        args.expert_tensor_parallel_size,
        args.virtual_pipeline_model_parallel_size,
    )
    seed_everything(args)
    tokenizer, vocab, train_ds, valid_ds = build_data(args)

    layer_numbers = moe_layer_numbers(args.moe_layer_freq, args.num_layers, args.mtp_num_layers)
    mode = modes.spec(args.moe_parallel_mode).runtime_class().from_args(args, layer_numbers, args.use_cuda)
    models, config = build_model(args, vocab, on_gpu=args.use_cuda, mode=mode)
    chunks, optimizer = mode.wrap(models, config, args)
    mode.attach(models, config, optimizer)
    scheduler = mcore.scheduler(args, optimizer)
    num_params = sum(p.numel() for model in models for p in model.parameters())
    log0(f"model: {args.model_family} | {num_params:,} parameters on rank 0 | vocab {tokenizer.vocab_size} padded to {vocab}")
    dtypes = precision_dtypes(args, models)
    precision = precision_summary(args, dtypes)
    log0(f"precision: {precision}")
    for line in mode.take_log():
        log0(line)

    state = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    if args.load:
        loaded, notes = checkpoint.load(args.load, args.load_iteration, chunks, optimizer, scheduler, not args.no_load_optim,
                                        not args.no_load_rng, mode, args.dist_ckpt_strictness)
        if loaded is not None and args.finetune:
            log0(f"checkpoint: --finetune: the model of iteration {args.load_iteration}, training from iteration 0")
        elif loaded is not None:
            state.update({k: loaded[k] for k in state})
        for note in [*args.load_notes, *notes]:
            log0(f"checkpoint: {note}")
        for change in getattr(args, "resume_changes", []):
            log0(f"resume: {change}")
    dp_rank, dp_size = mode.data_parallel()
    return Run(
        mode=mode,
        models=models,
        chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        layer_numbers=layer_numbers,
        train_iter=datasets.BatchIterator(train_ds, args.micro_batch_size, dp_rank, dp_size, state["consumed_train_samples"]),
        valid_iter=datasets.BatchIterator(valid_ds, args.micro_batch_size, dp_rank, dp_size, state["consumed_valid_samples"]),
        state=state,
        dtypes=dtypes,
        precision=precision,
        flops_per_iteration=model_flops_per_iteration(args, vocab),
    )


def precision_dtypes(args, models: list) -> dict[str, str]:
    """The dtypes of the model's parameters, of the weights the optimizer steps (fp32 main
    weights in half precision, the parameters themselves in fp32) and of the gradients as they
    are accumulated and reduced; for the start-up line and every metrics record."""
    parameters = "/".join(sorted({str(p.dtype).removeprefix("torch.") for model in models for p in model.parameters()}))
    if args.bf16 or args.fp16:
        grads = "float32" if args.accumulate_allreduce_grads_in_fp32 else str(args.params_dtype).removeprefix("torch.")
    else:
        grads = parameters
    return {"parameters": parameters, "main_weights": "float32", "gradients": grads}


def precision_summary(args, dtypes: dict[str, str]) -> str:
    """Parameter, main-weight and gradient dtypes, loss scaling, the distributed optimizer and
    recompute, as one line."""
    parts = [f"parameters {dtypes['parameters']}"]
    if args.bf16 or args.fp16:
        parts.append(f"main weights and Adam state {dtypes['main_weights']} | gradients accumulated and reduced in "
                     f"{dtypes['gradients']}")
    if args.fp16:
        parts.append(f"loss scale {args.loss_scale:g} (static)" if args.loss_scale else
                     f"dynamic loss scale from {args.initial_loss_scale:g} (min {args.min_loss_scale:g}, "
                     f"window {args.loss_scale_window:g}, hysteresis {args.hysteresis})")
    if args.use_distributed_optimizer:
        parts.append("optimizer state sharded over data-parallel ranks (distributed optimizer)")
    if args.recompute_granularity == "full":
        parts.append(f"recompute full ({args.recompute_method}, {args.recompute_num_layers} layers)")
    elif args.recompute_granularity == "selective":
        parts.append(f"recompute selective ({', '.join(args.recompute_modules or ['core_attn'])})")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------
# Train
# ----------------------------------------------------------------------------------------


@dataclass
class History:
    """What the train stage saw, for the summary and the load trace."""

    start_iteration: int
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    skipped: int = 0
    """Iterations whose update was skipped (an fp16 overflow or a non-finite gradient), in this run."""
    nonfinite: int = 0
    """Iterations with a non-finite loss or gradient (not counting fp16 overflows), in this run."""
    exit_reason: str | None = None
    """Why the run stopped before --train-iters (training/exits.py), or None."""
    balances: list[dict] = field(default_factory=list)
    """Rank 0: every iteration's balance (metrics.balance), for the progress lines and the summary."""
    routed: list[np.ndarray] = field(default_factory=list)
    """Rank 0 with --moe-log-loads: routed token copies [layers, experts] per iteration."""
    sources: list[np.ndarray] = field(default_factory=list)
    """Rank 0 with --moe-log-loads: routed copies per source rank [layers, ranks, experts]."""


def train(args, run: Run) -> History:
    forward_step = forward_step_for(args)
    recorder = metrics.MoELoadRecorder(run.chunks, run.layer_numbers, args.num_experts, args.expert_model_parallel_size,
                                       compute_device(args.use_cuda))
    writer = (metrics.MetricsWriter(args.log_json, args.tensorboard_dir, args.train_iters, args.log_validation_ppl_to_tensorboard,
                                    args.tensorboard_log_interval, args.log_timers_to_tensorboard, args.log_memory_to_tensorboard)
              if dist.get_rank() == 0 else None)
    if writer is not None:
        writer.log_text("run/precision", run.precision)
    history = History(start_iteration=run.state["iteration"])
    log0(f"training: iterations {history.start_iteration} -> {args.train_iters}, {args.num_micro_batches} micro-batches of "
         f"{args.micro_batch_size} x DP {run.train_iter.dp_size}")

    def megatron_forward_backward(iterator, forward_only: bool) -> float:
        # the interleaved schedule reads every micro-batch once per chunk, each chunk from its own iterator
        iterators = iterator if len(run.chunks) == 1 else datasets.chunk_iterators(iterator, len(run.chunks))
        losses = mcore.forward_backward(forward_step, iterators, run.chunks, args.num_micro_batches, args.seq_length,
                                        args.micro_batch_size, forward_only=forward_only)
        return mean_loss_over_world(losses)

    def forward_backward(iterator, forward_only: bool) -> float:
        return run.mode.forward_backward(megatron_forward_backward, iterator, forward_only)

    def evaluate() -> float:
        recorder.enabled = False
        for model in run.models:
            model.eval()
        with torch.no_grad():
            total = [forward_backward(run.valid_iter, forward_only=True) for _ in range(args.eval_iters)]
        for model in run.models:
            model.train()
        recorder.enabled = True
        run.state["consumed_valid_samples"] = run.valid_iter.consumed_samples
        return float(np.mean(total))

    activations.persistent([p for chunk in run.chunks for p in chunk.parameters()])
    if args.manual_gc:
        # Megatron-LM's --manual-gc: no collection at random allocation counts (a rank paused in
        # one holds every other rank up at the next collective); every rank collects at the same
        # iterations instead
        gc.disable()
        gc.collect()
    saved_at = None
    with StallWatchdog(args.stall_timeout) as watchdog, ExitConditions(args) as exits:
        for iteration in range(history.start_iteration + 1, args.train_iters + 1):
            started = time.perf_counter()
            if args.use_cuda:
                torch.cuda.reset_peak_memory_stats()
            run.mode.zero_grad(run.chunks, run.optimizer)
            run.mode.begin_iteration(iteration)
            loss = forward_backward(run.train_iter, forward_only=False)
            kept_bytes = activations.take_peak()
            lr_used = run.optimizer.param_groups[0]["lr"]
            update_ok, grad_norm, num_zeros = run.optimizer.step()
            if args.log_num_zeros_in_grad:  # before end_iteration, which consumes a mode's outside gradients
                num_zeros += run.mode.outside_zeros_in_grad()
            run.scheduler.step(increment=1)
            loads = recorder.collect()
            record = run.mode.end_iteration(
                StepResult(iteration, update_ok, grad_norm, lr_used, args.clip_grad, loads.routed_LE, loads.processed_LE)
            )
            if record is not None and "layers" in record:  # the mode's per-layer figures of every stage
                # in layer order: with virtual stages a rank's layers are not contiguous
                record["layers"] = sorted(mcore.every_stage(record["layers"]), key=lambda entry: entry["layer"])
            elapsed = time.perf_counter() - started
            for line in run.mode.take_log():
                log0(line)
            history.skipped += not update_ok
            # one decision on every rank: the loss is the world's mean, the gradient check world-wide
            nonfinite = not math.isfinite(loss) or (not update_ok and not args.fp16)
            history.nonfinite += nonfinite
            history.times.append(elapsed)
            history.losses.append(loss)
            run.state["iteration"] = iteration
            run.state["consumed_train_samples"] = run.train_iter.consumed_samples
            owner_layers = None
            if dist.get_rank() == 0:
                owner_layers = metrics.moe_layer_records(
                    loads, run.layer_numbers,
                    run.mode.owner_positions_LE(len(run.layer_numbers), args.num_experts, args.expert_model_parallel_size))
                history.balances.append(metrics.balance(owner_layers, run.mode.placed_layers(record),
                                                        "ep" if run.mode.owners_are_ep else run.mode.name, run.mode.name))
                if args.moe_log_loads:
                    history.routed.append(loads.routed_LE)
                    history.sources.append(loads.source_routed_LSE)
            if iteration % args.log_interval == 0 or iteration == args.train_iters or nonfinite:
                log_iteration(args, run, writer, history, iteration, loss, grad_norm, update_ok, elapsed, loads, record, kept_bytes,
                              num_zeros, owner_layers)
            if nonfinite:
                stop_or_skip(args, history, iteration, loss, update_ok, writer)
            if args.eval_interval and iteration % args.eval_interval == 0 and args.eval_iters > 0:
                if args.manual_gc and args.manual_gc_eval:
                    gc.collect()
                history.eval_loss = evaluate()
                if args.manual_gc and args.manual_gc_eval:
                    gc.collect()
                if writer is not None:
                    writer.log_eval(iteration, history.eval_loss)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                save(args, run, iteration)
                saved_at = iteration
            if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
                gc.collect()
            watchdog.progress(iteration)
            reason = exits.reason(iteration)
            if reason is not None and iteration < args.train_iters:
                history.exit_reason = reason
                saved = ""
                if args.save and saved_at != iteration:
                    save(args, run, iteration)
                    saved_at = iteration
                if args.save:
                    saved = f"; the checkpoint of iteration {iteration} in {args.save} resumes it"
                log0(f"exit: after iteration {iteration} of {args.train_iters}: {history.exit_reason}{saved}")
                break

        if args.save and saved_at != args.train_iters and history.exit_reason is None and args.train_iters > history.start_iteration:
            save(args, run, args.train_iters)
    if args.manual_gc:
        gc.enable()  # the collector as it was, for what follows the loop (and the next run in this process)
    if writer is not None:
        writer.close()
    return history


def stop_or_skip(args, history: History, iteration: int, loss: float, update_ok: bool, writer) -> None:
    """After a non-finite step: say so, and stop once more than --max-nonfinite-steps were seen
    (before any evaluation or checkpoint of this state)."""
    what = f"loss {loss}" if not math.isfinite(loss) else "loss finite, a gradient"
    step = "the update was skipped on every rank" if not update_ok else "the update was applied (its gradients were finite)"
    log0(f"non-finite: iteration {iteration}: {what} is not finite; {step} ({history.nonfinite} non-finite step(s), "
         f"--max-nonfinite-steps {args.max_nonfinite_steps})")
    if history.nonfinite <= args.max_nonfinite_steps:
        return
    if writer is not None:
        writer.close()
    saved = f"; the newest checkpoint in {args.save} is untouched" if args.save else ""
    message = (f"iteration {iteration}: {history.nonfinite} non-finite step(s), more than --max-nonfinite-steps "
               f"{args.max_nonfinite_steps} allows; no checkpoint of this state was written{saved}")
    if dist.get_rank() == 0:
        print(f"pretrain_gpt_moe.py: stopped: {message}", file=sys.stderr, flush=True)
    dist.barrier()  # no rank exits before rank 0 said why: the launcher kills the others at the first exit
    raise NonFiniteTraining(message)


def log_iteration(args, run: Run, writer, history: History, iteration: int, loss: float, grad_norm, update_ok, elapsed: float,
                  loads, record: dict | None, kept_bytes: int, num_zeros, owner_layers: list[dict] | None) -> None:
    """One metrics record (rank 0 writes it, with `owner_layers`, the common per-layer records;
    every rank takes part in the mode's collectives)."""
    element_bytes = 2 if (args.bf16 or args.fp16) else 4
    remote_copies = run.mode.a2a_remote_copies(loads)
    memory = activation_memory(args.use_cuda, kept_bytes)
    # a collective: every rank
    params_norm = run.mode.params_norm(run.optimizer) if args.log_params_norm else None
    mtp_loss = mcore.take_mtp_losses(args.mtp_num_layers, args.num_micro_batches) if args.mtp_num_layers else None
    if record is not None:
        record["memory"] = run.mode.memory_report()
    if writer is None:
        return
    metrics_record = {
        "iteration": iteration,
        "start_iteration": history.start_iteration,
        "loss": loss,
        **({"mtp_loss": mtp_loss} if mtp_loss is not None else {}),
        "lr": run.scheduler.get_lr(run.optimizer.param_groups[0]),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "update_successful": bool(update_ok),
        "loss_scale": mcore.loss_scale(run.optimizer),
        "skipped_iterations": history.skipped,
        "dtypes": run.dtypes,
        "tokens_per_s": args.global_batch_size * args.seq_length / elapsed,
        "iteration_time_s": elapsed,
        **({"params_norm": params_norm} if args.log_params_norm else {}),
        **({"num_zeros_in_grad": int(num_zeros)} if args.log_num_zeros_in_grad else {}),
        # --log-throughput: Megatron-LM's model FLOPs over this iteration's time, per rank
        **({"tflops_per_gpu": run.flops_per_iteration / (elapsed * 1e12 * args.world_size)} if args.log_throughput else {}),
        "moe_layers": owner_layers,
        "balance": history.balances[-1],
        # token copies crossing ranks: EP's ownership, or where the mode's dispatch plans sent them
        "bytes": {"a2a": 4 * remote_copies * args.hidden_size * element_bytes},
        "memory": memory,
        **({run.mode.name: record} if record is not None else {}),
    }
    placed, survival = run.mode.progress(metrics_record)
    writer.log(metrics_record, placed, survival, run.mode.tensorboard_scalars(metrics_record))


def compute_device(use_cuda: bool) -> torch.device:
    """This rank's GPU (set in init_distributed), or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def activation_memory(use_cuda: bool, kept_bytes: int) -> dict[str, list[int]]:
    """Every rank's activation memory this iteration: `activation_bytes`, what its largest
    micro-batch forward kept for the backward (measured by `compat.activations`, on every
    device), and on CUDA the allocator's peak over the iteration, which also holds the recomputed
    layer, the gradients and the optimizer's work."""
    mine_2 = torch.tensor([kept_bytes, torch.cuda.max_memory_allocated() if use_cuda else 0], dtype=torch.int64,
                          device=compute_device(use_cuda))
    ranks_R2 = [torch.empty_like(mine_2) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks_R2, mine_2)
    kept_R, peak_R = torch.stack(ranks_R2).cpu().T.tolist()
    return {"activation_bytes": kept_R, **({"cuda_peak_allocated_bytes": peak_R} if use_cuda else {})}


def save(args, run: Run, iteration: int) -> None:
    """A rank that cannot write its part (disk full, file-size limit, permissions) says so and
    raises CheckpointWriteFailed (exit code 5); the launcher ends the others, and the tracker
    still names the previous complete checkpoint."""
    try:
        path, removed = checkpoint.save(args.save, iteration, run.chunks, run.optimizer, run.scheduler, run.state,
                                        run.mode, args)
    except checkpoint.CheckpointWriteFailed as error:
        if error.own:  # the ranks torch_dist only told of another's failure stay quiet
            kept = checkpoint_dirs.latest_iteration(args.save)
            tracker = f"the tracker names iteration {kept}" if kept is not None else "no checkpoint yet"
            print(f"pretrain_gpt_moe.py: stopped: {error}; the checkpoints in {args.save} are untouched ({tracker})",
                  file=sys.stderr, flush=True)
        raise
    log0(f"checkpoint: saved {path}")
    for directory in removed:
        log0(f"checkpoint: removed {directory} (--keep-last-checkpoints {args.keep_last_checkpoints})")


# ----------------------------------------------------------------------------------------
# Finish
# ----------------------------------------------------------------------------------------


def write_load_trace(args, run: Run, history: History) -> None:
    """--moe-log-loads: the run's routed loads as a trace (rank 0)."""
    if dist.get_rank() != 0 or not args.moe_log_loads or not history.routed:
        return
    write_trace(
        args.moe_log_loads,
        np.stack(history.routed).astype(np.int64),
        np.stack(history.sources).astype(np.int64),
        model=args.model_family,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ranks=int(history.sources[0].shape[1]),
        topk=args.moe_router_topk,
        expert_parallel_size=args.expert_model_parallel_size,
        moe_layer_numbers=run.layer_numbers,
    )
    log0(f"trace: wrote {args.moe_log_loads} ({len(history.routed)} iterations)")


def finish(args, history: History) -> Summary:
    """Print the summary line, plot the run folder's metrics, tear the process groups down."""
    times, losses_seen = history.times, history.losses
    steady = times[1:] if len(times) > 1 else times
    mean_s = float(np.mean(steady)) if steady else float("nan")
    summary = Summary(
        iterations=len(times),
        first_loss=losses_seen[0] if losses_seen else float("nan"),
        last_loss=losses_seen[-1] if losses_seen else float("nan"),
        mean_iteration_s=mean_s,
        tokens_per_s=args.global_batch_size * args.seq_length / mean_s if steady else float("nan"),
        eval_loss=history.eval_loss,
        balance=metrics.balance_summary(history.balances) or None,
    )
    log0(
        f"summary: {summary.iterations} iterations | loss {summary.first_loss:.4f} -> {summary.last_loss:.4f} | "
        f"{summary.mean_iteration_s * 1e3:.1f} ms/iteration (excluding the first) | {summary.tokens_per_s:.0f} tokens/s"
        + (f" | eval loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else "")
        + (f" | {summary.balance}" if summary.balance else "")
    )
    if args.run_dir and dist.get_rank() == 0:
        plot = Path(args.run_dir) / outputs.PLOT
        outputs.plot_run(metrics.read_records(args.log_json), plot)
        log0(f"run folder: {args.run_dir} ({', '.join(sorted(p.name for p in Path(args.run_dir).iterdir()))})")
    tear_down()
    return summary


def tear_down() -> None:
    dist.barrier()
    activations.forget()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
