"""Measured kernel rates of one GPU type (a device profile), in place of peak x efficiency.

`tools/device_check.py`'s kernel stage measures, on the GPU it runs on, the rates the cost model
otherwise derives from a datasheet peak and a cited efficiency (`costs.KernelEfficiency`): dense
GEMMs at the paper models' shapes, expert GEMMs over a range of token counts, fused attention and
HBM streaming. It writes them as a JSON profile; `tools/simulate.py --device-profile FILE` turns
that profile into the efficiencies it implies for the simulated cluster:

    dense_gemm        = measured dense GEMM FLOP/s / the GEMM peak the cost model uses
    expert_gemm       = measured large-batch expert GEMM FLOP/s / the same peak
    expert_half_tokens  measured (the fit of rate(n) = rate_max x n / (n + n_half))
    flash_attention   = measured fused-attention FLOP/s / the FP16/BF16 peak (half precision only)
    memory            = measured streaming bandwidth / the HBM bandwidth of the cluster file
    kernel_launch_s   = the measured fixed cost of one expert's forward beyond its kernels
                        (`expert_launch_us`: eager fc1, activation, fc2 at 16 tokens less the same
                        kernels replayed from a CUDA graph), when the profile has it

so every other part of the model (launch overheads, communication, schedules) is unchanged, and
a profile and the `--efficiency` overrides it stands for give the same simulation. A profile
describes one GPU type: it applies to clusters made of that type only, and names the type's
entry in the cluster file (`gpu_type`), since CUDA's device name ("NVIDIA H200") does not say
which memory or NVLink variant it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_patches.sim.costs import Hardware, Precision, SimError

PROFILE_FORMAT = "megatron-patches device profile 1"
"""The `format` field every profile carries."""

RATE_FIELDS = ("dense_gemm_tflops", "expert_gemm_tflops", "expert_half_tokens", "flash_attention_tflops")
"""Per-precision fields; flash_attention_tflops only for fp16 / bf16 (fused kernels take no fp32)."""


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU type's measured rates (see module docstring)."""

    gpu_type: str
    """The cluster files' name of the GPU type measured, e.g. "H200-SXM-141GB"."""
    device_name: str
    """What CUDA called the device, e.g. "NVIDIA H200"."""
    hbm_gb_s: float
    """Measured device-to-device streaming bandwidth, GB/s (bytes read + written)."""
    precisions: dict[str, dict[str, float]]
    """Precision name -> RATE_FIELDS values (TFLOP/s, tokens)."""
    source: str = ""
    """Where and how it was measured (software versions, date, shapes)."""
    expert_launch_us: float | None = None
    """The fixed cost of one expert's forward as training launches it, microseconds (the cost
    model's `kernel_launch_s`); None: not measured (profiles before 2026-11-29 lack it)."""

    def __post_init__(self) -> None:
        if not self.gpu_type or not isinstance(self.gpu_type, str):
            raise SimError(f"device profile: gpu_type must name a GPU type of the cluster files, got {self.gpu_type!r}")
        _positive("hbm_gb_s", self.hbm_gb_s)
        if self.expert_launch_us is not None:
            _positive("expert_launch_us", self.expert_launch_us)
        if not self.precisions:
            raise SimError("device profile: precisions is empty; valid keys: fp32, fp16, bf16")
        for name, rates in self.precisions.items():
            if name not in ("fp32", "fp16", "bf16"):
                raise SimError(f"device profile: precision {name!r} is unknown; valid: fp32, fp16, bf16")
            needed = RATE_FIELDS if name != "fp32" else RATE_FIELDS[:3]
            missing = [f for f in needed if f not in rates]
            unknown = sorted(set(rates) - set(RATE_FIELDS))
            if missing or unknown:
                raise SimError(f"device profile: precisions.{name} lacks {missing} / has unknown {unknown}; "
                               f"valid fields: {', '.join(needed)}")
            for field, value in rates.items():
                _positive(f"precisions.{name}.{field}", value)

    def to_dict(self) -> dict[str, Any]:
        out = {"format": PROFILE_FORMAT, "gpu_type": self.gpu_type, "device_name": self.device_name,
               "hbm_gb_s": self.hbm_gb_s, "precisions": self.precisions, "source": self.source}
        if self.expert_launch_us is not None:
            out["expert_launch_us"] = self.expert_launch_us
        return out

    def efficiency_overrides(self, hardware: Hardware, precision: Precision) -> dict[str, float]:
        """The KernelEfficiency fields this profile implies on `hardware` in `precision`.

        SimError when a simulated device is of another GPU type, when the profile has no rates for
        the precision, or when a measured rate exceeds the cluster file's peak (an efficiency
        above 1: the file's peak or the measurement is wrong, and the message names both).
        """
        types = sorted(set(hardware.device_types))
        if types != [self.gpu_type]:
            raise SimError(f"--device-profile measures {self.gpu_type} ({self.device_name}); the simulated devices are "
                           f"{', '.join(types)}: a profile applies to a cluster of its own GPU type only")
        rates = self.precisions.get(precision.name)
        if rates is None:
            raise SimError(f"--device-profile has no {precision.name} rates; it has {', '.join(self.precisions)} "
                           f"(pass --precision with one of them)")
        gemm_peak = float(hardware.gemm_peaks_D(precision)[0][0])
        overrides = {
            "dense_gemm": _fraction("dense_gemm_tflops", rates["dense_gemm_tflops"] * 1e12, gemm_peak, "GEMM peak"),
            "expert_gemm": _fraction("expert_gemm_tflops", rates["expert_gemm_tflops"] * 1e12, gemm_peak, "GEMM peak"),
            "expert_half_tokens": float(rates["expert_half_tokens"]),
            "memory": _fraction("hbm_gb_s", self.hbm_gb_s * 1e9, float(hardware.hbm_bw_D[0]), "hbm_gb_s"),
        }
        if precision.half:
            overrides["flash_attention"] = _fraction("flash_attention_tflops", rates["flash_attention_tflops"] * 1e12,
                                                     float(hardware.peak_flops_D[0]), "peak_fp16_tflops")
        if self.expert_launch_us is not None:
            overrides["kernel_launch_s"] = self.expert_launch_us * 1e-6
        return overrides


def load_device_profile(path: str | Path) -> DeviceProfile:
    """Read a profile written by tools/device_check.py; SimError naming the file and what is wrong."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SimError(f"--device-profile {path}: cannot read it as JSON ({err})") from None
    if not isinstance(values, dict) or values.get("format") != PROFILE_FORMAT:
        found = values.get("format") if isinstance(values, dict) else type(values).__name__
        raise SimError(f"--device-profile {path}: format is {found!r}; valid: {PROFILE_FORMAT!r} "
                       f"(written by tools/device_check.py --stages kernels)")
    fields = {k: v for k, v in values.items() if k != "format"}
    try:
        return DeviceProfile(**fields)
    except TypeError as err:
        raise SimError(f"--device-profile {path}: {err}") from None


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SimError(f"device profile: {name} must be a positive finite number, got {value!r}")


def _fraction(name: str, measured: float, peak: float, peak_name: str) -> float:
    share = measured / peak
    if share > 1.0:
        raise SimError(f"device profile: {name} = {measured:.4g} is above the cluster file's {peak_name} "
                       f"{peak:.4g} (efficiency {share:.2f} > 1); check the GPU type's figures or the measurement")
    return share
