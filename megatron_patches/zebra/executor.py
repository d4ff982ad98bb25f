"""The zebra schedule's executor: one host thread walks a rank's three task queues (DESIGN 4.7).

Per role there is one compute queue, one dispatch queue and one combine queue
(``placement.zebra.task_order``). A collective is launched when it is at the head of its queue and
its local producer has run (a receiver posts it as soon as it reaches the head); it is complete
when all its async works are. A compute task runs when it is at the head of the compute queue and
its local inputs are complete. While nothing can progress the thread polls again after a short
sleep, never blocking on one collective, so every stream stays live.

Dispatch and combine run on two process groups per ZP group, and on GPU on two CUDA streams
(``comm.streams.CommStream``) ordered against the compute stream by events; on CPU they are async
gloo works. The executor also keeps the timeline clock: host time on CPU, CUDA events on GPU
(resolved after the iteration).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_patches.comm.streams import CommStream
from megatron_patches.placement.zebra import Task
from megatron_patches.zebra.timeline import RankTimeline, TaskSpan

__all__ = ["COMM_STREAMS", "Arrival", "Collective", "ScheduleExecutor"]

# Backoff of the host thread while every stream waits on other ranks.
_MIN_IDLE_S = 20e-6
_MAX_IDLE_S = 1e-3

COMM_STREAMS = ("dispatch", "combine")
"""The two all-to-all streams (and process groups) of a ZP group; the records count bytes as "a2a_<stream>"."""


class Collective:
    """One all-to-all task in flight on this rank: the async works of its current stage, and the
    stages still to launch (each launched once the previous one's works have completed)."""

    def __init__(self, task: Task, works: list, next_stages: Sequence[Callable[[], list]], finish: Callable[[], None]):
        self.task = task
        self.works = works
        self.next_stages = deque(next_stages)
        self.finish = finish

    def poll(self) -> bool:
        """True when every stage has completed; launches the next stage as soon as the current
        one has (never blocks)."""
        while all(work.is_completed() for work in self.works):
            for work in self.works:
                work.wait()
            if not self.next_stages:
                return True
            self.works = self.next_stages.popleft()()
        return False


class Arrival:
    """A host copy in flight, as a work: completed once the copy's values are in host memory."""

    def __init__(self, arrived: Callable[[], bool]):
        self.is_completed = arrived

    def wait(self) -> None:
        """Only called once is_completed() said so: nothing left to wait for."""


class ScheduleExecutor:
    """Runs one rank's task queues (see the module docstring). ``emulated_expert_slowdown``:
    benchmark-only emulation of slower expert GPUs (tools/bench_zebra.py; no training flag sets
    it): after each expert task an expert rank sleeps (factor - 1) x the task's time."""

    def __init__(self, rank: int, role: str, zp_group: int, device: torch.device, record_timeline: bool,
                 emulated_expert_slowdown: float = 1.0) -> None:
        self.rank = rank
        self.role = role
        self.zp_group = zp_group
        self.streams = {stream: CommStream(device) for stream in COMM_STREAMS}
        self._use_cuda = device.type == "cuda"
        self.record_timeline = record_timeline
        """Record task times (a barrier starts each iteration's clock)."""
        self.timeline: RankTimeline | None = None
        """The last recorded iteration's executed tasks (when ``record_timeline`` is on)."""
        self.emulated_expert_slowdown = emulated_expert_slowdown

    def run(self, order: dict[str, list[Task]], ready: Callable[[Task, set[str]], bool],
            launch: Callable[[Task], Collective], compute: Callable[[Task], None]) -> None:
        """Run every queue of ``order`` to its end. ``ready(task, done)``: whether a task's local
        inputs are complete; ``launch(task)``: start a dispatch or combine task; ``compute(task)``:
        run a compute task."""
        self._recording = self.record_timeline
        self._marks: list[tuple] = []
        if self._recording:
            dist.barrier()  # one start for every rank's clock
        self._t0 = self._mark("compute")
        queues = {stream: deque(tasks) for stream, tasks in order.items()}
        in_flight: dict[str, Collective] = {}
        starts: dict[str, object] = {}
        done: set[str] = set()
        idle_s = _MIN_IDLE_S
        while any(queues.values()):
            progressed = False
            for stream in COMM_STREAMS:
                queue = queues[stream]
                if not queue:
                    continue
                task = queue[0]
                collective = in_flight.get(stream)
                if collective is None and ready(task, done):
                    starts[task.id] = self._mark(stream)
                    in_flight[stream] = launch(task)
                    progressed = True
                elif collective is not None and collective.poll():
                    self._complete(stream, collective, starts.pop(task.id), done)
                    queue.popleft()
                    del in_flight[stream]
                    progressed = True
            queue = queues["compute"]
            if queue and ready(queue[0], done):
                task = queue.popleft()
                start = self._mark("compute")
                compute(task)
                self._emulate_slow_expert(task, start)
                self._record("compute", task, start, self._mark("compute"))
                done.add(task.id)
                progressed = True
            if progressed:
                idle_s = _MIN_IDLE_S
            else:
                idle_s = self._idle(in_flight, queues, idle_s)
        self._resolve_timeline()

    def _emulate_slow_expert(self, task: Task, start) -> None:
        if self.emulated_expert_slowdown == 1.0 or task.kind != "E" or self.role != "expert":
            return
        if self._use_cuda:
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(self._mark("compute")) / 1e3
        else:
            elapsed = time.perf_counter() - start
        time.sleep((self.emulated_expert_slowdown - 1.0) * elapsed)

    def _idle(self, in_flight: dict[str, Collective], queues: dict[str, deque], idle_s: float) -> float:
        """Nothing could progress: sleep briefly and poll again (the next backoff is returned).

        Polling instead of blocking on one collective keeps every stream live: a completed
        collective must let its stream launch the next one (and a count gather its token
        exchange) at once, since the other ranks may need that to complete the awaited one."""
        if not in_flight:
            heads = {stream: q[0].id for stream, q in queues.items() if q}
            raise RuntimeError(f"zebra schedule stuck on rank {self.rank}: no collective in flight, heads {heads}")
        time.sleep(idle_s)
        return min(2 * idle_s, _MAX_IDLE_S)

    def _complete(self, stream: str, collective: Collective, start, done: set[str]) -> None:
        with self.streams[stream].finish():
            collective.finish()
            end = self._mark(stream)
        self._record(stream, collective.task, start, end)
        done.add(collective.task.id)

    # ---- timeline clock: host time on CPU, CUDA events on GPU (resolved after the iteration) ----

    def _mark(self, stream: str):
        if not self._use_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        cuda_stream = self.streams[stream].cuda_stream if stream != "compute" else torch.cuda.current_stream()
        event.record(cuda_stream)
        return event

    def _record(self, stream: str, task: Task, start, end) -> None:
        if self._recording:
            self._marks.append((stream, task.label, start, end))

    def _resolve_timeline(self) -> None:
        if not self._recording:
            return
        if self._use_cuda:
            torch.cuda.synchronize()

            def seconds(mark):
                return self._t0.elapsed_time(mark) / 1e3
        else:

            def seconds(mark):
                return mark - self._t0

        self.timeline = RankTimeline(
            rank=self.rank, role=self.role, zp_group=self.zp_group,
            spans=[TaskSpan(stream, label, seconds(start), seconds(end)) for stream, label, start, end in self._marks],
        )
