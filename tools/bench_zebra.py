#!/usr/bin/env python
"""Zebra on CPU ranks: naive disaggregation vs zebra vs zebra + Asym-EA, bubbles and iteration time.

    python tools/bench_zebra.py                            # M = N = 2, R = 4, no emulation
    python tools/bench_zebra.py --expert-slowdown 3        # EMULATED 3x slower expert ranks

One run spawns M + N local gloo ranks and trains the same model (same seed, same synthetic
tokens) three times with the zebra engine (megatron_patches.zebra.engine):

- naive: disaggregated, one micro-batch at a time (its whole forward and backward through
  attention and expert ranks before the next starts): attention and expert ranks never compute
  at once;
- zebra: the Theorem-1 zig-zag order of placement.zebra.task_order (R micro-batches in flight);
- zebra + Asym-EA: the same, with the offload plan of placement.zebra.asym_ea computed from a
  profile measured on the zebra run's own timeline: T_A^attn = mean attention task (forward +
  backward) per layer and micro-batch on attention ranks, T_E^exp = mean expert task on expert
  ranks, T_E^attn = T_E^exp / slowdown (the same CPU without the emulated slowdown), no memory
  bounds (n_min = 0, n_max = every expert).

Printed per mode: median iteration time (max over ranks) and the mean compute-stream bubble of
attention and expert ranks over the last iteration's timeline (zebra.timeline.bubble_fractions).

The baselines process zebra's global batch (micro batch x R x M sequences, the same tokens per
iteration) through the training script in ep mode (`pretrain_gpt_moe.py`, Megatron's EP, mock
tokens of the same vocabulary, one torchrun per measurement):

- ep: EP over all M + N ranks;
- EP-Ideal (HeterMoE's EP (Ideal), as the simulator's ep-ideal): EP on each rank type alone, M
  ranks and N ranks, throughputs summed; the iteration time is zebra's tokens at that throughput.
  The two EP runs run at the same time: on a CPU machine with fewer cores than ranks, one of them
  alone would have every core, which a pool's GPU types never give each other (measured on 2
  cores, M = N = 2: apart, EP-Ideal came out 2.5x ep).

An ep time is the training loop's `iteration_time_s` (its batch read, forward, backward,
optimizer step and the load count's all-reduce), zebra's the engine's train_step on batches
built beforehand: the ep figures carry a little more work. The losses differ (other tokens).

With --expert-slowdown F (below) the N expert ranks stand for older GPUs, F times slower. The
ep runs cannot sleep as zebra's expert ranks do (no training flag reaches an emulation), so
their times are scaled (EMULATED): ep's measured time x F (lockstep EP waits for
its slowest rank at every all-to-all; its communication is scaled too, so this is an upper
bound), and the N-rank EP's time x F in EP-Ideal. Speedups are against ep.

CPU ranks all run at the same speed. ``--expert-slowdown F`` (default 1: off) EMULATES older
expert GPUs: after every expert task an expert rank sleeps (F - 1) x the task's time. It is an
engine argument only this tool sets (emulated_expert_slowdown); no training flag reaches it.
The timelines of the last iteration of every mode are written to --out-dir
(tools/plot_timeline.py draws them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODES = ("naive", "zebra", "zebra + Asym-EA")
ENTRY = REPO / "pretrain_gpt_moe.py"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention-ranks", type=int, default=2, help="M")
    parser.add_argument("--expert-ranks", type=int, default=2, help="N")
    parser.add_argument("--microbatches", type=int, default=4, help="R")
    parser.add_argument("--iters", type=int, default=4, help="timed iterations per mode (after one warm-up)")
    parser.add_argument("--expert-slowdown", type=float, default=1.0,
                        help="EMULATION: expert ranks sleep (F - 1) x each expert task's time; 1 = off")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=512)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1024, help="synthetic tokens (NullTokenizer)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_zebra_out"))
    args = parser.parse_args(argv)
    if args.expert_slowdown < 1.0:
        parser.error(f"--expert-slowdown={args.expert_slowdown} is invalid; valid: >= 1 (1 = no emulation)")
    sequences = args.attention_ranks * args.microbatches  # micro-batches of zebra's global batch
    for ranks in (args.attention_ranks + args.expert_ranks, args.expert_ranks):
        if sequences % ranks:
            parser.error(f"--attention-ranks={args.attention_ranks} x --microbatches={args.microbatches} = {sequences} "
                         f"micro-batches per iteration do not split over the {ranks} ranks of an ep baseline; valid: "
                         f"M x R a multiple of M + N and of N")
    return args


def model_flags(opts) -> list[str]:
    return [
        "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden_size),
        "--ffn-hidden-size", str(opts.moe_ffn_hidden_size), "--moe-ffn-hidden-size", str(opts.moe_ffn_hidden_size),
        "--num-attention-heads", "4", "--seq-length", str(opts.seq_length),
        "--max-position-embeddings", str(opts.seq_length), "--num-experts", str(opts.num_experts),
        "--moe-router-topk", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", str(opts.micro_batch_size), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(opts.vocab_size), "--lr", "1e-4", "--lr-warmup-iters", "0",
    ]


def ep_iteration_ms(opts, runs: dict[str, int]) -> dict[str, float]:
    """Median iteration time (iterations after the first) of the training script in ep mode at
    zebra's global batch, for each run name -> local rank count; the runs given together run at
    the same time (sharing this machine's cores as the types of a pool would not share GPUs, but
    as zebra's ranks share the cores)."""
    import subprocess

    from megatron_patches.training.metrics import read_records

    global_batch = opts.micro_batch_size * opts.microbatches * opts.attention_ranks
    procs = {}
    for name, ranks in runs.items():
        log = opts.out_dir / f"{name}.jsonl"
        log.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(ENTRY),
               "--cpu", *model_flags(opts), "--expert-model-parallel-size", str(ranks), "--global-batch-size",
               str(global_batch), "--train-iters", str(opts.iters + 1), "--log-interval", "1", "--eval-iters", "0",
               "--log-json", str(log)]
        print(f"bench: {name}: ep on {ranks} ranks, global batch {global_batch} ...", flush=True)
        procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    times = {}
    for name, proc in procs.items():
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"bench_zebra.py: error: the {name} baseline failed (exit {proc.returncode}):\n{stderr[-3000:]}")
        seconds = [r["iteration_time_s"] for r in read_records(str(opts.out_dir / f"{name}.jsonl")) if "loss" in r][1:]
        times[name] = 1e3 * statistics.median(seconds)
    return times


def measured_plan(timeline: dict, shape, slowdown: float):
    """Asym-EA from the zebra run's own timeline (see the module docstring)."""
    from megatron_patches.placement.zebra import ZebraProfile, asym_ea

    def mean_pair(role: str, kind: str, layers: range) -> float:
        totals: dict[tuple[int, int, int], float] = {}
        for rank in timeline["ranks"]:
            if rank["role"] != role:
                continue
            for task in rank["tasks"]:
                if task["stream"] != "compute" or not task["task"].startswith(kind):
                    continue
                layer, mb = (int(x) for x in task["task"].split("(")[1].rstrip(")").split(","))
                if layer in layers:
                    key = (rank["rank"], layer, mb)
                    totals[key] = totals.get(key, 0.0) + task["end"] - task["start"]
        return statistics.mean(totals.values())

    t_attn = mean_pair("attention", "A_", range(shape.num_layers))
    t_exp = mean_pair("expert", "E_", range(shape.num_layers))
    profile = ZebraProfile(shape, t_attn_A=t_attn, t_exp_E=t_exp, t_exp_A=t_exp / slowdown, n_min=0,
                           n_max=shape.num_layers * shape.num_experts)
    return asym_ea(profile)


def rank_main(rank: int, world: int, store: str, opts) -> None:
    import datetime
    import time

    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    from megatron_patches.compat.cpu import import_megatron_with_eager_fusers

    import_megatron_with_eager_fusers()  # as the training script on CPU, before Megatron-Core is imported
    from megatron.core import parallel_state

    from megatron_patches.compat import mcore, prepare_megatron
    from megatron_patches.placement.zebra import ZebraShape
    from megatron_patches.training.arguments import parse_args as parse_training_args
    from megatron_patches.training.validation import validate_args
    from megatron_patches.training.model import build_model
    from megatron_patches.zebra.config import ZebraConfig
    from megatron_patches.zebra.engine import ZebraEngine
    from megatron_patches.mode.adam import AdamSettings
    from megatron_patches.zebra.pools import local_pool, zebra_layout
    from megatron_patches.zebra.timeline import bubble_fractions, read_timeline

    prepare_megatron(use_cuda=False)
    mcore.initialize_model_parallel(1, 1, 1, 1)
    args = validate_args(parse_training_args([*model_flags(opts), "--train-iters", str(opts.iters + 1)]), 1)
    M, N, R = opts.attention_ranks, opts.expert_ranks, opts.microbatches
    cluster = local_pool(world)  # one node of identical CPU "devices", widened to the world
    vocab = ((opts.vocab_size + 127) // 128) * 128
    generator = torch.Generator().manual_seed(1234)
    S, B = opts.seq_length, opts.micro_batch_size
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    data = [
        [{"tokens": ids[:, :-1].clone(), "labels": ids[:, 1:].clone(), "loss_mask": torch.ones(B, S),
          "position_ids": torch.arange(S).expand(B, S).clone(), "attention_mask": causal}
         for ids in torch.randint(0, opts.vocab_size, (M * R, B, S + 1), generator=generator)]
        for _ in range(opts.iters + 1)
    ]
    shape = ZebraShape(opts.layers, opts.num_experts, M, N)
    results = {}
    plan = "off"
    for mode in MODES:
        asym = plan if mode == "zebra + Asym-EA" else "off"
        torch.manual_seed(args.seed)
        mcore.seed_model_parallel_rng(args.seed)
        (model,), _ = build_model(args, vocab, on_gpu=False)
        layout = zebra_layout(cluster, M, N, world, num_layers=opts.layers, num_experts=opts.num_experts, asym_ea=asym)
        timeline_path = str(opts.out_dir / f"timeline_{mode.replace(' + ', '_').replace(' ', '_')}.json")
        engine = ZebraEngine(model, ZebraConfig(M, N, R, asym_ea=asym, timeline=timeline_path), layout,
                             AdamSettings.from_args(args), schedule="naive" if mode == "naive" else "zebra",
                             emulated_expert_slowdown=opts.expert_slowdown)
        times, losses = [], []
        for it, batches in enumerate(data):
            mine = batches[rank * R : (rank + 1) * R] if engine.role == "attention" else None
            dist.barrier()
            started = time.perf_counter()
            result = engine.train_step(mine)
            elapsed = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if it > 0:
                times.append(float(elapsed))
            losses.append(result.loss)
        engine.write_timeline(timeline_path)
        if rank == 0:
            timeline = read_timeline(timeline_path)
            bubbles = bubble_fractions(timeline)
            results[mode] = {
                "iteration_ms": 1e3 * statistics.median(times),
                "attention_bubble": float(np.mean([bubbles[r] for r in layout.attention_dp_group])),
                "expert_bubble": float(np.mean([b for r, b in bubbles.items() if layout.roles[r] == "expert"])),
                "offload_chunks": list(layout.asym_ea.offload_chunks_L),
                "losses": losses,
            }
        if mode == "zebra":
            # rank 0 holds the gathered timeline: it derives the plan, every rank receives it
            chosen = [measured_plan(read_timeline(timeline_path), shape, opts.expert_slowdown) if rank == 0 else None]
            dist.broadcast_object_list(chosen, src=0)
            plan = ",".join(str(c) for c in chosen[0].offload_chunks_L)
            results["asym_ea_profile"] = {"t_gather_s": chosen[0].t_gather, "t_squeeze_s": chosen[0].t_squeeze,
                                          "offload_chunks": list(chosen[0].offload_chunks_L)}
    if rank == 0:
        (opts.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main(argv=None) -> None:
    import torch.multiprocessing as mp

    opts = parse_args(argv)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    world = opts.attention_ranks + opts.expert_ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench_zebra_") as tmp:
        mp.start_processes(rank_main, args=(world, os.path.join(tmp, "store"), opts), nprocs=world,
                           start_method="spawn")
    results = json.loads((opts.out_dir / "results.json").read_text())
    M, N, F = opts.attention_ranks, opts.expert_ranks, opts.expert_slowdown
    ep_ms = ep_iteration_ms(opts, {"ep": M + N})["ep"] * F
    # EP-Ideal: each type's EP alone on the same tokens, both at once; summed throughputs (1 / time)
    alone = ep_iteration_ms(opts, {"ep_attention_type": M, "ep_expert_type": N})
    ideal_ms = 1.0 / (1.0 / alone["ep_attention_type"] + 1.0 / (F * alone["ep_expert_type"]))
    results["baselines"] = {"ep_iteration_ms": ep_ms, "ep_ideal_iteration_ms": ideal_ms, "scaled_by": F}
    (opts.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    emulation = (f"EMULATED expert slowdown x{opts.expert_slowdown:g} (sleep after each expert task)"
                 if opts.expert_slowdown != 1.0 else "no emulation (all ranks the same CPU)")
    print(f"zebra bench: M={opts.attention_ranks} N={opts.expert_ranks} R={opts.microbatches} L={opts.layers} "
          f"n={opts.num_experts} hidden={opts.hidden_size} seq={opts.seq_length} x {opts.micro_batch_size}; {emulation}")
    profile = results["asym_ea_profile"]
    print(f"Asym-EA from the zebra run's timeline: T_gather {profile['t_gather_s'] * 1e3:.2f} ms, "
          f"T_squeeze {profile['t_squeeze_s'] * 1e3:.2f} ms -> chunks per layer {profile['offload_chunks']}")
    tokens = opts.micro_batch_size * opts.microbatches * M * opts.seq_length
    scaled = f" (EMULATED: measured x {F:g})" if F != 1.0 else ""
    print(f"every row: {tokens} tokens per iteration ({opts.micro_batch_size} x {opts.microbatches} micro-batches x {M} "
          f"attention ranks x {opts.seq_length}); speedup = ep's time / the row's")
    print(f"| system | iteration ms (median of {opts.iters}) | speedup vs ep | attention bubble | expert bubble | offload chunks |")
    print("|---|---|---|---|---|---|")
    print(f"| ep, {M + N} ranks{scaled} | {ep_ms:.1f} | 1.00x | - | - | - |")
    print(f"| EP-Ideal, {M} and {N} ranks apart{f' (the {N}: EMULATED x {F:g})' if F != 1.0 else ''} | {ideal_ms:.1f} | "
          f"{ep_ms / ideal_ms:.2f}x | - | - | - |")
    for mode in MODES:
        r = results[mode]
        print(f"| {mode} | {r['iteration_ms']:.1f} | {ep_ms / r['iteration_ms']:.2f}x | {r['attention_bubble']:.1%} | "
              f"{r['expert_bubble']:.1%} | {r['offload_chunks']} |")
    # All three modes compute the same model on the same data: their losses must agree.
    reference = results["naive"]["losses"]
    for mode in MODES[1:]:
        worst = max(abs(a - b) / abs(b) for a, b in zip(results[mode]["losses"], reference))
        print(f"losses of {mode} vs naive: max relative difference {worst:.1e}")
    print(f"timelines and results.json in {opts.out_dir}")


if __name__ == "__main__":
    main()
