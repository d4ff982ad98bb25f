"""Zebra mode inside training: `pretrain_gpt_moe.py --moe-parallel-mode zebra` on 4 gloo ranks.

The issue's done-when: M=2 attention + N=2 expert ranks, R=4 micro-batches, 12 iterations (the issue: 20) match
the ep run (Megatron's own EP=4 on the same 4 ranks, same data and seed) within 1e-5 relative (Asym-EA:
tests/zebra/test_zebra_engine.py against Megatron's model, and test_precision_training's fp16 run); the timeline of that run shows attention and expert ranks computing at the
same time, and tools/plot_timeline.py draws it. Dropout is off in both runs: the zebra schedule
draws dropout masks in another order (the equivalence is of the model, not of the RNG stream).

One launch per run (2 in all, about 2 minutes on 2 cores).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.training import REPO, launch

from megatron_patches.placement.trace import read_trace
from megatron_patches.zebra.timeline import read_timeline

pytestmark = pytest.mark.e2e

ITERS = 12
M, N, R = 2, 2, 4
MICRO = 4
COMMON = [
    "--cpu", "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--micro-batch-size", str(MICRO),
]
ZEBRA = ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", str(M), "--zebra-expert-ranks", str(N),
         "--zebra-microbatches", str(R)]
# tiny.yaml: 2 layers, hidden 64, 8 experts, top-2, sequence 128.
LAYERS, HIDDEN, EXPERTS, TOPK, SEQ = 2, 64, 8, 2, 128


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("zebra_training")
    # ep: one global batch = micro x R x M = 32 sequences, as zebra's (DP 4 x 2 micro-batches).
    ep = launch(4, [*COMMON, "--global-batch-size", str(MICRO * R * M)], work, "ep")
    timeline = work / "timeline.json"
    zebra = launch(4, [*COMMON, *ZEBRA, "--zebra-timeline", str(timeline), "--moe-log-loads", str(work / "loads.npz")],
                   work, "zebra")
    return {"ep": ep, "zebra": zebra, "timeline": timeline, "work": work}


def _series(run, key):
    return [r[key] for r in run.records if key in r and "moe_layers" in r]


@pytest.mark.parametrize("variant", ["zebra"])
def test_losses_and_grad_norms_match_ep(runs, variant):
    ep_loss, loss = _series(runs["ep"], "loss"), _series(runs[variant], "loss")
    assert len(ep_loss) == len(loss) == ITERS
    assert loss == pytest.approx(ep_loss, rel=1e-5)
    assert loss[-1] < loss[0] - 0.5  # it trains
    assert _series(runs[variant], "grad_norm") == pytest.approx(_series(runs["ep"], "grad_norm"), rel=1e-4)
    assert _series(runs[variant], "lr") == pytest.approx(_series(runs["ep"], "lr"), rel=1e-12)


def test_records_count_routed_tokens_and_exact_all_to_all_bytes(runs):
    copies = MICRO * R * M * SEQ * TOPK  # token copies routed per layer and iteration
    records = [r for r in runs["zebra"].records if "moe_layers" in r]
    for record in records:
        zebra = record["zebra"]
        assert {k: v for k, v in zebra.items() if k not in ("bytes", "memory")} == {
            "attention_ranks": M, "expert_ranks": N, "zp_groups": 1, "microbatches": R, "offload_chunks": [0, 0]}
        for layer in record["moe_layers"]:
            assert sum(layer["expert_tokens"]) == copies
            # no Asym-EA: the two attention positions hold nothing, expert rank j holds experts 4j..4j+3
            tokens = layer["expert_tokens"]
            assert layer["device_tokens"] == [0, 0, sum(tokens[:4]), sum(tokens[4:])]
            assert layer["imbalance"] == pytest.approx(max(layer["device_tokens"]) / (copies / N))
        # Every copy crosses ranks (attention -> expert). Dispatch: tokens and fp32 probabilities
        # forward, their gradients backward; combine: outputs forward, their gradients backward.
        assert zebra["bytes"]["a2a_dispatch"] == LAYERS * copies * (2 * HIDDEN * 4 + 2 * 4)
        assert zebra["bytes"]["a2a_combine"] == LAYERS * copies * 2 * HIDDEN * 4
        # the common record's a2a: 4 transfers of every remote copy (tokens only), as in every mode
        assert record["bytes"]["a2a"] == 4 * LAYERS * copies * HIDDEN * 4
    # --moe-log-loads: the shared loop's trace, from Megatron's routers on the attention ranks
    trace = read_trace(runs["work"] / "loads.npz")
    assert trace.loads.shape == (ITERS, LAYERS, EXPERTS)
    assert trace.loads.tolist() == [[layer["expert_tokens"] for layer in r["moe_layers"]] for r in records]


def test_timeline_shows_attention_and_expert_ranks_computing_at_once(runs):
    timeline = read_timeline(runs["timeline"])
    assert f"zebra: wrote the timeline of iteration {ITERS}" in runs["zebra"].output

    def compute_spans(role):
        return [(s["start"], s["end"]) for rank in timeline["ranks"] if rank["role"] == role
                for s in rank["tasks"] if s["stream"] == "compute"]

    attention, expert = compute_spans("attention"), compute_spans("expert")
    assert attention and expert
    overlap = sum(max(0.0, min(a1, e1) - max(a0, e0)) for a0, a1 in attention for e0, e1 in expert)
    assert overlap > 0.0, "no attention compute overlaps any expert compute"

    png = runs["work"] / "timeline.png"
    proc = subprocess.run([sys.executable, "tools/plot_timeline.py", str(runs["timeline"]), "--out", str(png)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 10_000
    assert "bubble" in proc.stdout.lower()
