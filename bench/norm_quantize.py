"""The adaLN path's one-pass FP8 input against inductor's fusion of the same torch ops, at the Qwen-Image rollout's
shapes.

The kernel (model_specs.common.norm_quantize): gated residual + LayerNorm + modulation + e4m3 row quantization,
what a block computes before its QKV GEMM (no residual) and its fc1 GEMM (the attention half's gated residual).
The control is what the compiled rollout block runs today: ``norm_quantize_reference`` (the block's torch ops and
``fp8.quantize_rows``) under ``torch.compile`` (inductor, coordinate-descent tuning as the product sets it).  The
residual is the attention's output projection before its bias: inductor adds the bias inside its fusion, while the
kernel (an opaque op) reads the residual with the bias added by a pass of its own, timed with it.

    python3 bench/norm_quantize.py [--batch 16] [--text-tokens 109] [--repeats 20]

Rows: the image stream (``--batch`` x 1024 tokens at 512², one CFG branch) and the text stream, each with and
without the residual, the modulated activation kept (an unmerged adapter reads it) or not.  Reported: ms and the
rate of the bytes each must move (x, r in; x', codes out; m out when kept), the codes that differ between the two
(each within one e4m3 step), and the gain per FP8 RL step (the recipe's 1200 block forwards per rollout batch,
one call of each case per block forward).  GPU only (CUDA events).
"""
from __future__ import annotations

import torch

from _profile import gpu_shape_args, median_ms
from model_specs.common.fp8 import quantize_rows
from model_specs.common.norm_quantize import norm_modulate_quantize_rows, norm_quantize_reference

HIDDEN, EPS, FORWARDS = 3072, 1e-6, 1200  # Qwen-Image's width and LayerNorm eps; 60 blocks x 10 steps x 2 branches


def cases(batch: int, text_tokens: int):
    """(name, sequence, residual, keep m)."""
    return (("image, norm1 (QKV input)", 1024, False, False),
            ("image, residual + norm2 (fc1 input)", 1024, True, False),
            ("image, residual + norm2, m kept", 1024, True, True), ("text, norm1", text_tokens, False, False),
            ("text, residual + norm2", text_tokens, True, False))


def main(argv=None) -> None:
    args = gpu_shape_args(__doc__, argv)
    import torch._inductor.config as inductor_config
    from rich.console import Console
    from rich.table import Table

    inductor_config.coordinate_descent_tuning = True  # as megatron_omni.compile sets it for the product

    def control(x, shift, scale, eps, r, gate, bias):
        res = (r + bias, gate) if bias is not None else (None, None)
        return norm_quantize_reference(x, shift, scale, eps, *res)

    compiled = torch.compile(control, dynamic=False)
    table = Table(title=f"adaLN -> FP8 input, {torch.cuda.get_device_name()}, median of {args.repeats} (ms, GB/s)")
    for col in ("case", "rows x cols", "inductor", "kernel", "codes apart from inductor's (rel.)", "per FP8 RL step"):
        table.add_column(col, justify="left" if col == "case" else "right")
    g = torch.Generator(device="cuda").manual_seed(0)
    total = 0.0
    for name, seq, residual, keep in cases(args.batch, args.text_tokens):
        x = (torch.randn(seq, args.batch, HIDDEN, device="cuda", generator=g) * 3).bfloat16()
        r = torch.randn(seq, args.batch, HIDDEN, device="cuda", generator=g).bfloat16()
        mod = (torch.randn(args.batch, 6 * HIDDEN, device="cuda", generator=g) * 0.5).bfloat16()
        shift, scale, gate = mod.chunk(6, dim=-1)[:3]
        bias = torch.randn(HIDDEN, device="cuda", generator=g).bfloat16()

        def ours():
            res = (r + bias, gate) if residual else (None, None)
            return norm_modulate_quantize_rows(x, shift, scale, EPS, *res, keep)

        def theirs():
            return compiled(x, shift, scale, EPS, r, gate, bias if residual else None)

        (_, _, q, s), (_, _, iq, i_s) = ours(), theirs()
        res = (r + bias, gate) if residual else (None, None)
        eager = norm_quantize_reference(x, shift, scale, EPS, *res)
        # the kernel rounds each op as eager does: its m bit-equal to eager's but where the LayerNorm's float32 sums
        # round apart (one bf16 step of an intermediate, which h (1 + scale) + shift's cancellation can make many
        # e4m3 steps of a small m: seen at 3 of 50 M codes on an H100), and its codes those of its own m
        _, m_kept, q_kept, _ = norm_modulate_quantize_rows(x, shift, scale, EPS, *res, True)
        m_apart = float((m_kept != eager[1]).float().mean())
        if m_apart > 1e-4:
            raise SystemExit(f"{name}: {m_apart:.1e} of m differs from the eager torch ops' (expected < 1e-4)")
        own = quantize_rows(m_kept.reshape(-1, HIDDEN))[0].float()
        if not ((q_kept.float() - own).abs() <= (own.abs() * 2.0 ** -3).clamp_min(2.0 ** -9) + 1e-6).all():
            raise SystemExit(f"{name}: a code is more than one e4m3 step from quantize_rows of the kernel's own m")
        # inductor keeps float32 between the ops (no bf16 rounding of h (1 + scale) before + shift): reported only
        mine, its = q.float() * s, iq.float() * i_s
        codes_apart = int((q.view(torch.uint8) != iq.view(torch.uint8)).sum())
        apart = f"{codes_apart} of {q.numel()} ({float((mine - its).norm() / its.norm()):.1e})"
        t_ind, t_ker = (median_ms(fn, args.repeats, warmup=3) for fn in (theirs, ours))
        moved = x.numel() * (2 + 1 + (4 if residual else 0) + (2 if keep else 0))  # x in, codes out, r in, x' out
        gain = (t_ind - t_ker) * FORWARDS / 1e3 if not keep else 0.0  # (m kept: not the recipe's merged adapters)
        total += gain
        table.add_row(name, f"{seq * args.batch} x {HIDDEN}", f"{t_ind:.3f} ({moved / t_ind / 1e6:.0f})",
                      f"{t_ker:.3f} ({moved / t_ker / 1e6:.0f})", apart,
                      f"{gain:+.3f} s" if not keep else "-")
    table.caption = (f"per FP8 RL step: (inductor - kernel) x {FORWARDS} block forwards, the merged-adapter cases; "
                     f"sum {total:+.3f} s (an upper bound: in the block, inductor may fuse more around these ops)")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
