"""Joint attention's q / k / v preparation in one pass: per-head RMSNorm of q and k, RoPE on both (Qwen-Image; SD3
adds its positions at the patch embedding and passes no tables: no rotation), and every stream's rows written into
the joint [text; image] sequence in Megatron's [S, B, N, D] layout.

Why: unfused (or as torch.compile fuses it) this is a reduction kernel per norm, a pointwise norm + RoPE
kernel and a concatenation copy per tensor: q and k are read and written about three times.  On the
full-size Qwen-Image at batch 32 that was 92 ms of a 975 ms compiled rollout forward on an H200; this kernel,
which reads each stream's fused QKV output once and writes q, k and v once (~1.4 GB per block), took 36 ms
(bench/RESULTS.md).

The Triton kernel has no backward: it runs under no_grad on CUDA (the rollout engine, ``fuse_inference``).
Everywhere else the same function runs as torch ops (``_reference``), the math of the unfused model:
RMSNorm in float32 rounded to the input dtype, then the float32 rotation of :func:`apply_rope`.

Layout: a stream's QKV is [S, B, N * 3D] with rows interleaved per head ([q_h, k_h, v_h]), as
``checkpoints_convert.mapping.fuse_qkv`` lays out the weight.  RoPE tables are float32 [S, D/2, 2]
(cos, sin), or None for a stream without rotation.  Outputs are [S_T + S_I, B, N, D] contiguous, the layout of the unfused path's concatenation.  SDPA
reads their [B, N, S, D] permutes natively and writes its output in the same sequence-major layout, so the
attention output needs no transposing copy before the output projections.  (Until 2026-12-01 this kernel wrote
batch-major q, k, v: cuDNN attention ran 1 % faster on them, but its batch-major output then took a [S, B, H] copy,
0.077 ms per block at batch 8 and 0.298 at batch 32 on an H200, bench/RESULTS.md.)
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below
    triton = None


def apply_rope(x_SBND: torch.Tensor, freqs_SD2: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2i, 2i+1) of q or k by (cos, sin) [S, D/2, 2], in float32:
    (a, b) -> (a cos - b sin, a sin + b cos), the complex product diffusers computes."""
    s, b, n, d = x_SBND.shape
    a, b_ = x_SBND.float().reshape(s, b, n, d // 2, 2).unbind(-1)
    cos, sin = freqs_SD2[:, None, None, :, 0], freqs_SD2[:, None, None, :, 1]
    out = torch.stack([a * cos - b_ * sin, a * sin + b_ * cos], dim=-1).flatten(3)
    return out.type_as(x_SBND)


def _rotated(x_SBND: torch.Tensor, freqs_SD2: torch.Tensor | None) -> torch.Tensor:
    return x_SBND if freqs_SD2 is None else apply_rope(x_SBND, freqs_SD2)


def rms_norms_fusable(*norms: torch.nn.Module) -> str:
    """'' when the kernel computes what ``norms`` (an attention's q / k norms) compute; else why not: the fusion
    protocol's ``fusable`` answer (model_specs.common.fusion) for an attention whose q / k go through here."""
    if not all(isinstance(n, torch.nn.RMSNorm) and n.weight is not None and n.eps is not None for n in norms):
        return "the q / k norms are not torch.nn.RMSNorm with a weight and an explicit eps"
    if len({n.eps for n in norms}) != 1:
        return f"the q / k norms have different eps {sorted({n.eps for n in norms})}"
    return ""


def _summed(qkv, bias, lora):
    """qkv + bias + lora in float32, rounded once to qkv's dtype (what torch.compile's fused add of megatron's
    bias and the LoRA output computed); qkv itself when both are None."""
    if bias is None and lora is None:
        return qkv
    out = qkv.float()
    if bias is not None:
        out = out + bias.float()
    if lora is not None:
        out = out + lora.float()
    return out.to(qkv.dtype)


def _reference(streams, heads: int, eps: float):
    """Torch ops: the unfused model's math.  ``streams``: (qkv [S, B, N*3D], q_weight, k_weight, freqs or None[,
    bias, lora])."""
    qs, ks, vs = [], [], []
    for qkv, wq, wk, freqs, *added in streams:
        qkv = _summed(qkv, *(added or (None, None)))
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, heads, qkv.shape[-1] // heads).split(qkv.shape[-1] // (3 * heads), dim=-1)
        d = q.shape[-1]
        qs.append(_rotated(F.rms_norm(q, (d,), wq, eps), freqs))
        ks.append(_rotated(F.rms_norm(k, (d,), wk, eps), freqs))
        vs.append(v)
    return tuple(torch.cat(parts, dim=0) for parts in (qs, ks, vs))


if triton is not None:
    @triton.jit
    def _norm_rope(x, w_e, w_o, cos, sin, eps, D: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr):
        """[HB, D] head rows -> RMSNorm (float32, rounded to the input dtype, as the unfused path) -> RoPE
        (``ROPE``; else the normed rows as they are)."""
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
        a, b = tl.split(tl.reshape(xf, (x.shape[0], HALF, 2)))
        a = (a * rstd[:, None] * w_e[None, :]).to(x.dtype).to(tl.float32)
        b = (b * rstd[:, None] * w_o[None, :]).to(x.dtype).to(tl.float32)
        if ROPE:
            out = tl.join(a * cos[None, :] - b * sin[None, :], a * sin[None, :] + b * cos[None, :])
        else:
            out = tl.join(a, b)
        return tl.reshape(out, (x.shape[0], D)).to(x.dtype)

    @triton.jit
    def _load_summed(at, bias_at, lora_at, m, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr):
        """qkv (+ bias) (+ lora) in float32, rounded once to qkv's dtype, as ``_summed``."""
        x = tl.load(at, mask=m)
        if HAS_BIAS or HAS_LORA:
            xf = x.to(tl.float32)
            if HAS_BIAS:
                xf = xf + tl.load(bias_at, mask=m).to(tl.float32)
            if HAS_LORA:
                xf = xf + tl.load(lora_at, mask=m).to(tl.float32)
            x = xf.to(x.dtype)
        return x

    @triton.jit
    def _qk_norm_rope_kernel(qkv, stride_s, stride_b, bias, lora, lstride_s, lstride_b, wq, wk, freqs, q_out, k_out,
                             v_out, s_offset, B, N, eps, D: tl.constexpr, HB: tl.constexpr,
                             HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, ROPE: tl.constexpr):
        row = tl.program_id(0)  # one (token, sample) row of the stream: all its heads
        s, b = row // B, row % B
        HALF: tl.constexpr = D // 2
        pair, col, hs = tl.arange(0, HALF), tl.arange(0, D), tl.arange(0, HB)
        if ROPE:
            cos = tl.load(freqs + s * D + 2 * pair)
            sin = tl.load(freqs + s * D + 2 * pair + 1)
        else:  # (unread)
            cos = tl.full((HALF,), 1.0, tl.float32)
            sin = tl.zeros((HALF,), tl.float32)
        wq_e, wq_o = tl.load(wq + 2 * pair).to(tl.float32), tl.load(wq + 2 * pair + 1).to(tl.float32)
        wk_e, wk_o = tl.load(wk + 2 * pair).to(tl.float32), tl.load(wk + 2 * pair + 1).to(tl.float32)
        src = qkv + s.to(tl.int64) * stride_s + b.to(tl.int64) * stride_b
        lsrc = lora + s.to(tl.int64) * lstride_s + b.to(tl.int64) * lstride_b
        dst = ((s_offset + s).to(tl.int64) * B + b) * N * D  # row (s_offset + s, b) of the joint [S, B, N, D]
        for h0 in range(0, N, HB):
            h = h0 + hs
            m = (h < N)[:, None]
            part = h[:, None] * (3 * D) + col[None, :]  # q of these heads; k at + D, v at + 2 D
            at, bias_at, lora_at = src + part, bias + part, lsrc + part
            out = dst + h[:, None] * D + col[None, :]
            q = _load_summed(at, bias_at, lora_at, m, HAS_BIAS, HAS_LORA)
            k = _load_summed(at + D, bias_at + D, lora_at + D, m, HAS_BIAS, HAS_LORA)
            tl.store(q_out + out, _norm_rope(q, wq_e, wq_o, cos, sin, eps, D, HALF, ROPE), mask=m)
            tl.store(k_out + out, _norm_rope(k, wk_e, wk_o, cos, sin, eps, D, HALF, ROPE), mask=m)
            tl.store(v_out + out, _load_summed(at + 2 * D, bias_at + 2 * D, lora_at + 2 * D, m, HAS_BIAS, HAS_LORA),
                     mask=m)


def _runs_kernel(qkv: torch.Tensor, d: int) -> bool:
    """Triton on CUDA, or in Triton's CPU interpreter (TRITON_INTERPRET=1: how the CPU tests check the kernel's
    logic); the kernel tiles a head: a power-of-2 head dim."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and (qkv.is_cuda or interpreting) and not d & (d - 1)


# Launch configuration: heads per loop step of a row's program, warps per program.  At the rollout's batch 32 on an
# H200 (bench/qk_norm_rope.py, ten calls per timed run; bench/RESULTS.md) 8 x 2 ran 0.593 ms per block with a LoRA
# output (best 0.574 at 4 x 1) and 0.440 without (the best), against 0.661 / 0.479 at 4 x 4.
HEADS_PER_STEP, NUM_WARPS = 8, 2


@torch.library.custom_op("megatron_omni::joint_qk_norm_rope", mutates_args=())
def _joint_op(qkv_txt: torch.Tensor, qkv_img: torch.Tensor, wq_txt: torch.Tensor, wk_txt: torch.Tensor,
              wq_img: torch.Tensor, wk_img: torch.Tensor, freqs_txt: torch.Tensor | None,
              freqs_img: torch.Tensor | None, heads: int, eps: float, bias_txt: torch.Tensor | None = None, bias_img: torch.Tensor | None = None,
              lora_txt: torch.Tensor | None = None, lora_img: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    streams = ((qkv_txt, wq_txt, wk_txt, freqs_txt, bias_txt, lora_txt),
               (qkv_img, wq_img, wk_img, freqs_img, bias_img, lora_img))
    d = qkv_img.shape[-1] // (3 * heads)
    if not _runs_kernel(qkv_img, d):
        return _reference(streams, heads, eps)
    q, k, v = _empty_outputs(qkv_txt, qkv_img, heads)
    offset = 0
    for qkv, wq, wk, freqs, bias, lora in streams:
        s, b = qkv.shape[:2]
        for name, t in (("QKV", qkv), ("LoRA output", lora)):
            if t is not None and (t.stride(2) != 1 or t.shape != qkv.shape):
                raise ValueError(f"joint_qk_norm_rope: {name} of shape {tuple(t.shape)} must be {tuple(qkv.shape)} "
                                 f"and contiguous in its last dim")
        if bias is not None and (bias.shape != qkv.shape[2:] or not bias.is_contiguous()):
            raise ValueError(f"joint_qk_norm_rope: bias of shape {tuple(bias.shape)}; expected contiguous "
                             f"{tuple(qkv.shape[2:])}")
        if s * b:  # (a launch over an empty grid is an error)
            lo = qkv if lora is None else lora  # (an unused pointer when there is no LoRA output)
            table = wq if freqs is None else freqs.contiguous()  # (an unused pointer without rotation)
            _qk_norm_rope_kernel[(s * b,)](qkv, qkv.stride(0), qkv.stride(1), qkv if bias is None else bias, lo,
                                           lo.stride(0), lo.stride(1), wq, wk, table, q, k, v,
                                           offset, b, heads, eps, D=d, HB=HEADS_PER_STEP,
                                           HAS_BIAS=bias is not None, HAS_LORA=lora is not None,
                                           ROPE=freqs is not None, num_warps=NUM_WARPS)
        offset += s
    return q, k, v


def _empty_outputs(qkv_txt, qkv_img, heads):
    s, b, width = qkv_txt.shape[0] + qkv_img.shape[0], qkv_img.shape[1], qkv_img.shape[2]
    shape = (s, b, heads, width // (3 * heads))
    return tuple(qkv_img.new_empty(shape) for _ in range(3))


@_joint_op.register_fake
def _(qkv_txt, qkv_img, wq_txt, wk_txt, wq_img, wk_img, freqs_txt, freqs_img, heads, eps, bias_txt=None,
      bias_img=None, lora_txt=None, lora_img=None):
    return _empty_outputs(qkv_txt, qkv_img, heads)


def joint_qk_norm_rope(txt, img, heads: int, eps: float):
    """q, k, v [S_T + S_I, B, N, D] from two streams, each (qkv [S, B, N*3D], q_norm weight [D],
    k_norm weight [D], RoPE freqs [S, D/2, 2] or None (no rotation)[, bias [N*3D] or None, LoRA output [S, B, N*3D]
    or None]).  A stream may have no rows (S = 0: an image-only attention passes an empty text stream).
    A stream's bias and LoRA output are added to its qkv here (float32, one rounding) rather than by a separate
    pass that writes the sum and reads it back (~1.2 GB per block at the rollout's batch 32)."""
    if txt[0].shape[2] % (3 * heads) or (txt[0].shape[2] // (3 * heads)) % 2:
        raise ValueError(f"joint_qk_norm_rope: QKV width {txt[0].shape[2]} is not {heads} heads x 3 x an even head dim")
    (bias_t, lora_t), (bias_i, lora_i) = (tuple(stream[4:6]) or (None, None) for stream in (txt, img))
    return _joint_op(txt[0], img[0], txt[1], txt[2], img[1], img[2], txt[3], img[3], heads, eps,
                     bias_t, bias_i, lora_t, lora_i)
