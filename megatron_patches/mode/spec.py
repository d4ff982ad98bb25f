"""A mode's declaration: name, flags, validation, runtime class (torch-free).

The argument parser (training/arguments.py) adds every registered mode's flags; validation
(training/validation.py) refuses each mode's flags outside its mode and calls the selected
mode's `validate`; the loop (training/loop.py) imports the selected mode's runtime class only
after the process groups exist.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable


def import_target(target: str):
    """The object a `module:attribute` string names, imported on demand."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _no_flags(parser: argparse.ArgumentParser) -> None:
    """ep adds no flags: it is configured by Megatron-LM's own."""


def _nothing_to_validate(args: argparse.Namespace) -> None:
    """ep has nothing beyond Megatron-LM's own rules."""


def _ep_only_simulated(args: argparse.Namespace, where: str, zp_groups: int) -> tuple[list[str], dict[str, tuple]]:
    """ep is the simulator's baseline, simulated for every run: nothing more."""
    return [], {}


def _no_launch_flags(cluster_reference: str) -> list[tuple[str, str, str]]:
    """ep needs nothing from the launcher beyond Megatron-LM's flags."""
    return []


def _one_replica_group(args: argparse.Namespace, component_ranks: list[int]) -> int:
    return 1


def _grid_line(args: argparse.Namespace, world_size: int) -> str | None:
    return None


def ep_model_state_shares(args: argparse.Namespace, component_ranks: list[int], zp_groups: int, dense: float,
                          experts: float) -> list[tuple[float, int, float, int] | None]:
    """Megatron's sharding, the same on every rank: non-expert parameters over TP x PP (their
    optimizer state over DP), experts over EP x ETP x PP (theirs over expert DP)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    share = (dense / (tp * pp), args.data_parallel_size, experts / (ep * etp * pp), args.expert_data_parallel_size)
    return [share] * len(component_ranks)



@dataclass(frozen=True)
class ModeSpec:
    """One MoE parallel mode, as the flag layer and the loop see it."""

    name: str
    """The --moe-parallel-mode value."""
    summary: str
    """One line for --help and docs: what the mode does."""
    runtime: str
    """`module:Class` of its ModeRuntime subclass; imported after the process groups exist
    (it needs Megatron-Core and torch.distributed)."""
    add_args: Callable[[argparse.ArgumentParser], None] = _no_flags
    """Adds the mode's own argument group. Its flags are refused (by their dest) when another
    mode is selected and they differ from their defaults."""
    validate: Callable[[argparse.Namespace], None] = _nothing_to_validate
    """Checks and resolves the mode's flags on the namespace after Megatron-LM's shared rules
    (parallel layout, model shape, MoE); raises config.flags.ArgumentError naming the flag."""
    default_load_window: int | None = None
    """--moe-load-window when not given (DESIGN 4.1); None: the mode places experts statically
    and refuses the flag."""
    grouped_gemm_on_instances: bool = False
    """--moe-grouped-gemm runs the mode's expert instances as grouped matmuls over their weight
    rows (`compat.grouped`: CPU or GPU, any precision) instead of Megatron's GroupedMLP, so
    Megatron-LM's CUDA and --bf16 rules for GroupedMLP do not apply; the mode checks its own."""
    default_expert_parallel_size: int | None = None
    """--expert-model-parallel-size when not given; None: the largest valid one (Megatron
    expert parallelism over as many ranks as the experts allow)."""
    simulated: Callable[[argparse.Namespace, str, int], tuple[list[str], dict[str, tuple]]] = _ep_only_simulated
    """tools/simulate.py --run: (the simulator systems a run of this mode maps to, beside ep,
    which is always simulated; the simulator settings the run's flags give, as {setting: (value,
    where it came from)}) from the validated training flags, `where` (the run file, for those
    notes) and the job's ZP groups. Raises ValueError for a run the simulator cannot model."""
    launch_flags: Callable[[str], list[tuple[str, str, str]]] = _no_launch_flags
    """launch/submit.py: training flags the launcher adds for this mode, as (dest, option, value),
    given the run's cluster config reference (zebra reads the pool it runs on)."""
    model_state_shares: Callable[..., list[tuple[float, int, float, int] | None]] = ep_model_state_shares
    """jobs/plan.py's model-state check: per launch component (given each one's ranks, the ZP
    groups and the model's non-expert and expert parameter counts), what one rank holds on
    average as (non-expert parameters, the ranks their optimizer state shards over, expert
    parameters, theirs), or None where only start-up knows it."""
    component_roles: tuple[str, ...] = ()
    """launch/submit.py: what the ranks of each launch component do, for a job whose cluster has
    exactly that many node groups (zebra: "attention pool", "expert pool"); () none."""
    replica_groups: Callable[[argparse.Namespace, list[int]], int] = _one_replica_group
    """jobs/plan.py: the groups the launch components' ranks form (zebra's ZP groups), from the
    training flags and each component's ranks; raises ValueError naming the flag and what is valid."""
    parallelism_line: Callable[[argparse.Namespace, int], str | None] = _grid_line
    """launch/submit.py: the job script's line on how the world splits, given the validated flags
    and the world size; None: Megatron's TP x PP x DP grid (the launcher's own line)."""

    def runtime_class(self):
        return import_target(self.runtime)

    def own_dests(self) -> list[str]:
        """The dest names of the flags `add_args` registers."""
        parser = argparse.ArgumentParser(add_help=False)
        self.add_args(parser)
        return [action.dest for action in parser._actions]


EP = ModeSpec(
    name="ep",
    summary="stock Megatron-Core expert parallelism (the baseline every mode is compared with)",
    runtime="megatron_patches.mode.runtime:ModeRuntime",
)
"""ep: Megatron's own MoE layer and expert parallelism, unchanged; its runtime is the base class."""
