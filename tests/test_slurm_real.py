"""The generated Slurm scripts on a real Slurm: a single-machine cluster of virtual nodes
(tests/slurm_cluster.py: installed with apt-get when missing, started here, stopped by PID).

- a homogeneous job: 2 nodes x 2 CPU ranks, the tiny GPT-MoE on the embedded corpus, 3 iterations
  (fssdp once that mode exists, ep until then);
- a 2-component hetjob (attention pool, expert pool; 1 node x 2 ranks each): zebra once it
  exists, until then ep across both components, which already exercises the hetjob mechanics:
  rank order, component derived from SLURM_NTASKS_HET_GROUP_<n>, MASTER_ADDR of component 0;
- a failing job's exit status reaches `submit.py --wait`;
- bad requests are refused by submit.py before anything reaches sbatch;
- GPU requests (fake mknod GPUs) are accepted by Slurm as generated (`sbatch --test-only`).

Each job is checked through what it leaves behind: exit status (`sbatch --wait`), the log (git
revision, start/end, preflight table, `summary:` line), preflight.json (which rank ran where)
and metrics.jsonl (finite losses). Run alone with `pytest -m slurm`.
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
from slurm_cluster import SlurmUnavailable, missing_programs, start_cluster

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = REPO / "tests" / "data" / "slurm"

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0 and missing_programs():
        pytest.skip(f"Slurm is not installed ({missing_programs()}) and installing it needs root")
    try:
        slurm = start_cluster(tmp_path_factory.mktemp("slurm"), nodes=4, cpus_per_node=4, gpus_per_node=2)
    except SlurmUnavailable as error:
        pytest.fail(f"could not start a single-machine Slurm: {error}")
    yield slurm
    slurm.stop()


@pytest.fixture(scope="module")
def corpus():
    """Prepare the embedded corpus once, before any job, so that ranks never build it at once."""
    from megatron_patches.training.corpus import ensure_default_corpus

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


def check_log_and_metrics(text: str, run_dir: Path, iterations: int) -> None:
    assert re.search(r"^\[job\] git revision [0-9a-f]{40}", text, re.M)
    assert re.search(r"^\[job\] \S+ \(job \d+\) started \d{4}-\d\d-\d\dT", text, re.M)
    assert re.search(r"^\[job\] finished \d{4}-\d\d-\d\dT.* exit status 0$", text, re.M)
    assert re.search(rf"^summary: {iterations} iterations \| loss [0-9.]+ -> [0-9.]+", text, re.M)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["iteration"] for r in records if "loss" in r] == list(range(1, iterations + 1))
    assert all(math.isfinite(loss) and 0 < loss < 20 for loss in losses)
    assert "SLURM_JOB_ID=" in (run_dir / "env.txt").read_text()


def test_homogeneous_job_on_two_nodes(cluster, corpus, tmp_path):
    mode = "fssdp" if "fssdp" in MOE_PARALLEL_MODES else "ep"
    out = tmp_path / "out"
    done = submit(cluster, "--run", str(TEST_DATA / "run_cpu_2x2.yaml"), "--mode", mode,
                  "--output-dir", str(out), "--wait")
    job_id, text = finished_job(cluster, done, out)
    run_dir = out / job_id
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


def test_hetjob_attention_pool_first(cluster, corpus, tmp_path):
    mode = "zebra" if "zebra" in MOE_PARALLEL_MODES else "ep"
    out = tmp_path / "out"
    done = submit(cluster, "--run", str(TEST_DATA / "run_cpu_het.yaml"), "--mode", mode,
                  "--output-dir", str(out), "--wait")
    job_id, text = finished_job(cluster, done, out)
    run_dir = out / job_id
    check_log_and_metrics(text, run_dir, iterations=3)
    assert "[job] layout: 1 node(s) x 2 cpu-attention" in text and "+ 1 node(s) x 2 cpu-expert" in text
    assert "preflight: OK: 4 ranks on 2 node(s) (gloo)" in text

    ranks = json.loads((run_dir / "preflight.json").read_text())["ranks"]
    # Component 0 (attention pool) holds ranks 0-1 on one node, component 1 ranks 2-3 on another;
    # preflight itself checked each rank's node against its component's node list.
    assert [r["component"] for r in ranks] == [0, 0, 1, 1]
    assert ranks[0]["node"] == ranks[1]["node"] != ranks[2]["node"] == ranks[3]["node"]
    env_lines = dict(line.split("=", 1) for line in (run_dir / "env.txt").read_text().splitlines())
    assert env_lines["HET_NODES_0"].split() == [ranks[0]["node"]]
    assert env_lines["HET_NODES_1"].split() == [ranks[2]["node"]]
    assert env_lines["SLURM_HET_SIZE"] == "2"


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
    run = str(TEST_DATA / "run_cpu_2x2.yaml")
    cases = {
        ("--nodes", "3"): ("nodes=3: more than cluster cluster_cpu_2x2 has (2 node(s) x 2 cpu-rank = 4 GPUs); "
                           "valid: 1..2"),
        ("--gpus-per-node", "4"): "gpus_per_node=4: more than the 2 cpu-rank per node of cluster cluster_cpu_2x2",
        ("--tensor-model-parallel-size", "3"): "--tensor-model-parallel-size=3:",
        ("--expert-model-parallel-size", "3"): "--expert-model-parallel-size=3:",
    }
    for args, message in cases.items():
        done = submit(cluster, "--run", run, *args, "--output-dir", str(out), "--wait")
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
