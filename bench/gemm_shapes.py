"""The full-size Qwen-Image block's GEMMs at the FlowGRPO recipe's shapes, one formulation per column: how much
of the rollout's and the training step's matmul time another cuBLAS call (or inductor's autotuned Triton GEMM)
would save.  GEMMs are ~80 % of a rollout forward's kernel time and ~63 % of a LoRA training step's.

    python bench/gemm_shapes.py [--repeats 20] [--autotune] [--only rollout train] [--rollout-batch 32]

Shapes (per block; a forward runs 60 blocks): the image stream (B x 1024 tokens) and the text stream (B x 128)
each through QKV 3072 -> 9216, output projection 3072 -> 3072, fc1 3072 -> 12288, fc2 12288 -> 3072; rollout at
batch 32 (16 images x cond / uncond; --rollout-batch), training at micro-batch 4 (forward and the input-gradient
product dY W).

Formulations: ``x·Wᵀ`` F.linear without bias (cuBLAS, the weight as stored [N, K]); ``+bias`` the same with the
bias in cuBLAS's epilogue (addmm); ``x·Wt`` the weight pre-transposed to [K, N] (an NN product); ``lt`` F.linear
with ``torch.backends.cuda.preferred_blas_library('cublaslt')``; ``autotune`` inductor's max-autotune GEMM
(cuBLAS or Triton templates, its tuning time printed apart).  For fc1 also ``+gelu``: bias + GELU-tanh in the
epilogue (the rollout engine's fused MLP).  Each product is checked against float32 before it is timed.

Then, for the rollout: each linear's text and image products (same K and N, their own weights) as ONE grouped GEMM
(``torch._grouped_mm`` over the rows of both streams, the two weights stacked) against the two cuBLAS calls the
model makes: the text stream's M = batch x 128 leaves most of a wave of SMs idle on its own.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from _profile import median_ms

HIDDEN, FFN, BLOCKS = 3072, 12288, 60
LINEARS = (("qkv", HIDDEN, 3 * HIDDEN), ("proj", HIDDEN, HIDDEN), ("fc1", HIDDEN, FFN), ("fc2", FFN, HIDDEN))
PHASES = {"rollout": (32, ("fwd",)), "train": (4, ("fwd", "dgrad"))}


def _blas(lib: str):
    def run(fn):
        def call(*a):
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(lib)
            try:
                return fn(*a)
            finally:
                torch.backends.cuda.preferred_blas_library(before)
        return call
    return run


def formulations(name: str, pass_: str, autotune: bool):
    """{column: fn(x, w, wt, b)}; for dgrad x is dY [M, N] and the product is dY W."""
    if pass_ == "dgrad":
        out = {"x·Wᵀ": lambda x, w, wt, b: torch.mm(x, w), "x·Wt": lambda x, w, wt, b: torch.mm(x, wt.t()),
               "lt": _blas("cublaslt")(lambda x, w, wt, b: torch.mm(x, w))}
    else:
        out = {"x·Wᵀ": lambda x, w, wt, b: F.linear(x, w), "+bias": lambda x, w, wt, b: F.linear(x, w, b),
               "x·Wt": lambda x, w, wt, b: torch.mm(x, wt),
               "lt": _blas("cublaslt")(lambda x, w, wt, b: F.linear(x, w))}
        if name == "fc1":
            out["+gelu"] = lambda x, w, wt, b: torch._addmm_activation(b, x, w.t(), use_gelu=True)
    if autotune:
        mm = torch.mm if pass_ == "dgrad" else (lambda x, w: F.linear(x, w))
        out["autotune"] = torch.compile(lambda x, w, wt, b: mm(x, w), mode="max-autotune-no-cudagraphs",
                                        dynamic=False)
    return out


def _reference(name, pass_, x, w, b):
    if pass_ == "dgrad":
        return x.float() @ w.float()
    ref = F.linear(x.float(), w.float())
    return F.gelu(ref + b.float(), approximate="tanh") if name == "fc1" else ref


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--autotune", action="store_true", help="also inductor's max-autotune GEMM (slow to tune)")
    p.add_argument("--only", nargs="+", choices=sorted(PHASES), default=sorted(PHASES))
    p.add_argument("--rollout-batch", type=int, default=PHASES["rollout"][0])
    args = p.parse_args()
    PHASES["rollout"] = (args.rollout_batch, PHASES["rollout"][1])
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # one compiled product per shape
    rows, totals, tuning = [], {}, 0.0
    for phase in args.only:
        batch, passes = PHASES[phase]
        for pass_ in passes:
            for stream, tokens in (("image", 1024), ("text", 128)):
                m = batch * tokens
                for name, k, n in LINEARS:
                    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                    wt, b = w.t().contiguous(), torch.randn(n, device="cuda", dtype=torch.bfloat16)
                    x = torch.randn(m, n if pass_ == "dgrad" else k, device="cuda", dtype=torch.bfloat16)
                    ref = _reference(name, pass_, x, w, b)
                    flops = 2 * m * k * n
                    row = (f"{phase} {pass_} {stream} {name}", f"{m}x{x.shape[1]}->{ref.shape[1]}", {})
                    for col, fn in formulations(name, pass_, args.autotune).items():
                        biased = col in ("+bias", "+gelu")
                        expect = ref if (name != "fc1" or pass_ == "dgrad" or col == "+gelu") else \
                            _reference("", pass_, x, w, b)
                        expect = expect + b.float() if col == "+bias" else expect
                        start = time.perf_counter()
                        with torch.no_grad():
                            got = fn(x, w, wt, b).float()
                        tuning += (time.perf_counter() - start) if col == "autotune" else 0.0
                        err = ((got - expect).norm() / expect.norm()).item()
                        if err > 1e-2:
                            raise SystemExit(f"{row[0]} {col}: relative error {err:.2e} against float32 (> 1e-2)")
                        with torch.no_grad():
                            ms = median_ms(lambda: fn(x, w, wt, b), args.repeats, warmup=3)
                        row[2][col] = f"{ms:.3f} ({flops / ms / 1e9:.0f})"
                        if not biased:
                            key = (phase, pass_, col)
                            totals[key] = totals.get(key, 0.0) + ms * BLOCKS
                    rows.append(row)
                    del x, w, wt, b, ref
    cols = ["x·Wᵀ", "+bias", "x·Wt", "lt", "+gelu"] + (["autotune"] if args.autotune else [])
    print(f"\n{'GEMM':<28} {'M x K -> N':<18} " + " ".join(f"{c:>15}" for c in cols))
    for label, shape, cells in rows:
        print(f"{label:<28} {shape:<18} " + " ".join(f"{cells.get(c, ''):>15}" for c in cols))
    print("\nms (TFLOP/s) per GEMM. Sum over the 8 products of 60 blocks (no bias / epilogue columns):")
    for (phase, pass_, col), ms in sorted(totals.items()):
        print(f"  {phase:<8} {pass_:<6} {col:<9} {ms:9.1f} ms")
    if args.autotune:
        print(f"  (autotune: {tuning:.0f} s of tuning and compiling)")
    if "rollout" in args.only:
        grouped_streams(PHASES["rollout"][0], args.repeats)


def grouped_streams(batch: int, repeats: int, device: str = "cuda") -> None:
    """Text + image products of each linear: two F.linear calls against one grouped GEMM; prints a table."""
    m_txt, m_img = batch * 128, batch * 1024
    offs = torch.tensor([m_txt, m_txt + m_img], device=device, dtype=torch.int32)
    print(f"\nrollout batch {batch}: text ({m_txt} rows) + image ({m_img} rows) per linear\n"
          f"{'linear':<6} {'two GEMMs ms':>13} {'grouped ms':>11} {'saved':>7}")
    sums = [0.0, 0.0]
    for name, k, n in LINEARS:
        x = torch.randn(m_txt + m_img, k, device=device, dtype=torch.bfloat16)  # [text rows; image rows]
        w = torch.randn(2, n, k, device=device, dtype=torch.bfloat16) / k ** 0.5  # (text, image) as stored
        wt = w.transpose(1, 2)  # [2, K, N] views of the stored weights
        ref = torch.cat([x[:m_txt].float() @ w[0].float().t(), x[m_txt:].float() @ w[1].float().t()])
        try:
            got = torch._grouped_mm(x, wt, offs=offs).float()
        except RuntimeError as exc:  # (a device or build without the grouped kernel)
            print(f"torch._grouped_mm unavailable here: {str(exc).splitlines()[0]}")
            return
        if (err := ((got - ref).norm() / ref.norm()).item()) > 1e-2:
            raise SystemExit(f"grouped {name}: relative error {err:.2e} against float32 (> 1e-2)")
        with torch.no_grad():
            two = median_ms(lambda: (F.linear(x[:m_txt], w[0]), F.linear(x[m_txt:], w[1])), repeats, warmup=3)
            one = median_ms(lambda: torch._grouped_mm(x, wt, offs=offs), repeats, warmup=3)
        sums[0], sums[1] = sums[0] + two * BLOCKS, sums[1] + one * BLOCKS
        print(f"{name:<6} {two:>13.3f} {one:>11.3f} {1 - one / two:>7.1%}")
        del x, w, wt, ref, got
    print(f"over 60 blocks: {sums[0]:.1f} ms as two GEMMs, {sums[1]:.1f} ms grouped")


if __name__ == "__main__":
    main()
