"""The registry of MoE parallel modes (--moe-parallel-mode): one line per mode.

Each mode's package declares a `ModeSpec` (mode/spec.py) in its `config.py`: its flags, their
validation and its runtime class. The argument parser, the validation and the training loop
read this registry only; adding a mode adds its line here and touches no other shared file.
"""

from __future__ import annotations

from megatron_patches.fssdp.config import MODE as FSSDP
from megatron_patches.mode.spec import EP, ModeSpec
from megatron_patches.replicate.config import MODE as REPLICATE
from megatron_patches.zebra.config import MODE as ZEBRA

MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (EP, FSSDP, REPLICATE, ZEBRA)}
"""Mode name -> spec, in the order --help and docs/flags.md list their flag groups."""

MOE_PARALLEL_MODES = tuple(MODES)

def spec(name: str) -> ModeSpec:
    return MODES[name]
