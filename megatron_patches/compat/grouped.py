"""torch's grouped matrix multiply, the kernel behind fssdp's and replicate's grouped GEMM
(version-sensitive: `torch.nn.functional.grouped_mm`, public since torch 2.10; pinned 2.13).

Megatron-Core's GroupedMLP calls the `grouped_gemm` package (CUDA only, packed expert weights
[H, E x F]); the instance modes keep each expert's weights in a packed row of their own
buffers (`mode.layer.ExpertLayout`), so they call torch's grouped matmul on strided views of
those rows instead, with autograd. What runs (torch's support matrix, pytorch#161407/#161717;
not measured here, no GPU in the session that built this): on CUDA SM90+ in bf16 one fused
CUTLASS kernel per call; on CUDA SM80+ in other dtypes, and on CPU, torch's fallback, one
matmul per group (the CPU tests' path: correct, not faster than one MLP per instance).

torch requires the inner strides of both operands to be multiples of 16 bytes: the hidden size
and the expert FFN width per ETP rank must be multiples of 16 / element size (4 in fp32, 8 in
bf16 / fp16). `grouped_mm_problem` is checked before any work starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm", "grouped_mm_problem"]

_ALIGNMENT_BYTES = 16


def grouped_mm(tokens_NK: torch.Tensor, weights_RKM: torch.Tensor, ends_R: torch.Tensor) -> torch.Tensor:
    """[N, M]: token rows ends_R[r-1]:ends_R[r] (ends_R int32, cumulative) times weights_RKM[r]."""
    return F.grouped_mm(tokens_NK, weights_RKM, offs=ends_R)


def grouped_mm_problem(dtype: torch.dtype, widths: dict[str, int]) -> str | None:
    """Why torch's grouped matmul cannot run the experts here (None: it can).

    `widths` names each matrix width that becomes an inner stride (flag -> elements); a tiny
    product on the host checks that the installed torch has the operator for `dtype`."""
    if not hasattr(F, "grouped_mm"):
        return f"needs torch's grouped matmul (torch.nn.functional.grouped_mm, torch >= 2.10); torch {torch.__version__} lacks it"
    per = _ALIGNMENT_BYTES // torch.empty(0, dtype=dtype).element_size()
    for flag, width in widths.items():
        if width % per:
            return (f"{flag}={width}: torch's grouped matmul needs widths that are multiples of "
                    f"{per} elements in {dtype} (16-byte strides)")
    tokens = torch.ones(2, per, dtype=dtype)
    try:
        grouped_mm(tokens, torch.ones(2, per, per, dtype=dtype), torch.tensor([1, 2], dtype=torch.int32))
    except RuntimeError as error:
        return f"torch {torch.__version__}'s grouped matmul fails on the host in {dtype}: {error}"
    return None
