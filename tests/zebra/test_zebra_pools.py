"""Zebra pools: the published pools' cluster configs, the rank layout (checked against the
launcher's own rank placement, launch/templates/task_env.sh) and every validation error."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatron_patches.config import cluster_config_from_dict, load_cluster_config
from megatron_patches.placement.zebra import DeviceProfile, ZebraProfile, ZebraShape, save_device_profile
from megatron_patches.zebra.pools import PoolError, zebra_layout

REPO = Path(__file__).resolve().parents[2]

# docs/design.md section 7: the zebra paper's pools, attention GPUs first.
PUBLISHED_POOLS = {
    "zebra_o1": (("A40-48GB", 6), ("V100-SXM2-16GB", 6)),
    "zebra_o2": (("A40-48GB", 4), ("V100-SXM2-16GB", 8)),
    "zebra_o3": (("A40-48GB", 6), ("V100-SXM2-16GB", 3)),
    "zebra_c1": (("L40S-48GB", 2), ("T4-16GB", 6)),
    "zebra_c2": (("L40S-48GB", 2), ("T4-16GB", 8)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_POOLS))
def test_published_pools_describe_device_types_per_node(name):
    cluster = load_cluster_config(name)
    (fast, m), (slow, n) = PUBLISHED_POOLS[name]
    topology = cluster.to_topology()
    assert topology.device_types == (fast,) * m + (slow,) * n
    assert topology.nodes * topology.devices_per_node == m + n
    # Every node holds one type only: the types change at a node boundary.
    per_node = [set(topology.device_types[i:i + topology.devices_per_node])
                for i in range(0, m + n, topology.devices_per_node)]
    assert all(len(types) == 1 for types in per_node)
    assert cluster.gpu_types[fast].peak_fp16_tflops > cluster.gpu_types[slow].peak_fp16_tflops

    # The whole pool as one ZP group: M = the fast GPUs, N = the slow ones.
    experts = 12 * n  # any expert count that N divides
    layout = zebra_layout(cluster, m, n, m + n, num_layers=4, num_experts=experts)
    assert layout.roles == ("attention",) * m + ("expert",) * n
    assert layout.device_types == topology.device_types
    assert (layout.attention_device_type, layout.expert_device_type) == (fast, slow)
    assert layout.asym_ea.offload_chunks_L == (0, 0, 0, 0)


def two_pool_cluster(attention_nodes=2, expert_nodes=2, per_node=2, fast="A40", slow="V100", peaks=(149.7, 125.0)):
    def gpu(peak):
        return {"memory_gb": 16, "peak_fp16_tflops": peak, "hbm_gb_s": 900, "flash_attention": False, "source": "test"}

    def group(count, name):
        return {"count": count, "gpus_per_node": per_node, "gpu": name, "intra_node_bw_gb_s": 32,
                "intra_node_link": "PCIe", "inter_node_gbps": 100}

    return cluster_config_from_dict({
        "name": "test_pool",
        "nodes": [group(attention_nodes, fast), group(expert_nodes, slow)],
        "gpu_types": {fast: gpu(peaks[0]), slow: gpu(peaks[1])},
    })


def launcher_ranks(het_counts: tuple[int, int], zp_groups: int) -> list[tuple[int, int]]:
    """(RANK, HET_COMPONENT) of every Slurm task as launch/templates/task_env.sh computes them."""
    script = (REPO / "launch" / "templates" / "task_env.sh").read_text()
    total = sum(het_counts)
    out = []
    for procid in range(total):
        env = dict(os.environ, SLURM_HET_SIZE="2", SLURM_NTASKS=str(total), SLURM_PROCID=str(procid), SLURM_LOCALID="0",
                   SLURM_NTASKS_HET_GROUP_0=str(het_counts[0]), SLURM_NTASKS_HET_GROUP_1=str(het_counts[1]),
                   ZP_GROUPS=str(zp_groups))
        done = subprocess.run(["bash", "-c", script, "task", "sh", "-c", 'echo "$RANK $HET_COMPONENT"'],
                              capture_output=True, text=True, env=env, check=True)
        rank, component = map(int, done.stdout.split())
        out.append((rank, component))
    return out


def test_layout_of_two_zp_groups_matches_the_launcher():
    cluster = two_pool_cluster()  # 4 A40 then 4 V100
    layout = zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4)
    assert layout.num_groups == 2
    assert layout.zp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.roles == ("attention", "attention", "expert", "expert") * 2
    assert layout.device_types == ("A40", "A40", "V100", "V100") * 2
    assert layout.attention_dp_group == (0, 1, 4, 5)
    assert layout.expert_dp_groups == ((2, 6), (3, 7))
    assert layout.offloaded_expert_dp_groups == ((0, 4), (1, 5))
    assert layout.attention_ranks_of(1) == (4, 5) and layout.expert_ranks_of(1) == (6, 7)
    # The launcher runs component 0 (the A40 node group) on the attention ranks.
    for rank, component in launcher_ranks((4, 4), zp_groups=2):
        assert layout.device_types[rank] == cluster.nodes[component].gpu
        assert layout.roles[rank] == ("attention", "expert")[component]


def test_layout_with_uneven_m_and_n_matches_the_launcher():
    cluster = two_pool_cluster(attention_nodes=1, expert_nodes=3, per_node=2)  # 2 A40, 6 V100
    layout = zebra_layout(cluster, 1, 3, 8, num_layers=2, num_experts=6, asym_ea="1,0")
    assert layout.roles == ("attention", "expert", "expert", "expert") * 2
    assert layout.expert_dp_groups == ((1, 5), (2, 6), (3, 7))
    assert layout.asym_ea.offload_chunks_L == (1, 0) and (layout.asym_ea.n1, layout.asym_ea.n2) == (3, 1)
    for rank, component in launcher_ranks((2, 6), zp_groups=2):
        assert layout.device_types[rank] == cluster.nodes[component].gpu


def test_homogeneous_cpu_pool():
    layout = zebra_layout(load_cluster_config("local_cpu"), 2, 2, 4, num_layers=2, num_experts=8)
    assert layout.device_types == ("cpu-rank",) * 4
    assert layout.roles == ("attention", "attention", "expert", "expert")
    assert layout.expert_dp_groups == ((2,), (3,))


def test_m_and_n_that_do_not_divide_each_other_work_without_asym_ea():
    cluster = two_pool_cluster(attention_nodes=1, expert_nodes=3, per_node=1)  # 1 A40, 3 V100
    layout = zebra_layout(cluster, 1, 3, 4, num_layers=2, num_experts=6)
    assert layout.asym_ea.offload_chunks_L == (0, 0)
    cluster = two_pool_cluster(attention_nodes=2, expert_nodes=3, per_node=1)
    layout = zebra_layout(cluster, 2, 3, 5, num_layers=2, num_experts=6, asym_ea="off")
    assert (layout.asym_ea.n1, layout.asym_ea.n2) == (0, 0)
    with pytest.raises(PoolError, match=r"--zebra-asym-ea 'auto' needs M to divide N or N to divide M, got "
                                        r"--zebra-attention-ranks=2 and --zebra-expert-ranks=3"):
        zebra_layout(cluster, 2, 3, 5, num_layers=2, num_experts=6, asym_ea="auto")


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 2, 4), {}, "--zebra-attention-ranks=0 is invalid; expected an integer >= 1"),
        ((2, True, 4), {}, "--zebra-expert-ranks=True is invalid"),
        ((2, 2, 6), {}, r"world size 6 is not divisible by M \+ N = 2 \+ 2 = 4: .* valid world sizes: multiples of 4"),
        ((2, 2, 4), {"num_experts": 5}, r"--zebra-expert-ranks=2 does not divide the 5 experts .* valid: \[1, 5\]"),
        ((1, 1, 8), {}, "world size 8 exceeds the 4 devices of cluster local_cpu; valid: at most 4"),
        ((2, 2, 4), {"num_layers": 0}, "num_layers=0 is invalid"),
    ],
)
def test_bad_pools_on_a_homogeneous_cluster(args, kwargs, message):
    params = dict(num_layers=2, num_experts=8)
    params.update(kwargs)
    with pytest.raises(PoolError, match=message):
        zebra_layout(load_cluster_config("local_cpu"), *args, **params)


def test_bad_two_type_pools():
    with pytest.raises(PoolError, match=r"2 ZP group\(s\) x 3 attention ranks = 6 A40 devices, but cluster test_pool "
                                        r"has 4; valid attention ranks per group: at most 2"):
        zebra_layout(two_pool_cluster(), 3, 1, 8, num_layers=2, num_experts=4)
    with pytest.raises(PoolError, match=r"1 ZP group\(s\) x 6 expert ranks = 6 V100 devices, but cluster "
                                        r"test_pool has 4"):
        zebra_layout(two_pool_cluster(), 2, 6, 8, num_layers=2, num_experts=6)
    # The older GPU listed first: its ranks would do attention.
    slow_first = two_pool_cluster(fast="V100", slow="A40", peaks=(125.0, 149.7))
    with pytest.raises(PoolError, match=r"ZP group 0: attention rank 0 runs on a V100 \(125 TFLOP/s fp16\) but expert "
                                        r"rank 2 on a faster A40 \(149.7 TFLOP/s\); the attention ranks must be the "
                                        r"newer, faster GPUs"):
        zebra_layout(slow_first, 2, 2, 8, num_layers=2, num_experts=4)
    three = cluster_config_from_dict({
        "name": "three",
        "nodes": [{"count": 1, "gpus_per_node": 2, "gpu": g, "intra_node_bw_gb_s": 32, "intra_node_link": "PCIe",
                   "inter_node_gbps": 100} for g in ("a", "b", "c")],
        "gpu_types": {g: {"memory_gb": 16, "peak_fp16_tflops": 10, "hbm_gb_s": 900, "flash_attention": False,
                          "source": "test"} for g in ("a", "b", "c")},
    })
    with pytest.raises(PoolError, match=r"cluster three has 3 node groups .* zebra runs on one node group"):
        zebra_layout(three, 2, 2, 4, num_layers=2, num_experts=4)


SHAPE = ZebraShape(num_layers=2, num_experts=4, attention_ranks=2, expert_ranks=2)


def test_memory_bounds_from_a_profile(tmp_path):
    cluster = two_pool_cluster()
    path = tmp_path / "profile.json"
    # A V100 holds 3 of its 2 x 2 experts: n_min = 1; an A40 takes up to 2 more.
    save_device_profile(path, SHAPE, DeviceProfile("A40", 1.0, 1.5, 2, None))
    save_device_profile(path, SHAPE, DeviceProfile("V100", None, 2.0, None, 3))
    layout = zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4, asym_ea="auto", profile=path)
    assert sum(layout.asym_ea.offload_chunks_L) >= 1
    with pytest.raises(PoolError, match="--zebra-asym-ea off is impossible: the profile says each expert GPU must give "
                                        "away n_min=1 experts"):
        zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4, asym_ea="off", profile=path)
    with pytest.raises(PoolError, match=r"--zebra-asym-ea 1,1 offloads 2 chunks, but attention GPUs can take only "
                                        r"n_max=1 experts"):
        tight = ZebraProfile(SHAPE, 1.0, 2.0, 1.5, n_min=1, n_max=1)
        zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4, asym_ea="1,1", profile=tight)
    with pytest.raises(PoolError, match="n_min cannot be met within n_max"):
        zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4, asym_ea="auto",
                     profile=ZebraProfile(SHAPE, 1.0, 2.0, 1.5, n_min=3, n_max=1))
    with pytest.raises(PoolError, match=r"--zebra-asym-ea auto needs a profile \(--zebra-profile FILE\)"):
        zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4, asym_ea="auto")
    with pytest.raises(PoolError, match="the zebra profile was made for .*num_layers=2.* the run has .*num_layers=3"):
        zebra_layout(cluster, 2, 2, 8, num_layers=3, num_experts=4, asym_ea="auto", profile=path)
    # The profile file is read for the pool's own GPU types.
    other = tmp_path / "other.json"
    save_device_profile(other, SHAPE, DeviceProfile("A40", 1.0, 1.5, 2, 4))
    with pytest.raises(PoolError, match=r"--zebra-profile .*other.json: .*no measurements for expert device type "
                                        r"'V100' "
                                        r"\(profiled types: \['A40'\]\)"):
        zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4, asym_ea="auto", profile=other)
    with pytest.raises(PoolError, match="'V100' was profiled only as an expert GPU"):
        zebra_layout(two_pool_cluster(fast="V100", slow="A40", peaks=(150.0, 125.0)), 2, 2, 8, num_layers=2,
                     num_experts=4, asym_ea="auto", profile=path)
    with pytest.raises(PoolError, match=r"--zebra-profile .*missing.json: \[Errno 2\]"):
        zebra_layout(cluster, 2, 2, 8, num_layers=2, num_experts=4, asym_ea="auto", profile=tmp_path / "missing.json")
