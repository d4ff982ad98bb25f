"""Process lifetime: a process ends when the process that started it ends, even by SIGKILL.

Linux's PR_SET_PDEATHSIG asks the kernel to signal a process when its parent ends, which covers
the one case no handler can forward: a parent killed with SIGKILL. Two places need it:
- a rank under torchrun: killing the agent with SIGKILL (an OOM killer, a scheduler's hard
  stop) otherwise leaves the ranks running, holding memory and devices, until a collective or
  the stall watchdog gives up;
- each rank's dist-checkpoint results queue, served by a spawned multiprocessing.Manager
  process (Megatron's filesystem_async; about 0.5 GB each): a rank killed with SIGKILL
  otherwise leaves it behind for good (compat/mcore.py starts it through `die_with_parent`).
Elsewhere than Linux nothing is set.

Light on purpose: a spawned helper imports this module to run `die_with_parent`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Be killed (SIGKILL) when `parent_pid`, this process's parent, ends."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent ended before the request took effect
