"""The generated Slurm scripts on a real Slurm: a single-machine cluster of virtual nodes
(tests/support/slurm_cluster.py: installed with apt-get when missing, announced first; started
here, stopped by PID). MEGATRON_PATCHES_SKIP_SLURM=1 skips them; CI runs them.

- a homogeneous job: 2 nodes x 2 CPU ranks, the tiny GPT-MoE on the embedded corpus, 3 iterations
  (fssdp once that mode exists, ep until then);
- a 2-component hetjob in zebra mode: attention pool (component 0, 1 node x 2 ranks) and expert
  pool (component 1, 1 node x 2 ranks), M = 2, N = 2, R = 4, 6 iterations: rank order, the
  component derived from SLURM_NTASKS_HET_GROUP_<n>, MASTER_ADDR of component 0, the pool's
  device types reaching training through --zebra-cluster, experts computed on the expert ranks
  only, and a falling loss;
- a failing job's exit status reaches `submit.py --wait`;
- bad requests (ep and zebra) are refused by submit.py before anything reaches sbatch;
- GPU requests (fake mknod GPUs) are accepted by Slurm as generated (`sbatch --test-only`).

Each job is checked through what it leaves behind: exit status (`sbatch --wait`), the log (git
revision, start/end, preflight table, `summary:` line), preflight.json (which rank ran where)
and metrics.jsonl (finite losses). Run alone with `pytest -m slurm`. About 3 minutes in all on
the 2-core development VM, most of it the two training jobs.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_patches.training.arguments import MOE_PARALLEL_MODES
from support.slurm_cluster import SLURM_PACKAGES, SlurmUnavailable, missing_programs, start_cluster

REPO = Path(__file__).resolve().parents[2]
TEST_DATA = REPO / "tests" / "data" / "slurm"

pytestmark = pytest.mark.slurm


SKIP_VARIABLE = "MEGATRON_PATCHES_SKIP_SLURM"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    if os.environ.get(SKIP_VARIABLE) == "1":
        pytest.skip(f"{SKIP_VARIABLE}=1: the real-Slurm tests are skipped (unset it to run them; as root they "
                    f"install {' '.join(SLURM_PACKAGES)} with apt-get when missing)")
    missing = missing_programs()
    if os.geteuid() != 0 and missing:
        pytest.skip(f"Slurm is not installed ({missing}) and installing it needs root")
    if missing:
        # a system-wide change: say what and why before it happens, past pytest's capture
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print(f"\n[slurm] {missing} not found: installing Debian's {' '.join(SLURM_PACKAGES)} with apt-get to "
                  f"start a single-machine Slurm for {Path(__file__).name} (set {SKIP_VARIABLE}=1 to skip these tests "
                  "instead)", flush=True)
    try:
        slurm = start_cluster(tmp_path_factory.mktemp("slurm"), nodes=4, cpus_per_node=4, gpus_per_node=2)
    except SlurmUnavailable as error:
        pytest.fail(f"could not start a single-machine Slurm: {error}")
    yield slurm
    slurm.stop()


@pytest.fixture(scope="module")
def corpus():
    """Prepare the embedded corpus once, before any job, so that ranks never build it at once."""
    from megatron_patches.data.corpus import ensure_default_corpus

    return ensure_default_corpus("gpt")


def submit(cluster, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/submit.py", *args], cwd=REPO, env=cluster.env(env),
                          capture_output=True, text=True, timeout=timeout)


def finished_job(cluster, done: subprocess.CompletedProcess, out: Path) -> tuple[str, str]:
    """(job id, log text) of a `submit.py --wait` run; fails with the log and daemon logs."""
    match = re.search(r"submitted job (\d+)", done.stdout)
    assert match, f"no job submitted:\n{done.stdout}\n{done.stderr}"
    job_id = match.group(1)
    log = out / f"slurm-{job_id}.out"
    text = log.read_text() if log.exists() else "(no log)"
    assert done.returncode == 0, f"job {job_id} exit {done.returncode}\n{text[-6000:]}\n{cluster.log_tail()}"
    assert f"job {job_id} finished with exit status 0" in done.stdout
    return job_id, text


def check_log_and_metrics(text: str, run_dir: Path, iterations: int) -> list[dict]:
    """The job log's bookkeeping and metrics.jsonl's losses; the training records."""
    assert re.search(r"^\[job\] git revision [0-9a-f]{40}", text, re.M)
    assert re.search(r"^\[job\] \S+ \(job \d+\) started \d{4}-\d\d-\d\dT", text, re.M)
    assert re.search(r"^\[job\] finished \d{4}-\d\d-\d\dT.* exit status 0$", text, re.M)
    assert re.search(rf"^summary: {iterations} iterations \| loss [0-9.]+ -> [0-9.]+", text, re.M)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    losses = [r["loss"] for r in records]
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    assert all(math.isfinite(loss) and 0 < loss < 20 for loss in losses)
    assert "SLURM_JOB_ID=" in (run_dir / "env.txt").read_text()
    return records


def test_homogeneous_job_on_two_nodes(cluster, corpus, tmp_path):
    """Also with hostile values in the output folder and a training flag: the real sbatch and
    bash carry them as text, and the `$(...)` inside never runs."""
    mode = "fssdp" if "fssdp" in MOE_PARALLEL_MODES else "ep"
    out = tmp_path / "out$(touch${IFS}INJECTED_OUT)"
    run_dir_flag = "$RUN_DIR/run$(touch${IFS}INJECTED_RUN)"
    done = submit(cluster, "--run", str(TEST_DATA / "run_cpu_2x2.yaml"), "--mode", mode,
                  "--output-dir", str(out), "--run-dir", run_dir_flag, "--wait")
    job_id, text = finished_job(cluster, done, out)
    run_dir = out / job_id
    assert (run_dir / "run$(touch${IFS}INJECTED_RUN)" / "arguments.txt").is_file()
    for where in (REPO, tmp_path, out, run_dir):
        assert not list(where.glob("INJECTED*")), f"a value ran as shell in {where}"
    check_log_and_metrics(text, run_dir, iterations=3)
    assert "preflight: OK: 4 ranks on 2 node(s) (gloo)" in text
    assert f"--moe-parallel-mode {mode}" in (out / "slurm_test_2x2.sbatch").read_text()

    ranks = json.loads((run_dir / "preflight.json").read_text())["ranks"]
    nodes = [r["node"] for r in ranks]
    # Two ranks per node, node-major: local ranks 0, 1 on the first node, then on the second.
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["component"] for r in ranks] == [0, 0, 0, 0]
    # MASTER_ADDR is the first node's NodeAddr (127.0.0.1 on this cluster; names do not resolve).
    assert re.search(rf"^\[job\] rendezvous 127\.0\.0\.1:\d+ \(node {nodes[0]}\)", text, re.M)


def test_zebra_hetjob_attention_pool_first(cluster, corpus, tmp_path):
    """Zebra on a real hetjob: component 0 = the M = 2 attention ranks, component 1 = the N = 2
    expert ranks (one ZP group), trained from the generated script."""
    out = tmp_path / "out"
    done = submit(cluster, "--run", str(TEST_DATA / "run_cpu_het.yaml"), "--output-dir", str(out), "--wait")
    job_id, text = finished_job(cluster, done, out)
    run_dir = out / job_id
    records = check_log_and_metrics(text, run_dir, iterations=6)
    script = (out / "slurm_test_het.sbatch").read_text()
    assert "--moe-parallel-mode zebra" in script
    assert "--zebra-cluster tests/data/slurm/cluster_cpu_het.yaml" in script
    assert "[job] layout: 1 node(s) x 2 cpu-attention (attention pool) + 1 node(s) x 2 cpu-expert (expert pool)" in text
    assert "preflight: OK: 4 ranks on 2 node(s) (gloo)" in text
    # Training saw the pool's device types (from --zebra-cluster, not a local pool) and the roles.
    assert ("zebra: 1 ZP group(s) of M=2 attention + N=2 expert ranks (cpu-attention / cpu-expert); "
            "R=4 micro-batches per attention rank") in text

    ranks = json.loads((run_dir / "preflight.json").read_text())["ranks"]
    # Ranks 0-1 (zebra's attention ranks) run in component 0 on one node, ranks 2-3 (expert
    # ranks) in component 1 on another; preflight itself checked each rank's node against its
    # component's node list.
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["component"] for r in ranks] == [0, 0, 1, 1]
    assert ranks[0]["node"] == ranks[1]["node"] != ranks[2]["node"] == ranks[3]["node"]
    env_lines = dict(line.split("=", 1) for line in (run_dir / "env.txt").read_text().splitlines())
    assert env_lines["HET_NODES_0"].split() == [ranks[0]["node"]]
    assert env_lines["HET_NODES_1"].split() == [ranks[2]["node"]]
    assert env_lines["SLURM_HET_SIZE"] == "2"

    # Every iteration: the tiny model's 2 MoE layers route global batch 16 x 128 tokens x top-2
    # = 4096 token copies, all of them to the expert ranks (positions 2, 3; Asym-EA is off).
    for record in records:
        zebra = {k: v for k, v in record["zebra"].items() if k not in ("bytes", "memory")}
        assert zebra == {"attention_ranks": 2, "expert_ranks": 2, "zp_groups": 1, "microbatches": 4,
                         "offload_chunks": [0, 0]}
        for layer in record["moe_layers"]:
            assert sum(layer["expert_tokens"]) == 16 * 128 * 2
            attention_tokens, expert_tokens = layer["device_tokens"][:2], layer["device_tokens"][2:]
            assert attention_tokens == [0, 0] and sum(expert_tokens) == 16 * 128 * 2 and min(expert_tokens) > 0
        assert record["zebra"]["bytes"]["a2a_dispatch"] > 0 and record["zebra"]["bytes"]["a2a_combine"] > 0
    # It learns: 6 Adam steps at lr 1e-3 on the embedded corpus (10.83 -> 10.60 when measured).
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.05, losses


def test_failing_job_reports_its_exit_status(cluster, tmp_path):
    """A rank that fails (here: a python that does not exist) fails the step, the script
    (set -e) and the job; `submit.py --wait` returns the job's status."""
    out = tmp_path / "out"
    done = submit(cluster, "--run", str(TEST_DATA / "run_cpu_2x2.yaml"), "--output-dir", str(out), "--wait",
                  env=dict(os.environ, PYTHON="/nonexistent/python"))
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)
    assert done.returncode != 0
    assert f"job {job_id} finished with exit status {done.returncode}" in done.stdout
    text = (out / f"slurm-{job_id}.out").read_text()
    assert re.search(rf"^\[job\] finished .* exit status {done.returncode}$", text, re.M)
    assert "[job] training" not in text  # the preflight step failed first


def test_bad_requests_never_reach_sbatch(cluster, tmp_path):
    before = cluster.jobs_submitted()
    out = tmp_path / "out"
    run, het = str(TEST_DATA / "run_cpu_2x2.yaml"), str(TEST_DATA / "run_cpu_het.yaml")
    cases = {
        (run, "--nodes", "3"): ("nodes=3: more than cluster cluster_cpu_2x2 has (2 node(s) x 2 cpu-rank = 4 GPUs); "
                                "valid: 1..2"),
        (run, "--gpus-per-node", "4"): "gpus_per_node=4: more than the 2 cpu-rank per node of cluster cluster_cpu_2x2",
        (run, "--tensor-model-parallel-size", "3"): "--tensor-model-parallel-size=3:",
        (run, "--expert-model-parallel-size", "3"): "--expert-model-parallel-size=3:",
        (het, "--zebra-expert-ranks", "1"): ("--zebra-expert-ranks=1: 1 ZP group(s) of 2 attention rank(s) need "
                                             "1 x 1 = 1 expert ranks, but component 1 has 2; valid: 2"),
        (het, "--use-distributed-optimizer"): "--use-distributed-optimizer=True: zebra has its own optimizer",
        (het, "--zebra-expert-ranks", "3", "--gpus-per-node", "2,3"): "gpus_per_node=3: more than the 2 cpu-expert",
    }
    for (run_file, *args), message in cases.items():
        done = submit(cluster, "--run", run_file, *args, "--output-dir", str(out), "--wait")
        assert done.returncode == 2, done.stdout + done.stderr
        assert message in done.stderr
    assert cluster.jobs_submitted() == before
    assert not out.exists()


def _gpu_cluster(tmp_path: Path, groups: list[tuple[int, int, str]]) -> Path:
    types = {gpu: {"memory_gb": 40, "peak_fp16_tflops": 100, "hbm_gb_s": 1000, "flash_attention": True,
                   "source": "a test device (fake GPUs made with mknod)"} for _, _, gpu in groups}
    nodes = [{"count": count, "gpus_per_node": per_node, "gpu": gpu, "intra_node_bw_gb_s": 100,
              "intra_node_link": "test", "inter_node_gbps": 100} for count, per_node, gpu in groups]
    path = tmp_path / f"cluster_{len(groups)}.yaml"
    path.write_text(yaml.safe_dump({"name": path.stem, "nodes": nodes, "gpu_types": types}))
    return path


@pytest.mark.parametrize("groups", [[(2, 2, "test-gpu")], [(1, 2, "new-gpu"), (1, 2, "old-gpu")]],
                         ids=["homogeneous", "hetjob"])
def test_gpu_requests_are_accepted_by_slurm(cluster, tmp_path, groups):
    """The #SBATCH lines of a GPU job (nodes, tasks and --gpus-per-node per component) are what
    a real Slurm with GPUs (gres) can schedule: sbatch --test-only, nothing runs."""
    run = yaml.safe_load((TEST_DATA / "run_cpu_2x2.yaml").read_text())
    run["train"].pop("cpu")
    run.update(cluster=str(_gpu_cluster(tmp_path, groups)), mode="ep", slurm={"time": "00:10:00", "exclusive": True})
    path = tmp_path / "run_gpu.yaml"
    path.write_text(yaml.safe_dump(run))
    done = submit(cluster, "--run", str(path), "--output-dir", str(tmp_path / "out"), "--dry-run")
    assert done.returncode == 0, done.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(done.stdout)
    for directive in ("--gpus-per-node=2", "--time=00:10:00", "--exclusive"):
        assert done.stdout.count(f"#SBATCH {directive}\n") == len(groups)
    (tmp_path / "out").mkdir()
    tested = cluster.run(["sbatch", "--test-only", str(script)], check=False)
    assert tested.returncode == 0, tested.stderr
    assert "to start at" in tested.stderr
