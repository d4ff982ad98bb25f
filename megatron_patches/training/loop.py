"""The training loop: Megatron-Core parts applied in one visible order.

    distributed init -> Megatron compat -> model-parallel groups + RNG -> tokenizer + data
    -> model (layer spec of the chosen MoE mode) -> DDP -> optimizer -> LR schedule
    -> optional resume -> train (forward/backward via Megatron's pipeline schedules,
       metrics, eval, checkpoints) -> summary

Megatron-Core ships no `megatron.training`; this is the lean equivalent built from its parts.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state

from megatron_patches.compat import mcore, prepare_megatron
from megatron_patches.placement.trace import write_trace
from megatron_patches.training import checkpoint, data, metrics
from megatron_patches.training.arguments import describe_args
from megatron_patches.training.model import build_model, stock_moe_spec


def log0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


# ----------------------------------------------------------------------------------------
# Stage 1: processes
# ----------------------------------------------------------------------------------------


def init_distributed(use_cuda: bool, backend: str) -> None:
    """torch.distributed from torchrun's environment, or a world of one for a plain process."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))


# ----------------------------------------------------------------------------------------
# Stage 2: data
# ----------------------------------------------------------------------------------------


def resolve_default_corpus(args) -> None:
    """With neither --data-path nor --mock-data, train on the embedded real corpus."""
    if args.data_path or args.mock_data:
        return
    from megatron_patches.training.corpus import ensure_default_corpus

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
    tokenizer = data.build_tokenizer(args)
    vocab = data.padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    train_ds, valid_ds, _ = data.build_datasets(args, tokenizer)
    return tokenizer, vocab, train_ds, valid_ds


def seed_everything(args) -> None:
    """Megatron-LM: the same seed on all DP ranks, offset per PP stage."""
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    mcore.seed_model_parallel_rng(seed)


# ----------------------------------------------------------------------------------------
# Forward steps (one per model family)
# ----------------------------------------------------------------------------------------


def _masked_mean(losses_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return (losses_BS.float() * mask_BS).sum() / mask_BS.sum().clamp(min=1.0)


def gpt_loss(mask_BS, output_BS):
    loss = _masked_mean(output_BS, mask_BS)
    return loss, {"lm loss": loss.detach().clone()}  # clone: Megatron divides `loss` in place


def gpt_forward_step(data_iterator, model):
    batch = data.gpt_batch(next(data_iterator))
    output_BS = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output_BS, partial(gpt_loss, batch["loss_mask"])


def bert_loss(mask_BS, is_random_B, output):
    lm_losses_BS, binary_logits_B2 = output
    lm = _masked_mean(lm_losses_BS, mask_BS)
    if binary_logits_B2 is None:
        return lm, {"lm loss": lm.detach().clone()}
    sop = F.cross_entropy(binary_logits_B2.view(-1, 2).float(), is_random_B.view(-1), ignore_index=-1)
    loss = lm + sop
    return loss, {"lm loss": loss.detach().clone()}  # clone: Megatron divides `loss` in place


def bert_forward_step(data_iterator, model, binary_head: bool):
    batch = data.bert_batch(next(data_iterator))
    output = model(
        batch["tokens"], batch["padding_mask"], tokentype_ids=batch["types"] if binary_head else None, lm_labels=batch["labels"]
    )
    if not isinstance(output, tuple):
        output = (output, None)
    return output, partial(bert_loss, batch["loss_mask"], batch["is_random"])


def _mean_loss_over_world(losses: list[dict]) -> float:
    """Mean micro-batch loss of the last pipeline stage, averaged over data-parallel ranks."""
    values = [float(d["lm loss"]) for d in losses] if losses else []
    counts = torch.tensor([sum(values), float(len(values))], dtype=torch.float64)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        counts.zero_()
    dist.all_reduce(counts)
    return float(counts[0] / counts[1]) if counts[1] > 0 else float("nan")


# ----------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------


@dataclass
class Summary:
    iterations: int
    first_loss: float
    last_loss: float
    mean_iteration_s: float
    tokens_per_s: float
    eval_loss: float | None


def pretrain(args) -> Summary:
    use_cuda = args.use_cuda
    init_distributed(use_cuda, args.distributed_backend)
    shims = prepare_megatron(use_cuda)
    log0(describe_args(args))
    log0(f"device: {'cuda' if use_cuda else 'cpu'} | world {dist.get_world_size()} | CPU shims: {', '.join(shims) or 'none'}")
    if args.moe_parallel_mode == "zebra":
        return pretrain_zebra(args)

    # Parallelisms, in one order: TP, PP, EP (x ETP), DP is what remains.
    mcore.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
        args.expert_tensor_parallel_size,
    )
    seed_everything(args)

    tokenizer, vocab, train_ds, valid_ds = build_data(args)

    # All MoE layers of the model (1-based global numbers), not only this stage's: the load
    # metrics and the trace cover the whole model.
    pattern = mcore.moe_layer_pattern(mcore.transformer_config(args, use_cuda))
    layer_numbers = [i + 1 for i, is_moe in enumerate(pattern) if is_moe]
    fssdp = replicate = None
    moe_spec_fn = stock_moe_spec
    if args.moe_parallel_mode == "fssdp":
        from megatron_patches.fssdp import FSSDPConfig, FSSDPRuntime

        fssdp = FSSDPRuntime(FSSDPConfig.from_args(args), args.num_experts, layer_numbers, use_cuda)
        moe_spec_fn = fssdp.moe_spec
    elif args.moe_parallel_mode == "replicate":
        from megatron_patches.replicate import AdamConfig
        from megatron_patches.replicate.config import ReplicateConfig
        from megatron_patches.replicate.runtime import ReplicateRuntime

        # The experts' optimizer takes Megatron's Adam settings (AdamW: decoupled weight decay).
        adam = AdamConfig(args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps, args.weight_decay, decoupled_weight_decay=True)
        replicate = ReplicateRuntime(ReplicateConfig.from_args(args), args.num_experts, layer_numbers, use_cuda, adam)
        moe_spec_fn = replicate.moe_spec
        slots = args.expert_model_parallel_size * args.replicate_slots_per_rank
        if slots == args.num_experts:
            log0(f"replicate: ranks x slots = {args.expert_model_parallel_size} x {args.replicate_slots_per_rank} = "
                 f"{slots} = --num-experts, so every expert gets exactly one instance and every policy places the "
                 "experts alike (DESIGN 4.6: at least one instance each); raise --replicate-slots-per-rank to leave "
                 "room for replicas")
    model, config = build_model(args, vocab, on_gpu=use_cuda, moe_spec_fn=moe_spec_fn)
    ddp = mcore.wrap_ddp(config, model, args)
    if fssdp is not None:
        fssdp.attach(mcore.transformer_layers(model), config)
    optimizer = mcore.optimizer(args, [ddp])
    if fssdp is not None:
        fssdp.attach_optimizer(optimizer)  # re-sharding moves the experts' optimizer state too
    if replicate is not None:
        replicate.attach(mcore.transformer_layers(model), config, optimizer)
    scheduler = mcore.scheduler(args, optimizer)
    num_params = sum(p.numel() for p in model.parameters())
    log0(f"model: {args.model_family} | {num_params:,} parameters on rank 0 | vocab {tokenizer.vocab_size} padded to {vocab}")

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    state = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    if args.load:
        loaded, notes = checkpoint.load(
            args.load, [ddp], optimizer, scheduler, not args.no_load_optim, not args.no_load_rng, replicate=replicate
        )
        state.update({k: loaded[k] for k in state})
        for note in notes:
            log0(f"checkpoint: {note}")

    train_iter = data.BatchIterator(train_ds, args.micro_batch_size, dp_rank, dp_size, state["consumed_train_samples"])
    valid_iter = data.BatchIterator(valid_ds, args.micro_batch_size, dp_rank, dp_size, state["consumed_valid_samples"])
    if args.model_family == "gpt":
        forward_step = gpt_forward_step
    else:
        forward_step = partial(bert_forward_step, binary_head=args.bert_binary_head)

    recorder = metrics.MoELoadRecorder([ddp], layer_numbers, args.num_experts, args.expert_model_parallel_size)
    writer = metrics.MetricsWriter(args.log_json, args.tensorboard_dir, args.train_iters) if dist.get_rank() == 0 else None
    trace_routed, trace_sources = [], []
    element_bytes = 2 if (args.bf16 or args.fp16) else 4
    tokens_per_iteration = args.global_batch_size * args.seq_length
    start_iteration = state["iteration"]
    losses_seen: list[float] = []
    times: list[float] = []
    eval_loss = None
    log0(f"training: iterations {start_iteration} -> {args.train_iters}, {args.num_micro_batches} micro-batches of {args.micro_batch_size} x DP {dp_size}")

    def evaluate() -> float:
        recorder.enabled = False
        model.eval()
        total = []
        with torch.no_grad():
            for _ in range(args.eval_iters):
                out = mcore.forward_backward(
                    forward_step, valid_iter, [ddp], args.num_micro_batches, args.seq_length, args.micro_batch_size, forward_only=True
                )
                total.append(_mean_loss_over_world(out))
        model.train()
        recorder.enabled = True
        state["consumed_valid_samples"] = valid_iter.consumed_samples
        return float(np.mean(total))

    for iteration in range(start_iteration + 1, args.train_iters + 1):
        started = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        if fssdp is not None:
            fssdp.begin_iteration(iteration)
        if replicate is not None:
            replicate.begin_iteration()
        losses = mcore.forward_backward(
            forward_step, train_iter, [ddp], args.num_micro_batches, args.seq_length, args.micro_batch_size, forward_only=False
        )
        lr_used = optimizer.param_groups[0]["lr"]
        update_ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        loss = _mean_loss_over_world(losses)
        loads = recorder.collect()
        fssdp_record = fssdp.end_iteration(loads.processed_LE) if fssdp is not None else None
        replicate_record = (
            replicate.end_iteration(iteration, update_ok, grad_norm, lr_used, args.clip_grad, loads.routed_LE)
            if replicate is not None
            else None
        )
        elapsed = time.perf_counter() - started
        if fssdp is not None:
            for line in fssdp.log:
                log0(line)
            fssdp.log.clear()
        times.append(elapsed)
        losses_seen.append(loss)
        state["iteration"] = iteration
        state["consumed_train_samples"] = train_iter.consumed_samples
        if dist.get_rank() == 0 and args.moe_log_loads:
            trace_routed.append(loads.routed_LE)
            trace_sources.append(loads.source_routed_LSE)
        log_now = iteration % args.log_interval == 0 or iteration == args.train_iters
        # token copies crossing ranks: EP's ownership, or where the mode's dispatch plans sent them
        mode_record = fssdp_record or replicate_record
        remote_copies = mode_record["a2a_remote_copies"] if mode_record is not None else loads.remote_copies
        if fssdp_record is not None and log_now:
            fssdp_record["memory"] = fssdp.memory_report(optimizer)
        if replicate_record is not None and log_now:
            replicate_record["memory"] = replicate.memory_report()
        if writer is not None and log_now:
            writer.log(
                {
                    "iteration": iteration,
                    "start_iteration": start_iteration,
                    "loss": loss,
                    "lr": scheduler.get_lr(optimizer.param_groups[0]),
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "update_successful": bool(update_ok),
                    "tokens_per_s": tokens_per_iteration / elapsed,
                    "iteration_time_s": elapsed,
                    "moe_layers": metrics.moe_layer_records(loads, layer_numbers, args.expert_model_parallel_size),
                    "bytes": {"a2a": 4 * remote_copies * args.hidden_size * element_bytes},
                    **({"fssdp": fssdp_record} if fssdp_record is not None else {}),
                    **({"replicate": replicate_record} if replicate_record is not None else {}),
                }
            )
        if args.eval_interval and iteration % args.eval_interval == 0 and args.eval_iters > 0:
            eval_loss = evaluate()
            if writer is not None:
                writer.log_eval(iteration, eval_loss)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            path = checkpoint.save(args.save, iteration, [ddp], optimizer, scheduler, state, replicate=replicate)
            log0(f"checkpoint: saved {path}")

    if args.save and (not args.save_interval or args.train_iters % args.save_interval != 0) and args.train_iters > start_iteration:
        path = checkpoint.save(args.save, args.train_iters, [ddp], optimizer, scheduler, state, replicate=replicate)
        log0(f"checkpoint: saved {path}")
    if dist.get_rank() == 0 and args.moe_log_loads and trace_routed:
        write_trace(
            args.moe_log_loads,
            np.stack(trace_routed).astype(np.int64),
            np.stack(trace_sources).astype(np.int64),
            model=args.model_family,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            ranks=int(trace_sources[0].shape[1]),
            topk=args.moe_router_topk,
            expert_parallel_size=args.expert_model_parallel_size,
            moe_layer_numbers=layer_numbers,
        )
        log0(f"trace: wrote {args.moe_log_loads} ({len(trace_routed)} iterations)")
    if writer is not None:
        writer.close()

    return finish(times, losses_seen, eval_loss, tokens_per_iteration)


def finish(times: list[float], losses_seen: list[float], eval_loss: float | None, tokens_per_iteration: int) -> Summary:
    """Print the summary line, tear the process groups down."""
    steady = times[1:] if len(times) > 1 else times
    mean_s = float(np.mean(steady)) if steady else float("nan")
    summary = Summary(
        iterations=len(times),
        first_loss=losses_seen[0] if losses_seen else float("nan"),
        last_loss=losses_seen[-1] if losses_seen else float("nan"),
        mean_iteration_s=mean_s,
        tokens_per_s=tokens_per_iteration / mean_s if steady else float("nan"),
        eval_loss=eval_loss,
    )
    log0(
        f"summary: {summary.iterations} iterations | loss {summary.first_loss:.4f} -> {summary.last_loss:.4f} | "
        f"{summary.mean_iteration_s * 1e3:.1f} ms/iteration (excluding the first) | {summary.tokens_per_s:.0f} tokens/s"
        + (f" | eval loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else "")
    )
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return summary


# ----------------------------------------------------------------------------------------
# Zebra mode: its own engine runs forward, backward and the optimizer
# ----------------------------------------------------------------------------------------


def pretrain_zebra(args) -> Summary:
    """Zebra mode (DESIGN 4.7, 4.8): Megatron's GPT model built whole on every rank (TP = PP =
    EP = 1), split by role by the ZebraEngine, which runs the zig-zag schedule, the gradient sums
    and AdamW with Megatron's parameter groups; Megatron's OptimizerParamScheduler drives its lr.
    Only attention ranks read data (R micro-batches each per iteration)."""
    from megatron_patches.zebra.config import ZebraConfig
    from megatron_patches.zebra.engine import AdamSettings, ZebraEngine
    from megatron_patches.zebra.pools import pool_cluster, zebra_layout

    use_cuda = args.use_cuda
    config = ZebraConfig.from_args(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = zebra_layout(pool_cluster(config.cluster, world), config.attention_ranks, config.expert_ranks, world,
                          num_layers=args.num_layers, num_experts=args.num_experts, asym_ea=config.asym_ea,
                          profile=config.profile)
    mcore.initialize_model_parallel(1, 1, 1, 1)
    seed_everything(args)
    tokenizer, vocab, train_ds, valid_ds = build_data(args)
    model, _ = build_model(args, vocab, on_gpu=use_cuda)
    engine = ZebraEngine(model, config, layout, AdamSettings.from_args(args),
                         loss_fn=lambda losses_BS, batch: gpt_loss(batch["loss_mask"], losses_BS)[0])
    scheduler = mcore.scheduler(args, engine.optimizer)
    owned = sum(p.numel() for p in engine.dense_params + engine.expert_params)
    log0(f"model: gpt | {owned:,} parameters on rank 0 (its role's share) | vocab {tokenizer.vocab_size} padded to {vocab}")
    log0(f"zebra: {layout.num_groups} ZP group(s) of M={layout.attention_ranks} attention + N={layout.expert_ranks} "
         f"expert ranks ({layout.attention_device_type} / {layout.expert_device_type}); R={config.microbatches} "
         f"micro-batches per attention rank; Asym-EA offload chunks per layer {list(layout.asym_ea.offload_chunks_L)}")

    attention = layout.roles[rank] == "attention"
    dp_size = len(layout.attention_dp_group)
    dp_rank = layout.attention_dp_group.index(rank) if attention else 0
    train_iter = data.BatchIterator(train_ds, args.micro_batch_size, dp_rank, dp_size)
    valid_iter = data.BatchIterator(valid_ds, args.micro_batch_size, dp_rank, dp_size)

    def microbatches(iterator):
        """This attention rank's R micro-batches of one global batch; None on expert ranks."""
        return [data.gpt_batch(next(iterator)) for _ in range(config.microbatches)] if attention else None

    layer_numbers = list(range(1, args.num_layers + 1))
    writer = metrics.MetricsWriter(args.log_json, args.tensorboard_dir, args.train_iters) if rank == 0 else None
    tokens_per_iteration = args.global_batch_size * args.seq_length
    times: list[float] = []
    losses_seen: list[float] = []
    eval_loss = None
    log0(f"training: iterations 0 -> {args.train_iters}, {config.microbatches} micro-batches of {args.micro_batch_size} "
         f"x {dp_size} attention ranks")
    for iteration in range(1, args.train_iters + 1):
        started = time.perf_counter()
        result = engine.train_step(microbatches(train_iter))
        scheduler.step(increment=1)
        routed_LE, bytes_sent = engine.last_run_counts()
        if config.timeline is not None and iteration == args.train_iters:
            engine.write_timeline(config.timeline)  # the last training iteration's schedule
            log0(f"zebra: wrote the timeline of iteration {iteration} to {config.timeline} (tools/plot_timeline.py draws it)")
        elapsed = time.perf_counter() - started
        times.append(elapsed)
        losses_seen.append(result.loss)
        if writer is not None and (iteration % args.log_interval == 0 or iteration == args.train_iters):
            writer.log(
                {
                    "iteration": iteration,
                    "loss": result.loss,
                    "lr": scheduler.get_lr(engine.optimizer.param_groups[0]),
                    "grad_norm": result.grad_norm,
                    "update_successful": True,
                    "tokens_per_s": tokens_per_iteration / elapsed,
                    "iteration_time_s": elapsed,
                    "moe_layers": metrics.zebra_layer_records(routed_LE, engine.owners_LE, layout, layer_numbers),
                    "bytes": {"a2a": bytes_sent["dispatch"] + bytes_sent["combine"], **{f"a2a_{k}": v for k, v in bytes_sent.items()}},
                    "zebra": {
                        "attention_ranks": layout.attention_ranks,
                        "expert_ranks": layout.expert_ranks,
                        "zp_groups": layout.num_groups,
                        "microbatches": config.microbatches,
                        "offload_chunks": list(layout.asym_ea.offload_chunks_L),
                    },
                }
            )
        if args.eval_interval and iteration % args.eval_interval == 0 and args.eval_iters > 0:
            eval_loss = float(np.mean([engine.evaluate(microbatches(valid_iter)) for _ in range(args.eval_iters)]))
            if writer is not None:
                writer.log_eval(iteration, eval_loss)
    if writer is not None:
        writer.close()
    return finish(times, losses_seen, eval_loss, tokens_per_iteration)
