"""Expert-load traces: the `.npz` format shared by training (`--moe-log-loads`) and the tools.

A trace records tokens routed per expert, per MoE layer, per iteration:

- `loads`: int64 [iterations, layers, experts], required;
- `source_loads`: int64 [iterations, layers, ranks, experts], optional: the same tokens split
  by the rank they came from (what topology-aware dispatch needs); when present,
  `source_loads.sum(axis=2) == loads` must hold;
- `metadata_json`: a JSON object (stored as a 0-d string array, so files load without
  pickle): e.g. model, ranks, topk, seed, generator parameters. Free-form, but values must be
  JSON-serialisable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from megatron_patches.placement.types import PlacementError, check_loads

__all__ = ["Trace", "TraceError", "TraceStatistics", "read_trace", "trace_statistics", "write_trace"]


class TraceError(PlacementError):
    """A trace file or array does not follow the trace format."""


def _validate(loads, source_loads, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        loads = check_loads(loads, "loads", 3)
        if source_loads is not None:
            source_loads = check_loads(source_loads, "source_loads", 4)
    except PlacementError as err:
        raise TraceError(f"{where}: {err}") from None
    if loads.size == 0:
        raise TraceError(f"{where}: loads must have >= 1 iteration, layer and expert, got shape {loads.shape}")
    if source_loads is not None:
        I, L, E = loads.shape
        if source_loads.shape[:2] != (I, L) or source_loads.shape[3] != E or source_loads.shape[2] < 1:
            raise TraceError(
                f"{where}: source_loads has shape {source_loads.shape}, expected ({I}, {L}, ranks, {E})"
            )
        mismatch = np.argwhere(source_loads.sum(axis=2) != loads)
        if mismatch.size:
            i, l, e = (int(x) for x in mismatch[0])
            raise TraceError(
                f"{where}: source_loads of iteration {i}, layer {l}, expert {e} sum to "
                f"{int(source_loads[i, l, :, e].sum())} but loads says {int(loads[i, l, e])}"
            )
    return loads, source_loads


@dataclass(frozen=True)
class Trace:
    """An expert-load trace (validated on construction)."""

    loads: np.ndarray
    """Tokens routed per expert; int64 [iterations, layers, experts]."""
    source_loads: np.ndarray | None = None
    """Tokens per source rank and expert; int64 [iterations, layers, ranks, experts], or None."""
    metadata: dict = field(default_factory=dict)
    """Free-form JSON-serialisable description: model, ranks, topk, seed, generator settings."""

    def __post_init__(self) -> None:
        loads, source_loads = _validate(self.loads, self.source_loads, "Trace")
        object.__setattr__(self, "loads", loads)
        object.__setattr__(self, "source_loads", source_loads)
        try:
            json.dumps(self.metadata)
        except TypeError as err:
            raise TraceError(f"Trace metadata must be JSON-serialisable: {err}") from None

    @property
    def num_iterations(self) -> int:
        """I."""
        return int(self.loads.shape[0])

    @property
    def num_layers(self) -> int:
        """L."""
        return int(self.loads.shape[1])

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.loads.shape[2])

    @property
    def num_ranks(self) -> int | None:
        """Number of source ranks in source_loads, or None without them."""
        return None if self.source_loads is None else int(self.source_loads.shape[2])


def write_trace(path: str | os.PathLike, loads_ILE, source_loads_ILRE=None, **metadata) -> Trace:
    """Validate and write a trace to `path` (compressed .npz, written exactly at `path`).

    Returns the Trace that was written.
    """
    trace = Trace(loads_ILE, source_loads_ILRE, dict(metadata))
    arrays = {"loads": trace.loads, "metadata_json": np.array(json.dumps(trace.metadata, sort_keys=True))}
    if trace.source_loads is not None:
        arrays["source_loads"] = trace.source_loads
    # an open file handle stops numpy from appending ".npz" to a path that lacks it
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return trace


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace written by `write_trace` (or by training's --moe-log-loads)."""
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise TraceError(f"{path}: not a readable .npz trace ({err})") from None
    with npz:
        if "loads" not in npz.files:
            raise TraceError(f"{path}: no 'loads' array (found {sorted(npz.files)})")
        unknown = set(npz.files) - {"loads", "source_loads", "metadata_json"}
        if unknown:
            raise TraceError(f"{path}: unexpected arrays {sorted(unknown)}; a trace holds loads, source_loads, metadata_json")
        loads = npz["loads"]
        source_loads = npz["source_loads"] if "source_loads" in npz.files else None
        metadata = {}
        if "metadata_json" in npz.files:
            try:
                metadata = json.loads(str(npz["metadata_json"]))
            except json.JSONDecodeError as err:
                raise TraceError(f"{path}: metadata_json is not valid JSON ({err})") from None
            if not isinstance(metadata, dict):
                raise TraceError(f"{path}: metadata_json must be a JSON object, got {type(metadata).__name__}")
    for name, arr in (("loads", loads), ("source_loads", source_loads)):
        if arr is not None and arr.dtype != np.int64:
            raise TraceError(f"{path}: {name} must be int64, got {arr.dtype}")
    loads, source_loads = _validate(loads, source_loads, str(path))
    return Trace(loads, source_loads, metadata)


@dataclass(frozen=True)
class TraceStatistics:
    """The routing statistics the MoE training papers report, measured on one trace.

    Shares are of a layer's routed tokens (token-expert assignments) in one iteration; with
    top-k routing an expert receives at most 1/k of them."""

    hot_share_mean: float
    """The hottest expert's share, mean over (iteration, layer); 1/E when balanced."""
    hot_share_max: float
    """The hottest expert's share, max over (iteration, layer)."""
    swing_window: int
    """k: the iterations over which swings are measured."""
    swing_p99: float
    """99th percentile of an expert's popularity swing over k iterations: max(s_i / s_(i+k),
    s_(i+k) / s_i) for its share s, counted where the expert holds at least its fair share 1/E
    at one end (a cold expert's noise over a handful of tokens is not a swing), shares floored at
    1/E^2 (an expert falling silent counts as a finite swing)."""
    swing_max: float
    """The largest such swing in the trace."""
    layer_hot_share_min: float
    """The least skewed layer: its hottest expert's share, mean over iterations."""
    layer_hot_share_max: float
    """The most skewed layer, the same measure."""
    same_hot_expert: float
    """How often two layers of one iteration have the same hottest expert (mean over layer
    pairs and iterations; 1/E when layers are independent, 1 when they move together; NaN with
    one layer)."""

    def describe(self) -> str:
        """One line: what a table footer or a tool prints about the trace."""
        return (f"hottest expert {self.hot_share_mean:.1%} of a layer's routed tokens (max {self.hot_share_max:.1%}; "
                f"layers {self.layer_hot_share_min:.1%}-{self.layer_hot_share_max:.1%}), popularity swings over "
                f"{self.swing_window} iterations p99 {self.swing_p99:.1f}x (max {self.swing_max:.1f}x), "
                f"same hottest expert in two layers {self.same_hot_expert:.1%}")


def trace_statistics(loads_ILE, window: int = 3) -> TraceStatistics:
    """TraceStatistics of loads int [iterations, layers, experts] (see its fields for the
    definitions); swings need more than `window` iterations."""
    loads_ILE = check_loads(loads_ILE, "loads", 3)
    I, L, E = loads_ILE.shape
    if window < 1 or I <= window:
        raise TraceError(f"swings over {window} iterations need more than {window} iterations and window >= 1; "
                         f"the trace has {I}")
    share_ILE = loads_ILE / np.maximum(loads_ILE.sum(axis=2, keepdims=True), 1)
    hot_IL = share_ILE.max(axis=2)
    floor = 1.0 / E**2
    before, after = np.maximum(share_ILE[:-window], floor), np.maximum(share_ILE[window:], floor)
    swing = np.maximum(before / after, after / before)[np.maximum(before, after) >= 1.0 / E]
    if swing.size == 0:  # no tokens at all
        swing = np.ones(1)
    hottest_IL = share_ILE.argmax(axis=2)
    pairs = [(a, b) for a in range(L) for b in range(a + 1, L)]
    same = float(np.mean([np.mean(hottest_IL[:, a] == hottest_IL[:, b]) for a, b in pairs])) if pairs else float("nan")
    layer_hot_L = hot_IL.mean(axis=0)
    return TraceStatistics(
        hot_share_mean=float(hot_IL.mean()), hot_share_max=float(hot_IL.max()), swing_window=int(window),
        swing_p99=float(np.quantile(swing, 0.99)), swing_max=float(swing.max()),
        layer_hot_share_min=float(layer_hot_L.min()), layer_hot_share_max=float(layer_hot_L.max()),
        same_hot_expert=same,
    )
