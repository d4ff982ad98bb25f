"""comm.timing: spans timed on the compute stream (host clock on CPU, CUDA events on GPU), NVTX
ranges, and the GPU memory figures auto m reads.

The CPU tests run everywhere. The GPU tests run where CUDA is (the device machine:
`python3 -m pytest -q tests/training/test_timing.py`); they show why the host clock cannot time GPU
work: it measures the enqueueing of a GEMM and returns at once from a wait on another stream,
while the events measure the stream's busy and stalled time.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_patches.comm.streams import CommStream
from megatron_patches.comm.timing import DeviceMemory, DeviceTimer, nvtx_range

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)")


def test_cpu_spans_are_host_seconds_collected_once_and_may_overlap():
    timer = DeviceTimer(torch.device("cpu"))
    assert not timer.on_gpu
    outer = timer.start("outer")
    with timer.span("sleep"):
        time.sleep(0.02)
    with nvtx_range("cpu: no range", torch.device("cpu")):
        time.sleep(0.01)
    timer.stop(outer)
    with timer.span("sleep"):
        pass
    times = timer.collect()
    assert set(times) == {"outer", "sleep"} and len(times["sleep"]) == 2
    assert 0.02 <= times["sleep"][0] < 1.0 and times["sleep"][1] < 0.01
    assert times["outer"][0] >= 0.03
    assert timer.collect() == {}


def test_a_span_that_raises_is_still_closed():
    timer = DeviceTimer(torch.device("cpu"))
    with pytest.raises(ValueError), timer.span("failing"):
        raise ValueError("boom")
    assert len(timer.collect()["failing"]) == 1


@GPU
def test_events_time_the_gemms_that_the_host_clock_only_enqueues():
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    a @ a  # cuBLAS initialises on the first GEMM, on the host (seen: 130 ms)
    torch.cuda.synchronize()
    timer = DeviceTimer(device)
    host = time.perf_counter()
    with timer.span("gemm"):
        for _ in range(20):
            a @ a
    host = time.perf_counter() - host
    gemm = timer.collect()["gemm"][0]
    flops = 20 * 2 * 8192**3
    print(f"20 bf16 GEMMs 8192^3: events {gemm * 1e3:.2f} ms ({flops / gemm / 1e12:.0f} TFLOP/s), "
          f"host clock {host * 1e3:.3f} ms")
    assert gemm > 5 * host
    assert flops / gemm < 2.0e15  # below any GPU's bf16 peak: the events saw the work


@GPU
def test_events_time_the_compute_streams_stall_behind_a_communication_stream():
    """A long GEMM on the communication stream; the compute stream waits for it (`finish`,
    as a sparse collective's wait does). The span around the wait is the stall: about the GEMM's
    time on the events, nearly nothing on the host clock."""
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    stream = CommStream(device)
    torch.cuda.synchronize()
    alone = DeviceTimer(device)
    with alone.span("gemm"):
        for _ in range(20):
            a @ a
    gemm = alone.collect()["gemm"][0]
    timer = DeviceTimer(device)
    with stream.launch(a):
        for _ in range(20):
            a @ a
    host = time.perf_counter()
    with timer.span("wait"):
        with stream.finish():
            pass
    host = time.perf_counter() - host
    stall = timer.collect()["wait"][0]
    print(f"stall behind the communication stream: events {stall * 1e3:.2f} ms (the GEMMs alone "
          f"{gemm * 1e3:.2f} ms), host clock {host * 1e3:.3f} ms")
    assert stall > 0.5 * gemm and stall > 10 * host


@GPU
def test_device_memory_reads_the_peak_since_a_reset_and_counts_the_cache_as_free():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    DeviceMemory.reset_peak(device)
    base = DeviceMemory.read(device)
    block = torch.empty(2**30, dtype=torch.uint8, device=device)
    held = DeviceMemory.read(device)
    del block
    after = DeviceMemory.read(device)
    print(f"free {base.free / 2**30:.2f} -> {held.free / 2**30:.2f} -> {after.free / 2**30:.2f} GiB, "
          f"peak {(after.peak - base.allocated) / 2**30:.2f} GiB over the base")
    assert after.peak - base.allocated >= 2**30
    assert held.free <= base.free - 2**30 + 2**21
    assert after.free >= held.free + 2**30  # the freed block is cached by the allocator, and free to us
    with nvtx_range("nvtx range on GPU", device):
        torch.cuda.synchronize()
