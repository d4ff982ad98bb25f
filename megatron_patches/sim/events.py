"""Event engine: in-order streams per device, tasks with dependencies, vectorised over iterations.

Every device has one compute stream and any number of communication streams ("a2a",
"sparse", "grad", ...). A task starts when its stream is free and every task it depends on
has ended; a stream runs its tasks in the order they were issued (as CUDA streams do). Compute
tasks run per device with their own durations; collectives run on all devices at once: they
start when the last device is ready (its stream free and its dependencies done) and end
together. This is where overlap appears (FSSDP's gather on the "sparse" stream runs while the
compute stream does attention) and where stragglers appear (a combine all-to-all cannot start
before the busiest device has finished its experts).

Collectives that cross nodes share the nodes' NICs (`nic_I`, the seconds a collective keeps the
busiest node's NIC busy at its full rate). Without that, two streams' collectives would each get
the whole NIC at once, and a gradient all-reduce would hide behind the all-to-all for free. The
model: the NIC is one resource per iteration, and a collective gets the NIC time that the
collectives scheduled before it left free. Its NIC work fills the gaps from its start on, it ends
later by the time the NIC was busy with others (`contention_s`), and from its start to the end of
its NIC work the NIC is busy. The total is conserved (two collectives end together as under fair
sharing), but the one issued first in the program keeps its time: it runs as if it had priority.
That is optimistic for it and pessimistic for the later one. Intra-node links (NVLink) are not
shared this way.

The iterations of a trace are independent (each starts at time 0 after the previous one's
optimizer step), so every quantity is an array over iterations, [I, D] per device or [I] for a
collective, and one program of `compute` / `collective` calls simulates all iterations at once.

Time accounting. Every second of every device's compute stream is either busy (by the task's
category) or idle. Idle time before a task is blamed on the dependency that ended last: if that
is a collective, the part of the wait during the collective goes to the collective's category,
and the part before it started goes, the same way, to whatever held the collective back (the
dependency or stream predecessor that was ready last: "straggler_wait" when that is another
device's compute), down the chain. So a wait behind a queue of collectives on one stream is
shared among them by the time each ran, per device busy + idle over all categories equals the
iteration time exactly, and averaging over devices gives an additive breakdown. Collectives
also carry a label (the kind of traffic: "spag", "grad_allreduce", ...); the idle time blamed on
collectives is recorded by label too (`by_label`), so a communication category splits into the
kinds that were exposed, adding up to it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

__all__ = ["CATEGORIES", "COMPUTE_CATEGORIES", "COMM_CATEGORIES", "Event", "Timeline"]

COMPUTE_CATEGORIES = ("attention", "other", "expert", "optimizer")
"""Categories of compute tasks: attention blocks; norms, gate, dense MLPs, embedding and head;
expert FFNs; the optimizer step."""
COMM_CATEGORIES = ("all_to_all", "exposed_collectives", "rearrangement")
"""Categories of collectives: token all-to-alls; every other collective (sparse gather /
reduce, gradient synchronisation, shadow broadcasts, weight scatter); moving experts between
iterations."""
STRAGGLER = "straggler_wait"
"""Idle time waiting for another device to reach a collective."""
CATEGORIES = COMPUTE_CATEGORIES + COMM_CATEGORIES + (STRAGGLER,)
_INDEX = {name: i for i, name in enumerate(CATEGORIES)}


@dataclass(frozen=True, eq=False)
class Event:
    """A task that has been scheduled (on every device, for every iteration)."""

    start_ID: np.ndarray
    """Start time per iteration and device, seconds from the iteration's start; float [I, D]."""
    end_ID: np.ndarray
    """End time; float [I, D]."""
    category: int
    """Index into CATEGORIES."""
    collective: bool
    """True for collectives (same start and end on every device)."""
    label: int = -1
    """Collectives: index into `Timeline.labels` (the kind of traffic); -1 for compute."""
    blockers: tuple = ()
    """Collectives: the events it waited for (dependencies, then its stream's previous collective)."""
    blocker_I: np.ndarray | None = None
    """Collectives: per iteration, the index into `blockers` of the one ready last (it decided the
    start); int [I]."""


class Timeline:
    """The streams of D devices over I iterations, plus the time accounting.

    Attributes:
        busy: seconds each device's compute stream spent per category; float [C, I, D].
        idle: seconds each device's compute stream waited, by blamed category; float [C, I, D].
        max_busy: per compute category, sum over tasks of the slowest device's duration; float [C, I].
        comm: per communication category, summed collective durations (hidden or not); float [C, I].
        labels: the collective labels seen, in order of first use.
        idle_label: idle seconds blamed on collectives, by label index; float [len(labels), I, D].
        share_nic: whether collectives that cross nodes share the NIC (`contention()` says how
            long each kind waited for it).
    """

    def __init__(self, num_iterations: int, num_devices: int, share_nic: bool = True) -> None:
        self.I, self.D = int(num_iterations), int(num_devices)
        self.share_nic = share_nic
        C = len(CATEGORIES)
        self.busy = np.zeros((C, self.I, self.D))
        self.idle = np.zeros((C, self.I, self.D))
        self.max_busy = np.zeros((C, self.I))
        self.comm = np.zeros((C, self.I))
        self.labels: list[str] = []
        self._idle_label: list[np.ndarray] = []
        self._compute_free = np.zeros((self.I, self.D))
        self._streams: dict[str, Event] = {}
        self._events: list[Event] = []
        self._contention: list[np.ndarray] = []
        # per iteration, the NIC's busy time as disjoint sorted intervals (their starts, their ends)
        self._nic = [([], []) for _ in range(self.I)]

    # -- scheduling --------------------------------------------------------------------------

    def compute(self, category: str, duration_ID, after=()) -> Event:
        """Run a compute task on every device's compute stream after the events in `after`.

        duration_ID: seconds, broadcastable to [I, D] (e.g. [D] for the same time every iteration).
        """
        cat = self._category(category, COMPUTE_CATEGORIES)
        duration = np.broadcast_to(np.asarray(duration_ID, dtype=np.float64), (self.I, self.D))
        free = self._compute_free
        start = free.copy()
        deps = [e for e in after if e is not None]
        if deps:
            ends = np.stack([e.end_ID for e in deps])  # [k, I, D]
            latest = ends.max(axis=0)
            start = np.maximum(free, latest)
            self._blame(free, start, deps, np.argmax(ends, axis=0))
        end = start + duration
        self.busy[cat] += duration
        self.max_busy[cat] += duration.max(axis=1)
        self._compute_free = end
        event = Event(start, end, cat, False)
        self._events.append(event)
        return event

    def collective(self, stream: str, category: str, duration_I, after=(), label: str | None = None,
                   nic_I=None) -> Event:
        """Run a collective over all devices on `stream` after the events in `after`.

        duration_I: seconds per iteration, broadcastable to [I]. The collective starts when
        every device is ready and ends `duration` later on all of them, plus what it waits for
        the NIC. label: the kind of traffic for `by_label` (default: the category). nic_I: the
        part of the duration the busiest node's NIC carries at full rate (broadcastable to [I],
        at most the duration; None or 0: it does not cross nodes).
        """
        cat = self._category(category, COMM_CATEGORIES)
        lab = self._label(label or category)
        duration = np.broadcast_to(np.asarray(duration_I, dtype=np.float64), (self.I,))
        candidates = [e for e in after if e is not None]
        previous = self._streams.get(stream)
        if previous is not None:
            candidates.append(previous)
        if candidates:
            ends = np.stack([e.end_ID for e in candidates])  # [k, I, D]
            ready_I = ends.max(axis=(0, 2))
            # which candidate, on which device, arrived last: it decides who is blamed for the wait
            k_I = np.argmax(ends.transpose(1, 0, 2).reshape(self.I, -1), axis=1) // self.D
        else:
            ready_I = np.zeros(self.I)
            k_I = None
        if nic_I is not None and self.share_nic:
            nic = np.broadcast_to(np.asarray(nic_I, dtype=np.float64), (self.I,))
            if np.any(nic > duration * (1 + 1e-12)) or np.any(nic < 0):
                raise ValueError(f"nic_I must lie in [0, duration] ({label or category})")
            waited_I = self._share_nic(ready_I, nic)
            self._contention[lab] += waited_I
            duration = duration + waited_I
        start = np.repeat(ready_I[:, None], self.D, axis=1)
        end = start + duration[:, None]
        self.comm[cat] += duration
        event = Event(start, end, cat, True, lab, tuple(candidates), k_I)
        self._streams[stream] = event
        self._events.append(event)
        return event

    def _share_nic(self, start_I: np.ndarray, work_I: np.ndarray) -> np.ndarray:
        """Fit `work_I` seconds of NIC time into the NIC's free time from `start_I` on, mark the NIC
        busy from the start to where the work ends, and return what it waited: the busy time of
        others in that span; float [I]."""
        waited = np.zeros(self.I)
        for i in np.flatnonzero(work_I > 0):
            starts, ends = self._nic[i]
            s, left = float(start_I[i]), float(work_I[i])
            k = bisect.bisect_right(starts, s)  # intervals from k on start after s
            t = max(s, ends[k - 1]) if k > 0 else s
            busy = t - s  # the others' NIC time it sits out, summed exactly (0 when none)
            while k < len(starts) and starts[k] - t < left:
                left -= starts[k] - t
                busy += ends[k] - starts[k]
                t = ends[k]
                k += 1
            f = t + left
            waited[i] = busy
            lo = bisect.bisect_left(ends, s)  # the first interval that ends at or after s
            hi = bisect.bisect_right(starts, f)  # intervals from hi on start after f
            new_start, new_end = (min(s, starts[lo]), max(f, ends[hi - 1])) if hi > lo else (s, f)
            starts[lo:hi], ends[lo:hi] = [new_start], [new_end]
        return waited

    def contention(self) -> dict[str, np.ndarray]:
        """Per collective label, seconds per iteration its collectives waited for the NIC behind
        collectives scheduled before them (added to their durations); float [I] each, labels that
        never waited left out."""
        return {name: self._contention[lab] for lab, name in enumerate(self.labels) if self._contention[lab].any()}

    def last(self, stream: str) -> Event | None:
        """The last collective issued on `stream`, or None if the stream was never used."""
        return self._streams.get(stream)

    def finish(self) -> np.ndarray:
        """End the iteration when every stream is done; returns the iteration time, float [I].

        The compute streams' final idle time is blamed like a wait on the last event to end.
        """
        ends = [self._compute_free.max(axis=1, keepdims=True) * np.ones((1, self.D))]
        sources: list[Event | None] = [None]
        for event in self._streams.values():
            ends.append(event.end_ID)
            sources.append(event)
        stacked = np.stack(ends)
        total_I = stacked.max(axis=(0, 2))
        target = np.repeat(total_I[:, None], self.D, axis=1)
        gap = target - self._compute_free
        k = np.argmax(stacked.max(axis=2), axis=0)  # [I] which source ends last
        straggler = _INDEX[STRAGGLER]
        for j, source in enumerate(sources):
            mask = (k == j)[:, None] & (gap > 0)
            if not mask.any():
                continue
            if source is None:
                self.idle[straggler] += np.where(mask, gap, 0.0)
            else:
                self._split_wait(self._compute_free, target, source, mask)
        self._compute_free = target
        return total_I

    # -- accounting --------------------------------------------------------------------------

    def _blame(self, free: np.ndarray, start: np.ndarray, deps: list[Event], latest_k: np.ndarray) -> None:
        """Attribute the idle time [free, start] of each device to the dependency that ended last."""
        gap = start - free
        if not (gap > 0).any():
            return
        for j, dep in enumerate(deps):
            mask = (latest_k == j) & (gap > 0)
            if not mask.any():
                continue
            # a compute dependency is a device's own earlier task on its one compute stream, so it
            # ended by `free` and never causes a wait; only collectives can
            if dep.collective:
                self._split_wait(free, start, dep, mask)

    def _split_wait(self, free: np.ndarray, until: np.ndarray, dep: Event, mask: np.ndarray) -> None:
        """Split a wait [free, until] on collective `dep`: from its start -> its category and label;
        before its start -> split the same way on the blocker that held it back (a straggler when
        that was compute)."""
        gap = np.where(mask, until - free, 0.0)
        before = np.clip(dep.start_ID - free, 0.0, None)
        before = np.minimum(np.where(mask, before, 0.0), gap)
        self.idle[dep.category] += gap - before
        self._idle_label[dep.label] += gap - before
        if dep.blocker_I is None or not (before > 0).any():
            return
        for j, blocker in enumerate(dep.blockers):
            held = (before > 0) & (dep.blocker_I == j)[:, None]
            if not held.any():
                continue
            if blocker.collective:
                self._split_wait(free, free + before, blocker, held)
            else:
                self.idle[_INDEX[STRAGGLER]] += np.where(held, before, 0.0)

    def _label(self, name: str) -> int:
        if name not in self.labels:
            self.labels.append(name)
            self._idle_label.append(np.zeros((self.I, self.D)))
            self._contention.append(np.zeros(self.I))
        return self.labels.index(name)

    @staticmethod
    def _category(name: str, allowed: tuple[str, ...]) -> int:
        if name not in allowed:
            raise ValueError(f"category {name!r} is not one of {allowed}")
        return _INDEX[name]

    def breakdown(self) -> dict[str, np.ndarray]:
        """Per category: busy + idle seconds averaged over devices; float [I] each. Sums to the iteration time."""
        total = (self.busy + self.idle).mean(axis=2)
        return {name: total[i] for i, name in enumerate(CATEGORIES)}

    def by_label(self, category: str) -> dict[str, np.ndarray]:
        """The idle seconds blamed on a communication category, split by collective label and
        averaged over devices; float [I] each, summing to `breakdown()[category]`."""
        cat = self._category(category, COMM_CATEGORIES)
        out = {}
        for lab, name in enumerate(self.labels):
            mine = [e for e in self._events if e.collective and e.label == lab]
            if mine and mine[0].category == cat:
                out[name] = self._idle_label[lab].mean(axis=1)
        return out
