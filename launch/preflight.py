"""Preflight: check that every rank of a job can communicate, before the long job starts.

The Slurm scripts of launch/submit.py run it as its own srun step, with the same ranks and
rendezvous as the training step (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from
the task prologue, launch/templates/task_env.sh). A node with a broken NIC, a wrong interface,
a missing GPU or a rank order that does not match the job's layout then fails the job in
seconds with a message naming the rank and node, instead of hanging the training step.

Checks, in order (every rank runs the same checks on the same gathered data, so they all
agree and all exit with the same status):
1. the process group forms within --timeout seconds (all ranks reach the rendezvous);
2. on GPU, LOCAL_RANK names a visible device;
3. all_gather of every rank's identity (node, local rank, hetjob component, device);
4. no two ranks share a (node, local rank) slot;
5. with --het-ranks: every rank sits in the component its rank says (attention pool first in
   each ZP group, see `expected_components`) and on a node of that component (HET_NODES_<c>);
6. all_reduce of the ranks' ids gives W(W-1)/2 (every rank contributes);
7. all_to_all_single: every pair of ranks exchanges one distinct value in each direction.

    python launch/preflight.py --backend gloo [--het-ranks 2,2 --zp-groups 1] [--out preflight.json]

Rank 0 prints one line per rank and a summary; --out writes the same as JSON. Exit status 0 when
every check passes, 1 otherwise. Only torch is needed (no Megatron), so it starts fast.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    """Where one rank runs, as that rank sees it."""

    rank: int
    """Global rank (RANK)."""
    local_rank: int
    """Index on its node (LOCAL_RANK), also its GPU index."""
    node: str
    """Slurm node name (SLURMD_NODENAME; every virtual node of a one-machine Slurm has the same
    host name), else the host name."""
    component: int
    """Hetjob component the task prologue placed it in (HET_COMPONENT; 0 outside a hetjob)."""
    device: str
    """"cpu", or "cuda:<i> <device name>"."""


def expected_components(het_ranks: list[int], zp_groups: int) -> list[int]:
    """The component of every rank, rank order: G ZP groups, each holding its share of every
    component in component order (attention pool first). [2, 4] with G=2 -> [0,1,1, 0,1,1]."""
    for c, count in enumerate(het_ranks):
        if count % zp_groups != 0:
            raise ValueError(f"component {c} has {count} ranks, not divisible by {zp_groups} ZP groups")
    one_group = [c for c, count in enumerate(het_ranks) for _ in range(count // zp_groups)]
    return one_group * zp_groups


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.lstrip("-").isdigit():
        raise SystemExit(f"preflight: environment variable {name}={value!r} must be an integer "
                         "(run under the job's task prologue, or torchrun)")
    return int(value)


def layout_problems(infos: list[RankInfo], het_ranks: list[int] | None, zp_groups: int,
                    het_nodes: dict[int, set[str]]) -> list[str]:
    """Every inconsistency between the gathered ranks and the expected layout, as messages."""
    problems = []
    slots: dict[tuple[str, int], int] = {}
    for info in infos:
        other = slots.setdefault((info.node, info.local_rank), info.rank)
        if other != info.rank:
            problems.append(f"ranks {other} and {info.rank} both run as local rank {info.local_rank} "
                            f"on node {info.node}")
    if het_ranks is not None:
        if sum(het_ranks) != len(infos):
            problems.append(f"--het-ranks {het_ranks} sum to {sum(het_ranks)}, but the world has {len(infos)} ranks")
            return problems
        for info, want in zip(infos, expected_components(het_ranks, zp_groups)):
            if info.component != want:
                problems.append(f"rank {info.rank} on {info.node} runs in component {info.component}, expected {want}")
            nodes = het_nodes.get(info.component)
            if nodes is not None and info.node not in nodes:
                problems.append(f"rank {info.rank} runs on {info.node}, which is not a node of component "
                                f"{info.component} ({' '.join(sorted(nodes))})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True,
                        help="torch.distributed backend of the job")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the rendezvous and each collective")
    parser.add_argument("--het-ranks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="ranks per hetjob component, e.g. 6,6; checks the rank order against the components")
    parser.add_argument("--zp-groups", type=int, default=1, help="ZP groups the ranks are interleaved into (zebra)")
    parser.add_argument("--out", default=None, help="write the rank table and timings as JSON (rank 0)")
    args = parser.parse_args(argv)

    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    component = int(os.environ.get("HET_COMPONENT", "0"))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    device = torch.device("cpu")
    if args.backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            print(f"preflight: rank {rank} on {node}: LOCAL_RANK={local_rank} but only {count} GPU(s) visible "
                  f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})", file=sys.stderr, flush=True)
            return 1
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    started = time.perf_counter()
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    rendezvous_s = time.perf_counter() - started
    name = "cpu" if device.type == "cpu" else f"cuda:{local_rank} {torch.cuda.get_device_name(device)}"
    me = RankInfo(rank=rank, local_rank=local_rank, node=node, component=component, device=name)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, asdict(me))
    infos = [RankInfo(**record) for record in gathered]

    het_nodes = {}
    for key, value in os.environ.items():
        if key.startswith("HET_NODES_") and key[len("HET_NODES_"):].isdigit():
            het_nodes[int(key[len("HET_NODES_"):])] = set(value.split())
    # Every rank finds the same layout problems (same gathered data); rank 0 reports them.
    layout = layout_problems(infos, args.het_ranks, args.zp_groups, het_nodes)
    problems = []  # this rank's own communication failures

    started = time.perf_counter()
    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)
    all_reduce_s = time.perf_counter() - started
    if int(total.item()) != world * (world - 1) // 2:
        problems.append(f"all_reduce of the rank ids gave {int(total.item())} on rank {rank}, "
                        f"expected {world * (world - 1) // 2}")

    # Rank r sends r * W + j to rank j; afterwards slot j must hold j * W + r.
    started = time.perf_counter()
    send_W = torch.arange(world, dtype=torch.float64, device=device) + rank * world
    recv_W = torch.empty_like(send_W)
    dist.all_to_all_single(recv_W, send_W)
    all_to_all_s = time.perf_counter() - started
    expect_W = torch.arange(world, dtype=torch.float64, device=device) * world + rank
    wrong = [j for j in range(world) if recv_W[j].item() != expect_W[j].item()]
    if wrong:
        problems.append(f"all_to_all on rank {rank}: wrong values from ranks {wrong}")

    # Agree on the outcome: a rank whose own check failed makes every rank fail.
    failed = torch.tensor([1.0 if problems else 0.0], device=device)
    dist.all_reduce(failed)
    ok = failed.item() == 0 and not layout
    for problem in problems:
        print(f"preflight: FAILED on rank {rank}: {problem}", file=sys.stderr, flush=True)
    if rank == 0:
        for problem in layout:
            print(f"preflight: FAILED: {problem}", file=sys.stderr, flush=True)
        print("preflight: rank  node  local_rank  component  device", flush=True)
        for info in infos:
            print(f"preflight: {info.rank:4d}  {info.node}  {info.local_rank}  {info.component}  {info.device}",
                  flush=True)
        nodes = sorted({info.node for info in infos})
        verdict = "OK" if ok else "FAILED"
        print(f"preflight: {verdict}: {world} ranks on {len(nodes)} node(s) ({args.backend}); rendezvous "
              f"{rendezvous_s:.2f} s, all_reduce {all_reduce_s * 1e3:.1f} ms, all_to_all {all_to_all_s * 1e3:.1f} ms",
              flush=True)
        if args.out:
            report = {
                "ok": ok, "world_size": world, "backend": args.backend, "ranks": [asdict(i) for i in infos],
                "rendezvous_s": rendezvous_s, "all_reduce_s": all_reduce_s, "all_to_all_s": all_to_all_s,
                "layout_problems": layout, "rank0_problems": problems,
            }
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
