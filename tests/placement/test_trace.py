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
from megatron_patches.placement.synthetic import PAPERS_ROUTING, cap_shares, popularity_weights
from megatron_patches.placement.trace import trace_statistics

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


def test_swings_follow_the_stationary_ar1_law():
    """log w_(i,e) = x_(i,e) - c_i with x a stationary AR(1) of std swing and lag-1 correlation rho,
    so between two experts, over k iterations, the change of log(w_a / w_b) is
    (x_a(i+k) - x_a(i)) - (x_b(i+k) - x_b(i)), of variance 2 * 2 swing^2 (1 - rho^k) by hand."""
    swing, rho, iterations, experts = 0.8, 0.7, 400, 200
    w_ILE = popularity_weights(iterations, 1, experts, zipf=0.0, drift=0.0, spike_prob=0.0, spike_factor=1.0,
                               layer_variation=0.0, rng=np.random.default_rng(1), swing=swing, swing_corr=rho)
    log_IE = np.log(w_ILE[:, 0, :])
    pair_IE = log_IE[:, 0::2] - log_IE[:, 1::2]  # 100 independent pairs: x_a - x_b, variance 2 swing^2
    assert np.var(pair_IE) == pytest.approx(2 * swing**2, rel=0.05)
    for k in (1, 3, 10):
        change = pair_IE[k:] - pair_IE[:-k]
        assert np.var(change) == pytest.approx(4 * swing**2 * (1 - rho**k), rel=0.06), k
    # swing 0 draws nothing: the trace of every earlier version, bit for bit
    kwargs = dict(iterations=30, layers=3, experts=16, tokens=5000, zipf=1.3, drift=0.2, spike_prob=0.1, ranks=4, seed=2)
    assert np.array_equal(synthetic_trace(swing=0.0, swing_corr=0.5, **kwargs).source_loads,
                          synthetic_trace(**kwargs).source_loads)
    with pytest.raises(PlacementError, match=r"swing_corr must be in \[0, 1\), got 1.0"):
        synthetic_trace(swing=0.5, swing_corr=1.0)
    with pytest.raises(PlacementError, match="swing must be >= 0.0, got -0.1"):
        synthetic_trace(swing=-0.1)


def test_top_k_caps_an_experts_share_by_water_filling():
    """A token picks k distinct experts, so no expert gets more than 1/k of the routed tokens. By
    hand: [0.7, 0.2, 0.1] at cap 1/2 is [0.5, 0.2 x 0.5/0.3, 0.1 x 0.5/0.3]; [0.45, 0.45, 0.06,
    0.04] at cap 1/3 caps two and spreads the last third as 0.06 : 0.04."""
    capped = cap_shares(np.array([[[0.7, 0.2, 0.1]], [[0.4, 0.35, 0.25]]]), 0.5)
    np.testing.assert_allclose(capped[0, 0], [0.5, 1 / 3, 1 / 6], rtol=1e-12)
    np.testing.assert_array_equal(capped[1, 0], [0.4, 0.35, 0.25])  # within the cap: untouched
    np.testing.assert_allclose(cap_shares(np.array([0.45, 0.45, 0.06, 0.04]), 1 / 3), [1 / 3, 1 / 3, 0.2, 0.4 / 3],
                               rtol=1e-12)
    # a strongly swinging top-2 trace stays within half of the tokens, up to the multinomial draw
    kwargs = dict(iterations=40, layers=4, experts=8, tokens=200_000, zipf=1.5, swing=1.5, swing_corr=0.5, seed=1)
    assert trace_statistics(synthetic_trace(**kwargs).loads).hot_share_max > 0.7
    assert trace_statistics(synthetic_trace(topk=2, **kwargs).loads).hot_share_max < 0.505
    assert np.array_equal(synthetic_trace(topk=1, **kwargs).loads, synthetic_trace(**kwargs).loads)
    with pytest.raises(PlacementError, match=r"topk must be <= experts \(8\)"):
        synthetic_trace(topk=9, **kwargs)


def test_trace_statistics_by_hand():
    # 5 iterations, 2 layers, 4 experts, 100 tokens per layer and iteration
    loads = np.zeros((5, 2, 4), dtype=np.int64)
    loads[:, 0] = [[40, 30, 20, 10], [40, 30, 20, 10], [40, 30, 20, 10], [10, 30, 20, 40], [40, 30, 20, 10]]
    loads[:, 1] = [[25, 25, 25, 25]] * 4 + [[0, 25, 25, 50]]
    stats = trace_statistics(loads, window=3)
    # hottest shares: layer 0 always 0.40; layer 1 0.25 four times, then 0.50
    assert stats.hot_share_mean == pytest.approx((5 * 0.40 + 4 * 0.25 + 0.50) / 10)
    assert stats.hot_share_max == pytest.approx(0.50)
    assert (stats.layer_hot_share_min, stats.layer_hot_share_max) == (pytest.approx(0.30), pytest.approx(0.40))
    # swings over 3 iterations, experts at >= 1/4 at one end: layer 0 (i=0 -> 3) expert 0 0.4 -> 0.1 and
    # expert 3 0.1 -> 0.4 (4x each), expert 1 (1x); (i=1 -> 4) experts 0, 1 (1x). Layer 1 (i=0 -> 3) all
    # 1x; (i=1 -> 4) expert 0 0.25 -> 0 floored at 1/16 (4x), experts 1, 2 (1x), expert 3 0.25 -> 0.5 (2x)
    assert stats.swing_max == pytest.approx(4.0)
    assert stats.swing_window == 3
    # the hottest expert (argmax, first on ties) agrees across the two layers at i = 0, 1, 2 (expert 0)
    assert stats.same_hot_expert == pytest.approx(3 / 5)
    assert stats.describe().startswith("hottest expert 35.0% of a layer's routed tokens (max 50.0%; layers 30.0%-40.0%)")
    with pytest.raises(TraceError, match="swings over 3 iterations need more than 3 iterations"):
        trace_statistics(loads[:3])


def test_papers_routing_swings_as_symi_reports():
    """PAPERS_ROUTING's documented calibration: on SYMI's setup (16 experts, top-1, 16 GPUs x 4 x 512
    tokens, 12 layers, 60 iterations, seed 0) the median layer's largest 3-iteration swing is 14.7x
    (SYMI: 16x within 3 iterations), and the layers' mean hottest share spreads about 2x."""
    trace = synthetic_trace(iterations=60, layers=12, experts=16, tokens=16 * 4 * 512, ranks=16, seed=0, topk=1,
                            **PAPERS_ROUTING)
    per_layer = [trace_statistics(trace.loads[:, l:l + 1]).swing_max for l in range(12)]
    assert np.median(per_layer) == pytest.approx(14.7, abs=0.05)
    stats = trace_statistics(trace.loads)
    assert stats.layer_hot_share_max / stats.layer_hot_share_min == pytest.approx(2.06, abs=0.01)


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
    assert "statistics: hottest expert" in result.stdout and "popularity swings over 3 iterations" in result.stdout
    trace = read_trace(out)
    assert trace.metadata["topk"] == 2 and trace.metadata["zipf"] == 1.2 and trace.metadata["model"] == "gpt-moe-s"
    expected = synthetic_trace(iterations=5, layers=2, experts=8, tokens=800, zipf=1.2, ranks=4, seed=3)
    assert np.array_equal(trace.loads, expected.loads)
    bad = subprocess.run(cmd[:4] + ["--zipf", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "zipf must be >= 0" in bad.stderr
    assert json.loads(json.dumps(trace.metadata)) == trace.metadata
    # --papers-routing starts from PAPERS_ROUTING; a flag beside it overrides its value
    papers = subprocess.run(cmd + ["--papers-routing", "--swing", "0.5"], capture_output=True, text=True, check=True)
    assert "statistics:" in papers.stdout
    expected = synthetic_trace(iterations=5, layers=2, experts=8, tokens=800, ranks=4, seed=3, topk=2,
                               **{**PAPERS_ROUTING, "zipf": 1.2, "swing": 0.5})
    assert np.array_equal(read_trace(out).loads, expected.loads)
