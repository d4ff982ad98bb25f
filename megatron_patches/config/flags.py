"""What every flag owner shares: the error type of bad flag values and the message form.

The training script's flags have several owners (Megatron-LM's table in
`training/arguments.py`, each MoE mode's own group in its package's `config.py`); all of them
refuse a value the same way, before any process group exists, with a message naming the flag,
the value and what would be valid.
"""

from __future__ import annotations

import argparse
import ast
import difflib

CLOSE_NAME_CUTOFF = 0.84
"""How alike a mistyped flag or key must be to a valid one to be offered as "did you mean"
(difflib's ratio): --num-layer -> --num-layers (0.96), --global-batch -> --global-batch-size
(0.85), but not --context-parallel-size -> --expert-model-parallel-size (0.75)."""


def close_names(name: str, names) -> list[str]:
    """Up to 3 of `names` close to `name` (CLOSE_NAME_CUTOFF), closest first."""
    return difflib.get_close_matches(name, list(names), n=3, cutoff=CLOSE_NAME_CUTOFF)


class ArgumentError(ValueError):
    """An impossible or inconsistent flag value; the message names the flag, its value and what
    would be valid. Raised by parse_args (bad YAML) and validate_args, before any process group."""


def fail(flag: str, value, message: str):
    """Raise ArgumentError as `--flag=value: message`."""
    raise ArgumentError(f"{flag}={value}: {message}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def auto_or_int(value: str):
    """`auto` or a non-negative integer (argparse type of e.g. --fssdp-overlap-degree)."""
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither auto nor an integer") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative; valid: auto or an integer >= 0")
    return number


def moe_layer_freq(value):
    """--moe-layer-freq as Megatron-LM reads it: an int N (every N-th layer is MoE), or a 0/1
    pattern per layer given as a list or as a list expression such as "([1]*3+[0]*1)*3".

    The expression is evaluated over list displays, ints, + and * only (no eval), and a pattern
    longer than 100,000 layers is refused so that a typo cannot exhaust memory."""
    if isinstance(value, bool):
        raise ValueError(f"not a layer frequency: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise ValueError(f"a layer pattern holds integers 0/1, got {value!r}")
        return list(value)
    if not isinstance(value, str):
        raise ValueError(f"not a layer frequency: {value!r}")
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an int or a list expression: {value!r}") from error
    pattern = _eval_pattern(tree.body, value)
    if not isinstance(pattern, list):
        raise ValueError(f"a layer pattern must evaluate to a list, got {pattern!r}")
    return moe_layer_freq(pattern)


def _eval_pattern(node, source: str):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_eval_pattern(item, source) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left, source), _eval_pattern(node.right, source)
        if isinstance(node.op, ast.Mult):
            sizes = [len(x) * y for x, y in ((left, right), (right, left))
                     if isinstance(x, list) and isinstance(y, int)]
            if sizes and sizes[0] > 100_000:
                raise ValueError(f"layer pattern {source!r} is longer than 100,000 layers")
        try:
            return left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError as error:
            raise ValueError(f"cannot evaluate layer pattern {source!r}: {error}") from error
    raise ValueError(f"layer pattern {source!r} may only use lists, integers, + and *")
