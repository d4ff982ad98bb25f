"""Tests of the .npz trace format, the synthetic generator and tools/make_trace.py."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_patches.placement import PlacementError, Trace, TraceError, read_trace, synthetic_trace, write_trace

REPO = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=25, deadline=None)


# ---------------------------------------------------------------------------- format


@FAST
@given(I=st.integers(1, 4), L=st.integers(1, 3), R=st.integers(1, 3), E=st.integers(1, 5),
       with_source=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_write_read_roundtrip(tmp_path_factory, I, L, R, E, with_source, seed):
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 50, size=(I, L, R, E))
    loads = source.sum(axis=2)
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    write_trace(path, loads, source if with_source else None, model="gpt-moe-s", ranks=R, topk=2)
    trace = read_trace(path)
    assert trace.loads.dtype == np.int64 and np.array_equal(trace.loads, loads)
    if with_source:
        assert np.array_equal(trace.source_loads, source) and trace.num_ranks == R
    else:
        assert trace.source_loads is None and trace.num_ranks is None
    assert trace.metadata == {"model": "gpt-moe-s", "ranks": R, "topk": 2}
    assert (trace.num_iterations, trace.num_layers, trace.num_experts) == (I, L, E)


def test_write_uses_the_exact_path(tmp_path):
    path = tmp_path / "loads.trace"
    write_trace(path, np.ones((1, 1, 2), dtype=np.int64))
    assert path.exists() and not (tmp_path / "loads.trace.npz").exists()
    assert read_trace(path).metadata == {}


def test_invalid_traces_are_rejected_with_clear_errors(tmp_path):
    with pytest.raises(TraceError, match="loads must have 3 dimension"):
        write_trace(tmp_path / "a.npz", np.ones((2, 3)))
    with pytest.raises(TraceError, match=r"non-negative token counts, got -1 at index \(0, 0, 1\)"):
        write_trace(tmp_path / "a.npz", np.array([[[1, -1]]]))
    source = np.ones((1, 1, 2, 3), dtype=np.int64)
    with pytest.raises(TraceError, match="iteration 0, layer 0, expert 2 sum to 2 but loads says 1"):
        write_trace(tmp_path / "a.npz", np.array([[[2, 2, 1]]]), source)
    with pytest.raises(TraceError, match=r"source_loads has shape \(1, 1, 2, 3\), expected \(1, 1, ranks, 4\)"):
        write_trace(tmp_path / "a.npz", np.ones((1, 1, 4), dtype=np.int64), source)
    with pytest.raises(TraceError, match="JSON-serialisable"):
        write_trace(tmp_path / "a.npz", np.ones((1, 1, 1), dtype=np.int64), model=object())


def test_read_rejects_foreign_files(tmp_path):
    np.savez(tmp_path / "float.npz", loads=np.ones((1, 1, 2)))
    with pytest.raises(TraceError, match="loads must be int64, got float64"):
        read_trace(tmp_path / "float.npz")
    np.savez(tmp_path / "noloads.npz", counts=np.ones((1, 1, 2), dtype=np.int64))
    with pytest.raises(TraceError, match="no 'loads' array"):
        read_trace(tmp_path / "noloads.npz")
    np.savez(tmp_path / "extra.npz", loads=np.ones((1, 1, 2), dtype=np.int64), junk=np.zeros(1))
    with pytest.raises(TraceError, match=r"unexpected arrays \['junk'\]"):
        read_trace(tmp_path / "extra.npz")
    np.savez(tmp_path / "meta.npz", loads=np.ones((1, 1, 2), dtype=np.int64), metadata_json=np.array("[1, 2]"))
    with pytest.raises(TraceError, match="must be a JSON object"):
        read_trace(tmp_path / "meta.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(TraceError, match="not a readable .npz trace"):
        read_trace(tmp_path / "text.npz")


# ---------------------------------------------------------------------------- synthetic traces


def hottest_share(trace: Trace) -> np.ndarray:
    return trace.loads.max(axis=2) / np.maximum(trace.loads.sum(axis=2), 1)


def test_synthetic_trace_shape_totals_and_reproducibility():
    a = synthetic_trace(iterations=20, layers=3, experts=8, tokens=1000, ranks=4, seed=7, model="tiny")
    b = synthetic_trace(iterations=20, layers=3, experts=8, tokens=1000, ranks=4, seed=7, model="tiny")
    assert np.array_equal(a.loads, b.loads) and np.array_equal(a.source_loads, b.source_loads)
    assert a.loads.shape == (20, 3, 8) and a.source_loads.shape == (20, 3, 4, 8)
    assert np.all(a.loads.sum(axis=2) == 1000)
    assert np.all(a.source_loads.sum(axis=3) == 250)  # equal shares per rank
    assert a.metadata["model"] == "tiny" and a.metadata["seed"] == 7 and a.metadata["ranks"] == 4
    assert not np.array_equal(a.loads, synthetic_trace(20, 3, 8, 1000, ranks=4, seed=8).loads)


def test_synthetic_trace_knobs_do_what_they_say():
    kwargs = dict(iterations=60, layers=2, experts=16, tokens=20000, seed=0)
    uniform = synthetic_trace(zipf=0.0, drift=0.0, **kwargs)
    skewed = synthetic_trace(zipf=1.5, drift=0.0, **kwargs)
    assert hottest_share(uniform).mean() < 0.09 < 0.3 < hottest_share(skewed).mean()
    # no drift: the hottest expert never changes; fast drift: it moves
    static_hot = np.argmax(skewed.loads, axis=2)
    assert np.all(static_hot == static_hot[0])
    moving_hot = np.argmax(synthetic_trace(zipf=1.5, drift=0.5, **kwargs).loads, axis=2)
    assert len(np.unique(moving_hot[:, 0])) > 3
    # layers differ in which experts are hot
    assert static_hot[0, 0] != static_hot[0, 1] or not np.array_equal(skewed.loads[0, 0], skewed.loads[0, 1])
    # spikes raise the hottest share on a uniform trace
    spiky = synthetic_trace(zipf=0.0, drift=0.0, spike_prob=1.0, spike_factor=20.0, **kwargs)
    assert hottest_share(spiky).mean() > 0.4


def test_synthetic_trace_validates_arguments():
    with pytest.raises(PlacementError, match="spike_prob must be in"):
        synthetic_trace(spike_prob=2.0)
    with pytest.raises(PlacementError, match="experts must be an integer >= 1, got 0"):
        synthetic_trace(experts=0)


def test_zero_tokens_is_a_valid_trace():
    trace = synthetic_trace(iterations=2, layers=1, experts=3, tokens=0, ranks=2)
    assert trace.loads.sum() == 0


# ---------------------------------------------------------------------------- CLI


def test_make_trace_cli(tmp_path):
    out = tmp_path / "sub" / "skewed.npz"
    cmd = [sys.executable, str(REPO / "tools" / "make_trace.py"), "--out", str(out), "--iterations", "5",
           "--layers", "2", "--experts", "8", "--tokens", "800", "--zipf", "1.2", "--ranks", "4",
           "--topk", "2", "--model", "gpt-moe-s", "--seed", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "wrote" in result.stdout and "source_loads (5, 2, 4, 8)" in result.stdout
    trace = read_trace(out)
    assert trace.metadata["topk"] == 2 and trace.metadata["zipf"] == 1.2 and trace.metadata["model"] == "gpt-moe-s"
    expected = synthetic_trace(iterations=5, layers=2, experts=8, tokens=800, zipf=1.2, ranks=4, seed=3)
    assert np.array_equal(trace.loads, expected.loads)
    bad = subprocess.run(cmd[:4] + ["--zipf", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "zipf must be >= 0" in bad.stderr
    assert json.loads(json.dumps(trace.metadata)) == trace.metadata
