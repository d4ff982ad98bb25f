"""Every paper run in configs/runs/ starts: its generated job's pretrain command, with only the
sizes shrunk, trains 3 iterations on 2 local CPU ranks.

Shrunk: the model's sizes (layers, widths, heads, sequence, experts) to the tiny model's, in a
copy of the run's model config that keeps every other model setting (family, normalisation,
activation, position embedding, routing, capacity); the world to 2 local ranks (zebra: one
attention and one expert rank of the CPU pool tests/data/slurm/cluster_cpu_het.yaml); batch, iterations and intervals to a
few (evaluation, re-sharding and checkpointing still run inside the 3 iterations). Everything
else is the run file's, precision included: the V100 runs train in fp16 with loss scaling,
the A100 runs in bf16, and the runs that pass `--save D --load D` start fresh in an empty D.

Runs whose shrunk commands are identical (the 16- and 32-GPU variants of one model family and
precision, the replicate sizes, the zebra pools) share one training run, so the module trains
each distinct command once; every run file's command is computed and checked against it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from support.submit import REPO, expanded_argv, submit
from support.training import launch_many, tensorboard_texts

pytestmark = pytest.mark.e2e

RUN_FILES = sorted((REPO / "configs" / "runs").glob("*.yaml"))
HET_CLUSTER = REPO / "tests" / "data" / "slurm" / "cluster_cpu_het.yaml"
ITERS = 3
RANKS = 2  # the CI machine's 2 cores: 4 ranks would share them
# the tiny model's sizes (configs/models/tiny.yaml), sequence 64
MODEL_SIZES = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "moe_ffn_hidden_size": 128,
               "num_attention_heads": 4, "num_query_groups": 4, "kv_channels": 16, "seq_length": 64,
               "max_position_embeddings": 64, "num_experts": 8}
TRAINING = ["--num-experts", "8", "--train-iters", str(ITERS), "--lr-warmup-iters", "1", "--log-interval", "1",
            "--eval-interval", str(ITERS), "--eval-iters", "1", "--cpu"]
SIZE_FLAGS = {  # set when the run sets them: only then are they part of its command
    "global_batch_size": ["--global-batch-size", "2"],
    "micro_batch_size": ["--micro-batch-size", "1"],
    "save_interval": ["--save-interval", str(ITERS)],
    "fssdp_reshard_interval": ["--fssdp-reshard-interval", "2"],
    "expert_model_parallel_size": ["--expert-model-parallel-size", "2"],
    "zebra_attention_ranks": ["--zebra-attention-ranks", "1"],
    "zebra_expert_ranks": ["--zebra-expert-ranks", "1"],
    "zebra_microbatches": ["--zebra-microbatches", "2"],  # with 1 attention rank: the global batch of 2
}


def shrunk_model(path: Path, workdir: Path) -> Path:
    values = yaml.safe_load(path.read_text())
    assert not isinstance(values.get("moe_layer_freq"), list), f"{path}: a per-layer pattern cannot be shrunk"
    values.update({key: value for key, value in MODEL_SIZES.items() if key in values})
    out = workdir / f"shrunk_{path.stem}.yaml"
    out.write_text(yaml.safe_dump(values))
    return out


def shrunk_command(run_file: Path, workdir: Path) -> list[str]:
    """The pretrain_gpt_moe.py command of `run_file`'s job script, sizes shrunk (module docstring)."""
    run = submit.load_run_config(run_file)
    model = shrunk_model(Path(submit.plan_job(run).model_path), workdir)
    values = {**run.train, **run.mode_flags.get(run.mode, {})}
    training = list(TRAINING)
    for key, flags in SIZE_FLAGS.items():
        if key in values:
            training += flags
    if run.mode == "zebra":
        layout = dict(cluster=str(HET_CLUSTER), nodes=(1, 1), gpus_per_node=(1, 1))
    else:
        layout = dict(cluster="local_cpu", nodes=(1,), gpus_per_node=(2,))
    job = submit.plan_job(run, submit.Overrides(model=str(model), training=tuple(training), **layout))
    assert job.world_size == RANKS
    return expanded_argv(submit.render_script(job), run_dir="RUN_DIR", ckpt_dir="CKPT_DIR")


def command_key(argv: list[str]) -> tuple:
    """What a command trains: its flags as a set (order does not matter) with the --config
    file's contents instead of its path."""
    flags, current = [], None
    for token in argv:
        if token.startswith("--"):
            current = [token]
            flags.append(current)
        else:
            current.append(token)
    config = next(f for f in flags if f[0] == "--config")
    config[1] = Path(config[1]).read_text()
    return tuple(sorted(tuple(f) for f in flags))


@pytest.fixture(scope="module")
def commands(workdir):
    """Distinct shrunk command -> the run files that give it."""
    groups: dict[tuple, list[Path]] = {}
    argv_of: dict[tuple, list[str]] = {}
    for run_file in RUN_FILES:
        argv = shrunk_command(run_file, workdir)
        key = command_key(list(argv))
        groups.setdefault(key, []).append(run_file)
        argv_of[key] = argv
    return [(argv_of[key], files) for key, files in groups.items()]


def test_the_shrunk_commands_keep_the_runs_precision_and_checkpointing(commands):
    for argv, files in commands:
        for run_file in files:
            train = submit.load_run_config(run_file).train
            assert ("--bf16" in argv) == bool(train.get("bf16")) and ("--fp16" in argv) == bool(train.get("fp16"))
            assert ("--save" in argv) == ("save_interval" in train)
            if "--save" in argv:
                assert argv[argv.index("--save") + 1] == argv[argv.index("--load") + 1] == "CKPT_DIR"
    # the cluster A runs (V100) train in fp16, the cluster B and replication runs (A100) in bf16
    precision = {f.stem: ("fp16" if "--fp16" in argv else "bf16" if "--bf16" in argv else "fp32")
                 for argv, files in commands for f in files}
    assert {p for name, p in precision.items() if name.endswith(("_a16", "_a32"))} == {"fp16"}
    assert {p for name, p in precision.items() if name.endswith(("_b16", "_b32")) or name.startswith("replicate")} == {"bf16"}
    assert {p for name, p in precision.items() if name.startswith("zebra")} == {"fp16"}  # V100 and T4: no bf16


def test_every_paper_run_trains_three_iterations(commands, workdir):
    flags_of, names_of = {}, {}
    for index, (argv, files) in enumerate(commands):
        run_dir, ckpt_dir = workdir / f"run{index}", workdir / f"run{index}_checkpoints"
        run_dir.mkdir()
        ckpt_dir.mkdir()  # empty: the first job of a run whose --save and --load are one directory
        flags = [str(run_dir) + t[len("RUN_DIR"):] if t.startswith("RUN_DIR") else str(ckpt_dir) if t == "CKPT_DIR" else t
                 for t in argv]
        log_json = flags.index("--log-json")
        flags_of[f"run{index}"] = flags[:log_json] + flags[log_json + 2:]  # launch_many writes its own
        names_of[f"run{index}"] = ", ".join(f.stem for f in files)
    runs = launch_many(RANKS, flags_of, workdir)  # one spawn (support/multirun.py)
    for index, (argv, files) in enumerate(commands):
        run, names = runs[f"run{index}"], names_of[f"run{index}"]
        run_dir, ckpt_dir = workdir / f"run{index}", workdir / f"run{index}_checkpoints"
        assert [r["iteration"] for r in run.records if "loss" in r] == list(range(1, ITERS + 1)), names
        assert all(math.isfinite(loss) for loss in run.losses), (names, run.losses)
        assert "summary: 3 iterations" in run.output, names
        if "--fp16" in argv and "fssdp" in names:
            # fp16's initial loss scale (2^32) skips the first steps, so the optimizer has no state to
            # move when the shrunk interval (2) asks for a re-shard: it waits (it raised before)
            assert "fssdp: re-shard check at iteration 3 deferred to the next interval: the optimizer has no state yet" \
                in run.output, names
        line = next(x for x in run.output.splitlines() if x.startswith("precision: ")).removeprefix("precision: ")
        assert tensorboard_texts(run_dir / "tensorboard")["run/precision"] == line, names
        want = "float16" if "--fp16" in argv else "bfloat16" if "--bf16" in argv else "float32"
        assert {r["dtypes"]["parameters"] for r in run.records if "loss" in r} == {want}, names
        if "--save" in argv:
            assert "holds no checkpoint yet (it is the --save directory): starting from iteration 0" in run.output, names
            assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS), names
