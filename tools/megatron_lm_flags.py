"""Extract Megatron-LM's flag table from its own parser, mechanically.

Megatron-LM builds its parser in `megatron/training/arguments.py`: hand-written add_argument
calls plus flags generated from Megatron-Core's dataclasses (TransformerConfig through
ArgumentGroupFactory), so reading the file's text would miss most MoE flags. This tool imports
that module from a Megatron-LM checkout against the installed megatron-core, builds the parser
(`add_megatron_arguments`) and writes every flag as JSON: option strings, dest, argparse action,
type, default, nargs, choices, group and help, with the checkout's tag, commit and path.

The pinned megatron-core==0.16.1 matches Megatron-LM's tag core_v0.16.1; the table the product
reads (megatron_patches/training/megatron_lm_arguments.json) was made with

    git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
    pip install six    # Megatron-LM's BERT tokenizer module, imported by arguments.py, needs it
    python tools/megatron_lm_flags.py --megatron-lm Megatron-LM \
        > megatron_patches/training/megatron_lm_arguments.json

Only `megatron.training` (and `megatron.legacy`, which it imports) come from the checkout; its
package `__init__` (the whole trainer) is not run. Nothing of the checkout is copied into this
tree: only the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

PATH_IN_REPO = "megatron/training/arguments.py"


def _json_value(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return repr(value)


def megatron_lm_parser(checkout: Path) -> argparse.ArgumentParser:
    """Megatron-LM's parser, built by its own add_megatron_arguments from `checkout`."""
    sys.path.insert(0, str(checkout))
    import megatron

    package = types.ModuleType("megatron.training")
    package.__path__ = [str(checkout / "megatron" / "training")]
    sys.modules["megatron.training"] = package
    megatron.training = package
    from megatron.training import global_vars  # utils.py imports its getters from the package

    for name in dir(global_vars):
        if name.startswith("get_"):
            setattr(package, name, getattr(global_vars, name))
    from megatron.training import arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    return parser


def flag_table(parser: argparse.ArgumentParser) -> list[dict]:
    group_of = {id(action): group.title for group in parser._action_groups for action in group._group_actions}
    return [
        {
            "flags": action.option_strings,
            "dest": action.dest,
            "action": type(action).__name__,
            "type": getattr(action.type, "__name__", repr(action.type)) if action.type is not None else None,
            "default": _json_value(action.default),
            "nargs": action.nargs,
            "choices": _json_value(list(action.choices)) if action.choices else None,
            "group": group_of.get(id(action)),
            "help": action.help,
        }
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True, metavar="DIR",
                        help="a Megatron-LM checkout (git) at the tag matching the pinned megatron-core")
    opts = parser.parse_args(argv)
    checkout = opts.megatron_lm.resolve()
    if not (checkout / PATH_IN_REPO).is_file():
        print(f"--megatron-lm {checkout}: no {PATH_IN_REPO} there; give a Megatron-LM checkout", file=sys.stderr)
        return 2

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True).stdout.strip()

    source = {"repository": "NVIDIA/Megatron-LM", "path": PATH_IN_REPO, "commit": git("rev-parse", "HEAD"),
              "tag": git("describe", "--tags", "--exact-match", "HEAD")}
    try:
        table = flag_table(megatron_lm_parser(checkout))
    except ModuleNotFoundError as error:
        print(f"importing Megatron-LM's arguments.py needs {error.name!r}: pip install {error.name}", file=sys.stderr)
        return 2
    json.dump({"source": source, "flags": table}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    print(f"{len(table)} flags from {source['repository']} {source['tag']} ({source['commit'][:12]})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
