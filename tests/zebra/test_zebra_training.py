"""Zebra mode inside training: `pretrain_gpt_moe.py --moe-parallel-mode zebra` on 4 gloo ranks.

The issue's done-when: M=2 attention + N=2 expert ranks, R=4 micro-batches, 12 iterations (the issue: 20) match
the ep run (Megatron's own EP=4 on the same 4 ranks, same data and seed) within 1e-5 relative (Asym-EA:
tests/zebra/test_zebra_engine.py against Megatron's model, and test_precision_training's fp16 run); the timeline of that run shows attention and expert ranks computing at the
same time, and tools/plot_timeline.py draws it. Dropout is off in both runs: the zebra schedule
draws dropout masks in another order (the equivalence is of the model, not of the RNG stream).

Checkpoints (ep's placement-independent form, zebra/checkpoint.py): both runs save at iteration
K = 9, and four runs resume from those checkpoints to iteration 12 (from the second resumed
iteration on, a loss depends on Adam's moments crossing the checkpoint):
    zebra, Asym-EA "1,2"       from zebra  -> zebra's iterations 10-12, losses bit for bit (every expert's
                                               gradient is the same sum wherever it lives)
    zebra, 2 ZP groups (1 + 1) from zebra  -> zebra's within 1e-6 (each ZP group's expert rank sums
                                               its own tokens' gradients: another summation order)
    ep                         from zebra  -> iteration 10 is zebra's loss bit for bit (the same weights,
                                               the same forward), then within 1e-6
    zebra                      from ep     -> iteration 10 is ep's loss bit for bit, then within 1e-6
Measured (2026-11-26, K = 3 of 6): 0 / 1e-9 / 8e-8 (grad norms) / 3e-8 relative.

Asym-EA re-planned from the loads (--zebra-replan-interval, placement/zebra/replan.py), with a
profile that makes the expert ranks 4x slower than attention per layer, so a re-plan pays:
    zebra, re-plan every 3 iterations  -> zebra's losses bit for bit, grad norms to rounding (an expert computes
                                          the same rows in the same order wherever it lives; its
                                          weights and Adam state move exactly), bytes moved = planned
    ep from its checkpoint at K         -> ep_from_zebra's losses bit for bit (the moved experts are saved
                                          by their new owners)
    2 ZP groups, re-plan every iteration
    from zebra's checkpoint             -> the resume without re-planning, bit for bit

Two spawns of 4 ranks (the three runs, then the six resumes: support/multirun.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch.distributed.checkpoint import FileSystemReader

from support.training import REPO, launch_many, zebra_replan_flags

from megatron_patches.placement.trace import read_trace
from megatron_patches.zebra.timeline import read_timeline

pytestmark = pytest.mark.e2e

ITERS = 12
K = 9  # the checkpoint the resumes start from
M, N, R = 2, 2, 4
MICRO = 4
COMMON = [
    "--cpu", "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--micro-batch-size", str(MICRO),
]
ZEBRA = ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", str(M), "--zebra-expert-ranks", str(N),
         "--zebra-microbatches", str(R)]
EP = ["--global-batch-size", str(MICRO * R * M)]  # zebra's global batch: micro x R x M = 32 sequences
AUX = ["--moe-aux-loss-coeff", "0.1"]
# Megatron-LM's attention and norm flags: zebra runs Megatron's attention modules in its own layer order
ATTENTION = ["--position-embedding-type", "rope", "--rotary-percent", "0.5", "--rotary-interleaved", "--qk-layernorm",
             "--norm-epsilon", "1e-6", "--normalization", "RMSNorm"]
CAPACITY = {"capacity": ["--moe-expert-capacity-factor", "1.0"],
            "capacity_pad": ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]}
# tiny.yaml: 2 layers, hidden 64, 8 experts, top-2, sequence 128.
LAYERS, HIDDEN, EXPERTS, TOPK, SEQ = 2, 64, 8, 2, 128


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("zebra_training")
    timeline = work / "timeline.json"
    zebra = [*ZEBRA, "--zebra-timeline", str(timeline), "--moe-log-loads", str(work / "loads.npz")]
    replan = [*ZEBRA, *zebra_replan_flags(work / "profile.json", LAYERS, EXPERTS, M, N, interval=3)]
    runs = launch_many(4, {"ep": [*COMMON, *EP, *saving(work / "ep_ckpt")],
                           "zebra": [*COMMON, *zebra, *saving(work / "zebra_ckpt")],
                           "zebra_replan": [*COMMON, *replan, *saving(work / "replan_ckpt")],
                           **{f"{mode}_{kind}": [*COMMON, *flags, *AUX, "--moe-router-load-balancing-type", kind]
                              for kind in ("aux_loss", "seq_aux_loss") for mode, flags in (("ep", EP), ("zebra", ZEBRA))},
                           **{f"{mode}_{name}": [*COMMON, "--train-iters", "6", *flags, *more]
                              for name, more in CAPACITY.items() for mode, flags in (("ep", EP), ("zebra", ZEBRA))},
                           **{f"{mode}_attention": [*COMMON, "--train-iters", "4", *flags, *ATTENTION]
                              for mode, flags in (("ep", EP), ("zebra", ZEBRA))}},
                      work)
    return {**runs, "timeline": timeline, "work": work}


def saving(checkpoint) -> list[str]:
    return ["--save", str(checkpoint), "--save-interval", str(K)]


@pytest.fixture(scope="module")
def resumed(runs):
    """The four resumes from iteration K (module docstring), the trackers pointed at the mid-run save."""
    work = runs["work"]
    zebra_ckpt, ep_ckpt = ["--load", str(work / "zebra_ckpt")], ["--load", str(work / "ep_ckpt")]
    groups = ["--moe-parallel-mode", "zebra", "--zebra-attention-ranks", "1", "--zebra-expert-ranks", "1",
              "--zebra-microbatches", str(R)]
    flags = {
        "zebra_asym": [*ZEBRA, "--zebra-asym-ea", "1,2", *zebra_ckpt],
        "zebra_groups": [*groups, *zebra_ckpt],
        "ep_from_zebra": [*EP, *zebra_ckpt],
        "zebra_from_ep": [*ZEBRA, *ep_ckpt],
        "ep_from_replan": [*EP, "--load", str(work / "replan_ckpt")],
        "zebra_groups_replan": [*groups, *zebra_replan_flags(work / "profile_1_1.json", LAYERS, EXPERTS, 1, 1, interval=1),
                                *zebra_ckpt],
    }
    trackers = {"zebra_asym": (work / "zebra_ckpt", K), "zebra_from_ep": (work / "ep_ckpt", K),
                "ep_from_replan": (work / "replan_ckpt", K)}
    return launch_many(4, {name: [*COMMON, *more] for name, more in flags.items()}, work, trackers)


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


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_the_auxiliary_loss_trains_as_in_ep(runs, kind):
    """Megatron's routers attach the loss on the attention ranks, on each micro-batch's own tokens as
    in ep (the same micro-batches); zebra scales its backward as the head's loss. Measured
    (2026-11-26, coefficient 0.1): 2.3e-8 (aux_loss) and 1.2e-8 (seq_aux_loss) from ep, while the
    loss moves the run 3.7e-4 away from the one without it (a wrong scale of its backward fails)."""
    zebra, ep = _series(runs[f"zebra_{kind}"], "loss"), _series(runs[f"ep_{kind}"], "loss")
    assert zebra == pytest.approx(ep, rel=1e-6)
    plain = _series(runs["zebra"], "loss")
    assert max(abs(a - b) / b for a, b in zip(zebra, plain)) > 1e-4  # the loss takes effect


def test_attention_and_norm_flags_train_as_in_ep(runs):
    """RoPE on half of each head, interleaved; query/key norms; RMSNorm at epsilon 1e-6: the same
    losses as ep's, and not those of the plain model (the flags took effect)."""
    zebra, ep = _series(runs["zebra_attention"], "loss"), _series(runs["ep_attention"], "loss")
    assert len(zebra) == 4 and zebra == pytest.approx(ep, rel=1e-6)
    assert max(abs(a - b) / b for a, b in zip(zebra, _series(runs["zebra"], "loss"))) > 1e-3


@pytest.mark.parametrize("name", CAPACITY)
def test_token_dropping_drops_what_ep_drops(runs, name):
    """A capacity factor: Megatron's routers on the attention ranks drop (and with padding add) the
    same token copies as ep's on the same micro-batches; the expert ranks run what is left."""
    zebra, ep = runs[f"zebra_{name}"], runs[f"ep_{name}"]
    assert _series(zebra, "loss") == pytest.approx(_series(ep, "loss"), rel=1e-6)
    for z, e in zip(*[[r for r in run.records if "moe_layers" in r] for run in (zebra, ep)], strict=True):
        assert [layer["survival"] for layer in z["moe_layers"]] == [layer["survival"] for layer in e["moe_layers"]]
    assert all(layer["survival"] < 1.0 for r in zebra.records if "moe_layers" in r for layer in r["moe_layers"])
    if name == "capacity_pad":
        # padded slots are sent and computed but are no token: survival counts the routed copies kept,
        # as without padding (it read 1.000 while tokens were dropped), while ep's all-to-all carries more
        unpadded = [[r for r in runs[f"{mode}_capacity"].records if "moe_layers" in r] for mode in ("zebra", "ep")]
        padded = [[r for r in run.records if "moe_layers" in r] for run in (zebra, ep)]
        for mine, theirs in zip(padded, unpadded, strict=True):
            assert [[layer["survival"] for layer in r["moe_layers"]] for r in mine] == [
                [layer["survival"] for layer in r["moe_layers"]] for r in theirs]
        assert sum(r["bytes"]["a2a"] for r in padded[1]) > sum(r["bytes"]["a2a"] for r in unpadded[1])


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


def test_checkpoints_resume_in_zebra_layouts_and_in_ep(runs, resumed):
    zebra, ep = _series(runs["zebra"], "loss"), _series(runs["ep"], "loss")
    for name, run in resumed.items():
        assert [r["iteration"] for r in run.records if "moe_layers" in r] == list(range(K + 1, ITERS + 1)), name
    # zebra -> zebra with another Asym-EA plan: bit for bit, grad norms to rounding
    assert _series(resumed["zebra_asym"], "loss") == zebra[K:]
    assert _series(resumed["zebra_asym"], "grad_norm") == pytest.approx(_series(runs["zebra"], "grad_norm")[K:], rel=1e-12)
    assert [r["zebra"]["offload_chunks"] for r in resumed["zebra_asym"].records if "zebra" in r][0] == [1, 2]
    assert f"checkpoint: zebra: Adam state loaded (step {K})" in resumed["zebra_asym"].output
    # zebra -> zebra in 2 ZP groups of 1 + 1
    assert _series(resumed["zebra_groups"], "loss") == pytest.approx(zebra[K:], rel=1e-6)
    assert [r["zebra"]["zp_groups"] for r in resumed["zebra_groups"].records if "zebra" in r][0] == 2
    # across modes: the first resumed loss is the saving run's exactly (the weights crossed bit for bit)
    for name, saver in (("ep_from_zebra", zebra), ("zebra_from_ep", ep)):
        losses = _series(resumed[name], "loss")
        assert losses[0] == saver[K], name
        assert losses == pytest.approx(saver[K:], rel=1e-6), name
    # the resumed runs train on, with Adam's moments and the LR schedule carried over
    assert _series(resumed["ep_from_zebra"], "lr") == pytest.approx(_series(runs["zebra"], "lr")[K:], rel=1e-12)


def test_replanning_moves_experts_and_keeps_every_loss(runs, resumed):
    run = runs["zebra_replan"]
    assert _series(run, "loss") == _series(runs["zebra"], "loss")
    # the norm's squares are summed per rank, and the experts now sit on other ranks: rounding only
    assert _series(run, "grad_norm") == pytest.approx(_series(runs["zebra"], "grad_norm"), rel=1e-12)
    records = [r for r in run.records if "moe_layers" in r]
    replans = {r["iteration"]: r["zebra"]["replan"] for r in records if "replan" in r["zebra"]}
    assert sorted(replans) == [3, 6, 9, 12]
    adopted = [i for i, entry in replans.items() if entry["adopted"]]
    assert 3 in adopted, replans[3]  # from "off", with expert ranks 4x slower than attention
    for i in adopted:
        entry = replans[i]
        assert entry["move_bytes"] == entry["predicted_move_bytes"] > 0  # the busiest rank's bytes, as planned
        assert entry["predicted_s"][1] < entry["predicted_s"][0]
        assert f"zebra: re-plan at iteration {i}: " in run.output
        if i == len(records):
            continue  # adopted after the last iteration: no record runs the new plan
        after = records[i]  # iteration i + 1 runs the new plan: the attention positions process tokens
        assert after["zebra"]["offload_chunks"] == entry["offload_chunks"]
        for layer, chunks in zip(after["moe_layers"], entry["offload_chunks"]):
            assert (sum(layer["device_tokens"][:M]) > 0) == (chunks > 0)
    # a checkpoint saved after re-plans is the same model: ep resumes it as it resumes zebra's
    assert _series(resumed["ep_from_replan"], "loss") == _series(resumed["ep_from_zebra"], "loss")
    # 2 ZP groups re-planning every iteration: each group moves alike, the expert groups stay aligned
    groups = resumed["zebra_groups_replan"]
    assert _series(groups, "loss") == _series(resumed["zebra_groups"], "loss")
    assert any(r["zebra"].get("replan", {}).get("adopted") for r in groups.records if "zebra" in r)


def test_zebra_checkpoint_has_eps_keys_and_shapes(runs):
    zebra = FileSystemReader(str(runs["work"] / "zebra_ckpt" / f"iter_{K:07d}")).read_metadata().state_dict_metadata
    ep = FileSystemReader(str(runs["work"] / "ep_ckpt" / f"iter_{K:07d}")).read_metadata().state_dict_metadata
    assert set(zebra) == set(ep)
    for key in zebra:
        assert getattr(zebra[key], "size", None) == getattr(ep[key], "size", None), key
    assert "chained_1.optimizer.state.exp_avg.module.decoder.layers.mlp.experts.experts.linear_fc1.weight" in zebra
