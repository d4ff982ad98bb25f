"""Ranks that run only the stall watchdog, for the failure catalogue (under torchrun):

    torchrun --nproc-per-node 3 tests/support/watchdog_ranks.py hang|monitors

Each rank joins a gloo group from torchrun's environment, runs StallWatchdog(3 s, a beat every
0.5 s) and reports step 1; then
- hang: every rank keeps running and completes nothing more (a deadlock, a stuck collective);
- monitors: ranks 0 and 1 (the ranks that read every heartbeat) stop themselves with SIGSTOP,
  the others go on completing steps.
The watchdog ends the job within seconds; a rank that is still here after 60 s exits 0, which
the test reports as the watchdog having missed it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch.distributed as dist

from megatron_patches.training.watchdog import StallWatchdog


def main(scenario: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with StallWatchdog(3.0, interval_s=0.5) as watchdog:
        watchdog.progress(1)
        dist.barrier()
        if scenario == "monitors" and rank < 2:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGSTOP)
        for step in range(2, 122):
            time.sleep(0.5)
            if scenario == "monitors":
                watchdog.progress(step)


if __name__ == "__main__":
    main(sys.argv[1])
