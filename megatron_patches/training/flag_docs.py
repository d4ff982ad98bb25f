"""The flags as text: `describe_args` (every value of a run, printed by rank 0) and
`flag_reference_markdown` (docs/flags.md, generated from the parser; a test keeps it in sync):

    python -m megatron_patches.training.flag_docs > docs/flags.md
"""

import argparse
import enum

from megatron_patches.training import megatron_lm
from megatron_patches.training.arguments import (
    FLAGS_WITHOUT_EFFECT,
    DERIVED_VALUES,
    EMBEDDED_JOB,
    KERNEL_CHOICES,
    MODEL_SIZE_FLAGS,
    REPO_ROOT,
    build_parser,
)
from megatron_patches.training.yaml_config import type_name


def describe_args(args: argparse.Namespace) -> str:
    """Every value in `args`, sorted within the parser's groups, then derived and other values."""
    parser = build_parser()
    dests_by_group = []
    seen = set()
    for group in parser._action_groups:
        dests = sorted(action.dest for action in group._group_actions
                       if action.dest != "help" and hasattr(args, action.dest))
        if dests:
            dests_by_group.append((group.title, dests))
            seen.update(dests)
    derived = sorted(dest for dest in DERIVED_VALUES if hasattr(args, dest))
    seen.update(derived)
    other = sorted(dest for dest in vars(args) if dest not in seen)
    if derived:
        dests_by_group.append(("derived (validate_args)", derived))
    if other:
        dests_by_group.append(("other", other))

    lines = ["------------------------ arguments ------------------------"]
    for title, dests in dests_by_group:
        lines.append(f"{title}:")
        for dest in dests:
            lines.append(f"  {dest} {'.' * max(2, 40 - len(dest))} {_show(getattr(args, dest))}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(str(item) for item in value)
    if isinstance(value, enum.Enum):  # --exit-signal: its name, as the flag takes it
        return value.name
    return str(value)


def flag_reference_markdown() -> str:
    """The Markdown flag reference (docs/flags.md), generated from build_parser()."""
    parser = build_parser()
    lines = [
        "# Flag reference",
        "",
        "Generated from the parser by `megatron_patches.training.flag_docs.flag_reference_markdown()`;",
        "do not edit by hand. Regenerate with",
        "`python -m megatron_patches.training.flag_docs > docs/flags.md`.",
        "",
        "Flags keep Megatron-LM's names, types, defaults and meanings; where a default differs,",
        "the description says so. Values are layered: parser defaults (Megatron-LM's), then the",
        "`--config` YAML files in order, then the flags given on the command line. Without `--config`",
        f"and without a model-size flag ({', '.join(f'`{flag}`' for flag in MODEL_SIZE_FLAGS)}), the",
        "embedded tiny job's files take the place of the `--config` files:",
        f"{' and '.join(f'`{path.relative_to(REPO_ROOT)}`' for path in EMBEDDED_JOB)}. YAML keys are the",
        "dest names in the second column.",
        "`validate_args` then resolves the derived values and refuses impossible combinations",
        "before any process group starts.",
    ]
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if action.dest != "help"]
        if not actions:
            continue
        lines += ["", f"## {group.title}", "", "| Flag | YAML key | Type | Default | Meaning |",
                  "|---|---|---|---|---|"]
        for action in actions:
            yaml_key = "—" if action.dest == "config" else f"`{action.dest}`"
            kind = "path, repeatable" if action.dest == "config" else type_name(action)
            cells = [", ".join(f"`{option}`" for option in action.option_strings), yaml_key, kind,
                     _default_cell(action), action.help.replace("%%", "%")]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", "## Derived values", "",
              "Set by `validate_args(args, world_size)` and printed by `describe_args`:", "",
              "| Name | Meaning |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in DERIVED_VALUES.items()]
    lines += _megatron_lm_kinds(parser)
    return "\n".join(lines) + "\n"


def _megatron_lm_kinds(parser) -> list[str]:
    """Which of Megatron-LM's flags are honoured and which refused, and why (training/megatron_lm.py)."""
    source, table = megatron_lm.table()
    honoured, refused_flags = megatron_lm.kinds(option for action in parser._actions for option in action.option_strings)
    refused = [megatron_lm.refusal(flag.flags[0]) for flag in refused_flags]
    kernels = [flag for flag in honoured if flag.dest in KERNEL_CHOICES]
    unread = [flag for flag in honoured if flag.dest in FLAGS_WITHOUT_EFFECT]
    lines = ["", "## Megatron-LM's flags: honoured, GPU kernel choices and refused", "",
             f"Megatron-LM {source['tag']} (commit {source['commit'][:12]}, `{source['path']}`) defines {len(table)} "
             f"flags (`megatron_patches/training/megatron_lm_arguments.json`). "
             f"{len(honoured) - len(kernels) - len(unread)} are honoured: they are in the tables above, with "
             f"Megatron-LM's meaning. {len(kernels)} are GPU kernel choices (the group of that name above: on GPU "
             "they reach Megatron-Core, on CPU the ones given are listed in one start-up line), and "
             f"{len(unread)} are accepted without effect, each for its reason "
             f"({'; '.join(f'`{flag.flags[0]}`: {FLAGS_WITHOUT_EFFECT[flag.dest]}' for flag in unread)}; named in a "
             f"start-up line). {len(refused)} are "
             "refused: given on the command line or as a `--config` key, the run stops before any work with the "
             "reason and what to do instead. None is unknown, and none is ignored.", "",
             "### Honoured with another type or default", "", "| Flag | Why |", "|---|---|"]
    lines += [f"| `{flag.flags[0]}` | {megatron_lm.DIFFERS[flag.dest]} |" for flag in honoured if flag.dest in megatron_lm.DIFFERS]
    lines += ["", "### Refused: other workloads, a group at a time", "",
              "| Megatron-LM group | Flags | Why | Instead |", "|---|---|---|---|"]
    for group, (workload, instead) in megatron_lm.WORKLOAD_GROUPS.items():
        count = sum(r.flag.group == group for r in refused)
        lines.append(f"| {group} | {count} | {workload} | {instead} |")
    lines += ["", "### Refused: GPT/BERT pre-training flags", "",
              "Leaving one out keeps Megatron-LM's default, which the refusal names."]
    by_reason: dict[str, list[str]] = {}
    for r in refused:
        if r.flag.group not in megatron_lm.WORKLOAD_GROUPS:
            by_reason.setdefault(r.reason, []).append(f"`{r.flag.flags[0]}`")
    for reason, flags in by_reason.items():
        lines += ["", f"**{reason[0].upper() + reason[1:]}** ({len(flags)}): " + ", ".join(flags)]
    return lines


def _default_cell(action) -> str:
    default = action.default
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "true" if default else "false"
    return f"`{_show(default)}`"


if __name__ == "__main__":
    print(flag_reference_markdown(), end="")
