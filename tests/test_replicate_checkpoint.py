"""Replicate-mode checkpoints in ep's form, end to end through `pretrain_gpt_moe.py` on 4 gloo ranks.

Replicate mode saves every expert's current weights into the frozen Megatron local expert that
EP's layout gives it and the experts' fp32 Adam moments under ep's expert-optimizer keys, with
the placement (slots per layer, popularity history) as common state. One launch sequence
(dropless, fp32, adaptive policy, so replicate computes ep's model):

    A  replicate, 2K iterations, saves at K
    B  replicate resumed from A at K            -> A's iterations K+1..2K, placements included
    C  ep resumed from A at K, runs to 3K, saves at 2K -> A's iterations K+1..2K (ep resumes the
                                                   moments: every later loss, not only the first)
    D  replicate resumed from C's ep checkpoint at 2K  -> C's iterations 2K+1..3K

Dropless replicate equals ep within 1e-5 (tests/test_replicate_training.py); Adam restarted
from zero moments would move the weights differently from the second step after a resume on,
so matching losses over K iterations show the moments crossed the checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch.distributed.checkpoint import FileSystemReader

from test_training_distributed import launch

pytestmark = pytest.mark.slow

G, K = 4, 3
COMMON = [
    "--lr-warmup-iters", "2", "--lr-decay-iters", str(3 * K), "--log-interval", "1", "--eval-interval", "1000",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--expert-model-parallel-size", str(G),
]
REPLICATE = ["--moe-parallel-mode", "replicate"]


def train_records(run) -> dict[int, dict]:
    return {record["iteration"]: record for record in run.records if "loss" in record}


def point_at(checkpoint, iteration: int) -> None:
    """Make `iteration` the checkpoint a --load picks (the runs also save later ones)."""
    (checkpoint / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def assert_same_losses(run: dict[int, dict], reference: dict[int, dict], iterations) -> None:
    iterations = list(iterations)
    assert sorted(run) == iterations
    np.testing.assert_allclose([run[i]["loss"] for i in iterations], [reference[i]["loss"] for i in iterations], rtol=1e-5, atol=0)
    np.testing.assert_allclose(
        [run[i]["grad_norm"] for i in iterations], [reference[i]["grad_norm"] for i in iterations], rtol=1e-5, atol=0
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("replicate_checkpoint")
    a_ckpt, c_ckpt = work / "a_ckpt", work / "c_ckpt"
    a = launch(G, [*COMMON, *REPLICATE, "--train-iters", str(2 * K), "--save", str(a_ckpt), "--save-interval", str(K)], work, "a")
    point_at(a_ckpt, K)
    b = launch(G, [*COMMON, *REPLICATE, "--train-iters", str(2 * K), "--load", str(a_ckpt)], work, "b")
    c = launch(
        G, [*COMMON, "--train-iters", str(3 * K), "--load", str(a_ckpt), "--save", str(c_ckpt), "--save-interval", str(2 * K)],
        work, "c",
    )
    point_at(c_ckpt, 2 * K)
    d = launch(G, [*COMMON, *REPLICATE, "--train-iters", str(3 * K), "--load", str(c_ckpt)], work, "d")
    return {"a": a, "b": b, "c": c, "d": d, "a_ckpt": a_ckpt, "c_ckpt": c_ckpt}


def test_replicate_resumes_exactly_with_its_placement(runs):
    a, b = train_records(runs["a"]), train_records(runs["b"])
    assert_same_losses(b, a, range(K + 1, 2 * K + 1))
    replicas = {i: [layer["replicas"] for layer in a[i]["replicate"]["layers"]] for i in a}
    # the adaptive policy re-placed the experts across the checkpoint, so the placement had to travel
    assert len({str(replicas[i]) for i in range(K, 2 * K + 1)}) > 1
    assert all([layer["replicas"] for layer in b[i]["replicate"]["layers"]] == replicas[i] for i in b)
    assert f"checkpoint: replicate: restored the placement and {K} observed iterations of popularity" in runs["b"].output
    assert f"checkpoint: replicate: experts' master weights and Adam moments loaded (step {K})" in runs["b"].output


def test_replicate_checkpoint_has_eps_keys_and_resumes_in_ep(runs):
    saved = FileSystemReader(str(runs["a_ckpt"] / f"iter_{K:07d}")).read_metadata().state_dict_metadata
    ep_saved = FileSystemReader(str(runs["c_ckpt"] / f"iter_{2 * K:07d}")).read_metadata().state_dict_metadata
    assert set(saved) == set(ep_saved)
    for key in saved:
        if hasattr(saved[key], "size"):
            assert saved[key].size == ep_saved[key].size, key
    assert "chained_1.optimizer.state.exp_avg_sq.module.decoder.layers.mlp.experts.experts.linear_fc2.weight" in saved
    assert_same_losses(
        {i: r for i, r in train_records(runs["c"]).items() if i <= 2 * K}, train_records(runs["a"]), range(K + 1, 2 * K + 1)
    )


def test_ep_checkpoint_loads_in_replicate_mode(runs):
    c, d = train_records(runs["c"]), train_records(runs["d"])
    assert_same_losses(d, c, range(2 * K + 1, 3 * K + 1))
    output = runs["d"].output
    assert "checkpoint: replicate: the checkpoint holds no replicate placement (saved in another mode); starting from static replication" in output
    assert f"checkpoint: replicate: experts' master weights and Adam moments loaded (step {2 * K})" in output
