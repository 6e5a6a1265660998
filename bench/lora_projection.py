"""LoRA's down-projection h = x A^T at the full-size Qwen-Image recipe's shapes: which formulation cuBLAS runs
fast.  A [M, K] x [K, r] product with r = 64 is skinny; a profile of the LoRA rollout forward showed cuBLAS
taking 2.1 ms for fc2's (K = 12288) where reading x takes 0.17 ms.  Prints one table (forward, and forward +
backward at the training micro-batch's M).

    python bench/lora_projection.py [--repeats 20]

Formulations: ``linear`` F.linear(x, A) (megatron / peft); ``swapped`` (A x^T)^T, the same product with the
operands' roles swapped for cuBLAS; ``splitk-S`` x split into S chunks along K, S partial products in one
batched GEMM summed in float32.
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F

from _profile import median_ms

SHAPES = [  # (what, M, K, r): rollout batch 32 x 1024 image tokens; training 4 pairs x 1024
    ("rollout qkv (3 parts)", 32768, 3072, 192), ("rollout proj / fc1", 32768, 3072, 64),
    ("rollout fc2", 32768, 12288, 64), ("train qkv (3 parts)", 4096, 3072, 192),
    ("train proj / fc1", 4096, 3072, 64), ("train fc2", 4096, 12288, 64),
]


def linear(x, a):
    return F.linear(x, a)


def swapped(x, a):
    return torch.mm(a, x.t()).t()


def splitk(s):
    def fn(x, a):
        m, k = x.shape
        parts = torch.bmm(x.view(m, s, k // s).transpose(0, 1), a.view(-1, s, k // s).permute(1, 2, 0))
        return parts.float().sum(0).to(x.dtype)
    fn.__name__ = f"splitk-{s}"
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    fns = [linear, swapped, splitk(4), splitk(8)]
    rows = []
    for what, m, k, r in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a = (torch.randn(r, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).requires_grad_("train" in what)
        ref = F.linear(x.float(), a.float())
        floor_ms = x.numel() * 2 / 4.8e12 * 1e3  # reading x once at the H200's 4.8 TB/s
        for fn in fns:
            with torch.no_grad():
                err = ((fn(x, a).float() - ref).norm() / ref.norm()).item()
                fwd = median_ms(lambda: fn(x, a), args.repeats, warmup=3)
            bwd = ""
            if "train" in what:
                xg = x.detach().requires_grad_(True)
                g = torch.randn(m, r, device="cuda", dtype=torch.bfloat16)
                bwd = f"{median_ms(lambda: torch.autograd.backward(fn(xg, a), g), args.repeats, warmup=3):.3f}"
            rows.append((what, fn.__name__, f"{fwd:.3f}", bwd, f"{floor_ms:.3f}", f"{err:.1e}"))
    print(f"\n{torch.cuda.get_device_name()}, bf16, LoRA down-projection x [M, K] -> [M, r]")
    print(f"{'shape':<24}{'formulation':<12}{'fwd ms':>9}{'fwd+bwd ms':>12}{'read-x ms':>11}{'rel err':>9}")
    for row in rows:
        print(f"{row[0]:<24}{row[1]:<12}{row[2]:>9}{row[3]:>12}{row[4]:>11}{row[5]:>9}")


if __name__ == "__main__":
    main()
