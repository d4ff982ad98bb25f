"""Zebra mode's own training loop (DESIGN 4.7, 4.8), kept apart from the shared loop until the
zebra issue moves the ZebraEngine onto the ModeRuntime steps (training/modes.py SEPARATE_LOOPS).

Set-up (process groups, compat, the printed arguments) and the summary are the shared loop's.
"""

from __future__ import annotations

import time

import numpy as np
import torch.distributed as dist

from megatron_patches.compat import mcore
from megatron_patches.data import datasets
from megatron_patches.training import metrics
from megatron_patches.training.loop import (
    History, Summary, build_data, finish, log0, precision_dtypes, seed_everything, stop_or_skip,
)
from megatron_patches.training.model import build_model
from megatron_patches.training.steps import gpt_loss
from megatron_patches.training.watchdog import StallWatchdog


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
    dtypes = precision_dtypes(args, model)
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
    train_iter = datasets.BatchIterator(train_ds, args.micro_batch_size, dp_rank, dp_size)
    valid_iter = datasets.BatchIterator(valid_ds, args.micro_batch_size, dp_rank, dp_size)

    def microbatches(iterator):
        """This attention rank's R micro-batches of one global batch; None on expert ranks."""
        return [datasets.gpt_batch(next(iterator)) for _ in range(config.microbatches)] if attention else None

    layer_numbers = list(range(1, args.num_layers + 1))
    writer = metrics.MetricsWriter(args.log_json, args.tensorboard_dir, args.train_iters) if rank == 0 else None
    tokens_per_iteration = args.global_batch_size * args.seq_length
    history = History(start_iteration=0)
    log0(f"training: iterations 0 -> {args.train_iters}, {config.microbatches} micro-batches of {args.micro_batch_size} "
         f"x {dp_size} attention ranks")
    with StallWatchdog(args.stall_timeout) as watchdog:
        for iteration in range(1, args.train_iters + 1):
            started = time.perf_counter()
            result = engine.train_step(microbatches(train_iter))
            scheduler.step(increment=1)
            routed_LE, bytes_sent = engine.last_run_counts()
            if config.timeline is not None and iteration == args.train_iters:
                engine.write_timeline(config.timeline)  # the last training iteration's schedule
                log0(f"zebra: wrote the timeline of iteration {iteration} to {config.timeline} (tools/plot_timeline.py draws it)")
            elapsed = time.perf_counter() - started
            history.times.append(elapsed)
            history.losses.append(result.loss)
            # one decision on every rank: the loss and the gradient norm are world-wide values
            nonfinite = not result.update_successful
            history.skipped += nonfinite
            history.nonfinite += nonfinite
            if writer is not None and (iteration % args.log_interval == 0 or iteration == args.train_iters or nonfinite):
                placed = f" (zebra M={layout.attention_ranks} N={layout.expert_ranks} R={config.microbatches})"
                writer.log(
                    {
                        "iteration": iteration,
                        "loss": result.loss,
                        "lr": scheduler.get_lr(engine.optimizer.param_groups[0]),
                        "grad_norm": result.grad_norm,
                        "update_successful": result.update_successful,
                        # the record fields of every mode; zebra trains in fp32 (no loss scale)
                        "loss_scale": 1.0,
                        "skipped_iterations": history.skipped,
                        "dtypes": dtypes,
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
                    },
                    placed,
                    1.0,  # zebra is dropless
                    {},
                )
            if nonfinite:
                stop_or_skip(args, history, iteration, result.loss, result.update_successful, writer)
            if args.eval_interval and iteration % args.eval_interval == 0 and args.eval_iters > 0:
                history.eval_loss = float(np.mean([engine.evaluate(microbatches(valid_iter)) for _ in range(args.eval_iters)]))
                if writer is not None:
                    writer.log_eval(iteration, history.eval_loss)
            watchdog.progress(iteration)
    if writer is not None:
        writer.close()
    return finish(args, history.times, history.losses, history.eval_loss)
