"""How a model runs its blocks: a slice of consecutive blocks per call of one function, the function that
``megatron_omni.compile.compile_blocks`` hands to torch.compile.

Why slices: under torch.compile each call of the compiled function is one graph (one guard check, one
AOTAutograd wrapper, one inductor-generated launcher), so a block per call pays that host work 60 times per
forward and per backward of a Qwen-Image, and leaves a block's last residual add and the next block's norm in two
kernels (the residual written, then read back).  Parameters are graph inputs, so every slice of the same length
reuses one compiled graph whichever blocks it holds.  Measured on an H200 (bench/RESULTS.md): the full-size
rollout forward is GPU-bound and gains nothing from 2 or 4 blocks per graph; the LoRA training step gains 0.7 %
at 4 for 35 s more compiling, so ``megatron_omni.compile`` keeps one block per graph by default.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint


def run_blocks(blocks: Sequence[torch.nn.Module], hidden: torch.Tensor, cond, modulations: Sequence) -> torch.Tensor:
    """``hidden`` through ``blocks`` in order, block i given (hidden, cond, modulations[i])."""
    for block, modulation in zip(blocks, modulations):
        hidden = block(hidden, cond, modulation)
    return hidden


class BlockRunner:
    """``per_call`` consecutive blocks per call of ``fn`` (``run_blocks`` or a compiled ``run_blocks``).
    ``recompute_layers``: with grad enabled, every that many consecutive blocks keep only their input and run
    again in the backward (activation recompute: ``model_specs.common.recompute``); None keeps everything."""

    def __init__(self, fn: Callable = run_blocks, per_call: int = 1, recompute_layers: int | None = None):
        for what, value in (("blocks per call", per_call), ("recompute layers", recompute_layers)):
            if what == "recompute layers" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} {value!r}; expected an integer >= 1")
        self.fn, self.per_call, self.recompute_layers = fn, per_call, recompute_layers

    def __call__(self, blocks: Sequence[torch.nn.Module], hidden: torch.Tensor, cond,
                 modulations: Sequence) -> torch.Tensor:
        if len(modulations) != len(blocks):
            raise ValueError(f"{len(modulations)} modulations for {len(blocks)} blocks; expected one per block")
        if self.recompute_layers is None or not torch.is_grad_enabled():
            return self._run(blocks, hidden, cond, modulations)
        n = self.recompute_layers
        for lo in range(0, len(blocks), n):
            hidden = checkpoint(self._run, blocks[lo:lo + n], hidden, cond, modulations[lo:lo + n],
                                use_reentrant=False)
        return hidden

    def _run(self, blocks, hidden: torch.Tensor, cond, modulations) -> torch.Tensor:
        for lo in range(0, len(blocks), self.per_call):
            hi = lo + self.per_call
            hidden = self.fn(blocks[lo:hi], hidden, cond, modulations[lo:hi])
        return hidden
