"""Stall watchdog: a rank that stops making progress is named, and the job ends.

Without it a stopped or hung rank leaves every other rank waiting in its next collective until
the process-group timeout (30 minutes), and nothing says which rank it was. Here every rank
runs a daemon thread that, every `interval` seconds, publishes into the job's rendezvous store
(a TCPStore client of its own, beside the process group's) a beat counter, its last completed
step and how long ago that was. The MONITORS lowest ranks read every rank's entry, and every
other rank reads the monitors' entries (the store serves O(world) requests per interval, not
O(world^2), and monitors that stop together are still named):

- a rank whose beat counter has not moved for `timeout` seconds is not running at all (stopped,
  swapped out, dead): it is named with its host and last completed step;
- when no rank completed a step for `timeout` seconds although all are alive, the job is hung
  in a collective or a deadlock: the ranks with the oldest step are named.

Staleness is measured on the observer's own clock (beats counted, not timestamps compared), so
hosts need no synchronised clocks. The lowest-numbered rank that looks alive prints the
diagnosis and exits with STALL_EXIT_CODE; the launcher (torchrun, `srun --kill-on-bad-exit`)
then ends the others. The others keep watching meanwhile, and report themselves when that rank
goes stale too or the job has not ended a timeout later. A store that stops answering (under srun it lives in rank 0's process) is itself
a diagnosis: rank 0 is not responding.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

STALL_EXIT_CODE = 4
KEY = "megatron_patches/heartbeat/{rank}"
MONITORS = 2
"""Ranks 0 and 1 read every heartbeat; the other ranks read theirs."""


class StallWatchdog:
    """Used as `with StallWatchdog(timeout) as watchdog:` around the training iterations, once the
    process group exists; call `progress(step)` after every completed unit of work (iteration,
    evaluation, checkpoint). Leaving the block stops it: the ranks then leave at different
    moments, and under srun the store leaves with rank 0."""

    def __init__(self, timeout_s: float, interval_s: float | None = None):
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else max(1.0, min(10.0, timeout_s / 10))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host = socket.gethostname()
        self.step = 0
        self.progress_at = time.monotonic()
        self.beats = 0
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def progress(self, step: int) -> None:
        self.step, self.progress_at = step, time.monotonic()

    def __enter__(self) -> StallWatchdog:
        if self.timeout_s > 0 and self.world > 1:
            self._thread = threading.Thread(target=self._run, name="stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopped.set()

    def _store(self) -> dist.TCPStore:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=max(self.timeout_s, 30)))

    def _run(self) -> None:
        try:
            store = self._store()
        except Exception as error:  # noqa: BLE001 - any failure to reach the store is reported, then ignored
            print(f"watchdog (rank {self.rank}): cannot reach the rendezvous store ({error}); stalls go unreported",
                  file=sys.stderr, flush=True)
            return
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat counter, when it last moved, my clock)
        deferred_since = None  # when this rank first left a diagnosis to a lower rank (my clock)
        monitor = self.rank < MONITORS
        watched = range(self.world) if monitor else range(min(MONITORS, self.world))
        while not self._stopped.is_set():
            self.beats += 1
            now = time.monotonic()
            try:
                store.set(KEY.format(rank=self.rank), f"{self.beats} {self.step} {now - self.progress_at:.1f} {self.host}")
                entries = {r: store.get(KEY.format(rank=r)).decode().split() if store.check([KEY.format(rank=r)]) else None
                           for r in watched}
            except Exception:  # noqa: BLE001 - the store timed out or went away: its host does not answer
                if self._stopped.is_set():
                    return
                if self.rank != 1:
                    time.sleep(5.0)  # rank 1 says it; nothing more can be learnt without the store
                self._abort(f"the rendezvous store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} stopped "
                            f"answering (under srun it lives in rank 0's process): rank 0 is not responding")
                return
            stopped = []
            for r, entry in entries.items():
                beats = int(entry[0]) if entry else 0
                previous = seen.get(r)
                if previous is None or previous[0] != beats:
                    seen[r] = (beats, now)
                elif now - previous[1] > self.timeout_s:
                    stopped.append((r, entry))
            diagnosis, reporter = None, self.rank
            if stopped:
                names = "; ".join(f"rank {r} on {e[3] if e else '?'} (last reported step {e[1] if e else 'none'})"
                                  for r, e in stopped)
                diagnosis = f"{names}: not running for more than {self.timeout_s:g} s (stopped, swapped out or dead)"
                reporter = min(r for r in range(self.world) if r not in {s for s, _ in stopped})
            ages = {r: float(e[2]) for r, e in entries.items() if e}
            if diagnosis is None and monitor and len(ages) == self.world and min(ages.values()) > self.timeout_s:
                oldest = min(int(entries[r][1]) for r in ages)
                laggards = [f"rank {r} on {entries[r][3]}" for r in ages if int(entries[r][1]) == oldest]
                diagnosis = (f"no rank completed a step for more than {self.timeout_s:g} s although every rank is "
                             f"running: hung in a collective or a deadlock; last completed step {oldest} on "
                             f"{', '.join(laggards)}")
                reporter = 0
            if diagnosis is not None:
                # A lower rank that looks alive reports it and ends the job. This rank keeps watching
                # meanwhile: that rank may itself be about to go stale (ranks stopped together are not
                # seen past the timeout in the same interval), and then this rank reports; after a
                # further timeout without the job ending, it reports anyway.
                deferred_since = now if deferred_since is None else deferred_since
                if reporter == self.rank or now - deferred_since > self.timeout_s:
                    self._abort(diagnosis)
                    return
            self._stopped.wait(self.interval_s)

    def _abort(self, diagnosis: str) -> None:
        """Say why and end this rank; the launcher (torchrun, `srun --kill-on-bad-exit`) ends the others."""
        if self._stopped.is_set():
            return
        print(f"pretrain_gpt_moe.py: stalled: {diagnosis}; ending the job (--stall-timeout {self.timeout_s:g})",
              file=sys.stderr, flush=True)
        os._exit(STALL_EXIT_CODE)
