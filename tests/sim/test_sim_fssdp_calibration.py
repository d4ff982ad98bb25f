"""FSSDP's calibration after the gate and its t by cost in the simulator: on random clusters
and traces it is never slower than EP (t = 0) or FasterMoE (calibration's shadow candidates),
which it contains, and it is priced the way the
simulator charges its gather (`sim.systems._sparse_gather_seconds`), all-to-all and expert
instances.

Measured on the 30 cases below (2026-11-27, t chosen by cost, `fssdp.choose_overlap_degree`,
pricing each t with calibration's copies on top; spRS waited for at the next MoE layer's
backward as the runtime does; experts every device holds broadcast along a ring when that is
faster, `placement.collectives.copy_sources`): fssdp / ep worst 0.978, mean 0.790; faster than
FasterMoE on all 30, closest 0.995 (case 8). Before the ring (session 21): worst 0.995, mean
0.820, slower than FasterMoE on 2 of 30 (cases 6 and 10, 4 nodes x 2 GPUs, up to 1.071): the
node-aware relays sent a hot expert copied everywhere out of its owner's node once per other
node, where FasterMoE's ring broadcast of the same shadow sends it once out of each node.
Before t by cost (t = DESIGN 4.2's hidden t from the probed bandwidths, spRS never waited for
before the optimizer): worst 1.023, mean 0.856, slower than FasterMoE on 10 of 30, worst 1.125.
What changed it: (1) the hidden t took copies whose extra instances cost more than their split
saves (each instance pays a launch, the small-batch GEMM inefficiency or streaming its weights;
cases 0, 8, 16 on 4096 tokens: the hidden t = 4-7, the cost model's t = 0-1); (2) on slow NICs
copies past the hidden budget keep tokens off the network (all-to-all) and pay although their
gather is exposed (case 1: hidden t = 0, t = 2, fssdp / ep 0.543); (3) where calibration's
copies after the gate do the job, t = 0 is priced cheaper than copies gathered before it.
"""

import numpy as np
import pytest
from sim_builders import make_cluster, make_model, skewed_trace

from megatron_patches.placement import fssdp
from megatron_patches.sim import SimOptions, build_scenario, resolve_systems, simulate

LAYOUTS = [(1, 4), (2, 4), (4, 2), (2, 8)]


def random_cases(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for case in range(count):
        nodes, per_node = LAYOUTS[case % len(LAYOUTS)]
        devices = nodes * per_node
        experts = int(rng.choice([devices, 2 * devices]))
        yield dict(nodes=nodes, per_node=per_node, experts=experts, nic=float(rng.choice([25.0, 80.0, 200.0])),
                   hidden=int(rng.choice([256, 512, 1024])), tokens=int(rng.choice([4096, 16384, 65536])),
                   zipf=float(rng.choice([0.6, 1.0, 1.4])), seed=case)


def simulate_case(case: dict, calibrate: bool, nic_sharing: bool = True) -> dict:
    devices = case["nodes"] * case["per_node"]
    model = make_model(layers=2, experts=case["experts"], hidden=case["hidden"], seq=1024)
    trace = skewed_trace(8, 2, case["experts"], devices, case["tokens"], seed=case["seed"], zipf=case["zipf"])
    scn = build_scenario(model, make_cluster(nodes=case["nodes"], gpus_per_node=case["per_node"], nic_gbps=case["nic"]),
                         devices, trace, options=SimOptions(fssdp_calibrate=calibrate, nic_sharing=nic_sharing))
    return {spec.name: simulate(scn, spec) for spec in resolve_systems(["ep", "fastermoe", "fssdp"])}


def mean_times(case: dict, calibrate: bool, nic_sharing: bool = True) -> dict[str, float]:
    return {name: float(np.mean(result.iteration_s_I))
            for name, result in simulate_case(case, calibrate, nic_sharing).items()}


def test_calibrated_fssdp_is_never_slower_than_ep_or_fastermoe():
    """On the costs FSSDP's planner prices (t and calibration's candidates), it never loses to EP
    or FasterMoE. Its cost model prices NIC sharing only in part (the copies' reduce is not hidden
    by the all-to-all), so this runs without sharing: FSSDP / EP 0.797 mean (0.800 before t was
    re-chosen after iterations 4, 16, 64). With NIC sharing (the simulator's default since
    2026-11-29), measured on these 30 cases: 0.855 mean, one case slower than EP (case 22, 1.017:
    see the test below), faster than FasterMoE in 28 of 30; with t chosen on the first
    iteration's loads alone, 0.862 and case 22 at 1.131; before the reduce stopped counting as
    hidden by the all-to-all, 0.876, 4 cases slower (up to 1.165) and 24 of 30
    (docs/benchmarks.md, "NIC sharing")."""
    ratios, faster = [], 0
    for case in random_cases(30):
        times = mean_times(case, calibrate=True, nic_sharing=False)
        ratios.append(times["fssdp"] / times["ep"])
        faster += times["fssdp"] < times["fastermoe"]
    assert max(ratios) <= 1.0, (max(ratios), int(np.argmax(ratios)))
    assert np.mean(ratios) < 0.85  # and it does gain on these skewed traces (0.800 measured)
    assert faster == 30  # FasterMoE's shadowing is in FSSDP's policy space (calibration's candidates)


def test_auto_t_chosen_again_leaves_copies_that_stopped_paying():
    """Case 22 (4 x 2 GPUs, 25 Gb/s NICs shared by every collective, Zipf 1.4): on the first
    iteration's loads t = 1 is priced 0.56 ms under t = 0 with calibration (the hottest expert,
    6,875 of 16,384 tokens, gathered to every device before the gate, instead of by calibration
    after it). Its share falls (4,111 tokens by the last iteration), calibration at t = 0 then takes
    1-2 copies, while t = 1 keeps gathering it everywhere: 3.2 ms of gather and 6.4 ms of reduce per
    layer on the NIC the all-to-all and the dense gradients need. Chosen again at iteration 4 (on
    iteration 3's loads) t becomes 0, and from there FSSDP is faster than EP every iteration (before
    these re-choices t stayed 1: 1.131x EP over the 8 iterations, now 1.017x)."""
    case = list(random_cases(23))[22]
    results = simulate_case(case, calibrate=True, nic_sharing=True)
    fssdp, ep = results["fssdp"], results["ep"]
    assert fssdp.details["overlap_degree_t"] == 1 and fssdp.details["overlap_degree_changes"] == [[4, 0]]
    assert np.all(fssdp.iteration_s_I[4:] < ep.iteration_s_I[4:]), (fssdp.iteration_s_I, ep.iteration_s_I)
    assert float(np.mean(fssdp.iteration_s_I) / np.mean(ep.iteration_s_I)) < 1.05


@pytest.mark.parametrize("index", [1, 3])
def test_calibration_gathers_after_the_gate_and_pays(index):
    """Two of the cases: calibration adds an after-gate gather ("spag_calibrate", charged before
    the dispatch) and makes the iteration faster than FSSDP without it."""
    case = list(random_cases(index + 1))[index]
    without, with_ = simulate_case(case, calibrate=False), simulate_case(case, calibrate=True)
    assert "spag_calibrate" not in without["fssdp"].details["collective_s"]
    assert with_["fssdp"].details["collective_s"]["spag_calibrate"] > 0
    assert np.mean(with_["fssdp"].iteration_s_I) < np.mean(without["fssdp"].iteration_s_I)
    assert np.array_equal(with_["ep"].iteration_s_I, without["ep"].iteration_s_I)


def test_auto_t_follows_the_loads_at_doubling_iterations_and_every_reshard_check():
    """As the runtime does, the simulator chooses t by cost on the first iteration's loads and again
    on the loads of the iteration before at `fssdp.overlap_due`'s iterations: 4, 16, 64, ... below
    the re-shard interval, then every re-shard check. A router that starts even (Zipf 0: copies do not
    pay, t = 0) and turns skewed (Zipf 1.4):
    - after 3 iterations, with re-shard checks every 20: copies from iteration 4, the first choice
      after the skew (before the doubling, t stayed 0 through the 20 iterations);
    - after 6, with checks every 5: t changes only at choice iterations (here at the checks 10 and
      15; the choices at 4 and 5 keep t = 0 on the even loads)."""
    from megatron_patches.placement.trace import Trace

    def changes(even_iterations: int, interval: int) -> list:
        devices, experts, tokens = 8, 16, 16384
        even = skewed_trace(even_iterations, 2, experts, devices, tokens, seed=1, zipf=0.0)
        skewed = skewed_trace(20 - even_iterations, 2, experts, devices, tokens, seed=2, zipf=1.4)
        trace = Trace(np.concatenate([even.loads, skewed.loads]),
                      np.concatenate([even.source_loads, skewed.source_loads]), metadata=even.metadata)
        model = make_model(layers=2, experts=experts, hidden=512, seq=1024)
        scn = build_scenario(model, make_cluster(nodes=2, gpus_per_node=4, nic_gbps=25.0), devices, trace,
                             options=SimOptions(fssdp_calibrate=False, reshard_interval=interval))
        details = simulate(scn, resolve_systems(["fssdp"])[0]).details
        assert details["overlap_degree_t"] == 0, details
        return details["overlap_degree_changes"]

    early = changes(3, 20)
    assert early and early[0][0] == 4 and early[0][1] > 0, early
    late = changes(6, 5)
    assert late and late[0][0] == 10 and late[0][1] > 0, late
    assert all(fssdp.overlap_due(iteration, 5) for iteration, _ in late), late
