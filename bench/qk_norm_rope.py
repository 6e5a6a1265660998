"""The joint q / k norm + RoPE kernel (model_specs/common/qk_norm_rope.py) at the rollout's shape — full-size
Qwen-Image, batch 32 (16 images x cond / uncond; --batch), 1024 image + 128 text tokens, 24 heads x 128, bf16 —
over its launch configuration: heads per loop step x warps per program, with and without a LoRA output to add.
Prints the traffic floor (reading QKV and the LoRA output, writing q, k, v once at 4.8 TB/s) and one line per
configuration, fastest first.  Each timed run makes ten calls back to back (the time per call reported), so that
the host's launch of the next call overlaps the GPU's work on this one, as inside the model.

    python bench/qk_norm_rope.py [--batch 32] [--heads-per-step 4 8 16] [--warps 1 2 4 8] [--repeats 20]
"""
from __future__ import annotations

import argparse

import torch

import model_specs.common.qk_norm_rope as kernel
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
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads-per-step", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    img_f, txt_f = rope_freqs((1, 32, 32), TEXT, (16, 56, 56), 10000, "cuda")
    chosen = (kernel.HEADS_PER_STEP, kernel.NUM_WARPS)
    rows = []
    for lora in (True, False):
        txt, img = _stream(TEXT, args.batch, txt_f, lora), _stream(IMAGE, args.batch, img_f, lora)
        moved = (3 if lora else 2) * (txt[0].numel() + img[0].numel()) * 2  # QKV (+ LoRA) read, q / k / v written
        print(f"LoRA output {'added' if lora else 'absent'}: traffic floor {moved / 4.8e12 * 1e3:.3f} ms", flush=True)
        with torch.no_grad():
            for hb in args.heads_per_step:
                for warps in args.warps:
                    kernel.HEADS_PER_STEP, kernel.NUM_WARPS = hb, warps
                    ms = median_ms(lambda: [kernel.joint_qk_norm_rope(txt, img, heads=HEADS, eps=1e-6)
                                            for _ in range(CALLS)], args.repeats, 3) / CALLS
                    rows.append((lora, ms, hb, warps))
        del txt, img
    kernel.HEADS_PER_STEP, kernel.NUM_WARPS = chosen
    print(f"\nbatch {args.batch}\n{'LoRA':<6} {'heads/step':>10} {'warps':>6} {'ms / block':>11}")
    for lora, ms, hb, warps in sorted(rows, key=lambda r: (not r[0], r[1])):
        mark = "  (the kernel's setting)" if (hb, warps) == chosen else ""
        print(f"{'yes' if lora else 'no':<6} {hb:>10} {warps:>6} {ms:>11.3f}{mark}")


if __name__ == "__main__":
    main()
