"""A device profile (tools/device_check.py's kernel stage) as the simulator reads it: the
efficiencies it implies, by hand from the H200 figures of configs/clusters/h200_hgx.yaml, its
refusals, and `tools/simulate.py --device-profile` against the same `--efficiency` overrides."""

import json

import pytest

from megatron_patches.config import load_cluster_config
from megatron_patches.sim import Hardware, Precision, SimError
from megatron_patches.sim.profile import PROFILE_FORMAT, DeviceProfile, load_device_profile
from sim.test_sim_cli import run_tool

# h200_hgx: FP16/BF16 peak 989 TFLOP/s, TF32 494.5, HBM 4,800 GB/s. The rates below are chosen
# so that every efficiency is a round fraction of those peaks.
RATES = {
    "bf16": {"dense_gemm_tflops": 494.5, "expert_gemm_tflops": 593.4, "expert_half_tokens": 200.0,
             "flash_attention_tflops": 395.6},
    "fp32": {"dense_gemm_tflops": 49.45, "expert_gemm_tflops": 49.45, "expert_half_tokens": 64.0},
}


def profile(**changes) -> DeviceProfile:
    values = {"gpu_type": "H200-SXM-141GB", "device_name": "NVIDIA H200", "hbm_gb_s": 3360.0, "precisions": RATES,
              "source": "hand-made for the test"}
    return DeviceProfile(**{**values, **changes})


def hardware(cluster: str = "h200_hgx", gpus: int = 8) -> Hardware:
    return Hardware.from_cluster(load_cluster_config(cluster), gpus)


def test_half_precision_efficiencies_are_measured_over_the_datasheet_peaks():
    got = profile().efficiency_overrides(hardware(), Precision("bf16"))
    assert got == pytest.approx({"dense_gemm": 0.5, "expert_gemm": 0.6, "expert_half_tokens": 200.0,
                                 "flash_attention": 0.4, "memory": 0.7}, rel=1e-12)


def test_fp32_is_measured_against_the_tf32_peak_and_has_no_fused_attention():
    # the cost model's fp32 GEMM peak is TF32's where the GPU has one (Hardware.gemm_peaks_D)
    got = profile().efficiency_overrides(hardware(), Precision("fp32"))
    assert got == pytest.approx({"dense_gemm": 0.1, "expert_gemm": 0.1, "expert_half_tokens": 64.0, "memory": 0.7},
                                rel=1e-12)


@pytest.mark.parametrize("cluster, precision, changes, message", [
    ("cluster_a", "fp16", {}, "measures H200-SXM-141GB (NVIDIA H200); the simulated devices are V100-SXM2-32GB"),
    ("h200_hgx", "fp16", {}, "has no fp16 rates; it has bf16, fp32"),
    ("h200_hgx", "bf16", {"hbm_gb_s": 5000.0}, "hbm_gb_s = 5e+12 is above the cluster file's hbm_gb_s 4.8e+12"),
    ("h200_hgx", "bf16", {"precisions": {"bf16": {**RATES["bf16"], "dense_gemm_tflops": 1200.0}}},
     "dense_gemm_tflops = 1.2e+15 is above the cluster file's GEMM peak 9.89e+14"),
])
def test_refusals_name_the_value_and_what_is_valid(cluster, precision, changes, message):
    gpus = 8 if cluster == "h200_hgx" else 32
    with pytest.raises(SimError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        profile(**changes).efficiency_overrides(hardware(cluster, gpus), Precision(precision))


@pytest.mark.parametrize("changes, message", [
    ({"hbm_gb_s": 0}, "hbm_gb_s must be a positive finite number, got 0"),
    ({"precisions": {"fp8": RATES["bf16"]}}, "precision 'fp8' is unknown; valid: fp32, fp16, bf16"),
    ({"precisions": {"bf16": RATES["fp32"]}}, r"precisions.bf16 lacks \['flash_attention_tflops'\]"),
    ({"precisions": {"fp32": {**RATES["fp32"], "expert_half_tokens": float("nan")}}},
     "precisions.fp32.expert_half_tokens must be a positive finite number"),
    ({"expert_launch_us": -3.0}, "expert_launch_us must be a positive finite number, got -3.0"),
])
def test_a_malformed_profile_is_refused(changes, message):
    with pytest.raises(SimError, match=message):
        profile(**changes)


def test_a_measured_expert_launch_cost_replaces_the_cited_one(tmp_path):
    """A profile's expert_launch_us (the kit's eager expert at 16 tokens less its CUDA-graph
    kernels) is the cost model's kernel_launch_s: 40 us -> 4e-5 s, in every precision, written
    and read back; a profile without it leaves the cited 8 us."""
    measured = profile(expert_launch_us=40.0)
    for precision in ("bf16", "fp32"):
        assert measured.efficiency_overrides(hardware(), Precision(precision))["kernel_launch_s"] == pytest.approx(4e-5)
    assert "kernel_launch_s" not in profile().efficiency_overrides(hardware(), Precision("bf16"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(measured.to_dict()))
    assert load_device_profile(path) == measured
    assert "expert_launch_us" not in profile().to_dict()


def test_files_round_trip_and_foreign_json_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile().to_dict()))
    assert load_device_profile(path) == profile()
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(SimError, match=f"format is 'something else'; valid: '{PROFILE_FORMAT}'"):
        load_device_profile(path)
    path.write_text("{not json")
    with pytest.raises(SimError, match="cannot read it as JSON"):
        load_device_profile(path)


def test_simulate_with_a_profile_equals_the_efficiencies_it_implies(tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(profile().to_dict()))
    common = ["--model", "configs/models/gpt_moe_s.yaml", "--cluster", "h200_hgx", "--gpus", 8, "--precision", "bf16",
              "--systems", "ep,fssdp", "--iterations", 3, "--quiet"]
    trace = tmp_path / "t.npz"
    made = run_tool("make_trace.py", "--out", trace, "--iterations", 3, "--layers", 12, "--experts", 64,
                    "--tokens", 16384, "--ranks", 8, "--seed", 0)
    assert made.returncode == 0, made.stderr
    with_profile = run_tool("simulate.py", *common, "--trace", trace, "--device-profile", path,
                            "--json", tmp_path / "a.json")
    assert with_profile.returncode == 0, with_profile.stderr
    assert "device profile" in with_profile.stdout and "dense_gemm=0.5" in with_profile.stdout
    by_hand = run_tool("simulate.py", *common, "--trace", trace, "--json", tmp_path / "b.json",
                       *[x for k, v in (("dense_gemm", 0.5), ("expert_gemm", 0.6), ("expert_half_tokens", 200),
                                        ("flash_attention", 0.4), ("memory", 0.7))
                         for x in ("--efficiency", f"{k}={v!r}")])
    assert by_hand.returncode == 0, by_hand.stderr
    a, b = (json.loads((tmp_path / name).read_text())["systems"] for name in ("a.json", "b.json"))
    assert {k: v["iteration_s"] for k, v in a.items()} == pytest.approx({k: v["iteration_s"] for k, v in b.items()},
                                                                       rel=1e-12)
    # and the measured rates matter: the datasheet's efficiencies give another time
    default = run_tool("simulate.py", *common, "--trace", trace, "--json", tmp_path / "c.json")
    c = json.loads((tmp_path / "c.json").read_text())["systems"]
    assert default.returncode == 0 and c["ep"]["iteration_s"] != pytest.approx(a["ep"]["iteration_s"], rel=1e-3)
    both = run_tool("simulate.py", *common, "--trace", trace, "--device-profile", path, "--efficiency", "memory=0.5")
    assert both.returncode != 0 and "--efficiency memory and --device-profile" in both.stderr + both.stdout


def test_the_shipped_h200_profile_is_the_device_kits_measurement():
    """configs/device_profiles/h200.json, written by the kit's kernels stage on a lent H200
    (2026-11-29): it loads, describes the H200 cluster's GPU, and its efficiencies are fractions of
    that cluster's datasheet peaks (bf16 dense GEMM 683.8 / 989 TFLOP/s; HBM 4,260 / 4,800 GB/s)."""
    from megatron_patches.config.models import CONFIGS_DIR

    shipped = load_device_profile(CONFIGS_DIR / "device_profiles" / "h200.json")
    assert shipped.gpu_type == "H200-SXM-141GB" and "device_check.py" in shipped.source
    got = shipped.efficiency_overrides(hardware(), Precision("bf16"))
    assert got["dense_gemm"] == pytest.approx(683.8177719278144 / 989, rel=1e-6)
    assert got["memory"] == pytest.approx(4259.906560678982 / 4800, rel=1e-6)
    assert all(0 < v < 1 for k, v in got.items() if k != "expert_half_tokens")
