"""torch.compile for DiT blocks, the one way both the rollout engine and the trainer use it.

Every block of a model shares one compiled graph per input shape (parameters are graph inputs, so the 60
blocks of a Qwen-Image reuse the first block's code).  Shapes are static (``dynamic=False``): the rollout's
rows and the trainer's micro-batches are a handful of fixed shapes, and each gets kernels tuned for it.
Grad mode is part of the guard, so the rollout (no_grad) and training (forward + backward through
AOTAutograd) compile separate graphs of the same blocks.

Inductor's coordinate-descent tuning is switched on (unless TORCHINDUCTOR_COORDINATE_DESCENT_TUNING is set): it
times neighbouring block sizes / warp counts of every Triton kernel it generates (the norms, modulations and
gated residuals around the GEMMs) once, at compile time.  The LoRA rollout forward of the full-size Qwen-Image at
batch 32 went 967.3 -> 957.1 ms on an H200, those kernels 69 -> 53 ms, for 12 s more compiling at the first
forward (bench/RESULTS.md).
"""
from __future__ import annotations

import os

import torch

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# shapes x grad modes x LoRA on/off the blocks of one run see; dynamo falls back to eager past this
RECOMPILE_LIMIT = 64


def compile_blocks(model: torch.nn.Module, mode: str) -> None:
    """``model.blocks`` each under ``torch.compile(mode=mode, dynamic=False)`` (in place)."""
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}; expected one of {MODES}")
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no .blocks to compile")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING" not in os.environ:  # (an explicit setting wins)
        torch._inductor.config.coordinate_descent_tuning = True
    for block in blocks:
        block.compile(mode=mode, dynamic=False)
