"""The JSONL metrics are strict JSON: a NaN loss or an infinite grad norm is written as null."""

from __future__ import annotations

import json
import math

import pytest

from megatron_patches.training.metrics import MetricsWriter, strict_json


def _refuse(constant: str):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_non_finite_values_are_written_as_null(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), None, train_iters=2)
    record = {
        "iteration": 1, "loss": math.nan, "lr": 1e-3, "grad_norm": math.inf, "tokens_per_s": 10.0,
        "iteration_time_s": 0.5, "loss_scale": 1.0, "skipped_iterations": 0,
        "moe_layers": [{"layer": 1, "imbalance": 1.5, "device_tokens": [1, 2], "survival": 1.0}],
        "bytes": {"a2a": 0}, "memory": {"activation_bytes": [1, 2]}, "extra": [-math.inf, (1.0, math.nan)],
    }
    writer.log(record, "", 1.0, {})
    writer.log_eval(1, math.inf)
    writer.close()
    lines = [json.loads(line, parse_constant=_refuse) for line in path.read_text().splitlines()]
    assert lines[0]["loss"] is None and lines[0]["grad_norm"] is None and lines[0]["extra"] == [None, [1.0, None]]
    assert lines[0]["lr"] == 1e-3 and lines[0]["moe_layers"][0]["imbalance"] == 1.5
    assert lines[1] == {"iteration": 1, "eval_loss": None}
    assert "loss nan" in capsys.readouterr().out  # the human line keeps saying what happened


@pytest.mark.parametrize("value, expected", [(1.0, 1.0), (math.nan, None), ({"a": [math.inf]}, {"a": [None]}), ("nan", "nan"), (3, 3)])
def test_strict_json(value, expected):
    assert strict_json(value) == expected
