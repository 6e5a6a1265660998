"""Does an SDPA backend's host path leave the GPU idle at the recipe's attention shapes?  The profiles of the FP8
step put ~0.1 s of each phase's idle right before cuDNN attention's kernels (bench/RESULTS.md).  Per backend
(cudnn, flash, efficient) and pass (forward without grad: the rollout; forward + backward: training), in the
model's layout ([S, B, N, D] q / k / v seen as [B, N, S, D]):

* kernel ms: the call's GPU time (CUDA events, median);
* host ms, idle queue: the call's host time with nothing queued;
* host ms, queued: its host time behind ``--queue-ms`` of queued GEMMs: about the queue's length when the call
  waits for the device (a synchronising call), else about the idle figure;
* idle / call: a block loop, ``--layers`` × [a GEMM of ``--gemm-ms``; the call], timed on the device: its time
  less its kernels' (the GEMMs' and the calls'), per call -- what the host path costs when the host is ahead.

One GPU; one table.

    python bench/sdpa_host.py [--batch 8] [--tokens 1133] [--layers 60] [--gemm-ms 3] [--queue-ms 20] [--repeats 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _profile import median_ms

HEADS, HEAD_DIM, GEMM_N = 24, 128, 8192
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention_call(backend: str, batch: int, tokens: int, train: bool):
    """A function running one attention call of ``backend`` (with its backward when ``train``)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    q, k, v = (torch.randn(tokens, batch, HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
               .permute(1, 2, 0, 3).requires_grad_(train) for _ in range(3))
    grad = torch.randn(tokens, batch, HEADS, HEAD_DIM, device="cuda", generator=g,
                       dtype=torch.bfloat16).permute(1, 2, 0, 3)

    def call():
        with sdpa_kernel(BACKENDS[backend]), torch.set_grad_enabled(train):
            out = F.scaled_dot_product_attention(q, k, v)
            if train:
                out.backward(grad)

    return call


class Gemms:
    """bf16 GEMMs to keep the device busy for a given time."""

    def __init__(self):
        self.a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.ms = median_ms(self.one, 10)

    def one(self):
        torch.mm(self.a, self.b, out=self.c)

    def queue(self, ms: float):
        for _ in range(max(1, round(ms / self.ms))):
            self.one()


def host_ms(call, gemms: Gemms | None, queue_ms: float, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if gemms is not None:
            gemms.queue(queue_ms)
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def idle_per_call(call, gemms: Gemms, gemm_ms: float, layers: int, kernel_ms: float, repeats: int) -> float:
    per_gemm = max(1, round(gemm_ms / gemms.ms))

    def loop():
        for _ in range(layers):
            for _ in range(per_gemm):
                gemms.one()
            call()

    loop_ms = median_ms(loop, repeats)
    return (loop_ms - layers * (per_gemm * gemms.ms + kernel_ms)) / layers


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="8: a training micro-batch; the rollout's is 16")
    p.add_argument("--tokens", type=int, default=1133, help="joint sequence (1024 image + the prompt's tokens)")
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--gemm-ms", type=float, default=3.0, help="device time between attention calls in the loop")
    p.add_argument("--queue-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backends", nargs="+", choices=tuple(BACKENDS), default=list(BACKENDS))
    args = p.parse_args(argv)
    if min(args.batch, args.tokens, args.layers, args.repeats) < 1 or min(args.gemm_ms, args.queue_ms) <= 0:
        p.error(f"--batch {args.batch}, --tokens {args.tokens}, --layers {args.layers}, --repeats {args.repeats}: "
                f"expected >= 1; --gemm-ms {args.gemm_ms}, --queue-ms {args.queue_ms}: expected > 0")
    if not torch.cuda.is_available():
        p.error("no CUDA device: this bench times GPU attention backends")
    gemms = Gemms()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"[B {args.batch}, N {HEADS}, S {args.tokens}, D {HEAD_DIM}] bf16 in [S, B, N, D] memory; one "
          f"{GEMM_N}^3 GEMM {gemms.ms:.3f} ms")
    rows = []
    for train in (False, True):
        for backend in args.backends:
            call = attention_call(backend, args.batch, args.tokens, train)
            try:
                kernel = median_ms(call, args.repeats, warmup=3)
            except RuntimeError as e:  # the backend refuses the shape / layout
                rows.append((backend, train, f"refused: {str(e).splitlines()[0][:80]}"))
                continue
            rows.append((backend, train, kernel, host_ms(call, None, 0, args.repeats),
                         host_ms(call, gemms, args.queue_ms, args.repeats),
                         idle_per_call(call, gemms, args.gemm_ms, args.layers, kernel, args.repeats)))
    print(f"\n| backend | pass | kernel ms | host ms, idle queue | host ms, {args.queue_ms:g} ms queued | "
          f"idle / call ms ({args.layers} × [{args.gemm_ms:g} ms GEMM; call]) |")
    print("|---|---|---|---|---|---|")
    for backend, train, *cells in rows:
        shown = cells if isinstance(cells[0], str) else [f"{c:.3f}" for c in cells]
        print(f"| {backend} | {'forward + backward' if train else 'forward, no grad'} | " + " | ".join(shown) + " |")


if __name__ == "__main__":
    main()
