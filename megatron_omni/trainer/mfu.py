"""Model FLOP utilisation: the FLOPs a step's work needed over what the device could do in that time.

The peak is the measured bf16 matrix rate of the device (BENCHMARKS.md: 792 TFLOP/s on an H200; the
H100 has the same tensor cores).  Where no peak is known (CPUs, other GPUs, fp32 runs) only the
achieved TFLOP/s is reported.
"""
from __future__ import annotations

import torch

MEASURED_BF16_PEAK = {"H200": 792e12, "H100": 792e12}


def device_peak_flops(dtype: torch.dtype) -> float | None:
    if dtype != torch.bfloat16 or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in MEASURED_BF16_PEAK.items() if key in name), None)


def step_flops(forward_flops_per_row: float, rollout_rows: int, check_rows: int, train_rows: int,
               extra_forward_rows: int = 0) -> float:
    """Rollout and log-prob check are forwards; a trained row is a forward and a backward (about two
    forwards); extra forward rows are CFG uncond branches and reference passes done under no_grad."""
    return forward_flops_per_row * (rollout_rows + check_rows + 3 * train_rows + extra_forward_rows)
