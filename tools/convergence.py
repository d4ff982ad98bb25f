"""Convergence experiment: adaptive replication vs static replication vs FlexMoE-style rebalancing.

    python tools/convergence.py                          # ~15 min on 2 cores: 5 runs x 120 iterations
    python tools/convergence.py --iters 300 --out runs/convergence
    python tools/convergence.py --policies adaptive static -- --moe-aux-loss-coeff 0.01

Every run trains the same tiny GPT-MoE on the embedded Austen corpus with the same seed and
data order, top-1 routing over 16 experts, 4 CPU ranks, capacity factor 1.0 per instance
(tokens over capacity are dropped and pass through the residual). Only the placement policy
differs (`--replicate-policy`): adaptive (new replica counts every iteration), static (every
expert keeps ranks x slots / experts instances, the DeepSpeed-style baseline) and periodic-K
(new counts every K iterations, moving the new replicas' optimizer state).

Slots: 8 per rank by default, not the 4 of the issue's sketch. With 4 ranks x 4 slots = 16
slots for 16 experts, DESIGN 4.6 gives every expert exactly one instance whatever its
popularity (at least one each, and no slot left), so all policies would coincide; 8 slots
leave 16 instances to share out by popularity (static: 2 per expert).

Output (in --out): one JSON-lines log per run, `convergence.png` (loss and token survival per
iteration per policy), `summary.json`, and this table on stdout: tokens dropped in all, mean
survival, iterations to reach the target loss (the highest final smoothed loss among the runs,
so every run reaches it), mean iteration time (excluding the first), and the periodic
baseline's moved optimizer-state bytes and time. CPU ranks share the cores: the times compare runs of this one
invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from megatron_patches.training.arguments import EMBEDDED_JOB

REPO = Path(__file__).resolve().parents[1]
# The tiny job named explicitly: the runs change its size (the entry point loads it by itself only without size flags).
EMBEDDED_JOB_FLAGS = [f"--config={path}" for path in EMBEDDED_JOB]
POLICIES = ("adaptive", "static", "periodic-10", "periodic-50", "periodic-100")
SMOOTH = 10  # iterations in the moving average used for the target-loss crossing


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=120, help="training iterations per run")
    parser.add_argument("--nproc", type=int, default=4, help="local CPU ranks (the replicate group)")
    parser.add_argument("--experts", type=int, default=16, help="experts per MoE layer")
    parser.add_argument("--slots-per-rank", type=int, default=8, help="expert instances per rank and layer (see above)")
    parser.add_argument("--capacity-factor", type=float, default=1.0, help="per-instance capacity factor")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), help=f"runs, from {', '.join(POLICIES)} (any periodic-K)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "convergence", help="output directory")
    parser.add_argument("flags", nargs="*", help="extra training flags for every run (after --)")
    args = parser.parse_args(argv)
    for name in ("iters", "nproc", "experts", "slots_per_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.iters <= SMOOTH:
        parser.error(f"--iters={args.iters}: must exceed the {SMOOTH}-iteration smoothing window")
    if not args.capacity_factor > 0:
        parser.error(f"--capacity-factor={args.capacity_factor}: must be > 0")
    if args.experts > args.nproc * args.slots_per_rank:
        parser.error(
            f"--experts={args.experts} > ranks x slots = {args.nproc} x {args.slots_per_rank}: every expert needs a slot"
        )
    for policy in args.policies:
        if policy not in ("adaptive", "static") and not _periodic_interval(policy):
            parser.error(f"--policies: {policy!r} is not adaptive, static or periodic-K with an integer K >= 1")
    return args


def _periodic_interval(policy: str) -> int | None:
    name, _, k = policy.partition("-")
    return int(k) if name == "periodic" and k.isdigit() and int(k) >= 1 else None


def policy_flags(policy: str) -> list[str]:
    k = _periodic_interval(policy)
    if k is not None:
        return ["--replicate-policy", "periodic", "--replicate-rebalance-interval", str(k)]
    return ["--replicate-policy", policy]


def train(policy: str, args) -> list[dict]:
    log = args.out / f"{policy}.jsonl"
    log.unlink(missing_ok=True)  # the training log appends
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        str(REPO / "pretrain_gpt_moe.py"), *EMBEDDED_JOB_FLAGS, "--cpu", "--moe-parallel-mode", "replicate",
        "--moe-router-topk", "1", "--num-experts", str(args.experts), "--moe-expert-capacity-factor", str(args.capacity_factor),
        "--replicate-slots-per-rank", str(args.slots_per_rank), "--train-iters", str(args.iters),
        "--log-interval", "1", "--eval-interval", "100000", "--log-json", str(log), *policy_flags(policy), *args.flags,
    ]
    print(f"[convergence] {policy}: {' '.join(cmd[3:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"[convergence] {policy} failed with exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if "loss" in r]


def summarize(runs: dict[str, list[dict]]) -> dict:
    smoothed = {p: np.convolve([r["loss"] for r in rs], np.ones(SMOOTH) / SMOOTH, mode="valid") for p, rs in runs.items()}
    target = max(float(curve[-1]) for curve in smoothed.values())
    table = {}
    for policy, records in runs.items():
        layers = [layer for r in records for layer in r["replicate"]["layers"]]
        crossing = np.flatnonzero(smoothed[policy] <= target)
        replicate = [r["replicate"] for r in records]
        table[policy] = {
            "tokens_dropped": int(sum(layer["routed"] - layer["processed"] for layer in layers)),
            "tokens_routed": int(sum(layer["routed"] for layer in layers)),
            "mean_survival": float(np.mean([r["replicate"]["survival"] for r in records])),
            "final_loss": float(records[-1]["loss"]),
            # the smoothed curve's first point averages iterations 1..SMOOTH
            "iterations_to_target": int(crossing[0]) + SMOOTH if crossing.size else None,
            "mean_iteration_s": float(np.mean([r["iteration_time_s"] for r in records[1:]])),
            "rearrange_bytes": int(sum(sum(x["bytes"]["rearrange"].values()) for x in replicate)),
            "rearrange_s": float(sum(x["seconds"]["rearrange"] for x in replicate)),
            "scheduler_and_metadata_share": float(
                np.mean([(r["replicate"]["seconds"]["scheduler"] + r["replicate"]["seconds"]["metadata"]) / r["iteration_time_s"] for r in records])
            ),
        }
    return {"target_loss": target, "smoothing": SMOOTH, "runs": table}


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, survival_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for policy, records in runs.items():
        iterations = [r["iteration"] for r in records]
        loss_ax.plot(iterations, [r["loss"] for r in records], label=policy, linewidth=1)
        survival_ax.plot(iterations, [r["replicate"]["survival"] for r in records], label=policy, linewidth=1)
    loss_ax.set_ylabel("training loss")
    survival_ax.set_ylabel("token survival")
    survival_ax.set_xlabel("iteration")
    loss_ax.legend()
    loss_ax.set_title("replicate mode: placement policies at capacity factor 1.0 (CPU, tiny GPT-MoE, top-1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {policy: train(policy, args) for policy in args.policies}
    summary = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(runs, args.out / "convergence.png")
    print(f"\ntarget loss {summary['target_loss']:.4f} ({SMOOTH}-iteration moving average; the highest final value of all runs)")
    header = f"{'policy':<12} {'dropped':>10} {'survival':>9} {'final loss':>10} {'iters to target':>16} {'s/iter':>8} {'moved state MiB':>18} {'state s':>8} {'sched+meta':>10}"
    print(header)
    print("-" * len(header))
    for policy, row in summary["runs"].items():
        reach = row["iterations_to_target"] if row["iterations_to_target"] is not None else "-"
        print(
            f"{policy:<12} {row['tokens_dropped']:>10} {row['mean_survival']:>9.3f} {row['final_loss']:>10.4f} {reach:>16} "
            f"{row['mean_iteration_s']:>8.3f} {row['rearrange_bytes'] / 2**20:>18.2f} {row['rearrange_s']:>8.3f} "
            f"{row['scheduler_and_metadata_share']:>10.2%}"
        )
    print(f"\nwrote {args.out / 'summary.json'}, {args.out / 'convergence.png'} and one .jsonl per run")


if __name__ == "__main__":
    main()
