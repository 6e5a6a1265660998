"""The adaLN path's one-pass FP8 input against inductor's fusion of the same torch ops, at the Qwen-Image rollout's
shapes, and the kernel's launches swept.

The kernel (model_specs.common.norm_quantize): gated residual (with the residual's bias) + LayerNorm + modulation
+ e4m3 row quantization, what a block computes before its QKV GEMM (no residual) and its fc1 GEMM (the attention
half's gated residual, the output projection's product with its bias still to add).  The control is what the
compiled rollout block runs without it: ``norm_quantize_reference`` (the block's torch ops and
``fp8.quantize_rows``) under ``torch.compile`` (inductor, coordinate-descent tuning as the product sets it), the
bias added inside its fusion.

    python3 bench/norm_quantize.py [--batch 16] [--text-tokens 109] [--repeats 20] [--no-sweep]

Rows: the image stream (``--batch`` x 1024 tokens at 512², one CFG branch) and the text stream, each with and
without the residual, the modulated activation kept (an unmerged adapter reads it) or not.  Reported: ms and the
rate of the bytes each must move (x, r in; x', codes out; m out when kept), the codes that differ between the two
(each within one e4m3 step), and the gain per FP8 RL step (the recipe's 1200 block forwards per rollout batch,
one call of each case per block forward).  Then the sweep: each launch (rows per program x warps x eager's
roundings or float32 between the ops) checked against its reference and timed on every case, and the line
``best: ROWS,WARPS,ROUND`` (the least time per block forward, merged-adapter cases) for
``bench/rollout_forward.py --adaln-launch``.  GPU only (CUDA events).
"""
from __future__ import annotations

import itertools

import torch

from _profile import gpu_shape_args, median_ms
from model_specs.common import norm_quantize
from model_specs.common.fp8 import quantize_rows
from model_specs.common.norm_quantize import fused_reference, norm_modulate_quantize_rows, norm_quantize_reference

HIDDEN, EPS, FORWARDS = 3072, 1e-6, 1200  # Qwen-Image's width and LayerNorm eps; 60 blocks x 10 steps x 2 branches


# (rows per program, warps, eager's roundings) swept: every combination
LAUNCHES = tuple(itertools.product((1, 2, 4), (4, 8, 16), (True, False)))


def cases(batch: int, text_tokens: int):
    """(name, sequence, residual, keep m)."""
    return (("image, norm1 (QKV input)", 1024, False, False),
            ("image, residual + norm2 (fc1 input)", 1024, True, False),
            ("image, residual + norm2, m kept", 1024, True, True), ("text, norm1", text_tokens, False, False),
            ("text, residual + norm2", text_tokens, True, False))


def launch_name(launch) -> str:
    rows, warps, rounds = launch
    return f"{rows},{warps},{'true' if rounds else 'false'}"


def check(name: str, launch, kernel, x, res, bias) -> None:
    """The kernel at ``launch`` against its reference: eager's torch ops (round=true: m bit-equal but where the
    LayerNorm's float32 sums round apart, one bf16 step of an intermediate, which h (1 + scale) + shift's
    cancellation can make many e4m3 steps of a small m: seen at 3 of 50 M codes on an H100) or the same ops in
    float32 (round=false: m apart only where float32 sums in another order round to another bf16), its codes
    within one e4m3 step of ``quantize_rows`` of its own m."""
    norm_quantize._LAUNCH = launch
    try:
        _, m_kept, q_kept, _ = kernel(True)
    finally:
        norm_quantize._LAUNCH = None
    reference = norm_quantize_reference if launch[2] else fused_reference
    m_ref = reference(*x, EPS, *res, bias)[1]
    m_apart, limit = float((m_kept != m_ref).float().mean()), (1e-4 if launch[2] else 1e-3)
    if m_apart > limit:
        raise SystemExit(f"{name}, launch {launch_name(launch)}: {m_apart:.1e} of m differs from "
                         f"{reference.__name__}'s (expected < {limit:.0e})")
    own = quantize_rows(m_kept.reshape(-1, HIDDEN))[0].float()
    if not ((q_kept.float() - own).abs() <= (own.abs() * 2.0 ** -3).clamp_min(2.0 ** -9) + 1e-6).all():
        raise SystemExit(f"{name}, launch {launch_name(launch)}: a code is more than one e4m3 step from "
                         f"quantize_rows of the kernel's own m")


def main(argv=None) -> None:
    args = gpu_shape_args(__doc__, argv, switches={"no-sweep": "time the product's launch only"})
    import torch._inductor.config as inductor_config
    from rich.console import Console
    from rich.table import Table

    inductor_config.coordinate_descent_tuning = True  # as megatron_omni.compile sets it for the product

    def control(x, shift, scale, eps, r, gate, bias):
        return norm_quantize_reference(x, shift, scale, eps, *((r, gate) if r is not None else (None, None)), bias)

    compiled = torch.compile(control, dynamic=False)
    default = norm_quantize.launch_of(HIDDEN)
    table = Table(title=f"adaLN -> FP8 input, {torch.cuda.get_device_name()}, launch {launch_name(default)} "
                        f"(rows, warps, eager's roundings), median of {args.repeats} (ms, GB/s)")
    for col in ("case", "rows x cols", "inductor", "kernel", "codes apart from inductor's (rel.)", "per FP8 RL step"):
        table.add_column(col, justify="left" if col == "case" else "right")
    g = torch.Generator(device="cuda").manual_seed(0)
    total, timed = 0.0, []
    for name, seq, residual, keep in cases(args.batch, args.text_tokens):
        x = (torch.randn(seq, args.batch, HIDDEN, device="cuda", generator=g) * 3).bfloat16()
        r = torch.randn(seq, args.batch, HIDDEN, device="cuda", generator=g).bfloat16()
        mod = (torch.randn(args.batch, 6 * HIDDEN, device="cuda", generator=g) * 0.5).bfloat16()
        shift, scale, gate = mod.chunk(6, dim=-1)[:3]
        bias = torch.randn(HIDDEN, device="cuda", generator=g).bfloat16() if residual else None
        res = (r, gate) if residual else (None, None)

        def kernel(kept, x=x, shift=shift, scale=scale, res=res, bias=bias):
            return norm_modulate_quantize_rows(x, shift, scale, EPS, *res, kept, bias)

        def theirs(x=x, shift=shift, scale=scale, res=res, bias=bias):
            return compiled(x, shift, scale, EPS, *res, bias)

        check(name, default, kernel, (x, shift, scale), res, bias)
        (_, _, q, s), (_, _, iq, i_s) = kernel(keep), theirs()
        # inductor keeps float32 between the ops (no bf16 rounding of h (1 + scale) before + shift): reported only
        mine, its = q.float() * s, iq.float() * i_s
        codes_apart = int((q.view(torch.uint8) != iq.view(torch.uint8)).sum())
        apart = f"{codes_apart} of {q.numel()} ({float((mine - its).norm() / its.norm()):.1e})"
        t_ind, t_ker = (median_ms(fn, args.repeats, warmup=3) for fn in (theirs, lambda: kernel(keep)))
        moved = x.numel() * (2 + 1 + (4 if residual else 0) + (2 if keep else 0))  # x in, codes out, r in, x' out
        gain = (t_ind - t_ker) * FORWARDS / 1e3 if not keep else 0.0  # (m kept: not the recipe's merged adapters)
        total += gain
        timed.append((name, keep, t_ind, kernel, (x, shift, scale), res, bias))
        table.add_row(name, f"{seq * args.batch} x {HIDDEN}", f"{t_ind:.3f} ({moved / t_ind / 1e6:.0f})",
                      f"{t_ker:.3f} ({moved / t_ker / 1e6:.0f})", apart,
                      f"{gain:+.3f} s" if not keep else "-")
    table.caption = (f"per FP8 RL step: (inductor - kernel) x {FORWARDS} block forwards, the merged-adapter cases; "
                     f"sum {total:+.3f} s (an upper bound: in the block, inductor may fuse more around these ops)")
    console = Console(width=220)
    console.print(table)
    if not args.no_sweep:
        sweep(console, timed, args.repeats)


def sweep(console, timed, repeats: int) -> None:
    """Each launch checked, then timed on every case; the table, and ``best:`` (least ms per block forward)."""
    from rich.table import Table

    table = Table(title=f"the kernel's launches (rows per program, warps, eager's roundings), median of {repeats} "
                        f"(ms); per block forward: the merged-adapter cases, one call each")
    for col in ["launch"] + [name for name, *_ in timed] + ["per block forward", "per FP8 RL step vs inductor"]:
        table.add_column(col, justify="right")
    inductor = sum(t for _, keep, t, *_ in timed if not keep)
    best = None
    for launch in LAUNCHES:
        row = []
        for name, keep, _, kernel, x, res, bias in timed:
            check(name, launch, kernel, x, res, bias)
            norm_quantize._LAUNCH = launch
            try:
                row.append(median_ms(lambda: kernel(keep), repeats, warmup=3))
            finally:
                norm_quantize._LAUNCH = None
        forward = sum(t for t, (_, keep, *_) in zip(row, timed) if not keep)
        best = min(best or (forward, launch), (forward, launch))
        table.add_row(launch_name(launch), *(f"{t:.3f}" for t in row), f"{forward:.3f}",
                      f"{(inductor - forward) * FORWARDS / 1e3:+.3f} s")
    table.caption = f"inductor per block forward: {inductor:.3f} ms"
    console.print(table)
    print(f"best: {launch_name(best[1])} ({best[0]:.3f} ms per block forward; inductor {inductor:.3f}; "
          f"launch_of {launch_name(norm_quantize.launch_of(HIDDEN))})")


if __name__ == "__main__":
    main()
