"""torch.compile for DiT blocks, the one way both the rollout engine and the trainer use it.

The model's blocks run ``blocks_per_graph`` at a time (1 by default) through one compiled function
(``model_specs.common.block_runner``), and every such slice shares one compiled graph per input shape
(parameters are graph inputs, so the 60 blocks of a Qwen-Image reuse the first slice's code).  Shapes are
static at first and dynamic after the first change (``dynamic=None``, dynamo's automatic dynamic shapes): the
first shape gets kernels specialised to it, and a second one (another prompt's text length, a partial rollout
batch) recompiles once with the dimensions that changed symbolic, so later lengths reuse that graph.  With static
graphs every prompt length of a real prompt set was a new compilation (tens of seconds each, at every RL step of
the OCR recipe on an H200).
Grad mode is part of the guard, so the rollout (no_grad) and training (forward + backward through
AOTAutograd) compile separate graphs of the same blocks.

Inductor's coordinate-descent tuning is switched on (unless TORCHINDUCTOR_COORDINATE_DESCENT_TUNING is set): it
times neighbouring block sizes / warp counts of every Triton kernel it generates (the norms, modulations and
gated residuals around the GEMMs) once, at compile time.  The LoRA rollout forward of the full-size Qwen-Image at
batch 32 went 967.3 -> 957.1 ms on an H200, those kernels 69 -> 53 ms, for 12 s more compiling at the first
forward (bench/RESULTS.md).

At TP > 1, megatron-core's column-parallel linear all-reduces its input gradient inside its own autograd function
with ``torch.distributed.all_reduce(..., async_op=True)`` (to overlap it with the weight-gradient GEMM in eager
runs).  Dynamo cannot trace ``async_op=True``, so it leaves the whole function out of the graph and splits the
block at every column-parallel linear: 30 graph breaks for two blocks' forward + backward at TP=2 (CPU gloo).
``compile_blocks`` therefore sets their ``allreduce_dgrad = False``, megatron's own switch to its other path for
the same sum: ``copy_to_tensor_model_parallel_region`` before the linear (identity forward, a synchronous
all-reduce of the gradient backward, which dynamo traces as a functional collective).  The gradients are
unchanged (tests/trainer/test_compile.py); scheduling the all-reduce against the GEMMs is left to inductor.
"""
from __future__ import annotations

import os

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear

from model_specs.common.block_runner import BlockRunner, run_blocks

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# shapes x grad modes x LoRA on/off the blocks of one run see; dynamo falls back to eager past this
RECOMPILE_LIMIT = 64
# consecutive blocks per compiled graph (model_specs.common.block_runner: more than one measured no faster on an H200)
BLOCKS_PER_GRAPH = 1


def compile_blocks(model: torch.nn.Module, mode: str, blocks_per_graph: int | None = None) -> None:
    """``model.blocks`` under ``torch.compile(mode=mode, dynamic=None)``, ``blocks_per_graph`` consecutive blocks
    per graph (None: ``BLOCKS_PER_GRAPH``), in place: the model's ``block_runner`` is replaced."""
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}; expected one of {MODES}")
    blocks = getattr(model, "blocks", None)
    if blocks is None or not isinstance(getattr(model, "block_runner", None), BlockRunner):
        raise ValueError(f"{type(model).__name__} has no .blocks run by a .block_runner to compile "
                         f"(model_specs.common.block_runner)")
    runner = BlockRunner(torch.compile(run_blocks, mode=mode, dynamic=None),
                         BLOCKS_PER_GRAPH if blocks_per_graph is None else blocks_per_graph,
                         recompute_layers=model.block_runner.recompute_layers)  # (activation recompute kept)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING" not in os.environ:  # (an explicit setting wins)
        torch._inductor.config.coordinate_descent_tuning = True
    traceable_dgrad_allreduce(blocks)
    model.block_runner = runner


def traceable_dgrad_allreduce(module: torch.nn.Module) -> int:
    """Every megatron-core column-parallel linear in ``module`` that all-reduces its input gradient inside its
    autograd function switched to the traceable path (see the module docstring); returns how many."""
    switched = [m for m in module.modules() if isinstance(m, ColumnParallelLinear) and m.allreduce_dgrad]
    for m in switched:
        m.allreduce_dgrad = False  # forward() then routes the input through copy_to_tensor_model_parallel_region
    return len(switched)
