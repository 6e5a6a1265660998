"""Model FLOP utilisation: the FLOPs a step's work needed over what the device could do in that time.

The peak is the measured bf16 matrix rate of the device (docs/benchmarks.md: 792 TFLOP/s on an H200; the
H100 has the same tensor cores).  Where no peak is known (CPUs, other GPUs, fp32 runs) only the
achieved TFLOP/s is reported.

FLOPs come from the model family of the architecture config (``model_specs.family``: each family counts its
own, ``model_specs/<family>/flops.py``).  A step's FLOPs count the work the algorithm needs,
so that the MFU of two implementations compares their speed: a trained row is a forward plus a backward
that computes activation gradients (about one forward) and weight gradients (another, skipped for a
frozen base under LoRA); the uncond branch of true CFG needs a forward and no backward, and none at all
where the trainer reused the rollout's uncond output (same weights, same inputs).  LoRA adapters are
counted as the work they are (``lora_forward_flops``, per family): A per policy forward, 3·A per trained
row (forward, activation gradient, adapter weight gradient); the KL reference runs without them.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable

import torch

from model_specs.family import family_of

MEASURED_BF16_PEAK = {"H200": 792e12, "H100": 792e12}


def device_peak_flops(dtype: torch.dtype) -> float | None:
    if dtype != torch.bfloat16 or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in MEASURED_BF16_PEAK.items() if key in name), None)


def forward_flops(arch, batch: int, image_tokens: int, text_tokens: int) -> float:
    """FLOPs of one forward of ``arch``'s model family over ``batch`` rows."""
    return family_of(arch).forward_flops(arch, batch, image_tokens, text_tokens)


def lora_forward_flops(arch, rank: int, targets, batch: int, image_tokens: int, text_tokens: int) -> float:
    """FLOPs of the LoRA adapters (rank ``rank`` on ``targets``) in one forward over ``batch`` rows; 0 without."""
    if rank <= 0:
        return 0.0
    return family_of(arch).lora_forward_flops(arch, rank, targets, batch, image_tokens, text_tokens)


def _backward_forwards(frozen_base: bool) -> int:
    """A backward in forward-equivalents: activation gradients, plus weight gradients unless frozen."""
    return 1 if frozen_base else 2


def step_flops(forward_flops_per_row: float, rollout_rows: int, check_rows: int, train_rows: int,
               extra_forward_rows: int = 0, frozen_base: bool = False, adapter_flops_per_row: float = 0.0,
               reference_rows: int = 0) -> float:
    """Rollout and log-prob check are forwards; a trained row is a forward and a backward; extra forward
    rows are CFG uncond branches done under no_grad; reference rows are the KL reference's forwards (the
    base alone: adapters off).  ``adapter_flops_per_row``: the LoRA adapters' part of a policy forward."""
    policy_forwards = rollout_rows + check_rows + train_rows + extra_forward_rows
    return (forward_flops_per_row * (policy_forwards + _backward_forwards(frozen_base) * train_rows + reference_rows)
            + adapter_flops_per_row * (policy_forwards + 2 * train_rows))  # adapters: A and B get weight gradients


def varlen_step_flops(per_row: Callable[[Hashable], tuple[float, float]],
                      trajectories: list[tuple[Hashable, Hashable | None, int]],
                      *, rollout_steps: int, frozen_base: bool, reused_uncond_pairs: int = 0, check_samples: int = 0,
                      check_reuses_uncond: bool = False, kl: bool = False, merged_rollout: bool = False) -> float:
    """FLOPs of one FlowGRPO step whose rows run at different text lengths (each prompt and negative prompt at its
    own, as the rollout engine and the trainer lay text out), as ``step_flops`` counts them row by row.

    ``trajectories``: per sample in training order, (the shape of its cond rows, its uncond rows' or None
    without CFG, its trained pairs), a shape being any key ``per_row`` takes (a text length; (image tokens, text
    length) where grids or context tokens differ); ``per_row(key)``: (base forward FLOPs, adapter FLOPs) of one
    row of that shape.  Rows: the rollout's steps (cond and uncond); per trained pair a cond forward + backward, an uncond
    forward unless among the first ``reused_uncond_pairs`` pairs (the rollout's output reused); the log-prob check
    of the first ``check_samples`` samples' pairs (cond rows only when ``check_reuses_uncond``); with ``kl`` the
    reference's cond and uncond rows (base only); ``merged_rollout``: the rollout's rows ran the adapters merged into
    the base's weights (base FLOPs only)."""
    forward, train, reference, rollout = Counter(), Counter(), Counter(), Counter()  # row shape -> rows
    reused_left = reused_uncond_pairs
    for i, (cond, uncond, pairs) in enumerate(trajectories):
        forward[cond] += rollout_steps
        rollout[cond] += rollout_steps
        train[cond] += pairs
        reference[cond] += pairs if kl else 0
        if i < check_samples:
            forward[cond] += pairs
        if uncond is None:
            continue
        reused = min(pairs, reused_left)
        reused_left -= reused
        rollout[uncond] += rollout_steps
        forward[uncond] += rollout_steps + (pairs - reused) + (pairs if i < check_samples and not check_reuses_uncond
                                                               else 0)
        reference[uncond] += pairs if kl else 0
    total = 0.0
    for shape in forward.keys() | train.keys():
        base, adapter = per_row(shape)
        total += step_flops(base, forward[shape], 0, train[shape], frozen_base=frozen_base,
                            adapter_flops_per_row=adapter, reference_rows=reference[shape])
        total -= adapter * rollout[shape] if merged_rollout else 0.0
    return total


def replica_peak_flops(dtype: torch.dtype, layout) -> float | None:
    """The summed peak of the devices one data-parallel replica spans (``layout``: a ParallelState or the config's
    parallel section; tp x cp x pp devices share a replica's step FLOPs), None where the device's peak is unknown:
    a replica's rate over it is the MFU per device."""
    peak = device_peak_flops(dtype)
    return peak * layout.tp * layout.cp * layout.pp if peak else None


def utilisation(flops: float, seconds: float, peak: float | None) -> dict[str, float]:
    """{"tflops_per_second": ...} and, where the peak is known, {"mfu": ...}."""
    out = {"tflops_per_second": flops / seconds / 1e12}
    if peak:
        out["mfu"] = flops / seconds / peak
    return out
