"""Process lifetime: a process ends when the process that started it ends, even by SIGKILL.

Linux's PR_SET_PDEATHSIG asks the kernel to signal a process when its parent ends, which covers
the one case no handler can forward: a parent killed with SIGKILL. A rank under torchrun needs
it: killing the agent with SIGKILL (an OOM killer, a scheduler's hard stop) otherwise leaves the
ranks running, holding memory and devices, until a collective or the stall watchdog gives up.
(Megatron's dist-checkpoint results queue used to be a spawned multiprocessing.Manager that also
outlived a killed rank; compat/mcore.py now keeps that queue in the rank's own process.)
Elsewhere than Linux nothing is set.

Light on purpose: the entry point imports it before torch.
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
