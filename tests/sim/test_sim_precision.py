"""Precision (fp32 / fp16 / bf16) and activation recompute (none / selective / full) in the
simulator (issue 15, item 5): exact figures from the formulas of `sim/costs.py`, the direction
of every change, the cluster files' precision keys, and the command line (--precision,
--recompute, --run on every run config)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from sim_builders import GPU, balanced_trace, make_cluster, make_model, make_pool

from megatron_patches.config import (
    ConfigError,
    available_clusters,
    cluster_config_from_dict,
    expert_parameter_count,
    load_cluster_config,
)
from megatron_patches.config.clusters import CLUSTERS_DIR
from megatron_patches.placement.synthetic import synthetic_trace
from megatron_patches.sim import (
    ComputeModel,
    Hardware,
    KernelEfficiency,
    MemoryModel,
    Precision,
    SimError,
    SimOptions,
    Workload,
    build_scenario,
    resolve_systems,
    simulate,
)

REPO = Path(__file__).resolve().parents[2]
RUN_FILES = sorted((REPO / "configs" / "runs").glob("*.yaml"))


def _load_tool():
    spec = importlib.util.spec_from_file_location("simulate_tool", REPO / "tools" / "simulate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


simulate_tool = _load_tool()


def run_tool(capsys, *args):
    """tools/simulate.py's main in this process (the launcher's imports are paid once); (rc, out, err)."""
    rc = simulate_tool.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# ---------------------------------------------------------------------------------------------
# Bytes per parameter and per element
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, fp32_grads, element, grad, optimizer, step", [
    ("fp32", None, 4, 4, 8, 28),   # 4 B weight + 4 B grad + 8 B Adam m, v; step: grad 4 + (w, m, v) x 8
    ("fp16", None, 2, 2, 12, 28),  # 2 + 2 + 12 (fp32 main, m, v); step: 2 + 24 + 2 B half weight written
    ("bf16", None, 2, 4, 12, 30),  # Megatron-LM accumulates bf16 gradients in fp32: 2 + 4 + 12
    ("fp16", True, 2, 4, 12, 30),  # --accumulate-allreduce-grads-in-fp32
])
def test_bytes_per_parameter_follow_megatron_mixed_precision(name, fp32_grads, element, grad, optimizer, step):
    p = Precision(name, fp32_grads)
    assert (p.element_bytes, p.grad_bytes_per_param, p.optimizer_bytes_per_param) == (element, grad, optimizer)
    assert p.optimizer_step_bytes_per_param == step
    assert p.half == (name != "fp32")


def test_impossible_precisions_are_refused():
    with pytest.raises(SimError, match="precision 'fp8' is unknown; valid: fp32, fp16, bf16"):
        Precision("fp8")
    with pytest.raises(SimError, match="bf16 gradients are always fp32"):
        Precision("bf16", fp32_gradients=False)


def test_expert_copies_tokens_and_dense_state_follow_the_precision():
    """h = 256, P = 262,912 per expert: an owned expert is 16 P bytes in fp32 and fp16, 18 P in
    bf16; a materialized copy (weights + gradients) 8 P, 4 P, 6 P; a token 4 h or 2 h."""
    model = make_model(hidden=256)
    hw = Hardware.from_cluster(make_cluster(1, 2), 2)
    P = expert_parameter_count(model)
    assert P == 262912
    for name, owned, copy, token in (("fp32", 16, 8, 1024), ("fp16", 16, 4, 512), ("bf16", 18, 6, 512)):
        wl = Workload(model, 2, 1, 512, Precision(name))
        mem = MemoryModel(wl, hw)
        assert mem.expert_bytes_per_instance(True) == owned * P
        assert mem.expert_bytes_per_instance(False) == copy * P
        assert wl.byte_model.token_bytes == token
        dense = wl.dense_params()
        params = sum(dense["per_layer"]) + dense["outer"]
        p = Precision(name)
        # weights and gradients everywhere, optimizer state sharded over the 2 data-parallel ranks
        assert mem.dense_bytes() == pytest.approx(params * (p.element_bytes + p.grad_bytes_per_param
                                                            + p.optimizer_bytes_per_param / 2))


# ---------------------------------------------------------------------------------------------
# Activations: Korthikanti et al. Table 2 and section 4, with e-byte elements
# ---------------------------------------------------------------------------------------------

H, A, S, F, V, LAYERS = 256, 4, 512, 512, 1024, 4
N = S  # tokens per device: micro-batch 1
ROUTED = 2 * N  # balanced top-2 over 2 devices: tokens each device's experts process per layer


def expected_activations(e: int, fused: bool, recompute: str) -> float:
    """Written out from the paper, independently of the code's structure."""
    scores = 0 if fused else (2 * e + 1) * A * S  # softmax out, dropout mask, dropout out: 5 a s at e = 2
    attention = 5 * e * H + H + scores  # QKV in, Q, K, V, projection in, dropout mask: 11 h at e = 2
    norms = 2 * e * H  # two layer-norm inputs: 4 h at e = 2
    experts = ROUTED * e * (H + 2 * F)  # input, fc1 output, GeLU output
    layer = N * (attention + norms) + experts
    logits = 4 * N * V  # fp32 logits of the loss, never recomputed
    if recompute == "none":
        return LAYERS * layer + logits
    if recompute == "selective":
        return LAYERS * (layer - N * scores) + logits
    return LAYERS * N * e * H + layer + logits  # every layer's input + one layer recomputed


def activations(precision: str, recompute: str, flash: bool, memory_efficient: bool = False) -> float:
    model = make_model(layers=LAYERS, hidden=H, heads=A, seq=S)
    gpu = {"flash_attention": flash, "memory_efficient_attention": memory_efficient}
    hw = Hardware.from_cluster(make_cluster(1, 2, gpu=gpu), 2)
    mem = MemoryModel(Workload(model, 2, 1, S, Precision(precision), recompute), hw)
    return float(mem.activation_bytes(np.full((LAYERS, 2), ROUTED))[0])


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("flash", [False, True])
def test_activation_bytes_equal_the_formulas(precision, recompute, flash):
    e = 4 if precision == "fp32" else 2
    fused = flash and precision != "fp32"  # fused attention takes fp16 / bf16 only
    assert activations(precision, recompute, flash) == expected_activations(e, fused, recompute)


def test_activation_figures_by_hand():
    """bf16, unfused: a layer holds 512 x (15 x 256 + 5 x 4 x 512) + 1024 x 2 x 1280 = 9,830,400 B,
    of which 5,242,880 B of scores; its input is 512 x 2 x 256 = 262,144 B; logits 2,097,152 B.
    fp32 doubles every 2-byte element: a layer holds 512 x (29 x 256 + 9 x 4 x 512) + 1024 x 4 x
    1280 = 18,481,152 B."""
    assert activations("bf16", "none", False) == 4 * 9_830_400 + 2_097_152 == 41_418_752
    assert activations("bf16", "selective", False) == 4 * (9_830_400 - 5_242_880) + 2_097_152 == 20_447_232
    assert activations("bf16", "full", False) == 4 * 262_144 + 9_830_400 + 2_097_152 == 12_976_128
    assert activations("fp32", "none", False) == 4 * 18_481_152 + 2_097_152 == 76_021_760
    # recompute keeps less: full < selective < none here (4 layers; see the next test for the exception)
    assert activations("bf16", "full", False) < activations("bf16", "selective", False) < activations(
        "bf16", "none", False)
    # fused attention keeps no scores: selective recompute saves nothing more
    assert activations("bf16", "selective", True) == activations("bf16", "none", True)
    assert activations("fp16", "none", True) == activations("bf16", "none", True)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_memory_efficient_attention_keeps_no_scores_at_the_unfused_time(precision, recompute):
    """Where flash does not run (a V100) and the cluster file says the systems run a
    memory-efficient kernel, attention keeps no scores in any precision (xFormers' CUTLASS kernel
    takes fp32 too), and takes the unfused path's time."""
    e = 4 if precision == "fp32" else 2
    assert activations(precision, recompute, False, memory_efficient=True) == expected_activations(e, True, recompute)
    assert activations(precision, recompute, False) == expected_activations(e, False, recompute)
    model = make_model(layers=LAYERS, hidden=H, heads=A, seq=S)
    times = []
    for memory_efficient in (False, True):
        gpu = {"flash_attention": False, "memory_efficient_attention": memory_efficient}
        hw = Hardware.from_cluster(make_cluster(1, 2, gpu=gpu), 2)
        compute = ComputeModel(Workload(model, 2, 1, S, Precision(precision), recompute), hw, KernelEfficiency())
        times.append((compute.attention_fwd_D()[0], compute.attention_bwd_D()[0]))
    assert times[0] == times[1]


def test_full_recompute_can_keep_more_than_selective_with_unfused_attention():
    """The recomputed layer holds its scores again: with unfused attention and few layers, one
    layer's scores outweigh what full recompute saves over selective (here 2 layers at s = 2048)."""
    model = make_model(layers=2, hidden=H, heads=A, seq=2048)
    hw = Hardware.from_cluster(make_cluster(1, 2, gpu={"flash_attention": False}), 2)
    kept = {}
    for recompute in ("none", "selective", "full"):
        mem = MemoryModel(Workload(model, 2, 1, 2048, Precision("fp16"), recompute), hw)
        kept[recompute] = float(mem.activation_bytes(np.full((2, 2), 4096))[0])
    assert kept["selective"] < kept["full"] < kept["none"]


# ---------------------------------------------------------------------------------------------
# Compute peaks
# ---------------------------------------------------------------------------------------------


def test_compute_peaks_follow_the_precision():
    """Test GPU: FP16/BF16 tensor 100, TF32 tensor 50, FP32 20 TFLOP/s. Half precision runs GEMMs
    and fused attention at 100; fp32 runs Transformer Engine's GEMMs at TF32 (50) and the unfused
    attention's PyTorch matmuls at FP32 (20); without TF32 tensor cores every fp32 GEMM runs at 20."""
    model = make_model(hidden=1024, heads=8, seq=4096)
    eff = KernelEfficiency()
    n = s = 4096
    projections = 2 * n * 1024 * 3072 + 2 * n * 1024 * 1024  # FLOPs
    core = 4 * n * s * 1024
    for precision, gpu, gemm_peak in (("bf16", {}, 100e12), ("fp32", {}, 50e12),
                                      ("fp32", {"peak_tf32_tflops": None}, 20e12)):
        hw = Hardware.from_cluster(make_cluster(1, 1, gpu=gpu), 1)
        compute = ComputeModel(Workload(model, 1, 1, s, Precision(precision)), hw, eff)
        assert compute.peak_flops_D[0] == gemm_peak
        if precision == "bf16":
            attention = projections / (100e12 * eff.dense_gemm) + 0.5 * core / (100e12 * eff.flash_attention)
        else:
            scores = n * 8 * s * 4 * ComputeModel.SCORE_PASSES / (1000e9 * eff.memory)  # 4-byte scores
            attention = projections / (gemm_peak * eff.dense_gemm) + max(core / (20e12 * eff.dense_gemm), scores)
        assert compute.attention_fwd_D()[0] == pytest.approx(attention, rel=1e-12)
    fp32 = ComputeModel(Workload(model, 1, 1, s, Precision("fp32")), Hardware.from_cluster(make_cluster(1, 1), 1), eff)
    bf16 = ComputeModel(Workload(model, 1, 1, s, Precision("bf16")), Hardware.from_cluster(make_cluster(1, 1), 1), eff)
    assert fp32.optimizer_D(1e9)[0] == pytest.approx(28e9 / (1000e9 * eff.memory))
    assert bf16.optimizer_D(1e9)[0] == pytest.approx(30e9 / (1000e9 * eff.memory))
    # an expert's weights stream in 4-byte elements: twice the bf16 time when memory-bound
    tokens = np.array([[2], [0]])
    assert fp32.expert_fwd(tokens)[0] > bf16.expert_fwd(tokens)[0]


# ---------------------------------------------------------------------------------------------
# Recompute in the schedule
# ---------------------------------------------------------------------------------------------

MODEL = make_model(layers=3, experts=8, hidden=512, seq=1024)


def scenario(recompute, cluster=None, gpus=1, trace=None, **options):
    trace = trace or balanced_trace(2, 3, 8, gpus, 64)
    return build_scenario(MODEL, cluster or make_cluster(1, 1), gpus, trace, recompute=recompute,
                          options=SimOptions(**options))


def run(scn, name):
    return simulate(scn, resolve_systems([name])[0])


def test_full_recompute_adds_exactly_one_forward_of_every_layer():
    """One device (no all-to-all, no gradient traffic): the iteration grows by each layer's
    attention, norms and gate, and expert forward, exactly."""
    none, full = scenario("none"), scenario("full")
    c = none.compute
    experts = sum(float(c.expert_fwd(none.loads_ILE[0, k][:, None])[0]) for k in range(3))
    extra = 3 * float(c.attention_fwd_D()[0] + c.other_fwd_D(True)[0]) + experts
    np.testing.assert_allclose(run(full, "ep").iteration_s_I - run(none, "ep").iteration_s_I, extra, rtol=1e-12)


def test_selective_recompute_adds_exactly_one_core_attention_forward():
    none, selective = scenario("none"), scenario("selective")
    extra = 3 * float(none.compute.core_attention_fwd_D()[0])
    np.testing.assert_allclose(run(selective, "ep").iteration_s_I - run(none, "ep").iteration_s_I, extra, rtol=1e-12)


def test_full_recompute_repeats_the_all_to_alls_but_not_the_sparse_gather():
    """EP on 8 devices, balanced: 4 all-to-alls per MoE layer become 6 (the recomputed forward's
    dispatch and combine), all on the critical path. FSSDP reuses its copies: the same spAG.
    Without NIC sharing: the dense gradients' all-reduces would delay the all-to-alls issued after
    them by amounts that depend on the program order, not on the recompute."""
    trace = balanced_trace(2, 3, 8, 8, 64)
    kw = dict(cluster=make_cluster(), gpus=8, trace=trace, overlap_degree=2, memory_capacity=1, nic_sharing=False)
    none, full = scenario("none", **kw), scenario("full", **kw)
    ep_none, ep_full = run(none, "ep"), run(full, "ep")
    np.testing.assert_allclose(ep_full.breakdown_I["all_to_all"], 1.5 * ep_none.breakdown_I["all_to_all"], rtol=1e-12)
    fssdp_none, fssdp_full = run(none, "fssdp"), run(full, "fssdp")
    assert fssdp_full.details["collective_s"]["spag"] == pytest.approx(fssdp_none.details["collective_s"]["spag"])
    assert np.all(fssdp_full.memory_D < fssdp_none.memory_D)
    assert np.all(fssdp_full.iteration_s_I > fssdp_none.iteration_s_I)


def test_zebra_roles_recompute_their_own_work():
    """Attention ranks re-run attention, norms and gate; expert ranks their experts (4 passes of a
    forward instead of 3); no all-to-all is repeated. Both roles keep less."""
    pool = make_pool(2, 2)
    trace = balanced_trace(2, 3, 8, 4, 64)
    results = {r: run(build_scenario(MODEL, pool, 4, trace, recompute=r, options=SimOptions(zebra_microbatches=2)),
                      "zebra") for r in ("none", "full")}
    none, full = (results[r].details["profile"] for r in ("none", "full"))
    scn = build_scenario(MODEL, pool, 4, trace)
    per_microbatch = 4 * 1024 / (2 * 2) / 1024  # a micro-batch's tokens over the workload's tokens per device
    c = scn.compute
    attention_forward = per_microbatch * float(c.attention_fwd_D()[0] + c.other_fwd_D(True)[0])
    assert full["t_attn_A"] - none["t_attn_A"] == pytest.approx(attention_forward, rel=1e-12)
    assert full["t_exp_E"] == pytest.approx(none["t_exp_E"] * 4 / 3, rel=1e-12)
    assert np.all(results["full"].memory_D < results["none"].memory_D)
    assert results["full"].iteration_s > results["none"].iteration_s


# ---------------------------------------------------------------------------------------------
# Which precision runs where; the cluster files
# ---------------------------------------------------------------------------------------------


def test_bf16_is_refused_on_gpus_without_it_and_the_default_falls_back_to_fp16():
    trace = synthetic_trace(iterations=2, layers=12, experts=64, tokens=1000, ranks=32)
    from megatron_patches.config import load_model_config

    model = load_model_config("gpt_moe_s")
    cluster_a = load_cluster_config("cluster_a")
    with pytest.raises(SimError, match=r"precision bf16: the V100-SXM2-32GB \(cluster cluster_a\) has no bf16"):
        build_scenario(model, cluster_a, 32, trace, precision="bf16")
    scn = build_scenario(model, cluster_a, 32, trace)
    assert scn.workload.precision.name == "fp16" and scn.precision_note == "default: the V100-SXM2-32GB has no bf16"
    scn = build_scenario(model, load_cluster_config("cluster_b"), 32, trace)
    assert scn.workload.precision.name == "bf16"
    assert scn.precision_note == "default: every simulated GPU (A100-SXM4-40GB) supports bf16"


def test_a_gpu_without_the_figures_names_the_file_and_key(tmp_path):
    values = yaml.safe_load((CLUSTERS_DIR / "cluster_b.yaml").read_text())
    for key in ("peak_fp32_tflops", "peak_tf32_tflops", "bf16"):
        del values["gpu_types"]["A100-SXM4-40GB"][key]
    path = tmp_path / "old_style.yaml"
    path.write_text(yaml.safe_dump(values))
    cluster = load_cluster_config(path)
    hw = Hardware.from_cluster(cluster, 8)
    assert hw.default_precision() == ("fp16", "the cluster file does not say whether the A100-SXM4-40GB supports bf16")
    with pytest.raises(SimError, match=rf"add `bf16: true` or `bf16: false` to gpu_types.A100-SXM4-40GB of {path}"):
        hw.check_precision(Precision("bf16"))
    with pytest.raises(SimError, match=rf"no FP32 rate for the A100-SXM4-40GB; add peak_fp32_tflops to "
                                       rf"gpu_types.A100-SXM4-40GB of {path}"):
        hw.check_precision(Precision("fp32"))


@pytest.mark.parametrize("mutate, words", [
    (lambda g: g.update(bf16="yes"), ["gpu_types.V100-SXM2-32GB: bf16='yes' is invalid", "true or false"]),
    (lambda g: g.update(peak_fp32_tflops=-1), ["gpu_types.V100-SXM2-32GB: peak_fp32_tflops=-1 is invalid"]),
    (lambda g: g.update(peak_fp32_tflops=None), ["peak_fp32_tflops=None is invalid", "positive number"]),
    (lambda g: g.update(peak_tf32_tflops="fast"), ["peak_tf32_tflops='fast' is invalid"]),
    (lambda g: g.update(bf16_support=True), ["unknown key(s) ['bf16_support']", "'bf16'"]),
    (lambda g: g.update(memory_efficient_attention=1),
     ["gpu_types.V100-SXM2-32GB: memory_efficient_attention=1 is invalid", "true or false"]),
])
def test_bad_precision_figures_name_the_file_and_key(mutate, words):
    values = yaml.safe_load((CLUSTERS_DIR / "cluster_a.yaml").read_text())
    mutate(values["gpu_types"]["V100-SXM2-32GB"])
    with pytest.raises(ConfigError) as err:
        cluster_config_from_dict(values, source="bad.yaml")
    assert str(err.value).startswith("bad.yaml: ")
    for word in words:
        assert word in str(err.value), str(err.value)


DATASHEET = {  # FP32, TF32 tensor (dense), bf16: NVIDIA datasheets
    "V100-SXM2-32GB": (15.7, None, False),
    "V100-SXM2-16GB": (15.7, None, False),
    "A100-SXM4-40GB": (19.5, 156.0, True),
    "A100-PCIe-80GB": (19.5, 156.0, True),
    "A40-48GB": (37.4, 74.8, True),
    "L40S-48GB": (91.6, 183.0, True),
    "T4-16GB": (8.1, None, False),
    "H100-SXM5-80GB": (67.0, 494.5, True),
    "H200-SXM-141GB": (67.0, 494.5, True),
    "cpu-rank": (0.0375, None, False),
}


@pytest.mark.parametrize("name", available_clusters())
def test_every_cluster_file_states_the_precision_figures(name):
    cluster = load_cluster_config(name)
    for gpu in cluster.gpu_types.values():
        assert (gpu.peak_fp32_tflops, gpu.peak_tf32_tflops, gpu.bf16) == DATASHEET[gpu.name]
        assert gpu.peak_fp32_tflops <= gpu.peak_fp16_tflops
        if gpu.name != "cpu-rank":
            assert str(gpu.peak_fp32_tflops) in gpu.source  # the datasheet citation carries the figure


def test_clusters_built_without_the_precision_keys_still_load():
    """Launcher tests write clusters with the five original keys; they stay valid."""
    original = {k: v for k, v in GPU.items() if k not in ("peak_fp32_tflops", "peak_tf32_tflops", "bf16")}
    node = dict(count=1, gpus_per_node=1, gpu="G", intra_node_bw_gb_s=1, intra_node_link="l", inter_node_gbps=1)
    gpu = cluster_config_from_dict({"name": "x", "nodes": [node], "gpu_types": {"G": original}}).gpu_types["G"]
    assert (gpu.peak_fp32_tflops, gpu.peak_tf32_tflops, gpu.bf16) == (None, None, None)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def d1_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "mixtral_d1.npz"
    from megatron_patches.placement.trace import write_trace

    trace = synthetic_trace(iterations=3, layers=8, experts=24, tokens=393216, ranks=12, seed=0)
    write_trace(str(path), trace.loads, trace.source_loads)
    return path


@pytest.fixture(scope="module")
def o1_unfused(tmp_path_factory):
    """zebra_o1 with the V100s' attention unfused (Megatron-Core's own on Volta), so it keeps its
    [s, s] scores: the shipped file runs a memory-efficient kernel there, as HeterMoE's systems do."""
    values = yaml.safe_load((CLUSTERS_DIR / "zebra_o1.yaml").read_text())
    values["gpu_types"]["V100-SXM2-16GB"]["memory_efficient_attention"] = False
    path = tmp_path_factory.mktemp("clusters") / "zebra_o1_unfused.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


D1_16K = ("--model", "mixtral_d1", "--seq-length", 16384)


def test_mixtral_d1_at_16k_fits_zebra_with_fp16_and_full_recompute(capsys, tmp_path, d1_trace, o1_unfused):
    out = tmp_path / "d1.json"
    # the shipped pool: the V100s' memory-efficient attention keeps no scores, so EP fits beside zebra
    rc, stdout, err = run_tool(capsys, *D1_16K, "--cluster", "zebra_o1", "--trace", d1_trace, "--precision", "fp16",
                               "--recompute", "full", "--systems", "ep,zebra", "--json", out, "--quiet")
    assert rc == 0, err
    systems = json.loads(out.read_text())["systems"]
    assert list(systems) == ["ep", "zebra"] and systems["ep"]["fits_in_memory"]
    rc, stdout, err = run_tool(capsys, *D1_16K, "--cluster", o1_unfused, "--trace", d1_trace, "--precision", "fp16",
                               "--recompute", "full", "--systems", "ep,zebra", "--json", out, "--quiet")
    assert rc == 0, err
    assert "precision  fp16: 2 B weights/activations/tokens, 2 B gradients" in stdout
    assert "recompute  full  [--recompute]" in stdout
    systems = json.loads(out.read_text())["systems"]
    assert systems["zebra"]["fits_in_memory"] and np.isfinite(systems["zebra"]["iteration_s"])
    # EP still cannot: one V100 layer's unfused 16K attention scores alone are 10.7 GB when
    # recomputed. So it is not simulated: the same answer as when it runs alone (refused below)
    summary = json.loads(out.read_text())
    assert list(systems) == ["zebra"] and summary["out_of_memory"]["ep"].startswith("EP needs ")
    assert "out of memory: ep is not simulated: EP needs " in stdout
    assert "no speedups over it" in stdout and systems["zebra"]["speedup_vs_ep"] is None
    rc, _, err = run_tool(capsys, *D1_16K, "--cluster", o1_unfused, "--trace", d1_trace, "--precision", "fp16",
                          "--recompute", "full", "--systems", "ep", "--quiet")
    assert rc == 2 and summary["out_of_memory"]["ep"] in err


def test_mixtral_d1_at_16k_without_recompute_is_refused_with_the_way_out(capsys, d1_trace, o1_unfused):
    rc, stdout, err = run_tool(capsys, *D1_16K, "--cluster", o1_unfused, "--trace", d1_trace, "--quiet")
    assert rc == 2
    assert "[default: the V100-SXM2-16GB has no bf16]" in stdout  # fp16: today's bytes
    assert "EP needs 101.0 GB per device (" in err and "activations 96.2 GB" in err
    assert "--recompute full (" in err
    rc, _, err = run_tool(capsys, *D1_16K, "--cluster", o1_unfused, "--trace", d1_trace, "--systems", "ep,zebra",
                          "--quiet")
    assert rc == 2 and "zebra (expert ranks) needs 19.5 GB per device" in err and "--recompute full (" in err


def test_bf16_on_v100_is_refused_on_the_command_line(capsys, d1_trace):
    rc, _, err = run_tool(capsys, "--model", "mixtral_d1", "--cluster", "zebra_o1", "--trace", d1_trace,
                          "--precision", "bf16")
    assert rc == 2
    assert "precision bf16: the V100-SXM2-16GB (cluster zebra_o1) has no bf16 support" in err


NO_EP_LAYOUT = {"zebra_c2": 10, "zebra_o3": 9}
"""Pools whose GPU count neither divides nor is a multiple of Mixtral-D1's 24 experts: the
simulator's EP (every GPU an EP rank) cannot place them, so zebra runs without speedups."""


@pytest.mark.parametrize("path", RUN_FILES, ids=[p.stem for p in RUN_FILES])
def test_every_run_config_simulates(capsys, tmp_path, path):
    out = tmp_path / "run.json"
    rc, stdout, err = run_tool(capsys, "--run", path, "--iterations", 2, "--quiet", "--json", out)
    assert rc == 0, err
    assert "synthetic (no --trace): 2 iterations" in stdout
    summary = json.loads(out.read_text())
    setup, run = summary["setup"], yaml.safe_load(path.read_text())
    precision = "bf16" if run["train"].get("bf16") else "fp16" if run["train"].get("fp16") else "fp32"
    assert setup["precision"] == precision and setup["settings_from"]["precision"].startswith("run: ")
    assert setup["micro_batch_size"] == run["train"]["micro_batch_size"]
    if path.stem in NO_EP_LAYOUT:
        assert f"24 experts over {NO_EP_LAYOUT[path.stem]} devices is impossible" in stdout
        assert list(summary["systems"]) == [run["mode"]] and summary["systems"][run["mode"]]["speedup_vs_ep"] is None
    else:
        assert list(summary["systems"]) == ["ep", run["mode"]]
    for name, s in summary["systems"].items():
        assert np.isfinite(s["iteration_s"]) and s["iteration_s"] > 0, name


def test_explicit_flags_override_the_run_config(capsys, tmp_path):
    out = tmp_path / "run.json"
    rc, stdout, err = run_tool(capsys, "--run", "fssdp_gpt_moe_s_b16", "--iterations", 2, "--quiet", "--json", out,
                               "--precision", "fp32", "--recompute", "selective", "--micro-batch-size", 2,
                               "--systems", "fssdp-remat")
    assert rc == 0, err
    setup = json.loads(out.read_text())["setup"]
    assert (setup["precision"], setup["recompute"], setup["micro_batch_size"]) == ("fp32", "selective", 2)
    assert setup["gpus"] == 16 and setup["seq_length"] == 2048 and setup["model"]["num_experts"] == 32
    assert setup["settings_from"]["precision"] == "--precision"
    assert setup["settings_from"]["gpus"] == "run: world size"
    assert "run        fssdp_gpt_moe_s_b16 (mode fssdp)" in stdout
    assert "precision  fp32: 4 B weights/activations/tokens, 4 B gradients, 8 B Adam m + v per parameter  " \
           "[--precision]" in stdout


def test_run_mode_flags_reach_the_systems(capsys, tmp_path):
    out = tmp_path / "run.json"
    assert run_tool(capsys, "--run", "replicate_gpt_small_16", "--iterations", 2, "--quiet", "--json", out)[0] == 0
    details = json.loads(out.read_text())["systems"]["replicate"]["details"]
    assert details["slots_per_rank"] == 4 and details["capacity_factor"] == 1.0
    assert run_tool(capsys, "--run", "zebra_o2", "--iterations", 2, "--quiet", "--json", out)[0] == 0
    assert json.loads(out.read_text())["systems"]["zebra"]["details"]["microbatches"] == 6  # the run config's zebra_microbatches


def test_a_system_s_answer_does_not_depend_on_its_company_and_short_traces_say_so(capsys, tmp_path):
    """Without --trace every command simulates the same 10 iterations, whichever systems it asks
    for (the trace used to grow to 2N + 1 when flexmoe-N was asked for, so EP's figure changed
    with its company). FlexMoE-10 acts at iterations i > 0 that 10 divides: (10 - 1) // 10 = 0
    times in 10 iterations, which the output says, and (21 - 1) // 10 = 2 times in 21."""
    out = tmp_path / "run.json"
    figures = {}
    for systems in ("flexmoe-10", "replicate", "flexmoe-10,replicate"):
        rc, stdout, _ = run_tool(capsys, "--run", "replicate_gpt_small_16", "--systems", systems, "--quiet",
                                 "--json", out)
        summary = json.loads(out.read_text())
        assert rc == 0 and summary["setup"]["iterations"] == 10
        figures[systems] = {name: s["iteration_s"] for name, s in summary["systems"].items()}
        assert ("note: flexmoe-10 rearranges every 10 iterations: 0 times in these 10 (--iterations 21 lets it act "
                "twice)" in stdout) == ("flexmoe-10" in systems)
    assert figures["flexmoe-10"]["ep"] == figures["replicate"]["ep"] == figures["flexmoe-10,replicate"]["ep"]
    assert figures["flexmoe-10"]["flexmoe-10"] == figures["flexmoe-10,replicate"]["flexmoe-10"]
    assert figures["replicate"]["replicate"] == figures["flexmoe-10,replicate"]["replicate"]
    rc, stdout, _ = run_tool(capsys, "--run", "replicate_gpt_small_16", "--systems", "flexmoe-10", "--iterations",
                             21, "--quiet", "--json", out)
    summary = json.loads(out.read_text())
    assert rc == 0 and "rearranges every" not in stdout and summary["setup"]["periodic_acts"] == {"flexmoe-10": 2}
    assert summary["systems"]["flexmoe-10"]["details"]["rearrangement_events"] >= 1


def test_the_tool_needs_a_trace_or_a_run(capsys):
    rc, _, err = run_tool(capsys, "--model", "gpt_moe_s", "--cluster", "cluster_a")
    assert rc == 2 and "--trace required (or --run, or --list-systems)" in err
