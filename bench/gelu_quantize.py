"""The FP8 rollout's row kernel at the Qwen-Image rollout's shapes, at each launch.

The kernel (model_specs.common.fp8): fc1's product -> bias + GELU-tanh -> fc2's e4m3 input and row scales; without
GELU, the rollout's weight copies.

    python3 bench/gelu_quantize.py [--batch 16] [--text-tokens 109] [--repeats 20]

Rows: the image stream's fc1 output at ``--batch`` (x 1024 tokens at 512²) with the adapters merged (no LoRA input,
nothing kept) and separate (the LoRA output read, the activation kept for fc2's adapter), the text stream's, and
the weight copies of fc1 / fc2.  Each row times every launch of ``fp8.LAUNCHES`` (BLOCK, warps: BLOCK >= N runs
a row whole), the product's (``fp8.launch_of``) and the product's with the e4m3 rounding emulated in float32 (what
Triton's CPU interpreter runs), the product's with GELU's tanh the other way (``fp8.TANH_APPROX``: the exact tanh or the
hardware's ``tanh.approx.f32``), and reports the memory traffic's rate; every launch's codes and scales must equal the
whole-row launch's bit for bit (the same ops on the same inputs); the codes of the emulated rounding and of the
other tanh that differ from the product's are counted.
GPU only (CUDA events).
"""
from __future__ import annotations

import torch

from _profile import gpu_shape_args, median_ms
from model_specs.common import fp8

MLP, HIDDEN = 12288, 3072


def cases(batch: int, text_tokens: int):
    """(name, rows, columns, bias, LoRA input + kept activation, GELU)."""
    image, text = batch * 1024, batch * text_tokens
    return (("image fc1 -> fc2, merged", image, MLP, True, False, True),
            ("image fc1 -> fc2, separate", image, MLP, True, True, True),
            ("text fc1 -> fc2, merged", text, MLP, True, False, True),
            ("fc1 weight copy", MLP, HIDDEN, False, False, False),
            ("fc2 weight copy", HIDDEN, MLP, False, False, False))


def run(y, bias, lora, keep: bool, gelu: bool):
    if gelu:
        return fp8.gelu_quantize_rows(y, bias, lora, keep)
    return (None, *fp8.quantize_weight_rows(y))


def main(argv=None) -> None:
    args = gpu_shape_args(__doc__, argv)
    from rich.console import Console
    from rich.table import Table

    # (launch, emulated rounding, tanh.approx): the product's; the product's launch with the float32 rounding the CPU
    # interpreter needs (the GPU's too until 2026-12-03); with the other tanh; each fixed launch
    default = fp8.TANH_APPROX
    launches = [(None, None, default), (None, True, default), (None, None, not default),
                *((launch, None, default) for launch in fp8.LAUNCHES)]
    table = Table(title=f"fp8 row kernel, {torch.cuda.get_device_name()}, median of {args.repeats} (ms, GB/s)")
    table.add_column("case")
    table.add_column("rows x cols", justify="right")
    for launch, emulate, approx in launches:
        table.add_column(("launch_of" if launch is None else f"{launch[0]} / {launch[1]}w")
                         + (", emulated cast" if emulate else "")
                         + ("" if approx == default else ", tanh.approx" if approx else ", exact tanh"),
                         justify="right")
    g = torch.Generator(device="cuda").manual_seed(0)
    emulated = []
    for name, m, n, has_bias, separate, gelu in cases(args.batch, args.text_tokens):
        y = (torch.randn(m, n, device="cuda", generator=g) * 2).bfloat16()
        bias = torch.randn(n, device="cuda", generator=g).bfloat16() if has_bias else None
        lora = (torch.randn(m, n, device="cuda", generator=g) * 0.1).bfloat16() if separate else None
        moved = y.numel() * (2 + 1) + (y.numel() * 2 * 2 if separate else 0)  # y in, codes out (+ LoRA in, a out)
        cells, whole = [], None
        for launch, emulate, approx in launches:
            fp8._LAUNCH, fp8._EMULATE, fp8.TANH_APPROX = launch, emulate, approx
            try:
                out = run(y, bias, lora, separate, gelu)
                ms = median_ms(lambda: run(y, bias, lora, separate, gelu), args.repeats, warmup=3)
            finally:
                fp8._LAUNCH, fp8._EMULATE, fp8.TANH_APPROX = None, None, default
            codes = (out[1].view(torch.uint8), out[2])
            if (launch, emulate, approx) == (fp8.LAUNCHES[0], None, default):
                whole = codes
            cells.append((ms, codes))
        for (launch, emulate, approx), (_, (q, s)) in zip(launches, cells):
            if emulate or approx != default:  # reported, not required: the interpreter's rounding, the other tanh
                differ = q != whole[0]
                what = "the emulated cast" if emulate else "tanh.approx" if approx else "the exact tanh"
                emulated.append(f"{name}, {what}: {int(differ.sum())} of {q.numel()} codes differ from the product's"
                                + (f", e.g. bytes {q[differ][:4].tolist()} for {whole[0][differ][:4].tolist()}"
                                   if differ.any() else ""))
            elif not (torch.equal(q, whole[0]) and torch.equal(s, whole[1])):
                raise SystemExit(f"{name}: the launch {launch or 'launch_of'}'s codes or scales differ from the "
                                 f"whole-row launch's")
        table.add_row(name, f"{m} x {n}", *(f"{ms:.3f} ({moved / ms / 1e6:.0f})" for ms, _ in cells))
    table.caption = ("GB/s = bytes the kernel must move (y read, e4m3 codes written; separate: + the LoRA output read "
                     "and the activation written) / time; every launch's codes and scales equal the whole-row one's")
    Console(width=220).print(table)
    print("the emulated rounding and the other tanh against the product's kernel:", *emulated, sep="\n  ")


if __name__ == "__main__":
    main()
