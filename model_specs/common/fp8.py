"""FP8 rollout GEMMs: the rollout engine's per-token linears in float8 e4m3 with per-row scales, training in bf16.

Each switched linear keeps a quantized copy of its weight, W ≈ diag(s_w) Q_w with one float32 scale per output
row (s_w = max|W_n| / 448, e4m3's largest finite value), next to the model's own weight (which training, the
weight sync and a LoRA adapter keep using).  At every forward without autograd its input is quantized the same
way per row (per token), and the product is

    x W^T ≈ diag(s_x) (Q_x Q_w^T) diag(s_w),

one ``torch._scaled_mm`` on CUDA (sm89+: FP8 tensor cores, float32 accumulation, bf16 output), a float32
emulation of that kernel elsewhere (the same quantized operands, dequantized, multiplied in float32), so that the
path's logic is testable on a CPU.  The bias, megatron's TP reductions and a LoRA adapter's low-rank output stay
as they are, in the model dtype.

Only GEMMs of at least ``MIN_ROWS`` rows take the FP8 path: the per-token ones (image and text tokens).  The
per-sample GEMMs (a batch's few rows: the timestep embedding) stay in the model dtype; they cost nothing and a
per-sample scale buys no speed.  Linears that gather their output (the adaLN modulations) are never switched.

The quantized copy is rebuilt when the weight changes (its version counter moves: a weight sync, a load), so a
LoRA run, whose base never changes, quantizes once.  With the engine sharing the policy's base (LoRA in
process) the copy costs half the base's bf16 bytes.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_ROWS = 256  # GEMMs with fewer rows (per-sample ones) stay in the model dtype
_TINY = 1e-12  # floor of a scale: an all-zero row quantizes to zeros, not NaN


def quantize_rows(t_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q [M, K] e4m3, s [M, 1] float32) with t ≈ s * Q, one scale per row: s = max|t_m| / 448."""
    t = t_MK.float()
    scale_M1 = (t.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp_min(_TINY)
    return (t / scale_M1).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale_M1


def fp8_matmul(x_MK: torch.Tensor, w_q_NK: torch.Tensor, w_scale_1N: torch.Tensor,
               fast_accum: bool = True) -> torch.Tensor:
    """x W^T [M, N] in x's dtype from the quantized weight (``quantize_rows(W)``, its scales as a contiguous row
    [1, N], the kernel's layout); x is quantized per row here.  ``fast_accum``: the kernel's fast accumulation
    (the GPU only; the emulation accumulates in float32)."""
    x_q, x_scale = quantize_rows(x_MK)
    if x_MK.is_cuda:
        return torch._scaled_mm(x_q, w_q_NK.t(), scale_a=x_scale, scale_b=w_scale_1N, out_dtype=x_MK.dtype,
                                use_fast_accum=fast_accum)
    # the kernel's math in float32: the same quantized operands, scaled after the product
    return ((x_q.float() @ w_q_NK.float().t()) * x_scale * w_scale_1N).to(x_MK.dtype)


def check_fp8_device(device: torch.device) -> None:
    """Raise ValueError when ``device`` is a CUDA GPU without FP8 tensor cores (compute capability < 8.9)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"rollout.fp8: the GPU {torch.cuda.get_device_name(device)!r} has compute capability {cap}; "
                         f"FP8 GEMMs need 8.9 or newer (Ada, Hopper, Blackwell); expected rollout.fp8=false here")


class FP8Linear:
    """Mixin of a megatron-core local linear: its matmul (``_forward_impl``) runs in FP8 once ``set_fp8(True)``
    was called and autograd is off, for inputs of at least ``MIN_ROWS`` rows; otherwise megatron's own."""

    fp8_weight: torch.Tensor | None = None  # [N, K] e4m3
    fp8_scale: torch.Tensor | None = None  # [1, N] float32
    _fp8_on = False
    _fp8_version: tuple | None = None
    fp8_fast_accum = True  # the GPU kernel's fast accumulation (fp8_matmul)

    def fp8_capable(self) -> bool:
        """Whether this linear's product is a plain local x W^T (no sequence parallelism, no output gather)."""
        k, n = self.weight.shape[1], self.weight.shape[0]
        return (not getattr(self, "sequence_parallel", False) and not getattr(self, "gather_output", False)
                and k % 16 == 0 and n % 16 == 0)

    def set_fp8(self, enable: bool, fast_accum: bool = True) -> bool:
        """Switch the FP8 path on (quantizing the weight) or off (dropping the copy); returns whether it is on."""
        self._fp8_on = bool(enable) and self.fp8_capable()
        self.fp8_fast_accum = bool(fast_accum)
        self.fp8_weight = self.fp8_scale = self._fp8_version = None
        self.refresh_fp8()
        return self._fp8_on

    @torch.no_grad()
    def refresh_fp8(self) -> None:
        """Re-quantize the weight if it changed since the last quantization (a sync, a load, a device move)."""
        if not self._fp8_on:
            return
        w = self.weight
        version = (w.data_ptr(), w._version, w.device)
        if version != self._fp8_version:
            self.fp8_weight, scale_N1 = quantize_rows(w)
            self.fp8_scale = scale_N1.t().contiguous()
            self._fp8_version = version

    def fp8_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T in FP8 when the path applies to ``x`` (on, no autograd, enough rows), else None."""
        if not self._fp8_on or torch.is_grad_enabled() or x.numel() < MIN_ROWS * x.shape[-1]:
            return None
        if self.fp8_weight is None:
            raise RuntimeError(f"{type(self).__name__}: FP8 is on but the weight was not quantized; call refresh_fp8()")
        x_MK = x.reshape(-1, x.shape[-1])
        return fp8_matmul(x_MK, self.fp8_weight, self.fp8_scale, self.fp8_fast_accum).view(*x.shape[:-1], -1)

    def _forward_impl(self, input, weight, *args, **kwargs):
        bias = kwargs.get("bias", args[0] if args else None)
        if weight is self.weight:
            out = self.fp8_product(input)
            if out is not None:
                return out if bias is None else out + bias
        return super()._forward_impl(input, weight, *args, **kwargs)


def fp8_linears(model: torch.nn.Module):
    return ((name, m) for name, m in model.named_modules() if isinstance(m, FP8Linear))


def enable_fp8(model: torch.nn.Module, enable: bool = True, fast_accum: bool = True) -> int:
    """Switch every FP8-capable local linear of ``model`` to FP8 products (``enable=False``: all back), with the
    GPU kernel's fast accumulation or not; returns how many are on.  Call before ``fusion.fuse_inference``: a fused
    GEMM epilogue yields to FP8."""
    return sum(m.set_fp8(enable, fast_accum) for _, m in fp8_linears(model))


def refresh_fp8(model: torch.nn.Module) -> None:
    """Re-quantize the switched linears whose weights changed (cheap when none did)."""
    for _, m in fp8_linears(model):
        m.refresh_fp8()


def drop_fp8(model: torch.nn.Module) -> None:
    """Free the quantized copies (the switch stays on: ``refresh_fp8`` rebuilds them), e.g. while weights sleep."""
    for _, m in fp8_linears(model):
        m.fp8_weight = m.fp8_scale = m._fp8_version = None


def uses_fp8(linear: torch.nn.Module) -> bool:
    """Whether ``linear`` (or a LoRA adapter's base) runs its product in FP8."""
    base = getattr(linear, "base", linear)
    return bool(getattr(base, "_fp8_on", False))
