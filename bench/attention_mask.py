"""What an all-True text mask costs the joint attention: SDPA on the Qwen-Image shapes with ``attn_mask=None``
and with a boolean [B, 1, 1, S] mask that masks nothing (the trainer passed one for unpadded text until
2026-12-01, while the rollout engine passed None).  Forward, and forward + backward, per shape, and the largest
difference of the outputs.  One GPU, bf16.  Prints one table.

    python bench/attention_mask.py [--repeats 20]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _profile import median_ms

HEADS, HEAD_DIM = 24, 128
SHAPES = {"train micro-batch 4": 4, "rollout batch 32": 32}  # rows of 1024 image + 128 text tokens
TOKENS = 1024 + 128


def _case(rows: int, masked: bool, backward: bool, repeats: int) -> tuple[float, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(rows, HEADS, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_(backward) for _ in range(3))
    mask = torch.ones(rows, 1, 1, TOKENS, device="cuda", dtype=torch.bool) if masked else None

    def run():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if backward:
            out.backward(torch.ones_like(out))
        return out

    with torch.no_grad() if not backward else torch.enable_grad():
        return median_ms(run, repeats), run().detach()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, bf16, {HEADS} heads x {HEAD_DIM}, {TOKENS} tokens per row")
    print(f"{'shape':<22} {'pass':<20} {'no mask ms':>11} {'all-True mask ms':>17} {'ratio':>6} {'max |diff|':>11}")
    for name, rows in SHAPES.items():
        for backward in (False, True):
            plain_ms, plain = _case(rows, False, backward, args.repeats)
            masked_ms, masked = _case(rows, True, backward, args.repeats)
            diff = (plain.float() - masked.float()).abs().max().item()
            print(f"{name:<22} {'forward + backward' if backward else 'forward':<20} {plain_ms:>11.3f} "
                  f"{masked_ms:>17.3f} {masked_ms / plain_ms:>6.2f} {diff:>11.2e}")


if __name__ == "__main__":
    main()
