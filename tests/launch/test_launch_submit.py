"""launch/submit.py without Slurm: every run config dry-runs, scripts are well formed, bad
requests are refused with messages that name the value, and the hetjob rank order.

The real-Slurm side (submitting these scripts) is tests/launch/test_slurm_real.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_patches.config import load_cluster_config
from megatron_patches.placement.zebra import DeviceProfile, ZebraShape, save_device_profile
from megatron_patches.training.arguments import MOE_PARALLEL_MODES
from support.submit import TEST_DATA, expanded_argv, load_module, plan, refused, submit, tiny_run

REPO = Path(__file__).resolve().parents[2]
RUN_FILES = sorted((REPO / "configs" / "runs").glob("*.yaml"))
ZEBRA_RUN_FILES = [path for path in RUN_FILES if path.stem.startswith("zebra_")]


preflight = load_module("launch_preflight", REPO / "launch" / "preflight.py")


def bash_syntax_ok(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------------------------
# Paper runs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.stem)
def test_paper_run_dry_runs_in_its_own_mode(path):
    """Every paper run renders a job script in its own mode."""
    mode = yaml.safe_load(path.read_text())["mode"]
    assert mode in MOE_PARALLEL_MODES
    job = plan(path)
    script = submit.render_script(job)
    bash_syntax_ok(script)
    assert f"--moe-parallel-mode {mode}" in script


@pytest.mark.parametrize("path", ZEBRA_RUN_FILES, ids=lambda p: p.stem)
def test_zebra_paper_run_trains_in_zebra_mode_on_its_pool(path):
    """A zebra paper run is one ZP group over the whole pool: component 0 = the M attention GPUs
    (the cluster's first node group), component 1 = the N expert GPUs; training gets the pool as
    --zebra-cluster, fp16 and the load trace as the other runs, and none of the flags zebra refuses
    (checkpoints, the distributed optimizer)."""
    values = yaml.safe_load(path.read_text())
    cluster = load_cluster_config(values["cluster"])
    job = plan(path)
    script = submit.render_script(job)
    argv = expanded_argv(script)
    m, n = (values["mode_flags"]["zebra"][key] for key in ("zebra_attention_ranks", "zebra_expert_ranks"))
    attention, expert = cluster.nodes
    assert (m, n) == (attention.num_devices, expert.num_devices) and job.world_size == m + n
    assert [(c.gpu.name, c.ranks, c.role) for c in job.components] == [
        (attention.gpu, m, "attention pool"), (expert.gpu, n, "expert pool")]
    assert argv[argv.index("--zebra-cluster") + 1] == values["cluster"] == job.args.zebra_cluster
    for refused_flag in ("--save", "--load", "--use-distributed-optimizer"):
        assert refused_flag not in argv
    assert "--fp16" in argv  # V100 and T4: no bf16
    assert argv[argv.index("--moe-log-loads") + 1].endswith("/loads.npz")
    assert job.zp_groups == 1 and "export ZP_GROUPS=1" in script and f"--het-ranks {m},{n} --zp-groups 1" in script
    # Only the attention ranks read data: global batch = micro-batch x R x M.
    args = job.args
    r = values["mode_flags"]["zebra"]["zebra_microbatches"]
    assert args.data_parallel_size == m and args.global_batch_size == args.micro_batch_size * r * m
    assert (f"# Zebra: world {m + n} = 1 ZP group(s) x ({m} attention + {n} expert ranks); attention ranks "
            f"data-parallel (DP {m}), each expert rank holds {args.num_experts // n} of the {args.num_experts} "
            f"experts of every layer; global batch {args.global_batch_size} = {r} micro-batches x 1 x {m} attention "
            "ranks.") in script
    # The ep baseline (--mode ep) trains the same sequences per iteration, so speedups are like for like.
    baseline = plan(path, mode="ep").args
    assert (baseline.global_batch_size, baseline.seq_length, baseline.micro_batch_size) == (
        args.global_batch_size, args.seq_length, args.micro_batch_size)
    assert re.search(rf"^zebra_args=\(\n  --zebra-attention-ranks {m}\n", script, re.M)


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.stem)
def test_paper_run_as_ep_baseline(path):
    values = yaml.safe_load(path.read_text())
    cluster = load_cluster_config(values["cluster"])
    job = plan(path, mode="ep")
    script = submit.render_script(job)
    bash_syntax_ok(script)

    # World size: the run's nodes (default: all) x the cluster's GPUs per node.
    groups = cluster.nodes
    nodes = values.get("nodes")
    world = nodes * groups[0].gpus_per_node if nodes else cluster.num_devices
    assert job.world_size == world == job.args.world_size
    args = job.args
    assert args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size == world

    # GPU request per component, hetjob exactly when the cluster has several node groups.
    assert script.count("#SBATCH hetjob") == len(groups) - 1
    srun_args = re.search(r"^srun_args=\((.*)\)$", script, re.M).group(1).split()
    assert ("--het-group=0,1" in srun_args) == (len(groups) == 2)
    for component in job.components:
        assert f"#SBATCH --gpus-per-node={component.ranks_per_node}" in script
    assert "--cpu" not in expanded_argv(script)

    # The command line the script runs is the one validated, and the baseline carries no flag of
    # the run's own mode.
    argv = expanded_argv(script)
    tokens = [t.replace("$RUN_DIR", "/out/7").replace("$CKPT_DIR", "/out/checkpoints")
              for f in job.flags for t in f.tokens]
    assert argv == tokens
    assert argv[argv.index("--moe-parallel-mode") + 1] == "ep"
    own_flags = values.get("mode_flags", {}).get(values["mode"], {})
    for dest in own_flags:
        assert "--" + dest.replace("_", "-") not in argv


def test_fssdp_run_cli_dry_run_prints_the_script():
    """The CLI end to end: the script is printed."""
    run = REPO / "configs" / "runs" / "fssdp_gpt_moe_s_b16.yaml"
    done = subprocess.run([sys.executable, "launch/submit.py", "--run", str(run), "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/bin/bash\n")
    done = subprocess.run([sys.executable, "launch/submit.py", "--run", "fssdp_gpt_moe_s_b16", "--mode", "ep",
                           "--train-iters", "70", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--train-iters 70" in done.stdout
    assert "#   python launch/submit.py --run fssdp_gpt_moe_s_b16 --mode ep --train-iters 70 --dry-run" in done.stdout


# ----------------------------------------------------------------------------------------------
# Script structure
# ----------------------------------------------------------------------------------------------


def test_script_follows_the_conventions():
    job = plan(REPO / "configs" / "runs" / "fssdp_gpt_moe_s_b16.yaml", mode="ep")
    script = submit.render_script(job)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    # sbatch reads directives up to the first command: all of them come before `set`.
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert lines[first_command] == "set -eo pipefail"
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:])
    header = "\n".join(lines[:first_command])
    for directive in ("--job-name=fssdp_gpt_moe_s_b16", "--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8",
                      "--time=02:00:00", "--exclusive"):
        assert f"#SBATCH {directive}" in header
    # Knobs with defaults, NCCL settings among them.
    for knob in ("REPO_DIR", "PYTHON", "OUT_DIR", "MASTER_PORT", "PREFLIGHT", "OMP_NUM_THREADS", "NCCL_DEBUG",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert re.search(rf"^(export )?{knob}=\${{{knob}:-", script, re.M), knob
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert "srun_args=(--kill-on-bad-exit=1 --wait=60)" in script
    # Logs: revision, start and end, environment; a preflight step before the training step.
    for text in ("git rev-parse HEAD", "started $(date -Is)", "[job] finished", "env.txt"):
        assert text in script
    assert script.index("launch/preflight.py") < script.index("pretrain_gpt_moe.py \\")
    # Flags grouped in arrays by concern.
    assert "parallelism_args=(--expert-model-parallel-size 16)" in script
    assert "mixed_precision_args=(--bf16)" in script
    assert re.search(r"^training_args=\(\n  --micro-batch-size 1\n  --global-batch-size 16\n  --train-iters 500\n\)$",
                     script, re.M)
    assert '  --log-json "$RUN_DIR"/metrics.jsonl' in script
    assert 'checkpointing_args=(\n  --save-interval 500\n  --save "$CKPT_DIR"\n  --load "$CKPT_DIR"\n)' in script
    assert "--moe-log-loads" in script and "--tensorboard-dir" in script


def test_cpu_run_requests_cpus_and_runs_gloo():
    script = submit.render_script(plan(TEST_DATA / "run_cpu_2x2.yaml"))
    assert "--gpus-per-node" not in script
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in script
    assert "--backend gloo" in script
    assert "--cpu" in expanded_argv(script)
    bash_syntax_ok(script)


def test_hetjob_layout_in_the_script():
    job = plan(REPO / "configs" / "runs" / "zebra_o3.yaml", mode="ep")
    script = submit.render_script(job)
    header = script[:script.index("set -eo pipefail")]
    before, after = header.split("#SBATCH hetjob\n")
    # Component 0 = the attention pool (A40), 2 nodes x 3; component 1 = 1 node x 3 V100.
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=3\n#SBATCH --gpus-per-node=3" in before
    assert "A40-48GB = ranks 0..5" in before
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=3\n#SBATCH --gpus-per-node=3" in after
    assert "V100-SXM2-16GB = ranks 6..8" in after
    assert "--job-name" in before and "--job-name" not in after
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0"' in script
    assert "srun_args=(--kill-on-bad-exit=1 --wait=60 --het-group=0,1)" in script
    assert "--het-ranks 6,3 --zp-groups 1" in script
    assert "export ZP_GROUPS=1" in script


def test_overrides_replace_run_values():
    path = REPO / "configs" / "runs" / "fssdp_gpt_moe_l_a32.yaml"
    job = plan(path, mode="ep", model="gpt_moe_s", nodes=(2,), gpus_per_node=(4,),
               training=["--train-iters", "90", "--expert-model-parallel-size=8", "--lr", "3e-4"])
    argv = [t for f in job.flags for t in f.tokens]
    assert job.world_size == 8
    assert argv.count("--train-iters") == 1 and argv[argv.index("--train-iters") + 1] == "90"
    assert argv[argv.index("--expert-model-parallel-size") + 1] == "8"
    assert job.args.lr == 3e-4 and job.args.train_iters == 90
    assert argv[argv.index("--config") + 1] == "configs/models/gpt_moe_s.yaml"
    script = submit.render_script(job)
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=4\n#SBATCH --gpus-per-node=4" in script


def test_switches_render_as_their_flags():
    """`add_bias_linear: false` is --disable-bias-linear (a store_false flag); a switch already at
    the value it would have without the flag adds nothing."""
    train = tiny_run()["train"]
    job = plan(tiny_run(train={**train, "add_bias_linear": False, "swiglu": False, "sequence_parallel": False}))
    argv = [t for f in job.flags for t in f.tokens]
    assert "--disable-bias-linear" in argv and job.args.add_bias_linear is False
    assert "--swiglu" not in argv and "--sequence-parallel" not in argv
    assert job.args.swiglu is False
    # a --x / --no-x flag (BooleanOptionalAction) renders as the one that sets the value
    off = plan(tiny_run(mode="fssdp", mode_flags={"fssdp": {"fssdp_calibrate": False}}))
    assert "--no-fssdp-calibrate" in [t for f in off.flags for t in f.tokens] and off.args.fssdp_calibrate is False
    on = plan(tiny_run(mode="fssdp", mode_flags={"fssdp": {"fssdp_calibrate": True}}))
    assert not any("calibrate" in t for f in on.flags for t in f.tokens) and on.args.fssdp_calibrate is True
    assert refused(tiny_run(mode="fssdp", mode_flags={"fssdp": {"fssdp_calibrate": "no"}})) == (
        "inline mode_flags.fssdp.fssdp_calibrate='no': expected true or false (--fssdp-calibrate)")


def test_hostile_values_never_run_as_shell(tmp_path):
    """A value reaches the job script quoted, or is refused: `$(...)` after $RUN_DIR stays text
    when bash runs the script's flag arrays, and a newline (which would end a comment line and
    start a command) is refused wherever a name or description is written."""
    marker = tmp_path / "INJECTED"
    job = plan(TEST_DATA / "run_cpu_2x2.yaml", training=["--run-dir", f"$RUN_DIR/$(touch {marker})"])
    script = submit.render_script(job)
    bash_syntax_ok(script)
    assert f"  --run-dir \"$RUN_DIR\"'/$(touch {marker})'" in script
    argv = expanded_argv(script)
    assert argv[argv.index("--run-dir") + 1] == f"/out/7/$(touch {marker})" and not marker.exists()
    for key, value in (("description", "tiny\ntouch /tmp/x"), ("name", "a\rb"), ("output_dir", "out\n$(reboot)")):
        message = refused(tiny_run(**{key: value}))
        assert f"{key}={value!r}: control characters (newlines, tabs, escapes) are not allowed" in message, message
    layout = [line for line in script.splitlines() if "[job] layout" in line]
    assert layout == ["echo '[job] layout: 2 node(s) x 2 cpu-rank = 4 ranks'"], layout


def test_output_dir_and_launcher_outputs(tmp_path):
    job = plan(TEST_DATA / "run_cpu_2x2.yaml", output_dir=str(tmp_path / "out"))
    script = submit.render_script(job)
    assert f"#SBATCH --output={tmp_path}/out/slurm-%j.out" in script
    assert f"OUT_DIR=${{OUT_DIR:-{tmp_path}/out}}" in script
    # No save_interval in this run: no checkpoint flags; no trace, no TensorBoard.
    argv = expanded_argv(script)
    assert "--save" not in argv and "--moe-log-loads" not in argv and "--tensorboard-dir" not in argv
    assert argv[argv.index("--log-json") + 1] == "/out/7/metrics.jsonl"


# ----------------------------------------------------------------------------------------------
# Refusals before sbatch
# ----------------------------------------------------------------------------------------------

A16 = REPO / "configs" / "runs" / "fssdp_gpt_moe_s_a16.yaml"


def test_more_nodes_or_gpus_than_the_cluster_has():
    assert refused(A16, mode="ep", nodes=(8,)) == (
        "nodes=8: more than cluster cluster_a has (4 node(s) x 8 V100-SXM2-32GB = 32 GPUs); valid: 1..4")
    assert refused(A16, mode="ep", gpus_per_node=(16,)) == (
        "gpus_per_node=16: more than the 8 V100-SXM2-32GB per node of cluster cluster_a; valid: 1..8")
    message = refused(REPO / "configs" / "runs" / "zebra_o2.yaml", mode="ep", nodes=(1,))
    assert message.startswith("nodes=[1]: cluster zebra_o2 has 2 node group(s)") and message.endswith("e.g. [1, 2]")
    assert refused(REPO / "configs" / "runs" / "zebra_o2.yaml", mode="ep", nodes=(1, 3)) == (
        "nodes=3: more than node group 1 of cluster zebra_o2 has (2 node(s) x 4 V100-SXM2-16GB = 8 GPUs); valid: 1..2")


def test_inconsistent_parallel_sizes():
    message = refused(A16, mode="ep", training=["--tensor-model-parallel-size", "3"])
    assert message.startswith("training flags at world size 16 (16 ranks): --tensor-model-parallel-size=3:")
    assert "valid: TP x PP in [1, 2, 4, 8, 16]" in message
    message = refused(A16, mode="ep", training=["--expert-model-parallel-size", "32"])
    assert "--expert-model-parallel-size=32" in message and "valid EP here: [1, 2, 4, 8, 16]" in message
    message = refused(A16, mode="ep", training=["--global-batch-size", "20"])
    assert "--global-batch-size=20" in message and "multiples of 16" in message


def test_model_state_must_fit_the_gpu_memory():
    """GPT-MoE-L with 64 experts (configs/models/gpt_moe_l.yaml): 7,446,286,080 parameters,
    7,251,296,256 of them in experts, so 194,989,824 outside; on 2 V100-32GB in the run's fp16
    (fp16 weight and gradient, fp32 main weight and Adam moments: 2 + 2 + 12 B per parameter)."""
    run = REPO / "configs" / "runs" / "fssdp_gpt_moe_l_a32.yaml"
    two_gpus = dict(mode="ep", nodes=(1,), gpus_per_node=(2,))
    # EP 2: (194,989,824 + 7,251,296,256 / 2) x 16 B = 61.13 GB per GPU.
    message = refused(run, **two_gpus, training=["--expert-model-parallel-size", "2", "--global-batch-size", "2"])
    assert message.startswith("model state needs at least 61.1 GB per GPU on every rank, more than the 32 GB of a "
                              "V100-SXM2-32GB (weights, gradients and Adam state of 7.45B parameters, 7.25B of them "
                              "in experts, before activations)")
    # EP 1 with the distributed optimizer: every parameter on both GPUs, main weights and Adam
    # state halved: 7,446,286,080 x (4 + 12 / 2) B = 74.46 GB.
    message = refused(run, **two_gpus, training=["--expert-model-parallel-size", "1", "--global-batch-size", "2",
                                                  "--use-distributed-optimizer"])
    assert message.startswith("model state needs at least 74.5 GB per GPU")
    # with fp32 gradient accumulation the gradient is 4 B: (2 + 4) + 12 / 2 = 12 B, 89.36 GB
    message = refused(run, **two_gpus, training=["--expert-model-parallel-size", "1", "--global-batch-size", "2",
                                                  "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32"])
    assert message.startswith("model state needs at least 89.4 GB per GPU")


def test_model_state_arithmetic_by_hand():
    """The header's lower bound for the tiny model: 3,527,824 parameters, 265,216 in experts
    (configs/models/tiny.yaml), fp32 (16 B each), EP 4: (3,262,608 + 265,216 / 4) x 16 B."""
    job = plan(TEST_DATA / "run_cpu_2x2.yaml")
    expected = (3_262_608 + 265_216 / 4) * 16 / 1e9
    assert job.memory_notes == (f"model state on every rank >= {expected:.2f} GB of 6 GB (cpu-rank; weights + grads "
                                "+ Adam, no activations)",)


def test_unknown_names_and_keys():
    assert refused(tiny_run(model="tinyy")).startswith("unknown model config 'tinyy'; available: ['bert_moe',")
    assert refused(tiny_run(cluster="cluster_c")).startswith(
        "unknown cluster config 'cluster_c'; available: ['cluster_a'")
    message = refused(tiny_run(nodse=2))
    assert message.startswith("inline: unknown key 'nodse' (did you mean nodes, mode, model?); valid keys: name, "
                              "description, model, cluster, mode, nodes,")
    message = refused(tiny_run(train={"trian_iters": 5}))
    assert message == ("inline train: unknown key 'trian_iters' (did you mean train_iters, eval_iters, "
                       "lr_decay_iters?); valid keys are the dest names of pretrain_gpt_moe.py's flags "
                       "(docs/flags.md; --train-iters -> train_iters)")
    message = refused(tiny_run(slurm={"partion": "gpu"}))
    assert message.startswith("inline: slurm: unknown key 'partion' (did you mean partition?)")
    assert refused(tiny_run(mode="fsdp")) == "mode 'fsdp' is unknown; valid: ep, fssdp, replicate, zebra"
    assert refused(tiny_run(mode_flags={"fsdp": {}})) == (
        "inline: mode_flags.fsdp: unknown mode; valid: ep, fssdp, replicate, zebra")
    message = refused(tiny_run(), training=["--trian-iters", "5"])
    assert message == ("command line: --trian-iters is neither a submit.py option nor a flag of pretrain_gpt_moe.py; "
                       "did you mean --train-iters, --eval-iters, --lr-decay-iters?")
    assert refused(tiny_run(name="a b")).startswith("inline: name='a b': use letters, digits")
    assert refused({"name": "x"}).startswith("inline: missing required key(s) ['description', 'model', 'cluster']")


def test_bad_values_and_reserved_flags():
    message = refused(tiny_run(train={"train_iters": "many", "cpu": True}))
    assert message == ("training flags: argument --train-iters: invalid int value: 'many'; valid flags: "
                       "pretrain_gpt_moe.py --help, docs/flags.md (from inline train.train_iters)")
    assert refused(tiny_run(train={"cpu": "yes"})) == "inline train.cpu='yes': expected true or false (--cpu)"
    assert refused(tiny_run(train={"save": "/ckpt"})).startswith(
        "inline train.save: not allowed here; the launcher saves")
    assert refused(tiny_run(), training=["--moe-parallel-mode", "ep"]) == (
        "command line: --moe-parallel-mode is not allowed; use the run config's `mode` key (or --mode)")
    # A switch the model config turns on cannot be turned off from the command line.
    message = refused(tiny_run(model="mixtral_d1", train={"swiglu": False, "cpu": True}))
    assert message.startswith("inline train.swiglu=False: --swiglu can only set it to True")
    # ... and a value the model config sets cannot be unset.
    message = refused(tiny_run(model="gpt_small", train={"moe_expert_capacity_factor": None, "cpu": True}))
    assert message.startswith("inline train.moe_expert_capacity_factor=null: a command line cannot unset it")


def test_data_paths_are_checked_from_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = refused(tiny_run(train={**tiny_run()["train"], "data_path": ["data/missing/prefix"],
                                      "tokenizer_type": "GPT2BPETokenizer"}))
    assert "--data-path=data/missing/prefix: missing data/missing/prefix.bin and data/missing/prefix.idx" in message


# ----------------------------------------------------------------------------------------------
# Zebra layout and the hetjob rank order
# ----------------------------------------------------------------------------------------------


def test_zebra_groups_from_the_component_sizes():
    """Zebra's ModeSpec.replica_groups: its ZP groups from the hetjob components' ranks."""
    from megatron_patches.zebra.config import ZebraConfigError, zp_groups

    args = argparse.Namespace(zebra_attention_ranks=3, zebra_expert_ranks=3)
    assert zp_groups(args, [6, 6]) == 2
    assert zp_groups(argparse.Namespace(), [4, 8]) == 1
    with pytest.raises(ZebraConfigError, match=r"--zebra-attention-ranks=4 does not divide the 6 attention ranks"):
        zp_groups(argparse.Namespace(zebra_attention_ranks=4, zebra_expert_ranks=3), [6, 6])
    with pytest.raises(ZebraConfigError, match=r"2 ZP group\(s\) of 3 attention rank\(s\) need 2 x 2 = 4 expert "
                                               r"ranks, but component 1 has 6; valid: 3"):
        zp_groups(argparse.Namespace(zebra_attention_ranks=3, zebra_expert_ranks=2), [6, 6])
    with pytest.raises(ZebraConfigError, match="needs a cluster with two node groups"):
        zp_groups(args, [4])
    # the launcher says it as its own error: test_zebra_split_must_match_the_hetjob_components


def test_zebra_hetjob_interleaves_zp_groups():
    job = plan(REPO / "configs" / "runs" / "zebra_o1.yaml",
               training=["--zebra-attention-ranks", "3", "--zebra-expert-ranks", "3"])
    script = submit.render_script(job)
    assert job.zp_groups == 2 and "export ZP_GROUPS=2" in script and "--het-ranks 6,6 --zp-groups 2" in script


def task_ranks(sizes: list[int], groups: int) -> list[tuple[int, int]]:
    """(RANK, HET_COMPONENT) that launch/templates/task_env.sh gives each SLURM_PROCID."""
    world = sum(sizes)
    base = {"SLURM_NTASKS": str(world), "SLURM_LOCALID": "0", "ZP_GROUPS": str(groups), "PATH": os.environ["PATH"]}
    if len(sizes) > 1:
        base["SLURM_HET_SIZE"] = str(len(sizes))
        base.update({f"SLURM_NTASKS_HET_GROUP_{c}": str(n) for c, n in enumerate(sizes)})
    out = []
    for procid in range(world):
        done = subprocess.run(["bash", str(REPO / "launch" / "templates" / "task_env.sh"), "bash", "-c",
                               "echo $RANK $HET_COMPONENT $WORLD_SIZE"], env=dict(base, SLURM_PROCID=str(procid)),
                              capture_output=True, text=True, check=True)
        rank, component, world_size = map(int, done.stdout.split())
        assert world_size == world
        out.append((rank, component))
    return out


@pytest.mark.parametrize("sizes,groups", [([4], 1), ([2, 2], 1), ([2, 4], 2), ([6, 3], 3), ([4, 8], 2),
                                          ([4, 8], 4), ([2, 2, 4], 2), ([1, 1], 1)])
def test_task_env_rank_order_matches_the_layout(sizes, groups):
    """Brute force over every task: the ranks are a permutation, each rank's component is the
    one preflight.expected_components (the spec, written the other way round) gives, and
    inside a component the SLURM_PROCID order is kept."""
    placed = task_ranks(sizes, groups)
    ranks = [rank for rank, _ in placed]
    assert sorted(ranks) == list(range(sum(sizes)))
    by_rank = dict(placed)
    assert [by_rank[r] for r in range(sum(sizes))] == preflight.expected_components(sizes, groups)
    for component in range(len(sizes)):
        mine = [rank for rank, c in placed if c == component]
        assert mine == sorted(mine)
    if groups == 1:
        assert ranks == list(range(sum(sizes)))


def test_task_env_refuses_groups_that_do_not_divide():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_HET_SIZE": "2",
           "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "3", "ZP_GROUPS": "2",
           "PATH": os.environ["PATH"]}
    done = subprocess.run(["bash", str(REPO / "launch" / "templates" / "task_env.sh"), "true"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "component 1 has 3 tasks, not divisible by ZP_GROUPS=2" in done.stderr


def test_expected_components_worked_example():
    assert preflight.expected_components([2, 4], 2) == [0, 1, 1, 0, 1, 1]
    assert preflight.expected_components([6, 6], 1) == [0] * 6 + [1] * 6
    with pytest.raises(ValueError, match="component 1 has 3 ranks, not divisible by 2"):
        preflight.expected_components([2, 3], 2)


def test_preflight_layout_problems():
    info = preflight.RankInfo
    good = [info(0, 0, "n1", 0, "cpu"), info(1, 1, "n1", 0, "cpu"),
            info(2, 0, "n2", 1, "cpu"), info(3, 1, "n2", 1, "cpu")]
    nodes = {0: {"n1"}, 1: {"n2"}}
    assert preflight.layout_problems(good, [2, 2], 1, nodes) == []
    # Ranks 1 and 2 swapped: the attention pool's second task got rank 2, the expert pool's first rank 1.
    swapped = [good[0], info(1, 0, "n2", 1, "cpu"), info(2, 1, "n1", 0, "cpu"), good[3]]
    problems = preflight.layout_problems(swapped, [2, 2], 1, nodes)
    assert problems == ["rank 1 on n2 runs in component 1, expected 0", "rank 2 on n1 runs in component 0, expected 1"]
    clash = [info(0, 0, "n1", 0, "cpu"), info(1, 0, "n1", 0, "cpu")]
    assert preflight.layout_problems(clash, None, 1, {}) == ["ranks 0 and 1 both run as local rank 0 on node n1"]
    misplaced = [info(0, 0, "n1", 0, "cpu"), info(1, 0, "n3", 1, "cpu")]
    assert preflight.layout_problems(misplaced, [1, 1], 1, nodes) == [
        "rank 1 runs on n3, which is not a node of component 1 (n2)"]


@pytest.mark.e2e
def test_preflight_on_three_gloo_ranks(tmp_path):
    """The real check on 3 local ranks (torchrun), then a layout it must refuse."""
    out = tmp_path / "preflight.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(REPO / "launch" / "preflight.py"), "--backend", "gloo"]
    done = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["world_size"] == 3
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2] and [r["local_rank"] for r in report["ranks"]] == [0, 1, 2]
    assert "preflight: OK: 3 ranks on 1 node(s) (gloo)" in done.stdout
    # Every rank claims component 0 (HET_COMPONENT from the environment), but --het-ranks 1,2
    # expects ranks 1 and 2 in component 1.
    done = subprocess.run([*cmd, "--het-ranks", "1,2"], env=dict(env, HET_COMPONENT="0"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "preflight: FAILED: rank 1 on" in done.stderr and "runs in component 0, expected 1" in done.stderr


def test_template_placeholders_must_all_be_filled():
    with pytest.raises(submit.SubmitError, match=r"template placeholders \['a', 'b'\] do not match the values \['a'\]"):
        submit.fill_template("@a@ @b@", {"a": "1"})


def test_readme_lists_every_run():
    """The Slurm page (docs/slurm.md) has one command per run config."""
    readme = (REPO / "docs" / "slurm.md").read_text()
    section = readme[readme.index("<!-- cluster-section-start -->"):readme.index("<!-- cluster-section-end -->")]
    for path in RUN_FILES:
        assert f"--run configs/runs/{path.name}" in section, path.name


# ----------------------------------------------------------------------------------------------
# Zebra requests refused before sbatch
# ----------------------------------------------------------------------------------------------

O1 = REPO / "configs" / "runs" / "zebra_o1.yaml"
ZEBRA_DISTOPT = "--use-distributed-optimizer=True: zebra has its own optimizer (AdamW over each rank's own parameters); drop it"


def het_run(**changes) -> dict:
    """An inline zebra run of the tiny model on the 2-component CPU test pool (M = N = 2)."""
    run = yaml.safe_load((TEST_DATA / "run_cpu_het.yaml").read_text())
    run.update(changes)
    return run


def test_zebra_refusals_name_the_run_key_that_caused_them():
    """Flags zebra refuses (the distributed optimizer) fail in validate_args; the message says which
    key of the run config produced the flag. A load trace and checkpoints are fine."""
    flags = yaml.safe_load((TEST_DATA / "run_cpu_het.yaml").read_text())["mode_flags"]["zebra"]
    assert refused(het_run(mode_flags={"zebra": {**flags, "use_distributed_optimizer": True}})) == (
        f"training flags at world size 4 (2 + 2 ranks): {ZEBRA_DISTOPT} (from inline mode_flags.zebra.use_distributed_optimizer)")
    assert plan(het_run(trace=True)).args.moe_log_loads == "$RUN_DIR/loads.npz"
    train = yaml.safe_load((TEST_DATA / "run_cpu_het.yaml").read_text())["train"]
    assert plan(het_run(train={**train, "save_interval": 3})).args.save == "$CKPT_DIR"
    assert refused(O1, training=["--use-distributed-optimizer"]).endswith("drop it (from command line)")
    # The same settings are fine for the ep baseline of the same hetjob.
    assert plan(het_run(trace=True), mode="ep").args.moe_log_loads == "$RUN_DIR/loads.npz"


def test_zebra_split_must_match_the_hetjob_components():
    assert refused(het_run(), training=["--zebra-attention-ranks", "3"]) == (
        "--zebra-attention-ranks=3 does not divide the 2 attention ranks (component 0); valid: divisors of 2")
    assert refused(O1, training=["--zebra-expert-ranks", "3"]) == (
        "--zebra-expert-ranks=3: 1 ZP group(s) of 6 attention rank(s) need 1 x 3 = 3 expert ranks, but component 1 "
        "has 6; valid: 6")
    assert refused(het_run(), nodes=(1, 1), gpus_per_node=(2, 1)) == (
        "--zebra-expert-ranks=2: 1 ZP group(s) of 2 attention rank(s) need 1 x 2 = 2 expert ranks, but component 1 "
        "has 1; valid: 1")
    message = refused(tiny_run(mode="zebra", mode_flags=het_run()["mode_flags"]))
    assert message == ("mode zebra needs a cluster with two node groups (attention GPUs first, then expert GPUs); "
                       "this one has 1")


def test_zebra_model_must_fit_the_pool():
    """Mixtral-D3's 40 experts do not divide over O1's 6 expert GPUs; Mixtral-W2's experts
    (4 layers x 24 x 3 x 2048 x 7168 = 4,227,858,432 parameters) over O3's 3 V100-16GB are
    4,227,858,432 / 3 x 16 B = 22.5 GB of model state per GPU (fp16 weights and gradients, fp32
    main weights and Adam moments)."""
    message = refused(O1, model="mixtral_d3")
    assert message.startswith("training flags at world size 12 (6 + 6 ranks): --zebra-expert-ranks=6 does not divide "
                              "the 40 experts per layer: every expert rank must hold the same number; valid: "
                              "[1, 2, 4, 5, 8, 10, 20, 40] (from ")
    message = refused(REPO / "configs" / "runs" / "zebra_o3.yaml", model="mixtral_w2")
    assert message.startswith("model state needs at least 22.5 GB per GPU on component 1 (expert pool), more than the "
                              "16 GB of a V100-SXM2-16GB")


def test_zebra_pool_check_sees_the_clusters_gpu_types(tmp_path):
    """--zebra-cluster carries the run's cluster into training's pool check: a pool that lists the
    faster GPUs second would put the attention ranks on the slower ones, refused before sbatch
    (an ep job on the same pool is fine)."""
    cluster = yaml.safe_load((TEST_DATA / "cluster_cpu_het.yaml").read_text())
    cluster["name"] = "slow_first"
    cluster["gpu_types"]["cpu-attention"]["peak_fp16_tflops"] = 0.01
    path = tmp_path / "slow_first.yaml"
    path.write_text(yaml.safe_dump(cluster))
    assert refused(het_run(cluster=str(path))) == (
        "training flags at world size 4 (2 + 2 ranks): ZP group 0: attention rank 0 runs on a cpu-attention "
        "(0.01 TFLOP/s fp16) but expert rank 2 on a faster cpu-expert (0.0375 TFLOP/s); the attention ranks must be "
        "the newer, faster GPUs: list their node group first in the cluster config")
    assert plan(het_run(cluster=str(path)), mode="ep").world_size == 4
    # A cluster outside configs/clusters reaches training as a path (repository-relative inside it).
    job = plan(het_run())
    assert job.args.zebra_cluster == "tests/data/slurm/cluster_cpu_het.yaml"
    assert refused(het_run(mode_flags={"zebra": {"zebra_cluster": "zebra_o1"}})).startswith(
        "inline mode_flags.zebra.zebra_cluster: not allowed here; zebra mode gets the run's cluster config")
    assert refused(O1, training=["--zebra-cluster", "zebra_o2"]) == (
        "command line: --zebra-cluster is not allowed; zebra mode gets the run's cluster config (its `cluster` key or "
        "--cluster) from the launcher")


def test_zebra_profile_is_read_for_the_pools_gpu_types(tmp_path):
    """--zebra-asym-ea auto reads the profile's entries for the pool's GPU types (A40-48GB
    attention, V100-SXM2-16GB expert on O1); a profile of other types is refused before sbatch."""
    shape = ZebraShape(num_layers=8, num_experts=24, attention_ranks=6, expert_ranks=6)  # Mixtral-D1 on O1
    profile = tmp_path / "o1.json"
    save_device_profile(profile, shape, DeviceProfile("A40-48GB", 1.0, 1.5, 64, None))
    save_device_profile(profile, shape, DeviceProfile("V100-SXM2-16GB", None, 3.0, None, 64))
    job = plan(O1, training=["--zebra-asym-ea", "auto", "--zebra-profile", str(profile)])
    assert job.memory_notes[1] == ("model state on component 1 (expert pool) not estimated: Asym-EA decides at "
                                   "start-up how many experts move")
    cpu = tmp_path / "cpu.json"
    save_device_profile(cpu, shape, DeviceProfile("cpu", 1.0, 1.5, 64, 64))
    message = refused(O1, training=["--zebra-asym-ea", "auto", "--zebra-profile", str(cpu)])
    assert message == (f"training flags at world size 12 (6 + 6 ranks): --zebra-profile {cpu}: {cpu} has no "
                       "measurements for attention device type 'A40-48GB' (profiled types: ['cpu']) "
                       "(from command line)")


def test_exit_signal_handler_asks_slurm_for_its_signal_before_the_time_limit():
    """--exit-signal-handler pairs with #SBATCH --signal: Slurm signals every task before the time
    limit, the ranks save and exit 0 (tests/training/test_exits.py); a signal without the handler, or another
    signal than --exit-signal, would end the ranks without a checkpoint: refused."""
    train = tiny_run()["train"]
    script = submit.render_script(plan(tiny_run(train={**train, "exit_signal_handler": True})))
    assert "#SBATCH --signal=TERM@300" in script and "  --exit-signal-handler" in script
    usr1 = plan(tiny_run(train={**train, "exit_signal_handler": True, "exit_signal": "SIGUSR1"},
                         slurm={"signal": "USR1@600"}))
    assert "#SBATCH --signal=USR1@600" in submit.render_script(usr1)
    assert "#SBATCH --signal" not in submit.render_script(plan(tiny_run()))
    assert "without the training flag exit_signal_handler" in refused(tiny_run(slurm={"signal": "TERM@300"}))
    assert "is not --exit-signal SIGTERM" in refused(tiny_run(train={**train, "exit_signal_handler": True},
                                                              slurm={"signal": "USR1@300"}))
