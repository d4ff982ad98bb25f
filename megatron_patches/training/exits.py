"""Stopping before --train-iters, as Megatron-LM does: --exit-interval, --exit-duration-in-mins and
--exit-signal-handler (Slurm's warning signal before a job's time limit or a preemption).

    with ExitConditions(args) as exits:     # installs the --exit-signal handler, restores it after
        ...one iteration...
        reason = exits.reason(iteration)    # None, or why every rank stops after this iteration

The decision is world-wide: a signal that reached one rank, or one rank's clock past the
duration, stops every rank after the same iteration (one all-reduce of two flags, only when a
signal handler or a duration is set). The loop then saves that iteration's checkpoint (with
--save) and the run ends normally, exit code 0; a resubmitted job resumes from it.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist


class ExitConditions:
    """Megatron-LM's three early exits, checked after every iteration."""

    def __init__(self, args):
        self.interval = args.exit_interval
        self.minutes = args.exit_duration_in_mins
        self.signal = args.exit_signal if args.exit_signal_handler else None
        self.received = False
        self.started = time.monotonic()
        self._previous = None

    def __enter__(self) -> "ExitConditions":
        if self.signal is not None:
            self._previous = signal.signal(self.signal, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self.signal is not None:
            signal.signal(self.signal, self._previous)

    def _on_signal(self, signum, frame) -> None:
        # only a flag: the iteration in progress finishes, its collectives included
        self.received = True

    def reason(self, iteration: int) -> str | None:
        """Why every rank stops after `iteration`, or None to go on."""
        elapsed_min = (time.monotonic() - self.started) / 60.0
        if self.signal is not None or self.minutes is not None:
            local_2 = torch.tensor([self.received, self.minutes is not None and elapsed_min > self.minutes],
                                   dtype=torch.int32)
            dist.all_reduce(local_2, op=dist.ReduceOp.MAX)
            received, late = (bool(x) for x in local_2.tolist())
            if received:
                return f"{self.signal.name} received (--exit-signal-handler)"
            if late:
                return f"--exit-duration-in-mins {self.minutes} reached ({elapsed_min:.1f} minutes of training)"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        return None
