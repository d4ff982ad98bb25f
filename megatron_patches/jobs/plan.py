"""Run configs (configs/runs/*.yaml) and the Slurm job each one plans to: the schema, its
checks and `plan_job`, importable by the launcher (launch/submit.py, which renders and submits
the job script) and the tools (tools/simulate.py --run reads a run as the launcher does).

A run config (`RunConfig`) names a model config, a cluster config, the MoE parallel mode, the
nodes to use and the training flags, so a run file alone describes the job. `Overrides` holds
what the launcher's command line replaces (`--model`, `--cluster`, `--mode`, `--nodes`,
`--gpus-per-node`, `--output-dir`, and any flag of pretrain_gpt_moe.py).

Everything is checked before a job exists, each error naming the value and what would be valid:
the run config's keys, the model and cluster names, that the mode is registered
(training/modes.py), that the job asks for no more nodes or GPUs per node than the cluster has,
the training flags and their TP x PP x DP x EP arithmetic (training.validation.validate_args on
the exact command line the job will run, at the job's world size), that the model state fits
the GPUs' memory, and for zebra the attention/expert rank split of the hetjob components.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from megatron_patches.config import (
    ClusterConfig,
    ConfigError,
    GpuType,
    available_clusters,
    count_parameters,
    load_cluster_config,
)
from megatron_patches.config.clusters import CLUSTERS_DIR
from megatron_patches.config.flags import moe_layer_freq
from megatron_patches.config.models import (
    MODELS_DIR,
    available_models,
    model_config_from_args,
    read_yaml_mapping,
    resolve_config_path,
)
from megatron_patches.sim.costs import Precision
from megatron_patches.training import arguments, modes, validation
from megatron_patches.training.yaml_config import is_bool_flag

REPO = Path(__file__).resolve().parents[2]
"""The repository (the package is installed in editable mode): configs/, launch/, the entry point."""
RUNS_DIR = REPO / "configs" / "runs"


# Flags the launcher sets itself (output layout) or that the run config holds under its own key.
RESERVED_FLAGS = {
    "config": "name the model with the run config's `model` key (or --model)",
    "moe_parallel_mode": "use the run config's `mode` key (or --mode)",
    "save": "the launcher saves to <output_dir>/checkpoints when save_interval is set",
    "load": "the launcher resumes from <output_dir>/checkpoints when save_interval is set",
    "log_json": "the launcher writes <output_dir>/<job id>/metrics.jsonl",
    "tensorboard_dir": "set `tensorboard: true` (writes <output_dir>/<job id>/tensorboard)",
    "moe_log_loads": "set `trace: true` (writes <output_dir>/<job id>/loads.npz)",
    "zebra_cluster": "zebra mode gets the run's cluster config (its `cluster` key or --cluster) from the launcher",
}


# Shell variables of the job script that launcher-set flag values refer to.
SCRIPT_VARIABLES = ("$RUN_DIR", "$CKPT_DIR")


class SubmitError(ValueError):
    """A run that cannot be submitted; the message names the value and what would be valid."""


@dataclass(frozen=True)
class SlurmOptions:
    """sbatch options of the job (or of one hetjob component); None = the cluster's default."""

    time: str | None = None
    """Wall-clock limit, e.g. "04:00:00" (`--time`)."""
    partition: str | None = None
    """Partition (`--partition`)."""
    account: str | None = None
    """Account to charge (`--account`)."""
    qos: str | None = None
    """Quality of service (`--qos`)."""
    constraint: str | None = None
    """Node features, e.g. "a40" to pick a hetjob component's GPU type (`--constraint`)."""
    reservation: str | None = None
    """Reservation (`--reservation`)."""
    exclusive: bool = False
    """Whole nodes, shared with no other job (`--exclusive`)."""
    cpus_per_task: int | None = None
    """CPU cores per rank (`--cpus-per-task`; also given to srun, which does not inherit it)."""
    mem: str | None = None
    """Memory per node, e.g. "0" = all of it (`--mem`)."""
    signal: str | None = None
    """A signal to the tasks before the time limit, e.g. "TERM@300" (`--signal`). Only with the
    training flag exit_signal_handler, which sets TERM@300 (its --exit-signal) when this is unset."""

    def sbatch_lines(self) -> list[str]:
        """The `#SBATCH` lines of the options that are set, in field order."""
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            option = "--" + f.name.replace("_", "-")
            if value is True:
                lines.append(f"#SBATCH {option}")
            elif value not in (None, False):
                lines.append(f"#SBATCH {option}={value}")
        return lines

    def merged(self, other: "SlurmOptions") -> "SlurmOptions":
        """These options with every option that `other` sets replaced by its value."""
        changes = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)
                   if getattr(other, f.name) not in (None, False)}
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RunConfig:
    """One experiment: what to train, where, how; a YAML file under configs/runs/."""

    name: str
    """Job name and default output folder (runs/<name>); letters, digits, '.', '_', '-'."""
    description: str
    """What the run reproduces (paper, table/figure, setting); printed at the top of the script."""
    model: str
    """Model config: a name under configs/models or a .yaml path (relative: to the repository)."""
    cluster: str
    """Cluster config: a name under configs/clusters or a .yaml path (relative: to the repository)."""
    mode: str = "ep"
    """--moe-parallel-mode: one of the registered modes (training/modes.py)."""
    nodes: tuple[int, ...] | None = None
    """Nodes to use per node group of the cluster (an int for a one-group cluster); None = all."""
    gpus_per_node: tuple[int, ...] | None = None
    """Ranks per node per node group; None = every GPU of the node."""
    output_dir: str | None = None
    """Where the job writes (relative: to the repository); None = runs/<name>."""
    trace: bool = False
    """Write the expert-load trace (--moe-log-loads <job dir>/loads.npz)."""
    tensorboard: bool = False
    """Write TensorBoard events (--tensorboard-dir <job dir>/tensorboard)."""
    train: Mapping[str, Any] = field(default_factory=dict)
    """pretrain_gpt_moe.py flags by dest name (as in a --config YAML): parallel sizes, batch,
    iterations, data, precision, ... They override the model config."""
    mode_flags: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per mode, flags used only when the run trains in that mode (so `--mode ep` gives the
    baseline on otherwise identical settings)."""
    slurm: SlurmOptions = SlurmOptions()
    """sbatch options of the job (every component of a hetjob)."""
    slurm_components: tuple[SlurmOptions, ...] = ()
    """Per hetjob component (node group order), options replacing `slurm`'s, e.g. a partition
    or constraint that selects the component's GPU type."""
    source: str = "<dict>"
    """The file this config was read from, for messages."""


_RUN_FIELDS = [f.name for f in dataclasses.fields(RunConfig) if f.name != "source"]


_RUN_REQUIRED = [f.name for f in dataclasses.fields(RunConfig) if f.default is dataclasses.MISSING
                 and f.default_factory is dataclasses.MISSING]


_SLURM_FIELDS = [f.name for f in dataclasses.fields(SlurmOptions)]


def _unknown_key(where: str, key: Any, valid: list[str]) -> SubmitError:
    close = difflib.get_close_matches(str(key), valid, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return SubmitError(f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(valid)}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SubmitError(f"{where}={value!r}: expected a non-empty string")
    if has_control_characters(value):
        raise SubmitError(f"{where}={value!r}: control characters (newlines, tabs, escapes) are not allowed; the value "
                          "is written into the job script: one line of printable text")
    return value


def has_control_characters(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _counts(value: Any, where: str) -> tuple[int, ...] | None:
    """An int or a list of ints (one per node group) as a tuple; None stays None."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in items):
        raise SubmitError(f"{where}={value!r}: expected a positive integer, or a list of them (one per node group)")
    return tuple(items)


def _flag_mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise SubmitError(f"{where}: expected a mapping of training flag dest names to values, got {value!r}")
    return dict(value)


def _slurm_options(value: Any, where: str) -> SlurmOptions:
    if value is None:
        return SlurmOptions()
    if not isinstance(value, dict):
        raise SubmitError(f"{where}: expected a mapping of sbatch options, got {value!r}")
    for key in value:
        if key not in _SLURM_FIELDS:
            raise _unknown_key(where, key, _SLURM_FIELDS)
    options = dict(value)
    for key, item in options.items():
        if key == "exclusive":
            if not isinstance(item, bool):
                raise SubmitError(f"{where}.exclusive={item!r}: expected true or false")
        elif key == "cpus_per_task":
            if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                raise SubmitError(f"{where}.cpus_per_task={item!r}: expected a positive integer")
        elif item is not None:
            plain = isinstance(item, (str, int)) and not isinstance(item, bool)
            if not plain or not re.fullmatch(r"[\w:.,|&=+@-]+", str(item)):
                raise SubmitError(f"{where}.{key}={item!r}: expected a plain sbatch value (letters, digits, :.,|&=+@-)")
            options[key] = str(item)
    return SlurmOptions(**options)


def run_config_from_dict(values: Any, source: str = "<dict>") -> RunConfig:
    """Check and convert a parsed run YAML; SubmitError naming the key otherwise."""
    if not isinstance(values, dict):
        raise SubmitError(f"{source}: a run config is a mapping of keys to values, got {type(values).__name__}")
    for key in values:
        if key not in _RUN_FIELDS:
            raise _unknown_key(source, key, _RUN_FIELDS)
    missing = [key for key in _RUN_REQUIRED if key not in values]
    if missing:
        raise SubmitError(f"{source}: missing required key(s) {missing}")
    name = _text(values["name"], f"{source}: name")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SubmitError(f"{source}: name={name!r}: use letters, digits, '.', '_' and '-' only "
                          "(it names the job and a folder)")
    mode = _text(values.get("mode", "ep"), f"{source}: mode")
    mode_flags = {}
    for flag_mode, flags in _flag_mapping(values.get("mode_flags"), f"{source}: mode_flags").items():
        if flag_mode not in arguments.MOE_PARALLEL_MODES:
            raise SubmitError(f"{source}: mode_flags.{flag_mode}: unknown mode; valid: {', '.join(arguments.MOE_PARALLEL_MODES)}")
        mode_flags[flag_mode] = _flag_mapping(flags, f"{source}: mode_flags.{flag_mode}")
    for key in ("trace", "tensorboard"):
        if not isinstance(values.get(key, False), bool):
            raise SubmitError(f"{source}: {key}={values[key]!r}: expected true or false")
    components = values.get("slurm_components") or []
    if not isinstance(components, list):
        raise SubmitError(f"{source}: slurm_components: expected a list with one mapping per node group")
    output_dir = values.get("output_dir")
    return RunConfig(
        name=name,
        description=_text(values["description"], f"{source}: description"),
        model=_text(values["model"], f"{source}: model"),
        cluster=_text(values["cluster"], f"{source}: cluster"),
        mode=mode,
        nodes=_counts(values.get("nodes"), f"{source}: nodes"),
        gpus_per_node=_counts(values.get("gpus_per_node"), f"{source}: gpus_per_node"),
        output_dir=None if output_dir is None else _text(output_dir, f"{source}: output_dir"),
        trace=values.get("trace", False),
        tensorboard=values.get("tensorboard", False),
        train=_flag_mapping(values.get("train"), f"{source}: train"),
        mode_flags=mode_flags,
        slurm=_slurm_options(values.get("slurm"), f"{source}: slurm"),
        slurm_components=tuple(_slurm_options(c, f"{source}: slurm_components[{i}]") for i, c in enumerate(components)),
        source=source,
    )


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run config: a path, or a name under configs/runs (e.g. "fssdp_gpt_moe_s_a16")."""
    names = sorted(p.stem for p in RUNS_DIR.glob("*.yaml"))
    try:
        resolved = resolve_config_path(path, RUNS_DIR, names, "run")
        return run_config_from_dict(read_yaml_mapping(resolved), source=str(path))
    except ConfigError as error:
        raise SubmitError(str(error)) from None


@dataclass(frozen=True)
class Flag:
    """One flag of pretrain_gpt_moe.py's command line."""

    dest: str
    """The flag's argparse dest (the YAML key), e.g. "train_iters"."""
    tokens: tuple[str, ...]
    """The option and its values, unquoted, e.g. ("--train-iters", "500")."""
    source: str
    """Where it came from, e.g. "configs/runs/x.yaml train.train_iters" or "command line"."""

    def shell(self) -> str:
        """The tokens quoted for bash. A value that starts with a job-script variable keeps the
        variable expandable ("$RUN_DIR") and the rest single-quoted: nothing else in it expands
        (a `$(...)` in a value stays text)."""
        return " ".join(_shell_word(t) for t in self.tokens)


def _shell_word(token: str) -> str:
    variable = next((v for v in SCRIPT_VARIABLES if token.startswith(v)), None)
    if variable is None:
        return shlex.quote(token)
    rest = token[len(variable):]
    return f'"{variable}"' + (shlex.quote(rest) if rest else "")




def _flags_from_mapping(values: Mapping[str, Any], actions: dict[str, argparse.Action], model_values: dict,
                        where: str) -> list[Flag]:
    """Flags for `dest: value` pairs of a run config (train or mode_flags.<mode>)."""
    flags = []
    for dest, value in values.items():
        if dest in RESERVED_FLAGS:
            raise SubmitError(f"{where}.{dest}: not allowed here; {RESERVED_FLAGS[dest]}")
        if dest not in actions:
            valid = sorted(d for d in actions if d not in RESERVED_FLAGS)
            close = difflib.get_close_matches(dest, valid, n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SubmitError(f"{where}: unknown key {dest!r}{hint}; valid keys are the dest names of "
                              "pretrain_gpt_moe.py's flags (docs/flags.md; --train-iters -> train_iters)")
        action = actions[dest]
        option = action.option_strings[0]
        # What the flag's dest holds when the flag is left out: the model config's value, else the default.
        without = model_values.get(dest, action.default)
        if is_bool_flag(action):
            if not isinstance(value, bool):
                raise SubmitError(f"{where}.{dest}={value!r}: expected true or false ({option})")
            if value == without:
                continue
            if isinstance(action, argparse.BooleanOptionalAction):
                option = action.option_strings[0 if value else 1]  # --x / --no-x
            elif value != action.const:
                raise SubmitError(f"{where}.{dest}={value!r}: {option} can only set it to {action.const}, and "
                                  f"without it the value is {without}; use a model config with {dest}: {value}")
            tokens: tuple[str, ...] = (option,)
        elif value is None:
            if without is None:
                continue
            raise SubmitError(f"{where}.{dest}=null: a command line cannot unset it (the model config sets "
                              f"{without!r}); use a model config without {dest}")
        elif isinstance(value, list) and action.nargs in ("*", "+"):
            tokens = (option, *(str(item) for item in value))
        elif isinstance(value, (dict, bool)) or (
                isinstance(value, list) and action.type is not moe_layer_freq):
            raise SubmitError(f"{where}.{dest}={value!r}: expected a single value for {option}")
        else:
            tokens = (option, str(value))
        flags.append(Flag(dest, tokens, f"{where}.{dest}"))
    return flags


def _flags_from_command_line(tokens: list[str], parser: argparse.ArgumentParser) -> list[Flag]:
    """Training-flag overrides as given after submit.py's own options, e.g. --train-iters 50."""
    options = parser._option_string_actions
    flags = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise SubmitError(f"command line: {token!r} is not a flag; training flags are written --name value")
        option, _, inline = token.partition("=")
        if option not in options or option in ("-h", "--help"):
            close = difflib.get_close_matches(option, [o for o in options if o.startswith("--")], n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise SubmitError(f"command line: {option} is neither a submit.py option nor a flag of "
                              f"pretrain_gpt_moe.py{hint}")
        values = [inline] if inline else []
        i += 1
        while i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        dest = options[option].dest
        if dest in RESERVED_FLAGS:
            raise SubmitError(f"command line: {option} is not allowed; {RESERVED_FLAGS[dest]}")
        flags.append(Flag(dest, (option, *values), "command line"))
    return flags


def _merge(*layers: list[Flag]) -> list[Flag]:
    """Flags of later layers replace earlier flags with the same dest; order of first appearance kept."""
    merged: dict[str, Flag] = {}
    for layer in layers:
        for flag in layer:
            merged[flag.dest] = flag
    return list(merged.values())


def _parse_training_flags(argv: list[str], flags: list[Flag]) -> argparse.Namespace:
    """arguments.parse_args on the job's command line; its refusals (a value of the wrong type,
    bad YAML) become SubmitError naming where the offending flag came from."""
    try:
        return arguments.parse_args(argv)
    except arguments.ArgumentError as error:
        message = str(error)
        option = re.search(r"argument (--[\w-]+)", message)
        sources = [f.source for f in flags if option and f.tokens[0] == option.group(1)]
        raise SubmitError(f"training flags: {message}" + (f" (from {sources[-1]})" if sources else "")) from None


@dataclass(frozen=True)
class Component:
    """The nodes of one node group that the job uses (one hetjob component)."""

    index: int
    """Component number (node group order); 0 in a homogeneous job."""
    nodes: int
    """Nodes of this group in the job."""
    ranks_per_node: int
    """Tasks per node: one per GPU (GPU runs) or per CPU rank."""
    gpu: GpuType
    """The group's device type, with its memory."""
    role: str
    """What its ranks do (`ModeSpec.component_roles`: zebra's "attention pool", "expert pool"); "" otherwise."""
    first_rank: int
    """Global rank of its first task in SLURM_PROCID order."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def label(self) -> str:
        """"component 1 (expert pool)", for messages and comments."""
        return f"component {self.index}" + (f" ({self.role})" if self.role else "")


@dataclass(frozen=True)
class Overrides:
    """What the command line changes in a run config (None = keep the run config's value)."""

    model: str | None = None
    """--model NAME|PATH."""
    cluster: str | None = None
    """--cluster NAME|PATH."""
    mode: str | None = None
    """--mode MODE."""
    nodes: tuple[int, ...] | None = None
    """--nodes N or N,M,... (one per node group)."""
    gpus_per_node: tuple[int, ...] | None = None
    """--gpus-per-node N or N,M,..."""
    output_dir: str | None = None
    """--output-dir DIR (relative: to the current directory)."""
    training: tuple[str, ...] = ()
    """Training flags of pretrain_gpt_moe.py, e.g. ("--train-iters", "50")."""


@dataclass(frozen=True)
class Job:
    """A checked job: everything the script template needs."""

    run: RunConfig
    """The run config it came from."""
    mode: str
    """MoE parallel mode."""
    model_path: Path
    """Model config file (absolute)."""
    cluster: ClusterConfig
    """The cluster config."""
    components: tuple[Component, ...]
    """One per node group used; several = a hetjob."""
    flags: tuple[Flag, ...]
    """pretrain_gpt_moe.py's command line, --config first."""
    args: argparse.Namespace
    """The validated training arguments (validate_args at world_size)."""
    backend: str
    """torch.distributed backend of the job: nccl on GPUs, gloo on CPU ranks."""
    zp_groups: int
    """Zebra ZP groups the hetjob ranks are interleaved into; 1 otherwise."""
    memory_notes: tuple[str, ...]
    """One line per component: model-state lower bound against the device memory."""
    output_dir: Path
    """Absolute output folder."""
    slurm: tuple[SlurmOptions, ...]
    """sbatch options per component."""
    command_line: str
    """The submit.py command that regenerates this job."""

    @property
    def world_size(self) -> int:
        return sum(c.ranks for c in self.components)

    @property
    def is_hetjob(self) -> bool:
        return len(self.components) > 1

    @property
    def on_cpu(self) -> bool:
        return bool(self.args.cpu)


def _resolve_path(value: str, base: Path) -> str:
    """Config names stay names; relative .yaml paths are taken relative to `base`."""
    path = Path(value)
    looks_like_path = path.suffix in (".yaml", ".yml") or path.parent != Path(".")
    return str(base / path) if looks_like_path and not path.is_absolute() else value


def _layout(run: RunConfig, cluster: ClusterConfig, nodes: tuple[int, ...] | None,
            gpus_per_node: tuple[int, ...] | None, mode: str) -> list[Component]:
    groups = cluster.nodes
    what = ", ".join(f"{g.count} node(s) x {g.gpus_per_node} {g.gpu}" for g in groups)
    for key, counts in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if counts is not None and len(counts) != len(groups):
            example = ", ".join(str(g.count if key == "nodes" else g.gpus_per_node) for g in groups)
            raise SubmitError(f"{key}={list(counts)}: cluster {cluster.name} has {len(groups)} node group(s) ({what}); "
                              f"give one value per group, e.g. [{example}]")
    components = []
    first = 0
    for i, group in enumerate(groups):
        n = nodes[i] if nodes else group.count
        per_node = gpus_per_node[i] if gpus_per_node else group.gpus_per_node
        label = f"node group {i} of " if len(groups) > 1 else ""
        if n > group.count:
            raise SubmitError(f"nodes={n}: more than {label}cluster {cluster.name} has ({group.count} node(s) x "
                              f"{group.gpus_per_node} {group.gpu} = {group.num_devices} GPUs); valid: 1..{group.count}")
        if per_node > group.gpus_per_node:
            raise SubmitError(f"gpus_per_node={per_node}: more than the {group.gpus_per_node} {group.gpu} per node of "
                              f"{label}cluster {cluster.name}; valid: 1..{group.gpus_per_node}")
        roles = modes.spec(mode).component_roles
        role = roles[i] if len(roles) == len(groups) else ""
        components.append(Component(i, n, per_node, cluster.gpu_types[group.gpu], role, first))
        first += n * per_node
    return components


def _bytes_per_parameter(args: argparse.Namespace, data_parallel: int) -> float:
    """Weights + gradients + Adam state per parameter, from the simulator's table of the
    precision (sim.costs.Precision; fp32: 4 + 4 + 8; bf16/fp16: 2 + (4 or 2) + 12, the gradient
    fp32 with --accumulate-allreduce-grads-in-fp32, always on with bf16). The distributed
    optimizer shards the optimizer part over the data-parallel ranks."""
    name = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    precision = Precision(name, fp32_gradients=args.accumulate_allreduce_grads_in_fp32 or None)
    fixed = precision.element_bytes + precision.grad_bytes_per_param
    return fixed + precision.optimizer_bytes_per_param / (data_parallel if args.use_distributed_optimizer else 1)


def check_model_memory(args: argparse.Namespace, mode: str, components: list[Component], zp_groups: int) -> list[str]:
    """Refuse a job whose model state alone exceeds a GPU's memory; notes for the script header.

    A lower bound: the average rank's weights, gradients and Adam state (max >= mean), no
    activations, no materialized expert copies (fssdp) or extra slots (replicate). What a rank
    holds is the mode's (`ModeSpec.model_state_shares`: Megatron's sharding, or zebra's roles)."""
    if args.vocab_size is None:
        return ["model state not estimated: --vocab-size is unknown"]
    counts = count_parameters(model_config_from_args(args), args.tensor_model_parallel_size)
    experts = counts["experts"]
    shares = modes.spec(mode).model_state_shares(args, [c.ranks for c in components], zp_groups,
                                                 counts["total"] - experts, experts)
    per_rank = [None if share is None else share[0] * _bytes_per_parameter(args, share[1])
                + share[2] * _bytes_per_parameter(args, share[3]) for share in shares]
    notes = []
    for component, need in zip(components, per_rank):
        have = component.gpu.memory_gb * 1e9
        where = component.label if len(components) > 1 else "every rank"
        if need is None:
            notes.append(f"model state on {where} not estimated: Asym-EA decides at start-up how many experts move")
            continue
        if need > have:
            raise SubmitError(
                f"model state needs at least {need / 1e9:.1f} GB per GPU on {where}, more than the "
                f"{component.gpu.memory_gb:g} GB of a {component.gpu.name} (weights, gradients and Adam state of "
                f"{counts['total'] / 1e9:.2f}B parameters, {experts / 1e9:.2f}B of them in experts, before "
                f"activations); use more GPUs, larger --expert-model-parallel-size / --tensor-model-parallel-size / "
                f"--pipeline-model-parallel-size, or --use-distributed-optimizer")
        notes.append(f"model state on {where} >= {need / 1e9:.2f} GB of {component.gpu.memory_gb:g} GB "
                     f"({component.gpu.name}; weights + grads + Adam, no activations)")
    return notes


def plan_job(run: RunConfig, overrides: Overrides = Overrides(), command_line: str = "") -> Job:
    """Check `run` with `overrides` against its model and cluster; the Job, or SubmitError."""
    mode = overrides.mode or run.mode
    if mode not in arguments.MOE_PARALLEL_MODES:
        raise SubmitError(f"mode {mode!r} is unknown; valid: {', '.join(arguments.MOE_PARALLEL_MODES)}")
    try:
        model_path = Path(resolve_config_path(overrides.model or _resolve_path(run.model, REPO), MODELS_DIR,
                                              available_models(), "model")).resolve()
        cluster_path = Path(resolve_config_path(overrides.cluster or _resolve_path(run.cluster, REPO), CLUSTERS_DIR,
                                                available_clusters(), "cluster")).resolve()
        cluster = load_cluster_config(cluster_path)
        model_values = read_yaml_mapping(model_path)
    except ConfigError as error:
        raise SubmitError(str(error)) from None

    components = _layout(run, cluster, overrides.nodes or run.nodes, overrides.gpus_per_node or run.gpus_per_node, mode)
    parser = arguments.build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    config_flag = Flag("config", ("--config", display_path(model_path)), "run config model")
    flags = _merge(
        [config_flag],
        _flags_from_mapping(run.train, actions, model_values, f"{run.source} train"),
        _flags_from_mapping(run.mode_flags.get(mode, {}), actions, model_values, f"{run.source} mode_flags.{mode}"),
        [Flag("moe_parallel_mode", ("--moe-parallel-mode", mode), "run config mode")],
        # what the mode needs from the launcher (zebra: the cluster its pool checks read)
        [Flag(dest, (option, value), "the run's cluster")
         for dest, option, value in modes.spec(mode).launch_flags(_cluster_reference(cluster_path))],
        _flags_from_command_line(list(overrides.training), parser),
    )
    outputs = [Flag("log_json", ("--log-json", "$RUN_DIR/metrics.jsonl"), "launcher")]
    if run.tensorboard:
        outputs.append(Flag("tensorboard_dir", ("--tensorboard-dir", "$RUN_DIR/tensorboard"),
                            f"{run.source} tensorboard: true"))
    if run.trace:
        outputs.append(Flag("moe_log_loads", ("--moe-log-loads", "$RUN_DIR/loads.npz"), f"{run.source} trace: true"))
    if any(f.dest == "save_interval" for f in flags) or model_values.get("save_interval") is not None:
        why = "save_interval (the launcher then checkpoints to $CKPT_DIR)"
        outputs += [Flag("save", ("--save", "$CKPT_DIR"), why), Flag("load", ("--load", "$CKPT_DIR"), why)]
    flags = _group_order(flags + outputs, parser)

    argv = [token for flag in flags for token in flag.tokens]
    # validate_args resolves paths (data, checkpoints) from the current directory; the job runs
    # in the repository, so check from there too.
    with _working_directory(REPO):
        args = _parse_training_flags(argv, flags)
        # The hetjob split first: its messages name the components, which is what a launcher user changes.
        try:
            zp_groups = modes.spec(mode).replica_groups(args, [c.ranks for c in components])
        except ValueError as error:
            raise SubmitError(str(error)) from None
        world = sum(c.ranks for c in components)
        try:
            validation.validate_args(args, world_size=world)
        except arguments.ArgumentError as error:
            # validate_args names the flag first (`--fp16=True: ...`, `--zebra-profile FILE: ...`);
            # say which key of the run set it.
            option = re.match(r"(--[\w-]+)[= ]", str(error))
            sources = [f.source for f in flags if option and f.tokens[0] == option.group(1)]
            raise SubmitError(f"training flags at world size {world} "
                              f"({' + '.join(str(c.ranks) for c in components)} ranks): {error}"
                              + (f" (from {sources[-1]})" if sources else "")) from None

    memory_notes = check_model_memory(args, mode, components, zp_groups)
    explicit_backend = next((f.tokens[1] for f in flags if f.dest == "distributed_backend" and len(f.tokens) > 1), None)
    backend = "gloo" if args.cpu else explicit_backend or "nccl"

    if run.slurm_components and len(run.slurm_components) != len(components):
        raise SubmitError(f"{run.source}: slurm_components has {len(run.slurm_components)} entries; the job has "
                          f"{len(components)} component(s) (one per node group of cluster {cluster.name})")
    slurm = tuple(run.slurm.merged(run.slurm_components[c.index]) if run.slurm_components else run.slurm
                  for c in components)
    slurm = _exit_signal(slurm, args, run.source)
    if overrides.output_dir:
        output_dir = Path(overrides.output_dir).resolve()
    else:
        output_dir = (REPO / (run.output_dir or f"runs/{run.name}")).resolve()
    if any(c.isspace() or c in "'\"\\" for c in str(output_dir)):
        # sbatch reads `#SBATCH --output=...` without a shell: no quoting can carry these through
        raise SubmitError(f"output_dir={str(output_dir)!r}: whitespace, quotes and backslashes cannot be written into "
                          "the script's #SBATCH --output line; valid: a path without them")
    return Job(run=run, mode=mode, model_path=model_path, cluster=cluster, components=tuple(components),
               flags=tuple(flags), args=args, backend=backend, zp_groups=zp_groups,
               memory_notes=tuple(memory_notes), output_dir=output_dir, slurm=slurm, command_line=command_line)


EXIT_SIGNAL_LEAD_S = 300


def _exit_signal(slurm: tuple[SlurmOptions, ...], args, source: str) -> tuple[SlurmOptions, ...]:
    """Pair --exit-signal-handler with `#SBATCH --signal`: Slurm then sends --exit-signal to every
    task before the time limit, and the run saves and exits 0. A signal without the handler would
    kill the ranks without a checkpoint: refused."""
    name = args.exit_signal.name.removeprefix("SIG")
    for options in slurm:
        if options.signal is not None and not args.exit_signal_handler:
            raise SubmitError(f"{source}: slurm.signal={options.signal!r} without the training flag "
                              "exit_signal_handler: the signal would end the ranks without a checkpoint; add "
                              "exit_signal_handler: true, or drop slurm.signal")
        if options.signal is not None and options.signal.split("@")[0].removeprefix("SIG") not in (
                name, str(int(args.exit_signal))):
            raise SubmitError(f"{source}: slurm.signal={options.signal!r} is not --exit-signal {args.exit_signal.name}, "
                              f"the signal the ranks wait for; valid: {name}@SECONDS")
    if not args.exit_signal_handler:
        return slurm
    return tuple(options if options.signal is not None else dataclasses.replace(options, signal=f"{name}@{EXIT_SIGNAL_LEAD_S}")
                 for options in slurm)


@contextlib.contextmanager
def _working_directory(path: Path):
    """Run the enclosed code in `path` (contextlib.chdir needs Python 3.11)."""
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _cluster_reference(path: Path) -> str:
    """How the job names a cluster config: its name when it is one of configs/clusters, else its path."""
    return path.stem if path.parent == CLUSTERS_DIR.resolve() else display_path(path)


def display_path(path: Path) -> str:
    """Repository-relative when inside the repository (the job runs there), else absolute."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def group_titles(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {action.dest: group.title for group in parser._action_groups for action in group._group_actions}


def _group_order(flags: list[Flag], parser: argparse.ArgumentParser) -> list[Flag]:
    """Flags sorted by the parser's groups (config, model, moe, parallelism, ...), stable inside a group."""
    titles = group_titles(parser)
    order = {group.title: i for i, group in enumerate(parser._action_groups)}
    return sorted(flags, key=lambda f: order[titles[f.dest]])
