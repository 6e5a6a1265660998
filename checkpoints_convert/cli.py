"""`megatron-omni convert`: HF (diffusers) <-> Megatron checkpoint conversion. One process, no torchrun.

    megatron-omni convert hf-to-mcore --hf DIR --out DIR --tp N [--pp N] [--dtype bfloat16]
    megatron-omni convert mcore-to-hf --mcore DIR --out DIR
"""
from __future__ import annotations

import argparse
import sys
import time

from checkpoints_convert.hf_folder import ConversionError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-omni convert", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True, metavar="{hf-to-mcore,mcore-to-hf}")
    a = sub.add_parser("hf-to-mcore", help="diffusers transformer folder -> Megatron distributed checkpoint")
    a.add_argument("--hf", required=True, help="diffusers model folder (config.json + safetensors)")
    a.add_argument("--out", required=True, help="new folder for the Megatron checkpoint (must not exist)")
    a.add_argument("--tp", type=int, default=1, help="intended tensor-parallel size (validated; default 1)")
    a.add_argument("--pp", type=int, default=1, help="intended pipeline-parallel size (validated; default 1)")
    a.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="cast tensors (default: keep the source dtype, which makes the round trip bit-exact)")
    b = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> diffusers transformer folder")
    b.add_argument("--mcore", required=True, help="Megatron checkpoint folder (any TP/PP it was written at)")
    b.add_argument("--out", required=True, help="new folder for the diffusers model (must not exist)")
    for s in (a, b):
        s.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from checkpoints_convert.convert import hf_to_mcore, mcore_to_hf

    start = time.perf_counter()
    try:
        if args.direction == "hf-to-mcore":
            meta = hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, progress=not args.quiet)
        else:
            meta = mcore_to_hf(args.mcore, args.out, progress=not args.quiet)
    except ConversionError as e:
        print(f"megatron-omni convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({meta['family']}, {meta['arch']['num_layers']} blocks, {meta['dtype']}) "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
