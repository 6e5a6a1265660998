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

Only the per-token GEMMs (image and text tokens) take the FP8 path, from ``MIN_ROWS`` rows on.  The per-sample
linears (``RolloutLinear.per_sample``: the timestep and pooled-text embedders, a batch's few rows whose output
modulates every token) and those that gather their output (the adaLN modulations) are never switched.  The floor
lets a batch's short text stream in too (Qwen-Image's 5-token negative prompt: 80 rows at the recipe's batch 16,
where the model dtype's path read the whole bf16 weight and ran each adapter's two products apart).

The switched linears and their quantized copies: ``model_specs.common.rollout_linear`` (rebuilt when the weight
changes; with the engine sharing the policy's base, LoRA in process, the copy costs half the base's bf16 bytes;
with the adapters merged, ``rollout.lora_weights=merged``, it holds them too).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_ROWS = 16  # per-token GEMMs with fewer rows stay in the model dtype (256 until 2026-12-07)
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
    return scaled_product(x_q, x_scale, w_q_NK, w_scale_1N, x_MK.dtype, fast_accum)


def scaled_product(x_q_MK: torch.Tensor, x_scale_M1: torch.Tensor, w_q_NK: torch.Tensor, w_scale_1N: torch.Tensor,
                   out_dtype: torch.dtype, fast_accum: bool = True) -> torch.Tensor:
    """diag(s_x) (Q_x Q_w^T) diag(s_w) [M, N] in ``out_dtype`` from quantized operands: ``torch._scaled_mm`` on
    CUDA, its math in float32 elsewhere (the same quantized operands, scaled after the product)."""
    if x_q_MK.is_cuda:
        return torch._scaled_mm(x_q_MK, w_q_NK.t(), scale_a=x_scale_M1, scale_b=w_scale_1N, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return ((x_q_MK.float() @ w_q_NK.float().t()) * x_scale_M1 * w_scale_1N).to(out_dtype)


def _gelu_quantize_reference(y_MN, bias_N, lora_MN):
    """Torch ops: what the unfused MLP computes between fc1's product and fc2's quantization, each step rounded to
    y's dtype as eager rounds it: h = (y + lora) + b, a = gelu_tanh(h), then ``quantize_rows(a)``."""
    h = y_MN if lora_MN is None else y_MN + lora_MN
    h = h if bias_N is None else h + bias_N
    a = F.gelu(h, approximate="tanh")
    return (a, *quantize_rows(a))


if triton is not None:
    @triton.jit
    def _activation(y, bias, lora, at, cols, m, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, GELU: tl.constexpr,
                    TANH_APPROX: tl.constexpr):
        """gelu_tanh((y + lora) + b) at ``at`` in y's dtype, each step rounded as eager rounds it.  ``TANH_APPROX``:
        the tanh by the GPU's ``tanh.approx.f32`` (one instruction, max. relative error ~2^-11, far below e4m3's
        2^-4; a value that lands at a rounding boundary of y's dtype or of e4m3 can round one step apart)."""
        x = tl.load(y + at, mask=m, other=0.0)
        if HAS_LORA:
            x = (x.to(tl.float32) + tl.load(lora + at, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        if HAS_BIAS:
            x = (x.to(tl.float32) + tl.load(bias + cols, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        if GELU:
            xf = x.to(tl.float32)
            inner = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)  # sqrt(2 / pi) (x + 0.044715 x^3)
            if TANH_APPROX:
                t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [inner], dtype=tl.float32,
                                              is_pure=True, pack=1)
                x = (0.5 * xf * (1.0 + t)).to(x.dtype)
            else:
                x = (0.5 * xf * (2.0 * tl.sigmoid(2.0 * inner))).to(x.dtype)  # 1 + tanh(z) = 2 sigmoid(2 z)
        return x

    @triton.jit
    def _e4m3_codes(g, inv_scale, m, EMULATE: tl.constexpr):
        """g / scale (g times the row's ``inv_scale`` = 1 / scale: a multiply, not a division, per value; within one
        float32 ulp of the quotient, so an e4m3 code can differ only at a rounding boundary's ulp) clamped to e4m3's
        range and cast to its codes, to nearest even.  ``EMULATE`` (Triton's CPU
        interpreter, whose cast truncates): the rounding done first in float32 arithmetic on |v| -- a step of
        2^(e - 3) at exponent e, 2^-9 below the normals -- and the sign put back (a tiny negative rounds to -0, as
        the hardware's and torch's casts give), so that the cast is exact; on a GPU the hardware's conversion.  Each
        is bit-equal to torch's cast where it runs (tests/rollout/test_fp8.py); bench/gelu_quantize.py counts the
        emulation's codes compiled for a GPU against the hardware cast's."""
        v = tl.minimum(tl.maximum(tl.where(m, g.to(tl.float32), 0.0) * inv_scale, -448.0), 448.0)
        if EMULATE:
            a = tl.abs(v)
            e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
            step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
            inv = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
            r = ((a * inv + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: float32's round-to-nearest-even
            sign = v.to(tl.int32, bitcast=True) & -2147483648  # v's sign bit, -0's too (a negation compiled for a
            v = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)  # GPU gave +0 for -0's -r)
        return v.to(tl.float8e4nv)

    @triton.jit
    def _gelu_quantize_kernel(y, bias, lora, a_out, q_out, s_out, N: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_LORA: tl.constexpr, KEEP: tl.constexpr, GELU: tl.constexpr, BLOCK: tl.constexpr,
                              EMULATE: tl.constexpr, TANH_APPROX: tl.constexpr):
        """One program per row.  BLOCK >= N: the row whole in registers, read once.  Else in chunks of BLOCK: a
        first pass for the row's maximum (writing the kept activation), a second that recomputes each chunk from
        y (a re-read the L2 cache mostly serves: the row was read a moment before) and writes its codes; the
        values are the first pass's exactly (the same ops on the same inputs).  Launch: ``launch_of``."""
        row = tl.program_id(0).to(tl.int64)
        base = row * N
        if BLOCK >= N:
            cols = tl.arange(0, BLOCK)
            m = cols < N
            g = _activation(y, bias, lora, base + cols, cols, m, HAS_BIAS, HAS_LORA, GELU, TANH_APPROX)
            if KEEP:
                tl.store(a_out + base + cols, g, mask=m)
            scale = tl.maximum(tl.max(tl.abs(tl.where(m, g.to(tl.float32), 0.0)), axis=0) / 448.0, 1e-12)
            tl.store(q_out + base + cols, _e4m3_codes(g, 1.0 / scale, m, EMULATE), mask=m)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                m = cols < N
                g = _activation(y, bias, lora, base + cols, cols, m, HAS_BIAS, HAS_LORA, GELU, TANH_APPROX)
                if KEEP:
                    tl.store(a_out + base + cols, g, mask=m)
                amax = tl.maximum(amax, tl.abs(tl.where(m, g.to(tl.float32), 0.0)))
            scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
            inv_scale = 1.0 / scale
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                m = cols < N
                g = _activation(y, bias, lora, base + cols, cols, m, HAS_BIAS, HAS_LORA, GELU, TANH_APPROX)
                tl.store(q_out + base + cols, _e4m3_codes(g, inv_scale, m, EMULATE), mask=m)
        tl.store(s_out + row, scale)

    # (BLOCK, warps) launches bench/gelu_quantize.py compares: a config as wide as the row runs it whole
    LAUNCHES = ((16384, 16), (16384, 8), (8192, 8), (4096, 8), (4096, 4), (2048, 4), (2048, 8), (1024, 4))


def _runs_gelu_kernel(y: torch.Tensor) -> bool:
    """Triton on CUDA, or in Triton's CPU interpreter (TRITON_INTERPRET=1: how the CPU tests check its logic)."""
    return triton is not None and (y.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# a fixed (BLOCK, warps) for the row kernel instead of ``launch_of``'s (tests, bench/gelu_quantize.py)
_LAUNCH: tuple[int, int] | None = None
# the e4m3 rounding in float32 arithmetic (True) or the backend's cast (False) instead of the default: emulated in
# Triton's CPU interpreter only (tests; bench/gelu_quantize.py counts the codes the two give apart on a GPU)
_EMULATE: bool | None = None
# the GELU's tanh by the GPU's tanh.approx.f32 for 16-bit activations (CUDA only: Triton's CPU interpreter runs no
# PTX; float32 ones keep the exact tanh, their rounding being finer than the instruction's error).  On an H200 the
# merged case's kernel 0.281 -> 0.214 ms with 0.14 % of the codes one e4m3 step from torch's GELU.  With the adaLN
# kernel (rollout.fp8_adaln_kernel) on, the FP8 step's sampling phase 5.596 / 5.606 -> 5.540 / 5.540 s (-1.1 %, two
# A/B pairs on one machine; log-prob Pearson 1: bench/RESULTS.md, 2026-12-06), so it is the default since then (with
# the inductor handoff it measured neutral, 2026-12-03); False = the exact tanh.  bench/gelu_quantize.py and
# tests/rollout/test_fp8.py run both
TANH_APPROX = True
CHUNKED_MIN_ROWS = 4096  # separate adapters' rows from which the chunked launch runs (a GPU's worth of programs)


def launch_of(rows: int, n: int, reads_lora: bool) -> tuple[int, int]:
    """(BLOCK, warps) of the row kernel, from bench/gelu_quantize.py on an H200 (bench/RESULTS.md, 2026-12-03): the
    row whole in one program for fc1 -> fc2 with the adapters merged (16384 x 12288: 0.510 ms, every chunked launch
    0.549-0.747) and for the weight copies, over at most 8 warps (the merged case 0.434 -> 0.327 ms from 16 warps to
    8, 0.266 with the hardware's cast); in chunks of 1024 over 4 warps when the LoRA output is read and the
    activation kept (adapters separate: 0.610 ms against the whole row's 0.904), whose three row-sized tensors crowd
    one program's registers."""
    if reads_lora and rows >= CHUNKED_MIN_ROWS:
        return 1024, 4
    block = triton.next_power_of_2(n)
    return block, max(4, min(8, block // 2048))


def _row_kernel(y_MN, bias, lora, a, q, s, has_bias: bool, has_lora: bool, keep: bool, gelu: bool) -> None:
    m, n = y_MN.shape
    block, warps = _LAUNCH or launch_of(m, n, has_lora or keep)
    _gelu_quantize_kernel[(m,)](y_MN, bias, lora, a, q, s, N=n, HAS_BIAS=has_bias, HAS_LORA=has_lora, KEEP=keep,
                                GELU=gelu, BLOCK=block, EMULATE=not y_MN.is_cuda if _EMULATE is None else _EMULATE,
                                TANH_APPROX=TANH_APPROX and gelu and y_MN.is_cuda and y_MN.element_size() == 2,
                                num_warps=warps)


@torch.library.custom_op("megatron_omni::gelu_quantize_rows", mutates_args=())
def gelu_quantize_rows(y_MN: torch.Tensor, bias_N: torch.Tensor | None, lora_MN: torch.Tensor | None,
                       keep_activation: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fc1's FP8 output to fc2's FP8 input in one kernel: (a [M, N] = gelu_tanh((y + lora) + b) in y's dtype, or an
    empty tensor unless ``keep_activation`` (what fc2's LoRA adapter reads), Q [M, N] e4m3, s [M, 1] float32)
    with a ≈ s Q per row, ``quantize_rows(a)``.  One Triton program per row reads y (and the LoRA output) from
    memory once and writes Q (and a) once; elsewhere the same math as torch ops.  With ``TANH_APPROX`` on a GPU and
    16-bit y, GELU's tanh is the hardware's approximation: a value can round one step from torch's."""
    if not _runs_gelu_kernel(y_MN):
        a, q, s = _gelu_quantize_reference(y_MN, bias_N, lora_MN)
        return (a if keep_activation else a.new_empty(0)), q, s
    m, n = y_MN.shape
    y_MN = y_MN.contiguous()
    lora = y_MN if lora_MN is None else lora_MN.contiguous()
    a = torch.empty_like(y_MN) if keep_activation else y_MN.new_empty(0)
    q = torch.empty(m, n, device=y_MN.device, dtype=E4M3)
    s = torch.empty(m, 1, device=y_MN.device, dtype=torch.float32)
    _row_kernel(y_MN, y_MN if bias_N is None else bias_N, lora, a, q, s, bias_N is not None, lora_MN is not None,
                keep_activation, True)
    return a, q, s


@torch.no_grad()
def quantize_weight_rows(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` of a weight (the rollout's copies: once per weight change, outside any compiled graph): on
    CUDA the row kernel above without its GELU, one read of W and one write of its codes (the torch ops make five
    float32 passes); elsewhere ``quantize_rows``."""
    if not _runs_gelu_kernel(w_NK):
        return quantize_rows(w_NK)
    n, k = w_NK.shape
    w_NK = w_NK.contiguous()
    q = torch.empty(n, k, device=w_NK.device, dtype=E4M3)
    s = torch.empty(n, 1, device=w_NK.device, dtype=torch.float32)
    _row_kernel(w_NK, w_NK, w_NK, w_NK, q, s, False, False, False, False)
    return q, s


@gelu_quantize_rows.register_fake
def _(y_MN, bias_N, lora_MN, keep_activation):
    m, n = y_MN.shape
    a = torch.empty_like(y_MN) if keep_activation else y_MN.new_empty(0)
    return a, y_MN.new_empty(m, n, dtype=E4M3), y_MN.new_empty(m, 1, dtype=torch.float32)


def check_fp8_device(device: torch.device) -> None:
    """Raise ValueError when ``device`` is a CUDA GPU without FP8 tensor cores (compute capability < 8.9)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"rollout.fp8: the GPU {torch.cuda.get_device_name(device)!r} has compute capability {cap}; "
                         f"FP8 GEMMs need 8.9 or newer (Ada, Hopper, Blackwell); expected rollout.fp8=false here")
