"""The per-layer planner's plans are byte-identical to the pinned ones (issue 44: made fast at
E = 256, D = 1,024 without changing a plan; the cases are in tests/support/planner_cases.py)."""

import json

from support.planner_cases import GOLDEN, digests


def test_plans_are_byte_identical_to_the_pinned_ones():
    golden = json.loads(GOLDEN.read_text())
    found = digests()
    assert found.keys() == golden.keys()
    changed = sorted(name for name in golden if found[name] != golden[name])
    assert not changed, f"{len(changed)} of {len(golden)} planner cases changed: {changed[:10]}"
