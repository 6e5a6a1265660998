"""The joint q / k norm + RoPE kernel (model_specs/qwen_image/qk_norm_rope.py) at the rollout's shape — full-size
Qwen-Image, batch 32 (16 images x cond / uncond; --batches), 1024 image + 128 text tokens, 24 heads x 128, bf16 —
over its launch configuration (``qk_norm_rope.Launch``): RoPE partners loaded or split / joined, a program per row
or per head block, heads per step, warps per program; with and without a LoRA output to add.  Prints the traffic
floor (reading QKV and the LoRA output, writing q, k, v once at 4.8 TB/s) and, per batch and LoRA, the fastest
configurations and the kernel's own.  Each timed run makes ten calls back to back (the time per call reported), so
that the host's launch of the next call overlaps the GPU's work on this one, as inside the model.

    python bench/qk_norm_rope.py [--batches 8 16 32] [--heads-per-step 2 4 8] [--warps 1 2 4] [--repeats 20]
"""
from __future__ import annotations

import argparse

import torch

import model_specs.qwen_image.qk_norm_rope as kernel
from _profile import median_ms
from model_specs.qwen_image.conditioning import rope_freqs

HEADS, HEAD_DIM, IMAGE, TEXT = 24, 128, 1024, 128
CALLS = 10  # per timed run


def _stream(tokens: int, batch: int, freqs: torch.Tensor, lora: bool):
    width = 3 * HEADS * HEAD_DIM
    qkv, lora_out = (torch.randn(tokens, batch, width, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ones = torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    return qkv, ones, ones, freqs, bias, lora_out if lora else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32])
    p.add_argument("--heads-per-step", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--show", type=int, default=4, help="fastest configurations listed per batch and LoRA")
    args = p.parse_args()
    torch.manual_seed(0)
    img_f, txt_f = rope_freqs((1, 32, 32), TEXT, (16, 56, 56), 10000, "cuda")
    chosen = dict(kernel.LAUNCH)
    launches = [kernel.Launch(partner, grid2d, hb, warps) for partner in (False, True) for grid2d in (False, True)
                for hb in args.heads_per_step for warps in args.warps]
    rows, floors = [], {}
    try:
        for batch in args.batches:
            for lora in (True, False):
                txt, img = _stream(TEXT, batch, txt_f, lora), _stream(IMAGE, batch, img_f, lora)
                moved = (3 if lora else 2) * (txt[0].numel() + img[0].numel()) * 2  # QKV (+ LoRA) read, q/k/v written
                floors[batch, lora] = moved / 4.8e12 * 1e3
                with torch.no_grad():
                    for launch in launches:
                        kernel.LAUNCH[lora] = launch
                        ms = median_ms(lambda: [kernel.joint_qk_norm_rope(txt, img, heads=HEADS, eps=1e-6)
                                                for _ in range(CALLS)], args.repeats, 3) / CALLS
                        rows.append((batch, lora, ms, launch))
                kernel.LAUNCH[lora] = chosen[lora]
                del txt, img
                print(f"batch {batch}, LoRA output {'added' if lora else 'absent'}: done", flush=True)
    finally:
        kernel.LAUNCH.update(chosen)
    print(f"\n{'batch':>5} {'LoRA':<5} {'partner':>7} {'grid':>5} {'heads/step':>10} {'warps':>6} {'ms / block':>11} "
          f"{'floor':>6}")
    for batch in args.batches:
        for lora in (True, False):
            mine = sorted((r for r in rows if r[:2] == (batch, lora)), key=lambda r: r[2])
            for _, _, ms, launch in mine[:args.show] + [r for r in mine[args.show:] if r[3] == chosen[lora]]:
                mark = "  (the kernel's setting)" if launch == chosen[lora] else ""
                print(f"{batch:>5} {'yes' if lora else 'no':<5} {str(launch.partner):>7} "
                      f"{'2d' if launch.grid2d else 'row':>5} {launch.heads_per_step:>10} {launch.warps:>6} "
                      f"{ms:>11.3f} {floors[batch, lora]:>6.3f}{mark}")


if __name__ == "__main__":
    main()
