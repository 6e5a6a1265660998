"""`megatron-omni demo convert`: the checkpoint-conversion job on a fresh CPU machine.

Build a small Qwen-Image transformer in
diffusers format, convert it to a Megatron distributed checkpoint at TP=2, load it into our
megatron-core model at TP=2 (gloo ranks) and at TP=1, check forward parity against diffusers, convert
back to diffusers and check every tensor is bit-identical.  Prints a table and writes summary.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from checkpoints_convert.convert import hf_to_mcore, mcore_to_hf
from checkpoints_convert.hf_folder import HFFolder
from checkpoints_convert.mcore_checkpoint import load_model
from model_specs.qwen_image.config import tiny_config
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.parallel.testing import run_distributed

IMG_FHW = (1, 8, 12)  # non-square 16x24 latent (2x2-packed), 96 image tokens


def _arch():
    return tiny_config(num_layers=4)


def _inputs(arch, batch=4, text_len=16):
    g = torch.Generator().manual_seed(7)
    n_img = IMG_FHW[0] * IMG_FHW[1] * IMG_FHW[2]
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    for b in range(batch):
        mask[b, text_len - 3 * b:] = False  # prompts of different lengths
    return (torch.randn(batch, n_img, arch.in_channels, generator=g),
            torch.randn(batch, text_len, arch.joint_attention_dim, generator=g),
            torch.rand(batch, generator=g), mask)


def _megatron_forward(state, ckpt: str):
    arch = _arch()
    model = QwenImageModel(arch, arch.transformer_config(state.tp), state.tp_group, qwen_image_block_spec("local"))
    load_model(model, ckpt)
    img, txt, sigma, mask = _inputs(arch)
    with torch.no_grad():
        return model(img, txt, sigma, IMG_FHW, mask)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-omni demo convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo_convert", help="run folder (replaced if it exists; default runs/demo_convert)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the Megatron side (gloo ranks)")
    args = p.parse_args(argv)
    from diffusers import QwenImageTransformer2DModel
    from rich.console import Console
    from rich.table import Table

    console, out, start = Console(), Path(args.out), time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    arch = _arch()
    torch.manual_seed(0)
    with console.status("building a random-init diffusers QwenImageTransformer2DModel"):
        ref = QwenImageTransformer2DModel(**{k: v for k, v in arch.to_diffusers().items() if not k.startswith("_")})
        ref.save_pretrained(out / "hf", max_shard_size="2MB")
    n_params = sum(p.numel() for p in ref.parameters())
    console.print(f"[1/4] diffusers folder {out / 'hf'}: {n_params / 1e6:.2f} M params, "
                  f"{len(list((out / 'hf').glob('*.safetensors')))} shards")
    hf_to_mcore(out / "hf", out / "mcore", tp=args.tp)
    console.print(f"[2/4] Megatron distributed checkpoint {out / 'mcore'} (TP={args.tp} layout)")

    img, txt, sigma, mask = _inputs(arch)
    with torch.no_grad():
        expected = ref(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=sigma,
                       img_shapes=[[IMG_FHW]] * img.shape[0]).sample
    with console.status(f"forward at TP={args.tp} on {args.tp} gloo ranks"):
        out_tp = run_distributed(_megatron_forward, args.tp, args=(str(out / "mcore"),), parallel={"tp": args.tp})[0]
    state = init_parallel(device="cpu")
    try:
        out_tp1 = _megatron_forward(state, str(out / "mcore"))
    finally:
        destroy_parallel()
    console.print("[3/4] forward parity checked at TP=1 and TP=%d" % args.tp)

    mcore_to_hf(out / "mcore", out / "hf_roundtrip")
    a, b = HFFolder(out / "hf"), HFFolder(out / "hf_roundtrip")
    exact = sum(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    console.print(f"[4/4] diffusers folder written back: {out / 'hf_roundtrip'}")

    summary = {"params": n_params, "tp": args.tp, "tensors": len(a.keys()), "tensors_bit_exact": exact,
               "rel_err_tp1_vs_diffusers": _rel(out_tp1, expected),
               f"rel_err_tp{args.tp}_vs_diffusers": _rel(out_tp, expected),
               "wall_seconds": round(time.perf_counter() - start, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = Table(title="Qwen-Image (tiny) diffusers -> Megatron -> diffusers")
    table.add_column("check")
    table.add_column("result", justify="right")
    table.add_row("forward rel. error, Megatron TP=1 vs diffusers (fp32)", f"{summary['rel_err_tp1_vs_diffusers']:.2e}")
    table.add_row(f"forward rel. error, Megatron TP={args.tp} vs diffusers (fp32)",
                  f"{summary[f'rel_err_tp{args.tp}_vs_diffusers']:.2e}")
    table.add_row("tensors bit-exact after HF -> Megatron -> HF", f"{exact} / {len(a.keys())}")
    table.add_row("wall time", f"{summary['wall_seconds']} s")
    console.print(table)
    console.print(f"summary: {out / 'summary.json'}")
    ok = exact == len(a.keys()) and max(summary["rel_err_tp1_vs_diffusers"],
                                        summary[f"rel_err_tp{args.tp}_vs_diffusers"]) <= 1e-5
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
