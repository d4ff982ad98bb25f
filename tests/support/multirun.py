"""Several training runs in one torchrun spawn: `support.training.launch_many` starts this script
on every rank with a JSON file of runs ([{"name": ..., "argv": [...]}, ...]) and it calls the
entry point's `main(argv)` for each in turn, in the same processes. A run may name a checkpoint
tracker to point at an earlier save first ("tracker": [directory, iteration]: a resume from the
middle of a run that went on saving).

Why: each rank process pays ~7 s of imports (torch, Megatron-Core), ~17 s per 4-rank spawn on
2 cores, and a training run tears its process groups down at its end (training.loop.tear_down),
so the next one can start in the same interpreter. Between runs:
- every rank flushes its output and meets the others at a barrier on torchrun's agent store, then
  rank 0 prints `MARKER name` on stdout, so the spawn's output splits per run (launch_many reads
  stdout and stderr as one stream);
- each run rendezvouses on a store of its own: rank 0 hosts a fresh TCPStore on a free port it
  publishes through the agent store. torch names a new default group's store keys from a counter
  that destroy_process_group resets, so a second group on the agent store would read the first
  one's keys (its ranks' old addresses).

A run that fails ends the spawn with its exit code, after a `MARKER-FAILED name` line.

A run may delay one rank ("delay": {"rank": r, "max_ms": x, "seed": s}): on rank r every compute
task of the zebra engine starts after a pause drawn uniformly from [0, x] ms by a generator of its
own (the training's random streams are untouched), so the other ranks find its collectives late,
at other points of their poll loops, than in the same run without it. The rank prints
`MARKER-delay rank r: <pauses> pauses, <ms> ms` at the end of the run.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import random
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "@@multirun"
TIMEOUT = datetime.timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((os.environ["MASTER_ADDR"], 0))
        return s.getsockname()[1]


def barrier(store, key: str, rank: int, world: int) -> None:
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in range(world)], TIMEOUT)


@contextmanager
def delayed(run: dict, rank: int):
    """On the rank that run["delay"] names, pause before every zebra compute task (see above)."""
    delay = run.get("delay")
    if delay is None or delay["rank"] != rank:
        yield
        return
    from megatron_patches.zebra.tasks import ZebraTasks

    pauses, compute = random.Random(delay["seed"]), ZebraTasks.compute
    paused_ms: list[float] = []

    def late_compute(tasks, task):
        paused_ms.append(pauses.uniform(0.0, delay["max_ms"]))
        time.sleep(paused_ms[-1] / 1e3)
        return compute(tasks, task)

    ZebraTasks.compute = late_compute
    try:
        yield
    finally:
        ZebraTasks.compute = compute
        print(f"{MARKER}-delay rank {rank}: {len(paused_ms)} pauses, {sum(paused_ms):.0f} ms", flush=True)


def main() -> int:
    from torch.distributed import TCPStore

    runs = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=TIMEOUT)
    sys.path.insert(0, str(REPO))
    import pretrain_gpt_moe
    from megatron_patches.training.checkpoint_dirs import write_tracker

    for index, run in enumerate(runs):
        sys.stdout.flush()
        sys.stderr.flush()
        barrier(agent, f"multirun/{index}/done", rank, world)
        if rank == 0:
            if "tracker" in run:
                directory, iteration = run["tracker"]
                write_tracker(Path(directory), iteration)
            agent.set(f"multirun/{index}/port", str(free_port()))
            print(f"{MARKER} {run['name']}", flush=True)
        barrier(agent, f"multirun/{index}/begin", rank, world)
        os.environ["MASTER_PORT"] = agent.get(f"multirun/{index}/port").decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        with delayed(run, rank):
            code = pretrain_gpt_moe.main(run["argv"])
        if code != 0:
            print(f"{MARKER}-FAILED {run['name']} (rank {rank}, exit {code})", flush=True)
            return code
    return 0


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as pretrain_gpt_moe.py does: skip the slow last collection over Megatron's objects
    sys.exit(code)
