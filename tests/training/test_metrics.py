"""The JSONL metrics are strict JSON (a NaN loss or an infinite grad norm is written as null), the
progress line's ETA follows the recent iterations, and Megatron's known warnings show once."""

from __future__ import annotations

import json
import math
import time
import warnings

import pytest

from megatron_patches.compat.known_warnings import known_line, show_once
from megatron_patches.training.metrics import (MetricsWriter, balance, balance_summary, balance_text, read_records,
                                               strict_json)
from megatron_patches.training.outputs import plot_run

LAYERS_BALANCE = {"owners": {"label": "ep", "imbalance": 1.5, "busiest_tokens": 2}}

# two MoE layers' tokens per rank: the owners' layout (ep's) and after a mode placed copies
OWNERS = [{"layer": 1, "imbalance": 1.5, "device_tokens": [30, 10]}, {"layer": 2, "imbalance": 1.2, "device_tokens": [24, 16]}]
PLACED = [{"layer": 1, "imbalance": 1.0, "device_tokens": [20, 20]}, {"layer": 2, "imbalance": 1.1, "device_tokens": [22, 18]}]


def test_balance_compares_the_owners_layout_with_the_placed_one():
    placed = balance(OWNERS, PLACED, "ep", "fssdp")
    assert placed == {"owners": {"label": "ep", "imbalance": 1.5, "busiest_tokens": 54},
                      "placed": {"label": "fssdp", "imbalance": 1.1, "busiest_tokens": 42}}
    assert balance_text(placed) == "imbalance(max layer) ep 1.50 -> fssdp 1.10"
    # a second iteration where placement could not help: the summary's figures are over both
    same = balance(OWNERS, OWNERS, "ep", "fssdp")
    assert balance_summary([placed, same]) == (
        "imbalance(max layer, mean) ep 1.50 -> fssdp 1.30, tokens on the busiest rank -11%")  # 96 / 108 - 1


def test_balance_without_placement_is_the_owners_alone():
    alone = balance(OWNERS, None, "zebra", "zebra")
    assert alone == {"owners": {"label": "zebra", "imbalance": 1.5, "busiest_tokens": 54}}
    assert balance_text(alone) == "imbalance(max layer) 1.50"
    assert balance_summary([alone, alone]) == "imbalance(max layer, mean) 1.50"
    assert balance_summary([]) == ""


def test_the_plot_draws_both_layouts_and_reads_records_written_before_the_balance_existed(tmp_path):
    old = {"iteration": 1, "loss": 5.0, "moe_layers": OWNERS}  # an earlier version's record, then a resume
    new = [{"iteration": i, "loss": 5.0 - i / 10, "moe_layers": OWNERS, "balance": balance(OWNERS, PLACED, "ep", "fssdp")}
           for i in (2, 3)]
    plot_run([old, *new, {"iteration": 3, "eval_loss": 4.8}], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.parametrize("flags", [(1, False, False), (2, True, True)])
def test_tensorboard_interval_timers_and_memory_follow_their_flags(tmp_path, flags):
    """--tensorboard-log-interval, --log-timers-to-tensorboard, --log-memory-to-tensorboard."""
    from support.training import tensorboard_scalars

    interval, timers, memory = flags
    writer = MetricsWriter(None, str(tmp_path), train_iters=4, tensorboard_interval=interval, log_timers=timers,
                           log_memory=memory)
    for iteration in range(1, 5):
        writer.log({"iteration": iteration, "loss": 5.0 - iteration, "lr": 1e-3, "tokens_per_s": 10.0,
                    "iteration_time_s": 0.5, "loss_scale": 1.0, "skipped_iterations": 0, "bytes": {"a2a": 0},
                    "moe_layers": [{"layer": 1, "imbalance": 1.5, "device_tokens": [1, 2], "survival": 1.0}],
                    "balance": LAYERS_BALANCE, "memory": {"activation_bytes": [1, 2]}}, "", 1.0, {})
    writer.close()
    scalars = tensorboard_scalars(tmp_path)
    assert sorted(scalars["train/loss"]) == list(range(interval, 5, interval))
    assert ("train/iteration_time_s" in scalars) == timers and ("memory/activation_bytes_max_rank" in scalars) == memory


def _refuse(constant: str):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_non_finite_values_are_written_as_null(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), None, train_iters=2)
    record = {
        "iteration": 1, "loss": math.nan, "lr": 1e-3, "grad_norm": math.inf, "tokens_per_s": 10.0,
        "iteration_time_s": 0.5, "loss_scale": 1.0, "skipped_iterations": 0,
        "moe_layers": [{"layer": 1, "imbalance": 1.5, "device_tokens": [1, 2], "survival": 1.0}],
        "balance": LAYERS_BALANCE, "bytes": {"a2a": 0}, "memory": {"activation_bytes": [1, 2]}, "extra": [-math.inf, (1.0, math.nan)],
    }
    writer.log(record, "", 1.0, {})
    writer.log_eval(1, math.inf)
    writer.close()
    lines = [json.loads(line, parse_constant=_refuse) for line in path.read_text().splitlines()]
    assert lines[0]["loss"] is None and lines[0]["grad_norm"] is None and lines[0]["extra"] == [None, [1.0, None]]
    assert lines[0]["non_finite"] == {"loss": "nan", "grad_norm": "inf", "extra.0": "-inf", "extra.1.1": "nan"}
    assert lines[0]["lr"] == 1e-3 and lines[0]["moe_layers"][0]["imbalance"] == 1.5
    assert lines[1] == {"iteration": 1, "eval_loss": None, "non_finite": {"eval_loss": "inf"}}
    assert "loss nan" in capsys.readouterr().out  # the human line keeps saying what happened


@pytest.mark.parametrize("value, expected", [
    (1.0, {"v": 1.0}),
    (math.nan, {"v": None, "non_finite": {"v": "nan"}}),
    ({"a": [math.inf]}, {"v": {"a": [None]}, "non_finite": {"v.a.0": "inf"}}),
    ("nan", {"v": "nan"}),
    (3, {"v": 3}),
])
def test_strict_json(value, expected):
    assert strict_json({"v": value}) == expected


def test_eta_follows_the_recent_iterations_not_the_start(tmp_path):
    writer = MetricsWriter(None, None, train_iters=100)
    writer._start -= 60.0  # a slow start (build, warm-up) must not count
    assert writer._eta(10, 0.5) == pytest.approx(90 * 0.5)  # the first line: its own iteration's pace
    time.sleep(0.2)
    eta = writer._eta(20, 0.5)  # 10 iterations in about 0.2 s since the last line
    assert 80 * 0.2 / 10 <= eta < 80 * 0.6 / 10


def test_read_records_returns_what_the_writer_wrote(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), None, train_iters=3)
    writer.log_eval(3, 2.5)
    writer.log_eval(4, math.nan)
    writer.close()
    assert read_records(str(path)) == [{"iteration": 3, "eval_loss": 2.5},
                                       {"iteration": 4, "eval_loss": None, "non_finite": {"eval_loss": "nan"}}]


MEGATRON_WARNINGS = (
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_applier",
    "Apex is not installed. Falling back to Torch Norm",
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` instead.",
    "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...",
    "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
    "Please use DTensor instead and we are deprecating ShardedTensor.",
)


@pytest.mark.parametrize("rank", [0, 2])
def test_known_warnings_show_once_from_rank_0_and_others_once_per_rank(capsys, rank):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show_once(rank)
        for _ in range(3):
            for text in MEGATRON_WARNINGS:
                warnings.warn(text, UserWarning)
            warnings.warn("something new\n  on two lines", RuntimeWarning)
    lines = capsys.readouterr().err.splitlines()
    prefix = "warning" if rank == 0 else f"warning (rank {rank})"
    new = [line for line in lines if "something new" in line]
    assert len(new) == 1 and new[0].startswith(f"{prefix}: RuntimeWarning: something new on two lines (")
    known = sorted({known_line(text) for text in MEGATRON_WARNINGS})
    assert len(known) == 3 and None not in known
    assert sorted(line for line in lines if line not in new) == ([f"warning: {line}" for line in known] if rank == 0 else [])


@pytest.mark.parametrize("ppl", [False, True])
def test_validation_perplexity_reaches_tensorboard_with_its_flag(tmp_path, ppl):
    """--log-validation-ppl-to-tensorboard: eval/ppl = exp(loss), capped at exp(20) as Megatron-LM."""
    from support.training import tensorboard_scalars

    writer = MetricsWriter(None, str(tmp_path), train_iters=10, validation_ppl=ppl)
    writer.log_eval(5, 2.0)
    writer.log_eval(10, 25.0)
    writer.close()
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["eval/loss"] == {5: 2.0, 10: 25.0}
    if ppl:
        assert scalars["eval/ppl"] == pytest.approx({5: math.exp(2.0), 10: math.exp(20.0)})
    else:
        assert "eval/ppl" not in scalars
