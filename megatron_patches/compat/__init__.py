"""Compatibility layer between this project and Megatron-Core 0.16.1.

- `cpu.py`: shims for Megatron's hard CUDA assumptions, installed only when CUDA is absent.
- `fixes.py`: fixes for device-independent Megatron-Core bugs (CPU and GPU).
- `mcore.py`: every version-sensitive call into Megatron-Core.
- `activations.py`: activation memory measured through torch's saved-tensor hooks.
- `known_warnings.py`: Megatron-Core's and torch's known warnings, once from rank 0 as one line each.
- `lifetime.py`: ranks end with their launcher, even on SIGKILL.

`prepare_megatron(use_cuda)` is called once per process before any model is built.
"""

from __future__ import annotations


def prepare_megatron(use_cuda: bool) -> list[str]:
    """Checks the pinned version and installs fixes (and CPU shims when not on CUDA).

    Returns the names of the CPU shims installed (empty on GPU).
    """
    import torch  # here, not at the top: the entry point imports known_warnings and lifetime before torch

    from megatron_patches.compat import fixes, mcore

    mcore.check_version()
    installed: list[str] = []
    if not use_cuda:
        if torch.cuda.is_available():
            raise RuntimeError(
                "running on CPU while CUDA is available is not supported: the CPU shims would "
                "change GPU behaviour; hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU"
            )
        from megatron_patches.compat.cpu import apply_cpu_shims

        installed = apply_cpu_shims()
    fixes.apply_global_fixes()
    return installed
