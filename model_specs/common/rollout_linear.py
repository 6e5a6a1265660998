"""The rollout engine's copies of a linear's weight: its LoRA adapter merged in, and / or quantized to FP8.

Without autograd (the engine's forwards) a switched linear's product reads, instead of the model's weight W:

* ``W + s·B·A`` with its LoRA adapter merged (``merge_adapters``; ``rollout.lora_weights=merged``): one GEMM where the
  trainer runs the base's and the adapter's two skinny ones (7 % of the full-size Qwen-Image's LoRA r64 rollout
  forward on an H200, bench/RESULTS.md).  The sum is one addmm (float32 accumulation, rounded once to the model
  dtype: ``LoRALinear.merged_weight``), so the rollout's products differ from the trainer's by rounding (the trainer then recomputes π_old itself:
  ``FlowGRPO.trainer_old_policy``);
* that weight (or W) quantized to float8 e4m3 with per-row scales (``enable_fp8``; ``rollout.fp8``,
  ``model_specs.common.fp8``), for inputs of at least ``fp8.MIN_ROWS`` rows: with an adapter merged, the FP8 GEMM
  carries it, and the adapter's bf16 GEMMs do not run at all.

The copies are rebuilt by ``refresh_rollout_weights`` when a weight they derive from changed (the version counters
of W, A and B: a weight sync, a load, an optimizer step), and freed by ``drop_rollout_weights`` (the merged ones
while the trainer runs: they are rebuilt from the next adapters anyway).  A LoRA run's unmerged FP8 base
never changes, so it quantizes once.  The adapter (``lora.LoRALinear``) asks its base ``adapter_merged(x)`` and
skips its own low-rank product when the base's already holds it.
"""
from __future__ import annotations

import torch

from model_specs.common import fp8


class RolloutLinear:
    """Mixin of a megatron-core local linear (``megatron_omni.parallel.linears``): the rollout's weight copies."""

    fp8_weight: torch.Tensor | None = None  # [N, K] e4m3 of W (+ s B A when merged)
    fp8_scale: torch.Tensor | None = None  # [1, N] float32
    merged_weight: torch.Tensor | None = None  # [N, K] W + s B A in the model dtype (merged without FP8)
    _fp8_on = False
    _merge_on = False
    _adapter = None  # the wrapping LoRALinear while merged (set with object.__setattr__: not a submodule)
    _rollout_version: tuple | None = None
    fp8_fast_accum = True  # the GPU kernel's fast accumulation (fp8.fp8_matmul)
    # a per-sample linear (a timestep or pooled-text embedder: a batch's few rows, whose output modulates every token):
    # its product stays in the model dtype whatever its rows (``fp8_capable``)
    per_sample = False

    def fp8_capable(self) -> bool:
        """Whether this linear's product is a per-token, plain local x W^T (not ``per_sample``, no sequence
        parallelism, no output gather)."""
        k, n = self.weight.shape[1], self.weight.shape[0]
        return (not self.per_sample and not getattr(self, "sequence_parallel", False)
                and not getattr(self, "gather_output", False) and k % 16 == 0 and n % 16 == 0)

    def set_fp8(self, enable: bool, fast_accum: bool = True) -> bool:
        """Switch the FP8 path on (quantizing the weight) or off (dropping the copy); returns whether it is on."""
        self._fp8_on = bool(enable) and self.fp8_capable()
        self.fp8_fast_accum = bool(fast_accum)
        self.drop_rollout()
        self.refresh_rollout()
        return self._fp8_on

    def set_merged(self, adapter) -> bool:
        """Merge ``adapter`` (the LoRALinear wrapping this base; None: unmerge) into the rollout's weight."""
        object.__setattr__(self, "_adapter", adapter)
        self._merge_on = adapter is not None
        self.drop_rollout()
        self.refresh_rollout()
        return self._merge_on

    def _merging(self) -> bool:
        return self._merge_on and self._adapter.enabled

    @torch.no_grad()
    def refresh_rollout(self) -> None:
        """Rebuild the copies if a weight they derive from changed since they were built."""
        if not (self._fp8_on or self._merge_on):
            return
        w = self.weight
        version = (w.data_ptr(), w._version, w.device)
        if self._merging():
            a, b = self._adapter.lora_A, self._adapter.lora_B
            version += (a.data_ptr(), a._version, b.data_ptr(), b._version)
        version += (self._merging(),)
        if version == self._rollout_version:
            return
        source = self._adapter.merged_weight() if self._merging() else w
        if self._fp8_on:
            self.fp8_weight, scale_N1 = fp8.quantize_weight_rows(source)
            self.fp8_scale = scale_N1.t().contiguous()
        self.merged_weight = source if self._merging() and not self._fp8_on else None
        self._rollout_version = version

    def drop_rollout(self, merged_only: bool = False) -> None:
        """Free the copies (rebuilt by the next ``refresh_rollout``); ``merged_only``: those holding an adapter."""
        if merged_only and not self._merging():
            return
        self.fp8_weight = self.fp8_scale = self.merged_weight = self._rollout_version = None

    # ---- the forward (no autograd) ---------------------------------------------------------------------------
    def _fp8_applies(self, x: torch.Tensor) -> bool:
        return self._fp8_on and not torch.is_grad_enabled() and x.numel() >= fp8.MIN_ROWS * x.shape[-1]

    def adapter_merged(self, x: torch.Tensor) -> bool:
        """Whether this base's product of ``x`` already holds its adapter's output (so the adapter adds none)."""
        if not self._merge_on or torch.is_grad_enabled() or not self._adapter.enabled:
            return False
        return self._fp8_applies(x) if self._fp8_on else True

    def rollout_weight(self) -> torch.Tensor:
        """The model-dtype weight this linear's product reads now: W + s B A (merged without FP8, no autograd)
        or W."""
        if not self._merge_on or self._fp8_on or torch.is_grad_enabled() or not self._adapter.enabled:
            return self.weight
        if self.merged_weight is None:
            raise RuntimeError(f"{type(self).__name__}: the adapter is merged but its weight was not built; call "
                               f"refresh_rollout_weights()")
        return self.merged_weight

    def fp8_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T in FP8 when the path applies to ``x`` (on, no autograd, enough rows), else None."""
        if not self._fp8_applies(x):
            return None
        if self.fp8_weight is None:
            raise RuntimeError(f"{type(self).__name__}: FP8 is on but the weight was not quantized; call "
                               f"refresh_rollout_weights()")
        x_MK = x.reshape(-1, x.shape[-1])
        return fp8.fp8_matmul(x_MK, self.fp8_weight, self.fp8_scale, self.fp8_fast_accum).view(*x.shape[:-1], -1)

    def fp8_quantized_product(self, x_q_MK: torch.Tensor, x_scale_M1: torch.Tensor, out_dtype: torch.dtype):
        """x W^T [M, N] from an input already quantized per row (``fp8.gelu_quantize_rows``): the kernel alone."""
        if self.fp8_weight is None:
            raise RuntimeError(f"{type(self).__name__}: FP8 is on but the weight was not quantized; call "
                               f"refresh_rollout_weights()")
        return fp8.scaled_product(x_q_MK, x_scale_M1, self.fp8_weight, self.fp8_scale, out_dtype,
                                  self.fp8_fast_accum)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if weight is self.weight and not torch.is_grad_enabled():
            out = self.fp8_product(input)
            if out is not None:
                bias = kwargs.get("bias", args[0] if args else None)
                return out if bias is None else out + bias
            weight = self.rollout_weight()
        return super()._forward_impl(input, weight, *args, **kwargs)


def rollout_linears(model: torch.nn.Module):
    return ((name, m) for name, m in model.named_modules() if isinstance(m, RolloutLinear))


def enable_fp8(model: torch.nn.Module, enable: bool = True, fast_accum: bool = True) -> int:
    """Switch every FP8-capable local linear of ``model`` to FP8 products (``enable=False``: all back), with the
    GPU kernel's fast accumulation or not; returns how many are on.  Call before ``fusion.fuse_inference``: a fused
    GEMM epilogue yields to FP8."""
    return sum(m.set_fp8(enable, fast_accum) for _, m in rollout_linears(model))


def merge_adapters(model: torch.nn.Module, enable: bool = True) -> int:
    """Merge every LoRA adapter of ``model`` whose base is a ``RolloutLinear`` into the rollout's weight
    (``enable=False``: unmerge all); returns how many are merged.  Call before ``fusion.fuse_inference``."""
    from model_specs.common.lora import lora_modules

    return sum(m.base.set_merged(m if enable else None) for m in lora_modules(model).values()
               if isinstance(m.base, RolloutLinear))


def refresh_rollout_weights(model: torch.nn.Module) -> None:
    """Rebuild the copies whose weights changed (cheap when none did)."""
    for _, m in rollout_linears(model):
        m.refresh_rollout()


def drop_rollout_weights(model: torch.nn.Module, merged_only: bool = False) -> None:
    """Free the copies (the switches stay on: ``refresh_rollout_weights`` rebuilds them); ``merged_only``: only
    those holding an adapter (rebuilt from the next adapters anyway), e.g. while the trainer runs."""
    for _, m in rollout_linears(model):
        m.drop_rollout(merged_only)


def uses_fp8(linear: torch.nn.Module) -> bool:
    """Whether ``linear`` (or a LoRA adapter's base) runs its product in FP8."""
    base = getattr(linear, "base", linear)
    return bool(getattr(base, "_fp8_on", False))

