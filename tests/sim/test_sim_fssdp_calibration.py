"""FSSDP's calibration after the gate in the simulator: on random clusters and traces it is
never meaningfully slower than EP, which it contains (no copies), and it is priced the way the
simulator charges its gather (`sim.systems._sparse_gather_seconds`) and all-to-all.

Measured on the 30 cases below (2026-11-27, t from the bandwidths the runtime's probe would
measure, `sim.costs.Hardware.probed_topology`): fssdp / ep worst 1.023, mean 0.856 (with t from
a single pair's NIC rate, 6x too large on 8-GPU nodes: 1.028, 0.856). Against FasterMoE, whose
shadowing calibration considers too, FSSDP is not always faster: slower on 10 of 30 (cases 0, 6,
8, 10, 11, 14, 16, 18, 20, 23), worst 1.125 (case 16), so that is reported, not asserted. Why,
measured per case with the earlier t (9 slower: 0, 6, 8, 10, 14, 16, 20, 25, 26; four of them on
one node): (1) for the same shadowed experts the node-aware spAG is priced 1.5-2.9x FasterMoE's
pipelined ring broadcast (the owner sends every copy into its node and one per remote node; a
ring has each holder forward once), and with FasterMoE's shadows, dispatch and no pre-gate
copies FSSDP would still be 1.002-1.066x, reaching <= 1.0 only with ring pricing; (2) pre-gate
copies whose gather is not hidden (cases 0, 25, 26: without pre-gate copies 0.96-0.98x; the
probe-based t fixes 25 and 26) and extra instances that each pay a kernel launch and a GEMM
overhead the planner's per-token compute model does not see (case 16); (3) dispatch spreads an
expert's tokens over its holders even when every device holds it, where keeping them local
avoids the all-to-all (cases 8, 20). The gradient reduce favours FSSDP (spRS is hidden;
FasterMoE's reduce queues behind the dense all-reduce).
"""

import numpy as np
import pytest
from sim_builders import make_cluster, make_model, skewed_trace

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


def simulate_case(case: dict, calibrate: bool) -> dict:
    devices = case["nodes"] * case["per_node"]
    model = make_model(layers=2, experts=case["experts"], hidden=case["hidden"], seq=1024)
    trace = skewed_trace(8, 2, case["experts"], devices, case["tokens"], seed=case["seed"], zipf=case["zipf"])
    scn = build_scenario(model, make_cluster(nodes=case["nodes"], gpus_per_node=case["per_node"], nic_gbps=case["nic"]),
                         devices, trace, options=SimOptions(fssdp_calibrate=calibrate))
    return {spec.name: simulate(scn, spec) for spec in resolve_systems(["ep", "fastermoe", "fssdp"])}


def mean_times(case: dict, calibrate: bool) -> dict[str, float]:
    return {name: float(np.mean(result.iteration_s_I)) for name, result in simulate_case(case, calibrate).items()}


def test_calibrated_fssdp_is_never_meaningfully_slower_than_ep():
    ratios, faster = [], 0
    for case in random_cases(30):
        times = mean_times(case, calibrate=True)
        ratios.append(times["fssdp"] / times["ep"])
        faster += times["fssdp"] < times["fastermoe"]
    assert max(ratios) <= 1.05, (max(ratios), int(np.argmax(ratios)))
    assert np.mean(ratios) < 0.95  # and it does gain on these skewed traces
    assert faster >= 15  # reported above: 21 of 30 when measured


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
