"""The YAML layer of the training script's flags: `--config FILE.yaml` files of flag values.

Keys are the flags' dest names (--num-layers -> num_layers); values are checked and converted
to each flag's type here, so a bad file fails before any work with a message naming the file,
the key and what would be valid. `arguments.parse_args` layers the values: parser defaults <
config files in order < explicit command-line flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from megatron_patches.config.flags import ArgumentError, auto_or_int, close_names, moe_layer_freq
from megatron_patches.training import megatron_lm


def load_yaml(path: Path, parser: argparse.ArgumentParser) -> dict:
    """The flag values in one YAML file, checked and converted to each flag's type."""
    if not path.is_file():
        raise ArgumentError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ArgumentError(f"--config {path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                            f"{error.start}); save it as UTF-8") from error
    except yaml.YAMLError as error:
        raise ArgumentError(f"--config {path}: not valid YAML: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(
            f"--config {path}: the file must be a mapping of flag dest names to values "
            f"(e.g. `num_layers: 2`), not a {type(data).__name__}"
        )
    actions = {action.dest: action for action in flag_actions(parser) if action.dest != "config"}
    values = {}
    for key, value in data.items():
        if key not in actions:
            raise ArgumentError(_unknown_key_message(path, key, actions))
        values[key] = _coerce(actions[key], key, value, path)
    return values


def flag_actions(parser: argparse.ArgumentParser) -> list:
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def _unknown_key_message(path: Path, key, actions: dict) -> str:
    message = f"--config {path}: unknown key {key!r}."
    if key == "config":
        return message + " A config file cannot include other files; pass several --config flags."
    # A key spelled like a flag whose dest differs (disable_bias_linear -> add_bias_linear).
    for dest, action in actions.items():
        for option in action.option_strings:
            if str(key).replace("-", "_") == option.lstrip("-").replace("-", "_") and dest != key:
                value = "false" if action.const is False else "true"
                return message + f" Flag {option} stores into {dest!r}: write `{dest}: {value}`."
    if (flag := megatron_lm.by_dest().get(key)) is not None:  # Megatron-LM's, refused here
        return f"--config {path}: key {key!r}: " + megatron_lm.refusal(flag.flags[0]).message(flag.flags[0])
    close = close_names(str(key).replace("-", "_"), sorted(actions))
    hint = f" Did you mean: {', '.join(close)}?" if close else " No valid key is close."
    return (message + hint + " Keys are the flags' dest names (--num-layers -> num_layers); "
            "see docs/flags.md for all of them.")


def is_bool_flag(action) -> bool:
    """A flag that takes no value and sets True or False: store_true / store_false, and
    BooleanOptionalAction (`--x` / `--no-x`, whose const is None)."""
    return action.nargs == 0 and (isinstance(action.const, bool) or isinstance(action, argparse.BooleanOptionalAction))


def type_name(action) -> str:
    if is_bool_flag(action):
        return "bool"
    if action.type is moe_layer_freq:
        return "int or list of 0/1"
    if action.type is auto_or_int:
        return "auto or int"
    name = (action.type or str).__name__
    return f"list of {name}" if action.nargs in ("*", "+") else name


def _coerce(action, key: str, value, path: Path):
    """`value` converted to the type the flag's dest holds, or ArgumentError."""
    def wrong():
        return ArgumentError(
            f"--config {path}: key {key!r} has value {value!r} ({type(value).__name__}); "
            f"expected {type_name(action)} (flag {action.option_strings[0]})"
        )

    if value is None:
        if action.default is None:
            return None
        raise wrong()
    if is_bool_flag(action):
        if isinstance(value, bool):
            return value
        raise wrong()
    if action.type is moe_layer_freq:
        try:
            return moe_layer_freq(value)
        except ValueError:
            raise wrong() from None
    if action.nargs in ("*", "+"):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise wrong()
        converted = [_coerce_scalar(action.type or str, item) for item in items]
        if any(item is None for item in converted):
            raise wrong()
        return converted
    converted = _coerce_scalar(action.type or str, value)
    if converted is None:
        raise wrong()
    return converted


def _coerce_scalar(kind, value):
    """`value` as `kind` (int, float or str), or None when it is not one."""
    if isinstance(value, (bool, list, dict)):
        return None
    if kind is int:
        return value if isinstance(value, int) else None
    if kind is float:
        if isinstance(value, (int, float)):
            return float(value)
        # YAML 1.1 (PyYAML) reads `1e-3` without a dot as a string.
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    # Text flags take unquoted YAML numbers too (`split: 100`, data-path weights).
    return str(value) if isinstance(value, (str, int, float)) else None
