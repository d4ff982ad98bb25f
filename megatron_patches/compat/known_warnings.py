"""Megatron-Core's and torch's known warnings: once per job, from rank 0, one line each.

Every rank imports Megatron-Core, and megatron-core 0.16.1 without Transformer Engine or Apex
warns from seven modules at import (multi-tensor ops, optimizers, norms), each as a two-line
`file:line: UserWarning` block; under torch 2.13 its collectives and its distributed
optimizer's zero_grad add more. Four ranks turned that into about 80 lines before the first
progress line. They say nothing about the run, so rank 0 shows each known one once as a single
line and the other ranks keep them to themselves. Any other warning is shown once per rank, on
one line naming the rank: it is new information, and a rank that differs from rank 0 is what a
person needs to see.

`show_once(rank)` is installed by the entry point before anything imports Megatron-Core.
"""

from __future__ import annotations

import re
import sys
import warnings

_FALLBACKS = ("megatron-core: Transformer Engine and Apex are not installed; it uses its torch fallbacks "
              "(optimizers, multi-tensor ops, norms)")

# (a regular expression found in the warning, the line shown for it); a line shared by several
# warnings prints once
KNOWN = (
    (r"Transformer Engine and Apex are not installed", _FALLBACKS),
    (r"Apex is not installed\. Falling back to Torch Norm", _FALLBACKS),
    (r"`torch\.distributed\.\w+` is deprecated",
     "torch: megatron-core 0.16.1 calls collectives that torch 2.13 deprecates (all_gather_into_tensor, "
     "reduce_scatter_tensor); harmless"),
    (r"`load_state_dict` is deprecated and will be removed|we are deprecating ShardedTensor",
     "torch: megatron-core 0.16.1's dist checkpointing calls APIs that torch 2.13 deprecates (load_state_dict, "
     "ShardedTensor); harmless"),
    (r"`sequence_parallel` is set to `True`, but tensor model parallel size is 1",
     "megatron-core: with --sequence-parallel and --expert-tensor-parallel-size 1 the experts' linear layers turn "
     "sequence parallelism off for themselves (their tokens arrive whole from the dispatcher), as intended; harmless"),
    (r"it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
     "megatron-core: with sequence parallelism on GPUs it recommends CUDA_DEVICE_MAX_CONNECTIONS=1 (its TP "
     "communication then keeps kernel order); left to the user, since one hardware queue also serialises fssdp's "
     "side-stream copies; no meaning on CPU"),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
     "megatron-core: its distributed optimizer's zero_grad reads .grad of parameter-shard views, which torch "
     "warns are not leaves; harmless (the optimizer copies those gradients itself)"),
)


def known_line(text: str) -> str | None:
    """The one line shown for a known warning's text, None for any other warning."""
    return next((line for pattern, line in KNOWN if re.search(pattern, text)), None)


def _origin(filename: str) -> str:
    """A warning's file relative to site-packages (or as given) for the one-line form."""
    return filename.rsplit("site-packages/", 1)[-1]


def show_once(rank: int) -> None:
    """Route every warning of this process through `_show`: known ones on rank 0 only, every
    distinct line once."""
    shown: set[str] = set()

    def _show(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        known = known_line(text)
        if known is not None and rank != 0:
            return
        summary = known or f"{category.__name__}: {text} ({_origin(filename)}:{lineno})"
        if summary in shown:
            return
        shown.add(summary)
        prefix = "warning" if rank == 0 else f"warning (rank {rank})"
        print(f"{prefix}: {summary}", file=sys.stderr if file is None else file, flush=True)

    warnings.showwarning = _show
