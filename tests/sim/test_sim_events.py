"""Event engine: stream order, dependencies, collectives as barriers, and the time accounting
(every device's busy + idle time adds up to the iteration time)."""

import numpy as np
import pytest

from megatron_patches.sim.events import CATEGORIES, Timeline


def test_straggler_and_all_to_all_worked_example():
    """Two devices compute 1 s and 3 s, then a 2 s all-to-all, then 1 s each: 3 + 2 + 1 = 6 s.

    Device 0 waits 2 s for device 1 (straggler) and 2 s in the all-to-all.
    """
    tl = Timeline(1, 2)
    work = tl.compute("expert", [1.0, 3.0])
    a2a = tl.collective("a2a", "all_to_all", 2.0, after=[work])
    tl.compute("other", 1.0, after=[a2a])
    total = tl.finish()
    assert total.tolist() == [6.0]
    b = tl.breakdown()
    per_device = {name: (tl.busy + tl.idle)[CATEGORIES.index(name), 0] for name in CATEGORIES}
    assert per_device["expert"].tolist() == [1.0, 3.0]
    assert per_device["straggler_wait"].tolist() == [2.0, 0.0]
    assert per_device["all_to_all"].tolist() == [2.0, 2.0]
    assert b["expert"][0] == 2.0 and b["straggler_wait"][0] == 1.0
    assert tl.max_busy[CATEGORIES.index("expert"), 0] == 3.0


def test_a_collective_on_its_own_stream_overlaps_compute_and_only_its_excess_is_exposed():
    """A 5 s gather launched with 3 s of attention: the experts wait 2 s, blamed on the gather."""
    tl = Timeline(1, 1)
    gather = tl.collective("sparse", "exposed_collectives", 5.0)
    attention = tl.compute("attention", 3.0)
    tl.compute("expert", 1.0, after=[attention, gather])
    assert tl.finish().tolist() == [6.0]
    b = tl.breakdown()
    assert b["exposed_collectives"][0] == 2.0 and b["attention"][0] == 3.0 and b["expert"][0] == 1.0
    hidden = Timeline(1, 1)
    gather = hidden.collective("sparse", "exposed_collectives", 2.0)
    attention = hidden.compute("attention", 3.0)
    hidden.compute("expert", 1.0, after=[attention, gather])
    assert hidden.finish().tolist() == [4.0]
    assert hidden.breakdown()["exposed_collectives"][0] == 0.0
    assert hidden.comm[CATEGORIES.index("exposed_collectives"), 0] == 2.0


def test_collectives_on_one_stream_run_in_order_and_the_wait_is_blamed_on_the_one_in_the_way():
    """A 4 s gradient sync and then a 1 s all-to-all on the same stream: the all-to-all starts at 4."""
    tl = Timeline(1, 1)
    tl.collective("a2a", "exposed_collectives", 4.0)
    ready = tl.compute("other", 1.0)
    a2a = tl.collective("a2a", "all_to_all", 1.0, after=[ready])
    assert a2a.start_ID[0, 0] == 4.0
    tl.compute("expert", 1.0, after=[a2a])
    assert tl.finish().tolist() == [6.0]
    b = tl.breakdown()
    assert b["exposed_collectives"][0] == 3.0  # idle from 1 to 4, before the all-to-all could start
    assert b["all_to_all"][0] == 1.0


def test_a_wait_behind_a_queue_of_collectives_is_shared_by_the_time_each_ran():
    """A 4 s replica all-reduce, then a 2 s dense all-reduce on the same stream; the optimizer
    waits from 1 s to 6 s: 3 s of it during the first (which held the second back), 2 s during
    the second. By label the exposed time splits 3 + 2."""
    tl = Timeline(1, 1)
    tl.collective("grad", "exposed_collectives", 4.0, label="grad_allreduce")
    backward = tl.compute("attention", 1.0)
    dense = tl.collective("grad", "exposed_collectives", 2.0, after=[backward], label="dense_grad_allreduce")
    tl.compute("optimizer", 1.0, after=[dense])
    assert tl.finish().tolist() == [7.0]
    assert tl.breakdown()["exposed_collectives"][0] == 5.0
    by_kind = tl.by_label("exposed_collectives")
    assert {k: float(v[0]) for k, v in by_kind.items()} == {"grad_allreduce": 3.0, "dense_grad_allreduce": 2.0}
    assert tl.by_label("all_to_all") == {}


def test_iterations_are_independent_and_vectorised():
    tl = Timeline(3, 2)
    work = tl.compute("expert", np.array([[1.0, 2.0], [5.0, 1.0], [0.0, 0.0]]))
    a2a = tl.collective("a2a", "all_to_all", np.array([1.0, 2.0, 3.0]), after=[work])
    tl.compute("attention", 1.0, after=[a2a])
    np.testing.assert_array_equal(tl.finish(), [4.0, 8.0, 4.0])


def test_the_final_wait_is_blamed_on_what_ends_last():
    tl = Timeline(1, 2)
    tl.compute("optimizer", [1.0, 3.0])
    assert tl.finish().tolist() == [3.0]
    assert tl.breakdown()["straggler_wait"][0] == 1.0
    tl = Timeline(1, 2)
    tl.compute("optimizer", [1.0, 1.0])
    tl.collective("grad", "exposed_collectives", 5.0)
    assert tl.finish().tolist() == [5.0]
    assert tl.breakdown()["exposed_collectives"][0] == 4.0


@pytest.mark.parametrize("seed", range(20))
def test_busy_plus_idle_equals_the_iteration_time_on_every_device(seed):
    """Random programs of compute tasks and collectives on three streams."""
    rng = np.random.default_rng(seed)
    I, D = 4, 5
    tl = Timeline(I, D)
    events = [None]
    for _ in range(30):
        after = [events[j] for j in rng.integers(0, len(events), size=rng.integers(0, 3))]
        if rng.random() < 0.5:
            category = ["attention", "other", "expert", "optimizer"][rng.integers(4)]
            events.append(tl.compute(category, rng.exponential(1.0, size=(I, D)), after=after))
        else:
            category = ["all_to_all", "exposed_collectives", "rearrangement"][rng.integers(3)]
            stream = ["a2a", "sparse", "grad"][rng.integers(3)]
            label = f"{category}-{rng.integers(3)}"
            events.append(tl.collective(stream, category, rng.exponential(1.0, size=I), after=after, label=label))
    total = tl.finish()
    np.testing.assert_allclose((tl.busy + tl.idle).sum(axis=0), np.repeat(total[:, None], D, axis=1))
    breakdown = tl.breakdown()
    for category in ("all_to_all", "exposed_collectives", "rearrangement"):
        by_label = tl.by_label(category)
        assert all(name.startswith(category) for name in by_label)
        np.testing.assert_allclose(sum(by_label.values(), np.zeros(I)), breakdown[category], atol=1e-12)
    assert np.all(tl.idle >= -1e-12)
    for e in events[1:]:
        assert np.all(e.end_ID <= total[:, None] + 1e-12)


def test_categories_are_checked():
    tl = Timeline(1, 1)
    with pytest.raises(ValueError, match="category 'all_to_all' is not one of"):
        tl.compute("all_to_all", 1.0)
    with pytest.raises(ValueError, match="category 'expert' is not one of"):
        tl.collective("a2a", "expert", 1.0)


def test_collectives_that_cross_nodes_share_the_nic():
    """By hand, one device, NIC seconds equal to the durations. A (3 s) is issued first and keeps
    the NIC; B (2 s), ready at the same time on another stream, gets the NIC after it and ends at
    5, having waited 3. Without sharing, B would end at 2. Work is conserved: the NIC is busy
    0-5."""
    tl = Timeline(1, 1)
    a = tl.collective("grad", "exposed_collectives", 3.0, label="grad_allreduce", nic_I=3.0)
    b = tl.collective("a2a", "all_to_all", 2.0, nic_I=2.0)
    assert (a.end_ID[0, 0], b.start_ID[0, 0], b.end_ID[0, 0]) == (3.0, 0.0, 5.0)
    assert tl.contention() == {"all_to_all": pytest.approx([3.0])}
    off = Timeline(1, 1, share_nic=False)
    off.collective("grad", "exposed_collectives", 3.0, nic_I=3.0)
    assert off.collective("a2a", "all_to_all", 2.0, nic_I=2.0).end_ID[0, 0] == 2.0
    assert off.contention() == {}


def test_nic_work_fills_the_gaps_between_earlier_collectives():
    """A holds the NIC 0-2 and C 4-6 (ready at 4); B, ready at 1 with 3 s of NIC work, takes the
    free 2-4 (2 s) and 6-7 (1 s): it ends at 7, having waited 1 s of A and 2 s of C. A collective
    whose NIC part is 1 s of a 4 s duration, after A's 2 s, waits 2 s: it ends at 6. Collectives
    without nic_I never wait, and a NIC part above the duration is refused."""
    one = Timeline(1, 1)
    one.collective("s1", "exposed_collectives", 2.0, nic_I=2.0)
    gate = one.collective("s0", "exposed_collectives", 1.0)  # no NIC: ends at 1, no wait
    four = one.compute("other", 4.0)
    one.collective("s2", "exposed_collectives", 2.0, after=[four], nic_I=2.0)
    b = one.collective("s3", "all_to_all", 3.0, after=[gate], nic_I=3.0)
    assert (gate.end_ID[0, 0], b.start_ID[0, 0], b.end_ID[0, 0]) == (1.0, 1.0, 7.0)
    partial = Timeline(1, 1)
    partial.collective("s1", "exposed_collectives", 2.0, nic_I=2.0)
    assert partial.collective("s2", "all_to_all", 4.0, nic_I=1.0).end_ID[0, 0] == 6.0
    with pytest.raises(ValueError, match="nic_I must lie in"):
        partial.collective("s3", "all_to_all", 1.0, nic_I=2.0)
