"""The stream a collective's copies run on: a dedicated CUDA stream on GPU, nothing on CPU.

The sparse collectives pack send buffers, copy local rows and unpack received rows. On GPU
those kernels must not queue behind the attention kernels on the compute stream, or the
gather would not overlap attention (DESIGN 4.5); they run on one communication stream per
device instead, ordered against the caller's stream with events:

- `launch()`: the communication stream first waits for everything the caller has queued so
  far (the inputs are ready), then runs the body (packing, the P2P launch);
- `finish()`: runs the body (unpacking) on the communication stream, then makes the caller's
  current stream wait for it, so the caller may use the results right away.

NCCL itself orders its own internal streams against whichever stream is current when a P2P
op is launched or waited for, which is why both bodies run with the communication stream
current. On CPU every operation is synchronous on the calling thread and gloo's async work
is waited for explicitly, so both contexts do nothing. The decision is taken from the
tensors' device, never from `torch.cuda`, which the CPU compat shims replace with stand-ins.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["CommStream", "comm_stream"]


class CommStream:
    """The communication stream of one device (a no-op on CPU)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        """The device whose kernels this stream orders."""
        self.cuda_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        """The dedicated CUDA stream; None on CPU."""

    @contextlib.contextmanager
    def launch(self, *tensors: torch.Tensor) -> Iterator[None]:
        """Run the body on the communication stream after the caller's queued work.

        `tensors` are caller-owned buffers the stream reads or writes (inputs, outputs): they are
        recorded on the stream so the caching allocator does not hand their memory out again
        while the stream may still use it, even if the caller drops them before waiting.
        """
        if self.cuda_stream is None:
            yield
            return
        self.cuda_stream.wait_stream(torch.cuda.current_stream(self.device))
        for tensor in tensors:
            tensor.record_stream(self.cuda_stream)
        with torch.cuda.stream(self.cuda_stream):
            yield

    @contextlib.contextmanager
    def finish(self) -> Iterator[None]:
        """Run the body on the communication stream, then make the caller's stream wait for it."""
        if self.cuda_stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.cuda_stream):
            yield
            done = torch.cuda.Event()
            done.record(self.cuda_stream)
        caller.wait_event(done)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], bool]]:
        """An asynchronous copy of `tensor` into pinned host memory, queued on this stream after
        what it holds; returns (the host tensor, a poll that is True once the values are there).
        The caller polls instead of blocking, so neither it nor the compute stream waits for the
        copy. On CPU: the tensor itself, already there."""
        if self.cuda_stream is None:
            return tensor, lambda: True
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        tensor.record_stream(self.cuda_stream)
        with torch.cuda.stream(self.cuda_stream):
            host.copy_(tensor, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.cuda_stream)
        return host, arrived.query


_STREAMS: dict[torch.device, CommStream] = {}


def comm_stream(device: torch.device) -> CommStream:
    """The communication stream of `device`, created on first use and shared by all collectives.

    One stream per device keeps collectives launched one after another in launch order (the
    P2P messages of two in-flight collectives must be posted in the same order on every rank).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = CommStream(device)
    return _STREAMS[device]
