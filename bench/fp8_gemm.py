"""The FP8 rollout's GEMMs (model_specs.common.fp8) at the Qwen-Image rollout's shapes on a GPU, beside bf16.

    python3 bench/fp8_gemm.py [--rows 32768] [--repeats 20]

Per linear of a block (image-stream rows: batch 32 x 1024 tokens at 512²): the bf16 ``mm``; ``torch._scaled_mm``
on pre-quantized operands (the kernel alone); the whole FP8 product as the engine runs it (the input's per-row
quantization, compiled as the rollout compiles it, then the kernel); and the product's error against a float32
reference, beside the float32 emulation's (the CPU path the tests check: equal math, so equal error to rounding).
Each FP8 figure twice: with the kernel's fast accumulation (``rollout.fp8_fast_accum=true``, the default) and
with promoted ("split") accumulation.
Median of ``--repeats`` timed runs after warm-up (CUDA events).  GPU only (sm89+).
"""
from __future__ import annotations

import argparse

import torch

from _profile import median_ms
from model_specs.common.fp8 import check_fp8_device, fp8_matmul, quantize_rows

# (name, K, N) of the Qwen-Image block's per-token linears (hidden 3072, MLP 12288)
LINEARS = (("qkv", 3072, 9216), ("proj", 3072, 3072), ("fc1", 3072, 12288), ("fc2", 12288, 3072))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32768, help="GEMM rows (tokens x batch; 32768 = the rollout's image)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("no CUDA device: this bench times GPU kernels")
    check_fp8_device(torch.device("cuda"))
    from rich.console import Console
    from rich.table import Table

    compiled = torch.compile(fp8_matmul, dynamic=False)
    table = Table(title=f"FP8 vs bf16 GEMMs, {args.rows} rows, {torch.cuda.get_device_name()}, median of "
                        f"{args.repeats}; FP8 columns: fast / split accumulation")
    for col in ("linear", "K x N", "bf16 mm ms (TFLOP/s)", "scaled_mm ms (TFLOP/s)", "FP8 product ms (TFLOP/s)",
                "speed-up", "rel err FP8", "rel err emul.", "FP8 vs emul."):
        table.add_column(col, justify="left" if col == "linear" else "right")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, k, n in LINEARS:
        x = torch.randn(args.rows, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
        wq, ws = quantize_rows(w)
        ws = ws.t().contiguous()
        xq, xs = quantize_rows(x)
        flops = 2 * args.rows * k * n
        t_bf16 = median_ms(lambda: torch.mm(x, w.t()), args.repeats, warmup=3) / 1e3
        ref = x.float() @ w.float().t()
        emul = ((xq.float() @ wq.float().t()) * xs * ws).bfloat16().float()  # the CPU path's math, on this GPU
        rel = lambda a: ((a - ref).norm() / ref.norm()).item()  # noqa: E731
        kernel, product, speed, err, vs_emul = [], [], [], [], []
        for fast in (True, False):
            t_kernel = median_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                          out_dtype=torch.bfloat16, use_fast_accum=fast),
                                 args.repeats, warmup=3) / 1e3
            t_fp8 = median_ms(lambda: compiled(x, wq, ws, fast), args.repeats, warmup=3) / 1e3
            out = compiled(x, wq, ws, fast).float()
            kernel.append(f"{t_kernel * 1e3:.3f} ({flops / t_kernel / 1e12:.0f})")
            product.append(f"{t_fp8 * 1e3:.3f} ({flops / t_fp8 / 1e12:.0f})")
            speed.append(f"{t_bf16 / t_fp8:.2f} x")
            err.append(f"{rel(out):.2e}")
            vs_emul.append(f"{((out - emul).norm() / emul.norm()).item():.1e}")
        table.add_row(name, f"{k} x {n}", f"{t_bf16 * 1e3:.3f} ({flops / t_bf16 / 1e12:.0f})", " / ".join(kernel),
                      " / ".join(product), " / ".join(speed), " / ".join(err), f"{rel(emul):.2e}", " / ".join(vs_emul))
    table.caption = ("FP8 product = per-row quantization of the bf16 input (compiled) + torch._scaled_mm with per-row "
                     "scales, bf16 out; rel err = ||out - x W^T|| / ||x W^T|| against float32; emul. = the float32 "
                     "emulation model_specs.common.fp8 runs off the GPU")
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
