"""The per-layer planner's plans are byte-identical to the pinned ones (issue 44: made fast at
E = 256, D = 1,024 without changing a plan; the cases are in tests/support/planner_cases.py)."""

import json

from support.planner_cases import GOLDEN, compare, digests


def test_plans_are_byte_identical_to_the_pinned_ones():
    """Every case's plan is the pinned one, byte for byte; a change is let through only where it
    balances at least as well (and is then pinned by `python -m support.planner_cases --write`)."""
    golden = json.loads(GOLDEN.read_text())
    found = digests()
    assert found.keys() == golden.keys()
    better, worse = compare(golden, found)
    assert not worse, [(name, golden[name][1], found[name][1]) for name in worse]
    assert not better, f"{len(better)} plans changed (none balances worse): re-pin them: {better[:10]}"


def test_by_owner_plans_answer_as_their_entries_do():
    """`dispatch` keeps its plan in `DispatchPlan.by_owner`'s form; every question the runtime and
    the cost models ask of it (device loads, remote tokens, link bytes, one source's row, busy
    instances, the simulator's source-to-device traffic and received tokens) gets the answer of the same plan stored as plain entries."""
    import numpy as np

    from megatron_patches.placement import fssdp
    from megatron_patches.placement.accounting import dispatch_bytes
    from megatron_patches.placement.types import DispatchPlan
    from support.planner_cases import layer_cases

    checked = 0
    for name, shard, source_DE, _, t, m, topology in layer_cases():
        if topology.num_devices > 128:
            continue
        placement = fssdp.materialize(shard, source_DE.sum(axis=0).astype(np.float64), t, m, topology)
        compact = fssdp.dispatch(placement, source_DE, topology)
        assert compact.by_owner_form
        plain = DispatchPlan(compact.source_K, compact.expert_K, compact.dest_K, compact.tokens_K,
                             compact.num_sources, compact.num_experts, compact.num_devices)
        fresh = fssdp.dispatch(placement, source_DE, topology)  # its entries never built
        np.testing.assert_array_equal(fresh.device_loads_D(), plain.device_loads_D(), err_msg=name)
        assert fresh.remote_tokens() == plain.remote_tokens(), name
        for a, b in zip(fresh.link_tokens(topology.node_of), plain.link_tokens(topology.node_of)):
            np.testing.assert_array_equal(a, b, err_msg=name)
        for bytes_per_token in (1536, 3072.0):
            a, b = dispatch_bytes(fresh, topology, bytes_per_token), dispatch_bytes(plain, topology, bytes_per_token)
            for field in ("sent_intra_D", "sent_inter_D", "recv_intra_D", "recv_inter_D"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=name)
        np.testing.assert_array_equal(fresh.instances_with_tokens_D(), plain.instances_with_tokens_D(), err_msg=name)
        np.testing.assert_array_equal(fresh.traffic_SD(), plain.traffic_SD(), err_msg=name)
        np.testing.assert_array_equal(fresh.received_ED(), plain.received_ED(), err_msg=name)
        for source in (0, topology.num_devices - 1):
            rows = [np.zeros((compact.num_experts, compact.num_devices), dtype=np.int64) for _ in range(2)]
            for row, plan in zip(rows, (fresh, plain)):
                np.add.at(row, plan.source_row(source)[:2], plan.source_row(source)[2])
            np.testing.assert_array_equal(rows[0], rows[1], err_msg=name)
        assert not fresh.__dict__.keys() & {"source_K", "expert_K", "dest_K", "tokens_K"}  # answered without them
        checked += 1
    assert checked >= 50
