"""An FP8 GEMM's input from the adaLN path in one pass: gated residual, LayerNorm, modulation, e4m3 row quantization.

What a DiT block computes before its QKV and fc1 GEMMs (Qwen-Image, SD3: ``layers._modulate``), with the
quantization those GEMMs' FP8 path applies (``fp8.quantize_rows``):

    x' = x + gate * (r + bias)              (optional: the gated residual of the half-block before, its bias
                                             optional: a projection's, left for this pass to add)
    m  = LayerNorm(x') * (1 + scale) + shift
    (Q, s) = quantize_rows(m)               (Q e4m3, one float32 scale per row)

Why: the compiled block runs this as inductor's reductions, which (a row of 3072 being past its persistent
reductions) can read a row once for the LayerNorm's statistics, again for the row maximum of m and again for the
codes, as its fusion of fc1 -> GELU -> quantization did before ``fp8.gelu_quantize_rows``; ``bench/norm_quantize.py``
measures it: on an H100 the kernel at ``launch_of`` takes 0.499 ms per block forward against inductor's 0.560.
A Triton program holds its rows (``ROWS``, one by default) in registers: x and r are read once, x' (when there is
a residual), Q and s written once, m only where a consumer needs it in the model dtype (an unmerged LoRA adapter's
input).

By default the ops run in float32 and round to x's dtype only where stored, as inductor's fusion of them computes
(``fused_reference``); a launch with eager's roundings rounds each step as eager does (``norm_quantize_reference``:
20-30 % slower).  The LayerNorm's statistics are float32 either way (two passes over the row in registers; a GPU
may order its sums differently from torch: a value at a rounding boundary can land one bf16 step apart).  The
kernel runs on CUDA and in Triton's CPU interpreter (the tests); elsewhere the same torch ops.

A block on this path (``enable_adaln_fp8``; ``rollout.fp8_adaln_kernel``) hands its FP8 GEMMs an ``FP8Input``
instead of the modulated activation: ``fusion.column_parts`` (the attention's QKV) and ``GeluMLP`` (fc1) take it.
Legend: S sequence, B batch, H hidden, M = S·B rows (layout [S, B, H]: row m is sample m mod B).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_specs.common import fp8
from model_specs.common.fp8 import E4M3, quantize_rows, triton

if triton is not None:
    import triton.language as tl

    from model_specs.common.fp8 import _e4m3_codes

    @triton.jit
    def _rounded(v, dtype: tl.constexpr, ROUND: tl.constexpr):
        """v (float32) rounded to ``dtype``, to nearest even as eager rounds an op's result, returned as float32
        (``ROUND``; else v itself: float32 between the ops, as inductor fuses them).  bfloat16 by integer arithmetic
        on the bits: exact on every backend (Triton's CPU interpreter truncates a cast) and never folded away (a bare
        ``.to(dtype).to(tl.float32)`` may be, and with FMA contraction the next op then reads the unrounded value:
        seen on an H100, 28 % of a bf16 row's m one step off eager's)."""
        if not ROUND:
            return v
        elif dtype == tl.bfloat16:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)
        elif dtype == tl.float16:
            return v.to(dtype).to(tl.int16, bitcast=True).to(dtype, bitcast=True).to(tl.float32)
        else:
            return v

    @triton.jit
    def _norm_quantize_kernel(x, res, bias, gate, shift, scale, x_out, m_out, q_out, s_out, M, batch, mod_stride,
                              eps, N: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                              KEEP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, ROUND: tl.constexpr,
                              EMULATE: tl.constexpr):
        """``ROWS`` rows per program, each whole in registers (BLOCK >= N).  ``mod_stride``: the row stride of gate /
        shift / scale between samples (0: one row for the batch).  ``ROUND``: each op rounded to x's dtype as
        eager rounds it, launched without FMA contraction (``enable_fp_fusion=False``); else float32 between the
        ops, rounded where stored (as inductor's fusion of the same ops)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        m = (rows < M)[:, None] & (cols < N)[None, :]
        at = rows[:, None] * N + cols[None, :]
        mod = ((rows % batch) * mod_stride)[:, None] + cols[None, :]
        v = tl.load(x + at, mask=m, other=0.0)
        dt: tl.constexpr = v.dtype
        v = v.to(tl.float32)
        if HAS_RES:
            r = tl.load(res + at, mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:  # the residual's bias (a linear's, added after its product as eager adds it)
                r = _rounded(r + tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :], dt, ROUND)
            g = _rounded(tl.load(gate + mod, mask=m, other=0.0).to(tl.float32) * r, dt, ROUND)
            v = _rounded(v + g, dt, ROUND)
            tl.store(x_out + at, _rounded(v, dt, EMULATE).to(dt), mask=m)  # (the interpreter's cast truncates)
        vf = tl.where(m, v, 0.0)
        mean = tl.sum(vf, axis=1) / N
        d = tl.where(m, vf - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
        h = _rounded(d * rstd[:, None], dt, ROUND)
        one_plus = _rounded(1.0 + tl.load(scale + mod, mask=m, other=0.0).to(tl.float32), dt, ROUND)
        h = _rounded(h * one_plus, dt, ROUND)
        h = _rounded(h + tl.load(shift + mod, mask=m, other=0.0).to(tl.float32), dt, ROUND)
        if KEEP:
            tl.store(m_out + at, _rounded(h, dt, EMULATE).to(dt), mask=m)
        amax = tl.max(tl.abs(tl.where(m, h, 0.0)), axis=1)
        s = tl.maximum(amax / 448.0, 1e-12)
        tl.store(q_out + at, _e4m3_codes(h, (1.0 / s)[:, None], m, EMULATE), mask=m)
        tl.store(s_out + rows, s, mask=rows < M)


def norm_quantize_reference(x_SBH, shift_BH, scale_BH, eps, residual_SBH=None, gate_BH=None, bias_H=None):
    """The torch ops the kernel replaces: (x', m, Q [M, H], s [M, 1]); ``bias_H``: the residual's (r + bias)."""
    if residual_SBH is not None:
        x_SBH = x_SBH + gate_BH[None] * (residual_SBH if bias_H is None else residual_SBH + bias_H)
    m_SBH = F.layer_norm(x_SBH, x_SBH.shape[-1:], eps=eps) * (1 + scale_BH[None]) + shift_BH[None]
    return (x_SBH, m_SBH, *quantize_rows(m_SBH.reshape(-1, m_SBH.shape[-1])))


def fused_reference(x_SBH, shift_BH, scale_BH, eps, residual_SBH=None, gate_BH=None, bias_H=None):
    """The same ops in float32 throughout, x' and m rounded to x's dtype only where returned and the codes from
    the float32 m: what a fusion without intermediate roundings computes (inductor's; the kernel's ``round=False``
    launch)."""
    f = [None if t is None else t.float() for t in (x_SBH, shift_BH, scale_BH, residual_SBH, gate_BH, bias_H)]
    xn, m, q, s = norm_quantize_reference(f[0], f[1], f[2], eps, *f[3:])
    return xn.to(x_SBH.dtype), m.to(x_SBH.dtype), q, s


def _check(x_SBH, shift_BH, scale_BH, residual_SBH, gate_BH, bias_H) -> None:
    if (residual_SBH is None) != (gate_BH is None):
        raise ValueError("norm_modulate_quantize_rows: a residual needs its gate and a gate its residual")
    if bias_H is not None and (residual_SBH is None or bias_H.shape != x_SBH.shape[-1:]):
        raise ValueError(f"norm_modulate_quantize_rows: bias {tuple(bias_H.shape)}"
                         f"{'' if residual_SBH is not None else ' without a residual'}; expected [{x_SBH.shape[-1]}] "
                         f"with a residual (the residual's bias)")
    s, b, h = x_SBH.shape
    mods = [("shift", shift_BH), ("scale", scale_BH)] + ([("gate", gate_BH)] if residual_SBH is not None else [])
    for name, t in mods:
        if t.dim() != 2 or t.shape[0] not in (1, b) or t.shape[1] != h or t.stride(1) != 1:
            raise ValueError(f"norm_modulate_quantize_rows: {name} has shape {tuple(t.shape)} (strides "
                             f"{t.stride()}); expected [1 or {b}, {h}] with contiguous rows, for x [{s}, {b}, {h}]")
    if residual_SBH is not None and residual_SBH.shape != x_SBH.shape:
        raise ValueError(f"norm_modulate_quantize_rows: residual {tuple(residual_SBH.shape)}; expected x's "
                         f"{tuple(x_SBH.shape)}")


# (rows per program, warps, eager's roundings) for the kernel instead of ``launch_of``'s (bench/norm_quantize.py)
_LAUNCH: tuple[int, int, bool] | None = None


def launch_of(h: int) -> tuple[int, int, bool]:
    """(rows per program, warps, eager's roundings) of the kernel for rows of ``h``: one row over 4 warps, float32
    between the ops as inductor's fusion of them computes (the best of bench/norm_quantize.py's 18 launches on an H100
    at Qwen-Image's 3072: 0.499 ms per block forward against inductor's 0.560 and eager's roundings' 0.623; more
    rows per program and more warps were slower; bench/RESULTS.md)."""
    return 1, 4, False


def parse_launch(text: str) -> tuple[int, int, bool]:
    """``"ROWS,WARPS,ROUND"`` (bench/norm_quantize.py's ``best:`` line, e.g. ``4,8,false``) as a launch."""
    parts = text.split(",")
    ok = (len(parts) == 3 and all(p.strip().isdigit() for p in parts[:2])
          and parts[2].strip().lower() in ("true", "false"))
    rows, warps = (int(p) for p in parts[:2]) if ok else (0, 0)
    if not ok or rows & (rows - 1) or warps & (warps - 1) or not (rows and 1 <= warps <= 32):
        raise ValueError(f"adaLN kernel launch {text!r}: expected ROWS,WARPS,ROUND with ROWS and WARPS powers of "
                         f"two (WARPS 1-32) and ROUND true or false, e.g. 4,8,false")
    return rows, warps, parts[2].strip().lower() == "true"


@torch.library.custom_op("megatron_omni::norm_modulate_quantize_rows", mutates_args=())
def norm_modulate_quantize_rows(x_SBH: torch.Tensor, shift_BH: torch.Tensor, scale_BH: torch.Tensor, eps: float,
                                residual_SBH: torch.Tensor | None, gate_BH: torch.Tensor | None,
                                keep_modulated: bool, bias_H: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x' [S, B, H] = x + gate (r + bias), or an empty tensor without a residual; m [S, B, H], or empty unless
    ``keep_modulated``; Q [S·B, H] e4m3; s [S·B, 1] float32) with m = LayerNorm(x') (1 + scale) + shift ≈ s Q per
    row.  gate / shift / scale: [B or 1, H] (views of a modulation's chunks are fine); ``bias_H`` [H]: the
    residual's bias (a linear's, left for this pass to add), or None."""
    _check(x_SBH, shift_BH, scale_BH, residual_SBH, gate_BH, bias_H)
    if not fp8._runs_gelu_kernel(x_SBH):
        xn, m_SBH, q, s = norm_quantize_reference(x_SBH, shift_BH, scale_BH, eps, residual_SBH, gate_BH, bias_H)
        return (xn if residual_SBH is not None else x_SBH.new_empty(0)), \
            (m_SBH if keep_modulated else x_SBH.new_empty(0)), q, s
    seq, batch, h = x_SBH.shape
    x_SBH = x_SBH.contiguous()
    has_res = residual_SBH is not None
    res = residual_SBH.contiguous() if has_res else x_SBH
    x_out = torch.empty_like(x_SBH) if has_res else x_SBH.new_empty(0)
    m_out = torch.empty_like(x_SBH) if keep_modulated else x_SBH.new_empty(0)
    q = torch.empty(seq * batch, h, device=x_SBH.device, dtype=E4M3)
    s = torch.empty(seq * batch, 1, device=x_SBH.device, dtype=torch.float32)
    # one stride for all three modulation views: they are chunks of one [B, 6H] tensor in the blocks; else copies
    mods = [shift_BH, scale_BH] + ([gate_BH] if has_res else [])
    if len({(t.shape[0], t.stride(0)) for t in mods}) != 1:
        mods = [t.expand(batch, h).contiguous() for t in mods]
    stride = mods[0].stride(0) if mods[0].shape[0] > 1 else 0
    rows, warps, rounds = _LAUNCH or launch_of(h)
    _norm_quantize_kernel[(triton.cdiv(seq * batch, rows),)](
        x_SBH, res, bias_H.contiguous() if bias_H is not None else x_SBH, mods[2] if has_res else mods[0], mods[0],
        mods[1], x_out if has_res else x_SBH, m_out if keep_modulated else x_SBH, q, s, seq * batch, batch, stride,
        float(eps), N=h, HAS_RES=has_res, HAS_BIAS=bias_H is not None, KEEP=keep_modulated,
        BLOCK=triton.next_power_of_2(h), ROWS=rows, ROUND=rounds,
        EMULATE=not x_SBH.is_cuda if fp8._EMULATE is None else fp8._EMULATE, num_warps=warps,
        enable_fp_fusion=not rounds)
    return x_out, m_out, q, s


@norm_modulate_quantize_rows.register_fake
def _(x_SBH, shift_BH, scale_BH, eps, residual_SBH, gate_BH, keep_modulated, bias_H=None):
    seq, batch, h = x_SBH.shape
    x_out = torch.empty_like(x_SBH) if residual_SBH is not None else x_SBH.new_empty(0)
    m_out = torch.empty_like(x_SBH) if keep_modulated else x_SBH.new_empty(0)
    return x_out, m_out, x_SBH.new_empty(seq * batch, h, dtype=E4M3), x_SBH.new_empty(seq * batch, 1,
                                                                                        dtype=torch.float32)


@dataclass
class FP8Input:
    """A per-token GEMM's input already quantized per row: codes [M, K] e4m3 and scales [M, 1] of an activation
    shaped and typed as ``like`` [.., K]; ``x``, that activation itself where a consumer also reads it in the model
    dtype (an unmerged LoRA adapter), else None."""
    q_MK: torch.Tensor
    scale_M1: torch.Tensor
    like: torch.Tensor
    x: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        """``like`` as [M, K] (what a linear's row-count checks read)."""
        return self.like.reshape(-1, self.like.shape[-1])


def adaln_layer_norm(norm: torch.nn.Module) -> str:
    """'' when ``norm`` is the kernel's LayerNorm (torch's, without affine parameters); else why not."""
    if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None or norm.bias is not None:
        return f"{type(norm).__name__} is not a torch LayerNorm without affine parameters"
    return ""


def enable_adaln_fp8(model: torch.nn.Module, enable: bool = True) -> int:
    """Switch every block of ``model`` whose ``adaln_fp8_capable()`` is '' to the one-pass FP8 input
    (``enable=False``: all back); returns how many are on.  Call after ``fusion.fuse_inference`` and
    ``rollout_linear.enable_fp8``: a block takes the path only when its attention and MLPs run fused in FP8."""
    count = 0
    for m in model.modules():
        if callable(getattr(m, "adaln_fp8_capable", None)):
            m.adaln_fp8 = bool(enable) and not m.adaln_fp8_capable()
            count += m.adaln_fp8
    return count
