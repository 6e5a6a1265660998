"""Timestep schedules of a rollout: the rectified-flow sigmas and which steps are trained (SDE window).

Rectified flow (docs/algorithms.md): x_t = (1 - t)·x0 + t·ε with t = σ ∈ [0, 1]; t = 1 is pure noise.
Shape legend: N number of sampling steps; a schedule has N + 1 sigmas (both ends included).
"""
from __future__ import annotations

import torch


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The family's static timestep shift σ ← s·σ / (1 + (s − 1)·σ) (SD3 / Flux / Qwen-Image).

    It fixes 0 and 1 and, for s > 1, spends more steps at high noise."""
    if not shift > 0:
        raise ValueError(f"shift={shift!r}; expected a positive number (1.0 = no shift)")
    return shift * sigma / (1 + (shift - 1) * sigma)


def sigmas(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """[num_steps + 1] float32 sigmas from exactly 1 (noise) down to exactly 0 (data), evenly spaced
    before the shift; step i goes from sigmas[i] to sigmas[i + 1].  Computed in float64, then rounded."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r}; expected an integer >= 1")
    base_N1 = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(base_N1, float(shift)).to(torch.float32)


def check_window(num_steps: int, size: int, start_range: tuple[int, int]) -> None:
    """Raise ValueError naming the bad value unless windows of ``size`` steps starting anywhere in the
    inclusive ``start_range`` fit inside ``num_steps`` steps."""
    if not isinstance(size, int) or not 1 <= size <= num_steps:
        raise ValueError(f"SDE window size {size!r}; expected an integer in [1, num_steps={num_steps}]")
    lo, hi = start_range
    if not (isinstance(lo, int) and isinstance(hi, int)) or not 0 <= lo <= hi <= num_steps - size:
        raise ValueError(f"SDE window start range {tuple(start_range)!r} for window size {size}; expected "
                         f"integers 0 <= lo <= hi <= num_steps - size = {num_steps - size}")


def sde_window(num_steps: int, size: int, start_range: tuple[int, int] | None = None,
               generator: torch.Generator | None = None, start: int | None = None) -> tuple[torch.Tensor, int]:
    """MixGRPO-style SDE window: the mask [num_steps] (bool, True = SDE step, trained) of ``size``
    consecutive steps, and its start.

    The start is ``start`` when given, else drawn uniformly from the inclusive ``start_range``
    (default: every start that fits) with ``generator``, so a seeded generator reproduces it.
    Steps outside the window are plain ODE (Euler) steps and carry no log-prob.
    """
    if start_range is None:
        start_range = (0, num_steps - size) if isinstance(size, int) else (0, 0)
    check_window(num_steps, size, tuple(start_range))
    if start is None:
        lo, hi = start_range
        start = int(torch.randint(lo, hi + 1, (1,), generator=generator).item())
    elif not isinstance(start, int) or not 0 <= start <= num_steps - size:
        raise ValueError(f"SDE window start={start!r}; expected an integer in [0, {num_steps - size}] "
                         f"(num_steps={num_steps}, window size {size})")
    mask_N = torch.zeros(num_steps, dtype=torch.bool)
    mask_N[start:start + size] = True
    return mask_N, start
