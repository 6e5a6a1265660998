"""The FP8 rollout's merged-adapter weight copies: W + s·B·A quantized per row, at Qwen-Image's adapted linears.

What the engine rebuilds after every weight change with ``rollout.fp8`` and merged adapters (the LoRA recipe's RL
step pays it once, at its first rollout batch), two ways:

* ``addmm + row kernel`` (``rollout.fp8_merge_kernel=false``): ``torch.addmm(W, U, A)`` writes the merged weight
  in bf16, then ``fp8.quantize_weight_rows`` reads it and writes its codes;
* ``merge kernel`` (the default): ``fp8.merge_quantize_rows``, two Triton passes that each read W (and A) and
  recompute U·A, the first for the row maxima, the second for the codes; the merged weight is never written.

    python3 bench/merge_quantize.py [--rank 64] [--repeats 20]

Rows: one block's four adapted linears of a stream (QKV with its three rank-r parts stacked, the out projection,
fc1, fc2; the text stream's have the same shapes), then their sum x 2 streams x 60 blocks: one RL step's rebuild.
Each launch of ``LAUNCHES`` (ROWS, CHUNK, BK, warps) is timed; GB/s counts W read once and its codes written.
Both paths' codes are compared with those of W + U·A summed in float64 and rounded once to bf16: the kernel's float32
sum may round a merged value one bf16 step apart and its code one e4m3 step (more fails the bench); cuBLAS's bf16
addmm rounds the product to bf16 before adding W, so its codes are counted, not required.
GPU only (CUDA events).
"""
from __future__ import annotations

import argparse

import torch

from _profile import median_ms
from model_specs.common import fp8

HIDDEN, MLP, BLOCKS, STREAMS = 3072, 12288, 60, 2
LAUNCHES = ((64, 1024, 64, 4), (32, 1024, 64, 4), (64, 512, 64, 4), (128, 1024, 64, 8), (64, 2048, 64, 4),
            (128, 1024, 32, 8))


def cases(rank: int):
    """(name, N, K, R) of one stream's adapted linears."""
    return (("QKV", 3 * HIDDEN, HIDDEN, 3 * rank), ("out projection", HIDDEN, HIDDEN, rank),
            ("fc1", MLP, HIDDEN, rank), ("fc2", HIDDEN, MLP, rank))


def old_path(w, u, a):
    return fp8.quantize_weight_rows(torch.addmm(w, u, a))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if min(args.rank, args.repeats) < 1:
        p.error(f"--rank {args.rank}, --repeats {args.repeats}: expected >= 1")
    if not torch.cuda.is_available() or fp8.triton is None:
        p.error("no CUDA device with Triton: this bench times a GPU Triton kernel")
    from rich.console import Console
    from rich.table import Table

    arms = [("addmm + row kernel", None), *((f"{r}x{c}/{b}, {w}w", (r, c, b, w)) for r, c, b, w in LAUNCHES)]
    table = Table(title=f"merged LoRA r{args.rank} -> FP8 copies, {torch.cuda.get_device_name()}, median of "
                        f"{args.repeats} (ms, GB/s)")
    table.add_column("linear")
    table.add_column("N x K (R)", justify="right")
    for name, _ in arms:
        table.add_column(name, justify="right")
    g = torch.Generator(device="cuda").manual_seed(0)
    totals, notes = [0.0] * len(arms), []
    for name, n, k, r in cases(args.rank):
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        u = (torch.randn(n, r, device="cuda", generator=g) * 0.01).bfloat16()
        a = (torch.randn(r, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        ref_q, ref_s = fp8.quantize_weight_rows((w.double() + u.double() @ a.double()).bfloat16())
        cells = []
        for i, (arm, launch) in enumerate(arms):
            fn = (lambda: old_path(w, u, a)) if launch is None else (lambda: fp8.merge_quantize_rows(w, u, a))
            fp8._MERGE_LAUNCH = launch
            try:
                q, s = fn()
                ms = median_ms(fn, args.repeats, warmup=3)
            finally:
                fp8._MERGE_LAUNCH = None
            totals[i] += ms
            cells.append(f"{ms:.3f} ({n * k * 3 / ms / 1e6:.0f})")
            differ = q.view(torch.uint8) != ref_q.view(torch.uint8)
            if launch is None:
                notes.append(f"{name}, addmm + row kernel: {int(differ.sum())} of {differ.numel()} codes differ")
                continue
            step = (ref_q.float().abs() * 2.0 ** -3).clamp_min(2.0 ** -9)
            if not ((q.float() - ref_q.float()).abs() <= step + 1e-6).all():
                raise SystemExit(f"{name}, launch {launch}: a code more than one e4m3 step from the single rounding's")
            if not torch.allclose(s, ref_s, rtol=2 ** -7, atol=0):
                raise SystemExit(f"{name}, launch {launch}: scales beyond bf16's rounding of the single rounding's")
            if i == 1:
                notes.append(f"{name}, merge kernel: {int(differ.sum())} of {differ.numel()} codes differ (one step)")
        table.add_row(name, f"{n} x {k} ({r})", *cells)
    table.add_row(f"one RL step ({STREAMS} streams x {BLOCKS} blocks)", "",
                  *(f"{t * STREAMS * BLOCKS:.1f}" for t in totals))
    table.caption = "GB/s = (W read once, its e4m3 codes written) / time; the last row in ms"
    Console(width=220).print(table)
    print("codes against W + U·A rounded once to bf16 (the merge kernel: its first launch):", *notes, sep="\n  ")


if __name__ == "__main__":
    main()
