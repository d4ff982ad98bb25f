"""Timing of spans on the compute stream, for decisions taken from measured times: CUDA events
on GPU, the host clock on CPU; NVTX ranges that name the spans for Nsight Systems.

On GPU, kernels and the waits on communication run asynchronously to the host: `wait()` on an
NCCL gather makes the compute *stream* wait and returns at once, and an expert's GEMMs are only
queued when the Python call returns. A host clock around either measures the enqueueing, not
the time the stream spent on the work or stalled behind the gather. `DeviceTimer` records a
pair of CUDA events on the current stream around every span instead, and reads them once per
iteration (`collect`): one synchronisation on the iteration's last event, after the step, where
the training loop reads the loss anyway, so the task loop never waits for the device. On CPU
every operation is synchronous on the calling thread, so the host clock around it is the work
itself (the same code, `time.perf_counter`).

The choice is taken from the device the timer is made for, never from `torch.cuda`, which the
CPU compat shims replace with stand-ins (`compat.cpu`). NVTX ranges are pushed only on GPU.

Usage (one timer per rank and device):

    timer = DeviceTimer(device)
    with timer.span("exposed_spag"):       # a stall of the compute stream behind spAG
        held = gather.wait()
    mark = timer.start("non_moe")          # a span that opens in one hook and closes in another
    ...
    timer.stop(mark)
    seconds = timer.collect()              # {"exposed_spag": [s, ...], "non_moe": [s, ...]} since the last collect
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["DeviceMemory", "DeviceTimer", "nvtx_range"]


@contextlib.contextmanager
def nvtx_range(name: str, device: torch.device) -> Iterator[None]:
    """An NVTX range around the body on a CUDA device (what Nsight Systems shows); nothing on CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


@dataclass
class _Mark:
    """An open span: its name, its start (a CUDA event, or host seconds) and its NVTX range id."""

    name: str
    start: object
    nvtx_id: int | None


class DeviceTimer:
    """Named spans of the compute stream of one device, read once per iteration."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        """The device whose current stream the spans time."""
        self.on_gpu = self.device.type == "cuda"
        """CUDA events (True) or the host clock (False)."""
        self._pending: list[tuple[str, object, object]] = []
        self._done: dict[str, list[float]] = defaultdict(list)

    def start(self, name: str) -> _Mark:
        """Open a span on the current stream (close it with `stop`; spans may overlap)."""
        if not self.on_gpu:
            return _Mark(name, time.perf_counter(), None)
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return _Mark(name, event, torch.cuda.nvtx.range_start(name))

    def stop(self, mark: _Mark) -> None:
        """Close a span opened by `start`."""
        if not self.on_gpu:
            self._done[mark.name].append(time.perf_counter() - mark.start)
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        torch.cuda.nvtx.range_end(mark.nvtx_id)
        self._pending.append((mark.name, mark.start, event))

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the body as one span called `name`."""
        mark = self.start(name)
        try:
            yield
        finally:
            self.stop(mark)

    def collect(self) -> dict[str, list[float]]:
        """Seconds of every span closed since the last collect, by name, in closing order.

        On GPU this waits for the last recorded event (the device has finished every timed
        span), then reads each pair; call it once per iteration, after the step.
        """
        if self._pending:
            self._pending[-1][2].synchronize()
            for name, start, end in self._pending:
                self._done[name].append(start.elapsed_time(end) / 1e3)
            self._pending = []
        done, self._done = dict(self._done), defaultdict(list)
        return done


@dataclass(frozen=True)
class DeviceMemory:
    """What the CUDA caching allocator and the driver say about one GPU's memory, bytes."""

    free: int
    """Free to this process: the driver's free memory plus what the allocator caches unused."""
    allocated: int
    """Held by live tensors now."""
    peak: int
    """The most held by live tensors since the last `reset_peak`."""

    @classmethod
    def read(cls, device: torch.device) -> "DeviceMemory":
        driver_free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
        return cls(free=int(driver_free + cached), allocated=int(allocated),
                   peak=int(torch.cuda.max_memory_allocated(device)))

    @staticmethod
    def reset_peak(device: torch.device) -> None:
        """Start a new peak from what is held now."""
        torch.cuda.reset_peak_memory_stats(device)
