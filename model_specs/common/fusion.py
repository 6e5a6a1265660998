"""Inference-only fused paths of a model's modules, switched on together (the rollout engine does it).

A module takes part by having ``fusable() -> str`` ('' when its fused path computes what its plain forward
does for this configuration, else why not), a ``fused`` flag its forward reads (the fused path runs only
with autograd off: its kernels have no backward) and ``refresh_fused()`` (rebuild whatever it derives
from the weights; called again after every weight change).  Members: ``gelu_mlp.GeluMLP`` (fc1 + GELU
epilogue), the Qwen-Image ``JointAttention`` (q / k norm + RoPE + joint layout in one kernel) and SD3's
``JointAttention`` / ``SelfAttention`` (the same kernel without rotation).
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from model_specs.common.lora import LoRALinear
from model_specs.common.norm_quantize import FP8Input
from model_specs.common.rollout_linear import RolloutLinear


def local_column(linear: torch.nn.Module) -> bool:
    """A local (megatron-core) column-parallel linear whose product is this rank's x W^T + b: it has a bias,
    no sequence parallelism, no output gather; (no LoRA wrapper: a ``LoRALinear`` is not one)."""
    return (isinstance(linear, ColumnParallelLinear) and linear.bias is not None and not linear.sequence_parallel
            and not linear.gather_output)


def plain_column(linear: torch.nn.Module) -> bool:
    """A ``local_column`` that also adds its bias itself (its forward's output includes the bias)."""
    return local_column(linear) and not linear.skip_bias_add


def column_parts(linear: torch.nn.Module, x: torch.Tensor):
    """``linear(x)``'s output for a consumer that adds the bias and a LoRA adapter's output itself, as
    (product [.., O], bias [O] or None, LoRA output [.., O] or None); their sum is ``linear(x)[0]``.

    - a ``plain_column``, or a ``LoRALinear`` on one: x W^T by ``mm``, the bias and
      the adapter's output apart, so that the consumer reads them once and sums them in float32 instead of a pass
      writing their sum first.  Not addmm with the bias in cuBLAS's epilogue: at the rollout's image QKV
      ([32768, 3072] x [3072, 9216], H200) cuBLAS ran ``mm`` at 817 TFLOP/s and the bias epilogue at 690
      (bench/gemm_shapes.py; within 2.5 % of each other at 4096 and 8192 rows).  The product rounded, then the bias
      added, is also what megatron's linear computes in training.  A base with rollout weights
      (``rollout_linear.RolloutLinear``) gives its FP8 product, or its merged weight's, instead (an adapter merged
      there gives no output of its own);
    - an ``FP8Input`` (already quantized by the block: ``norm_quantize``), to an FP8 ``plain_column``: the kernel
      alone, the adapter reading the input the block kept;
    - anything else: its own forward.
    """
    wrapped = isinstance(linear, LoRALinear)
    base = linear.base if wrapped else linear
    if isinstance(x, FP8Input):
        product = base.fp8_quantized_product(x.q_MK, x.scale_M1, x.like.dtype).view(*x.like.shape[:-1], -1)
        adapter = wrapped and linear.enabled and not linear.merged_in_base(x.rows())
        return product, base.bias, linear.low_rank(x.x) if adapter else None
    if plain_column(base):  # (an adapter on a column-parallel base is column-parallel itself)
        rollout = isinstance(base, RolloutLinear)
        product = base.fp8_product(x) if rollout else None  # (the FP8 rollout path)
        if product is None:
            weight = base.rollout_weight() if rollout else base.weight
            product = torch.mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], -1)
        adapter = wrapped and linear.enabled and not linear.merged_in_base(x)
        return product, base.bias, linear.low_rank(x) if adapter else None
    return linear(x)[0], None, None


def local_row(linear: torch.nn.Module) -> bool:
    """A megatron-core row-parallel linear on one rank (no reduction), adding its own bias: its output is x W^T + b,
    no sequence parallelism."""
    return (isinstance(linear, RowParallelLinear) and linear.bias is not None and not linear.sequence_parallel
            and not linear.skip_bias_add and linear.tp_group.size() == 1)


def row_parts(linear: torch.nn.Module, x: torch.Tensor):
    """``linear(x)``'s output for a consumer that adds the bias itself, as (product [.., O], bias [O] or None); their
    sum is ``linear(x)[0]``.  An FP8 ``local_row`` base (``rollout_linear.RolloutLinear``; a ``LoRALinear`` on one
    only with its adapter merged there): its FP8 product and its bias apart, so that the consumer (the block's
    one-pass adaLN input, ``norm_quantize``) adds the bias as it reads the product instead of a pass writing their
    sum first.  Anything else: its own forward."""
    wrapped = isinstance(linear, LoRALinear)
    base = linear.base if wrapped else linear
    if (isinstance(base, RolloutLinear) and local_row(base)
            and not (wrapped and linear.enabled and not linear.merged_in_base(x))):
        product = base.fp8_product(x)
        if product is not None:
            return product, base.bias
    return linear(x)[0], None


def _members(model: torch.nn.Module):
    return ((name, m) for name, m in model.named_modules() if callable(getattr(m, "fusable", None)))


def fuse_inference(model: torch.nn.Module, enable: bool = True, strict: bool = False) -> int:
    """Switch every member of ``model`` that can fuse to its fused path (``enable=False``: all back to the
    plain one) and build what it derives from the weights; returns how many are fused.  The others keep
    their plain path, or with ``strict`` raise ValueError naming the first and why."""
    count = 0
    for name, m in _members(model):
        why = m.fusable() if enable else "disabled"
        if why and enable and strict:
            raise ValueError(f"fuse_inference: {name} ({type(m).__name__}) cannot take its fused path: {why}")
        m.fused = not why
        m.refresh_fused()
        count += m.fused
    return count


def refresh_fused(model: torch.nn.Module) -> None:
    """Refresh what the fused members derive from the weights (after a sync or a load)."""
    for _, m in _members(model):
        if m.fused:
            m.refresh_fused()
