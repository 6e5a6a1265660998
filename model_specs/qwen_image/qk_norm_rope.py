"""Joint attention's q / k / v preparation in one pass: per-head RMSNorm of q and k, RoPE on both, and every
stream's rows written into the joint [text; image] sequence in the batch-major layout SDPA reads.

Why: unfused (or as torch.compile fuses it) this is a reduction kernel per norm, a pointwise norm + RoPE
kernel and a concatenation copy per tensor: q and k are read and written about three times.  On the
full-size Qwen-Image at batch 32 that was 92 ms of a 975 ms compiled rollout forward on an H200; this kernel,
which reads each stream's fused QKV output once and writes q, k and v once (~1.4 GB per block), took 36 ms
(bench/RESULTS.md).

A LoRA adapter on the QKV is applied here too: the kernel gets its factors h = A x [S, B, P*r] and (alpha/r) B,
and each program (a tile of rows x one head) multiplies its rows of h by that head's [r, D] slice of B with
tl.dot — instead of a GEMM writing the adapter's [S, B, N*3D] output (as wide as the QKV itself) for this
pass to read back.  The product is rounded to the QKV's dtype before the float32 sum, as that GEMM rounded it.

The Triton kernel has no backward: it runs under no_grad on CUDA (the rollout engine, ``fuse_inference``).
Everywhere else the same function runs as torch ops (``_reference``), the math of the unfused model:
RMSNorm in float32 rounded to the input dtype, then the float32 rotation of ``conditioning.apply_rope``.

Layout: a stream's QKV is [S, B, N * 3D] with rows interleaved per head ([q_h, k_h, v_h]), as
``checkpoints_convert.mapping.fuse_qkv`` lays out the weight.  RoPE tables are float32 [S, D/2, 2]
(cos, sin).  Outputs are [B, S_T + S_I, N, D] contiguous (batch-major); callers take ``transpose(0, 1)``
for Megatron's [S, B, N, D].
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from model_specs.common.lora import LowRank
from model_specs.qwen_image.conditioning import apply_rope

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below
    triton = None


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


def _adapter_output(qkv, low_rank: LowRank | None, heads: int):
    """[S, B, N*3D] a LoRA adapter's output from its factors, in the fused QKV's layout (rows interleaved per
    head), each part rounded to qkv's dtype as the GEMM writing it (``LoRALinear.low_rank``) rounds it."""
    if low_rank is None:
        return None
    h, b_scaled, columns = low_rank
    s, b, r = qkv.shape[0], qkv.shape[1], b_scaled.shape[-1]
    out = qkv.new_zeros(s, b, heads, 3, qkv.shape[-1] // (3 * heads))
    for part, c in enumerate(columns):
        if c >= 0:
            out[:, :, :, part] = F.linear(h[..., c:c + r], b_scaled[c // r]).view(s, b, heads, -1)
    return out.view(s, b, -1)


def _reference(streams, heads: int, eps: float):
    """Torch ops: the unfused model's math.  ``streams``: (qkv [S, B, N*3D], q_weight, k_weight, freqs[, bias,
    LowRank])."""
    qs, ks, vs = [], [], []
    for qkv, wq, wk, freqs, *added in streams:
        bias, low_rank = added or (None, None)
        qkv = _summed(qkv, bias, _adapter_output(qkv, low_rank, heads))
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, heads, -1).split(qkv.shape[-1] // (3 * heads), dim=-1)
        d = q.shape[-1]
        qs.append(apply_rope(F.rms_norm(q, (d,), wq, eps), freqs).transpose(0, 1))
        ks.append(apply_rope(F.rms_norm(k, (d,), wk, eps), freqs).transpose(0, 1))
        vs.append(v.transpose(0, 1))
    return tuple(torch.cat(parts, dim=1) for parts in (qs, ks, vs))


if triton is not None:
    @triton.jit
    def _norm_rope(x, w_e, w_o, cos, sin, eps, D: tl.constexpr, HALF: tl.constexpr):
        """[BM, D] head rows -> RMSNorm (float32, rounded to the input dtype, as the unfused path) -> RoPE with
        the rows' own [BM, D/2] cos / sin."""
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
        a, b = tl.split(tl.reshape(xf, (x.shape[0], HALF, 2)))
        a = (a * rstd[:, None] * w_e[None, :]).to(x.dtype).to(tl.float32)
        b = (b * rstd[:, None] * w_o[None, :]).to(x.dtype).to(tl.float32)
        out = tl.join(a * cos - b * sin, a * sin + b * cos)
        return tl.reshape(out, (x.shape[0], D)).to(x.dtype)

    @triton.jit
    def _load_part(src, bias, h_rows, b_scaled, bstride_p, bstride_o, rank, head, m, PART: tl.constexpr,
                   C: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr, R: tl.constexpr, IEEE: tl.constexpr):
        """Part PART (0 q, 1 k, 2 v) of ``head`` for a tile of rows: qkv (+ bias) (+ h[:, C:C+r] (s B_j)^T when
        C >= 0) in float32, the adapter's product rounded to qkv's dtype first (as its GEMM writes it), the sum
        rounded once (as ``_summed``)."""
        col = tl.arange(0, D)
        x = tl.load(src[:, None] + (head * 3 * D + PART * D + col)[None, :], mask=m[:, None])
        if HAS_BIAS or C >= 0:
            xf = x.to(tl.float32)
            if HAS_BIAS:
                xf = xf + tl.load(bias + head * 3 * D + PART * D + col).to(tl.float32)[None, :]
            if C >= 0:
                r = tl.arange(0, R)
                h = tl.load(h_rows[:, None] + C + r[None, :], mask=m[:, None] & (r < rank)[None, :], other=0.0)
                bt = tl.load(b_scaled + (C // rank) * bstride_p + (head * D + col)[None, :] * bstride_o + r[:, None],
                             mask=(r < rank)[:, None], other=0.0)  # [R, D]: B_j's rows of this head, transposed
                if IEEE:
                    lora = tl.dot(h, bt, input_precision="ieee")
                else:
                    lora = tl.dot(h, bt)
                xf = xf + lora.to(x.dtype).to(tl.float32)
            x = xf.to(x.dtype)
        return x

    @triton.jit
    def _qk_norm_rope_kernel(qkv, stride_s, stride_b, bias, h, hstride_s, hstride_b, b_scaled, bstride_p, bstride_o,
                             rank, wq, wk, freqs, q_out, k_out, v_out, s_offset, s_total, rows_total, B, N, eps,
                             D: tl.constexpr, BM: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr,
                             CQ: tl.constexpr, CK: tl.constexpr, CV: tl.constexpr, IEEE: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)  # a tile of the stream's (token, sample) rows
        head = tl.program_id(1)
        m = rows < rows_total
        s, b = rows // B, rows % B
        HALF: tl.constexpr = D // 2
        pair = tl.arange(0, HALF)
        at = freqs + s[:, None] * D + 2 * pair[None, :]
        cos = tl.load(at, mask=m[:, None], other=0.0)
        sin = tl.load(at + 1, mask=m[:, None], other=0.0)
        wq_e, wq_o = tl.load(wq + 2 * pair).to(tl.float32), tl.load(wq + 2 * pair + 1).to(tl.float32)
        wk_e, wk_o = tl.load(wk + 2 * pair).to(tl.float32), tl.load(wk + 2 * pair + 1).to(tl.float32)
        src = qkv + s.to(tl.int64) * stride_s + b.to(tl.int64) * stride_b
        h_rows = h + s.to(tl.int64) * hstride_s + b.to(tl.int64) * hstride_b
        out = (((b.to(tl.int64) * s_total + s_offset + s) * N + head) * D)[:, None] + tl.arange(0, D)[None, :]
        args = (bias, h_rows, b_scaled, bstride_p, bstride_o, rank, head, m)
        q = _load_part(src, *args, 0, CQ, HAS_BIAS, D, R, IEEE)
        k = _load_part(src, *args, 1, CK, HAS_BIAS, D, R, IEEE)
        v = _load_part(src, *args, 2, CV, HAS_BIAS, D, R, IEEE)
        tl.store(q_out + out, _norm_rope(q, wq_e, wq_o, cos, sin, eps, D, HALF), mask=m[:, None])
        tl.store(k_out + out, _norm_rope(k, wk_e, wk_o, cos, sin, eps, D, HALF), mask=m[:, None])
        tl.store(v_out + out, v, mask=m[:, None])


BLOCK_ROWS = 32  # rows per program: B_j's [r, D] slice of a head is read once per tile of rows, not per row


def _runs_kernel(qkv: torch.Tensor, d: int) -> bool:
    """Triton on CUDA (or in Triton's CPU interpreter, TRITON_INTERPRET=1: how the CPU tests check the kernel's
    logic); the kernel tiles a head with tl.dot: a power-of-2 head dim of at least 16."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and (qkv.is_cuda or interpreting) and d >= 16 and not d & (d - 1)


def _check(qkv, bias, h, b_scaled, columns):
    if qkv.stride(2) != 1:
        raise ValueError(f"joint_qk_norm_rope: QKV of shape {tuple(qkv.shape)} must be contiguous in its last dim")
    if bias is not None and (bias.shape != qkv.shape[2:] or not bias.is_contiguous()):
        raise ValueError(f"joint_qk_norm_rope: bias of shape {tuple(bias.shape)}; expected contiguous "
                         f"{tuple(qkv.shape[2:])}")
    if h is None:
        return
    p, o, r = b_scaled.shape
    if (h.shape[:2] != qkv.shape[:2] or h.stride(2) != 1 or len(columns) != 3 or o * 3 != qkv.shape[2]
            or any(c >= 0 and (c % r or c // r >= p or c + r > h.shape[2]) for c in columns)):
        raise ValueError(f"joint_qk_norm_rope: LoRA factors h {tuple(h.shape)}, B {tuple(b_scaled.shape)}, columns "
                         f"{tuple(columns)} do not fit QKV {tuple(qkv.shape)} (expected h [S, B, P*r] contiguous in "
                         f"its last dim, B [P, N*D, r], a column c per q / k / v: -1 or j*r with j < P)")


@torch.library.custom_op("megatron_omni::joint_qk_norm_rope", mutates_args=())
def _joint_op(qkv_txt: torch.Tensor, qkv_img: torch.Tensor, wq_txt: torch.Tensor, wk_txt: torch.Tensor,
              wq_img: torch.Tensor, wk_img: torch.Tensor, freqs_txt: torch.Tensor, freqs_img: torch.Tensor,
              heads: int, eps: float, bias_txt: torch.Tensor | None, bias_img: torch.Tensor | None,
              h_txt: torch.Tensor | None, h_img: torch.Tensor | None, b_txt: torch.Tensor | None,
              b_img: torch.Tensor | None, columns_txt: list[int], columns_img: list[int],
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    factors = [None if h is None else LowRank(h, b, tuple(c))
               for h, b, c in ((h_txt, b_txt, columns_txt), (h_img, b_img, columns_img))]
    streams = ((qkv_txt, wq_txt, wk_txt, freqs_txt, bias_txt, factors[0]),
               (qkv_img, wq_img, wk_img, freqs_img, bias_img, factors[1]))
    d = qkv_img.shape[-1] // (3 * heads)
    if not _runs_kernel(qkv_img, d):
        return _reference(streams, heads, eps)
    q, k, v = _empty_outputs(qkv_txt, qkv_img, heads)
    s_total, offset = q.shape[1], 0
    for qkv, wq, wk, freqs, bias, low_rank in streams:
        s, b = qkv.shape[:2]
        h, b_scaled, columns = low_rank or (None, None, (-1, -1, -1))
        _check(qkv, bias, h, b_scaled, columns)
        if s * b:  # (a launch over an empty grid is an error)
            if h is None:  # (unused pointers without an adapter)
                h, b_scaled = qkv, qkv.new_empty(1, 1, 1)
            b_scaled = b_scaled.contiguous()
            rank = b_scaled.shape[-1]
            grid = (triton.cdiv(s * b, BLOCK_ROWS), heads)
            _qk_norm_rope_kernel[grid](qkv, qkv.stride(0), qkv.stride(1), qkv if bias is None else bias, h,
                                       h.stride(0), h.stride(1), b_scaled, b_scaled.stride(0), b_scaled.stride(1),
                                       rank, wq, wk, freqs.contiguous(), q, k, v, offset, s_total, s * b, b, heads, eps,
                                       D=d, BM=BLOCK_ROWS, R=max(16, triton.next_power_of_2(rank)),
                                       HAS_BIAS=bias is not None, CQ=columns[0], CK=columns[1], CV=columns[2],
                                       IEEE=qkv.dtype == torch.float32)
        offset += s
    return q, k, v


def _empty_outputs(qkv_txt, qkv_img, heads):
    s, b, width = qkv_txt.shape[0] + qkv_img.shape[0], qkv_img.shape[1], qkv_img.shape[2]
    shape = (b, s, heads, width // (3 * heads))
    return tuple(qkv_img.new_empty(shape) for _ in range(3))


@_joint_op.register_fake
def _(qkv_txt, qkv_img, wq_txt, wk_txt, wq_img, wk_img, freqs_txt, freqs_img, heads, eps, bias_txt, bias_img,
      h_txt, h_img, b_txt, b_img, columns_txt, columns_img):
    return _empty_outputs(qkv_txt, qkv_img, heads)


def joint_qk_norm_rope(txt, img, heads: int, eps: float):
    """q, k, v [B, S_T + S_I, N, D] from two streams, each (qkv [S, B, N*3D], q_norm weight [D],
    k_norm weight [D], RoPE freqs [S, D/2, 2][, bias [N*3D] or None, a LoRA adapter's ``LowRank`` factors or
    None]).  A stream's bias and LoRA output are added to its qkv here (float32, one rounding), the adapter's
    up-projection computed in the kernel from h = A x and (alpha/r) B: no GEMM writes the adapter's [S, B, N*3D]
    output for this pass to read back (~1.2 GB per block at the rollout's batch 32)."""
    if txt[0].shape[2] % (3 * heads) or (txt[0].shape[2] // (3 * heads)) % 2:
        raise ValueError(f"joint_qk_norm_rope: QKV width {txt[0].shape[2]} is not {heads} heads x 3 x an even head dim")
    (bias_t, lr_t), (bias_i, lr_i) = (tuple(stream[4:6]) or (None, None) for stream in (txt, img))
    flat = [(None, None, []) if lr is None else (lr.h, lr.b_scaled, list(lr.columns)) for lr in (lr_t, lr_i)]
    return _joint_op(txt[0], img[0], txt[1], txt[2], img[1], img[2], txt[3], img[3], heads, eps,
                     bias_t, bias_i, flat[0][0], flat[1][0], flat[0][1], flat[1][1], flat[0][2], flat[1][2])
