"""Activation memory, measured: the bytes autograd keeps from a forward pass for its backward.

Activation recompute exists to lower this figure, so it is measured rather than estimated. While
`measure()` is active, a saved-tensor pack hook notes every tensor autograd saves. Tensors are
counted once per storage, so two views of one buffer count as that buffer. Storages that live for
the whole run (parameters, replicate's slots: `persistent`) are skipped. What remains is what the forward adds and the
backward frees, as a GPU allocator would see it:
- the layers' inputs and intermediates (or, under full recompute, only each checkpointed
  layer's input);
- fssdp's materialized expert copies, which stay alive until the backward, except under
  `--fssdp-rematerialize`, where only a marker is saved.

torch applies only the innermost pair of saved-tensor hooks. A mode that installs its own hooks
inside a measured forward (fssdp's re-materialization) calls `note(tensor)` for each tensor it
keeps as it is.

On CUDA, the loop also reports the allocator's peak; this module measures the same thing on every
device, CPU gloo ranks included.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_held: dict[int, int] | None = None
"""Storage address -> bytes for the forward being measured (None outside `measure`)."""
_persistent: set[int] = set()
"""Addresses of storages that live for the whole run (parameters, replicate's slots)."""
_peak_bytes = 0


def persistent(tensors) -> None:
    """Marks the tensors' storages as held anyway, not activations: the model's parameters (with
    Megatron's DDP buffers, one storage per buffer) and a mode's own weight buffers."""
    _persistent.update(t.untyped_storage().data_ptr() for t in tensors)


def released(tensors) -> None:
    """The tensors' storages are about to be freed (a zebra expert moved to another rank): their
    addresses may come back as activations."""
    _persistent.difference_update(t.untyped_storage().data_ptr() for t in tensors)


def forget() -> None:
    """At a run's end: its persistent storages are freed with it, and their addresses may come
    back as another run's activations in the same process (tests/support/multirun.py)."""
    global _peak_bytes
    _persistent.clear()
    _peak_bytes = 0


def note(tensor: torch.Tensor) -> None:
    """Counts `tensor`'s storage as kept for the backward (no-op outside a measured forward)."""
    if _held is None:
        return
    storage = tensor.untyped_storage()
    address = storage.data_ptr()
    if address and address not in _persistent:
        _held[address] = storage.nbytes()


def _pack(tensor: torch.Tensor) -> torch.Tensor:
    note(tensor)
    return tensor.detach()  # not the tensor itself: an op's saved output would reference its own grad_fn


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextmanager
def measure(forward: dict[int, int] | None = None):
    """Measures one forward (one micro-batch); the largest so far is `take_peak()`'s. A forward run
    in parts (zebra's tasks of one micro-batch) passes the same `forward` dict to every part: it
    collects that forward's storages, counted once, and the peak sees their sum so far."""
    global _held, _peak_bytes
    _held = {} if forward is None else forward
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _peak_bytes = max(_peak_bytes, sum(_held.values()))
        _held = None


def take_peak() -> int:
    """The largest forward's kept bytes since the last call, and a reset."""
    global _peak_bytes
    peak, _peak_bytes = _peak_bytes, 0
    return peak
