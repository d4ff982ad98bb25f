"""tools/bench_zebra.py as a user runs it, on a tiny shape: its five systems (ep and EP-Ideal
through the training script at zebra's global batch, and the engine's naive, zebra and
zebra + Asym-EA) in one table, and the three engine modes training one model (their losses
equal). No timing is asserted (timings are the benchmark's figures, not a test's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.training import REPO

pytestmark = pytest.mark.e2e


def test_bench_zebra_prints_ep_ep_ideal_and_the_zebra_modes(tmp_path):
    out = tmp_path / "bench"
    flags = ["--iters", "2", "--layers", "2", "--hidden-size", "32", "--moe-ffn-hidden-size", "64", "--seq-length", "32",
             "--expert-slowdown", "2", "--out-dir", str(out)]
    proc = subprocess.run([sys.executable, "tools/bench_zebra.py", *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # zebra's global batch: micro batch 2 x R 4 x M 2 sequences of 32 tokens, in every row
    assert "every row: 512 tokens per iteration" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| system")]
    assert [row.split(" | ")[0] for row in rows] == [
        "| ep, 4 ranks (EMULATED: measured x 2)", "| EP-Ideal, 2 and 2 ranks apart (the 2: EMULATED x 2)",
        "| naive", "| zebra", "| zebra + Asym-EA"]
    results = json.loads((out / "results.json").read_text())
    baselines = results["baselines"]
    assert baselines["scaled_by"] == 2.0 and baselines["ep_iteration_ms"] > 0 and baselines["ep_ideal_iteration_ms"] > 0
    reference = results["naive"]["losses"]
    for mode in ("zebra", "zebra + Asym-EA"):
        assert results[mode]["losses"] == pytest.approx(reference, rel=1e-5), mode


def test_bench_zebra_refuses_a_batch_the_baselines_cannot_split():
    proc = subprocess.run([sys.executable, "tools/bench_zebra.py", "--attention-ranks", "2", "--expert-ranks", "4",
                           "--microbatches", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--attention-ranks=2 x --microbatches=3 = 6 micro-batches per iteration do not split over the 4 ranks of an ep baseline" in proc.stderr, proc.stderr
