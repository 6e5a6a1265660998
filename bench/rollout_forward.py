"""Rollout forward throughput of the full-size Qwen-Image DiT: ours (megatron-core specs, TP=1) beside
diffusers' QwenImageTransformer2DModel, same GPU, same run.  Random init, bf16, 512x512 (1024 image
tokens) + 128 text tokens, no text padding, under torch.no_grad.  Prints one table.

    python bench/rollout_forward.py [--batches 1 8 16] [--layers 60] [--repeats 5] [--compile default]
                                    [--no-eager] [--no-reference] [--profile] [--fusion fused unfused qkv-sum]
                                    [--lora 64] [--modulation table computed] [--blocks-per-graph 1 2 4]

``--fusion``: ours with the rollout engine's inference fusions (model_specs.common.fusion: fc1 bias + GELU-tanh in
the GEMM epilogue, q / k RMSNorm + RoPE + the joint layout in one Triton kernel; the default, as EmbeddedEngine runs)
and / or without them (megatron-core's MLP, the norms, RoPE and concatenation as torch.compile fuses them).
``--lora R``: ours with LoRA rank R on the FlowGRPO targets (nonzero B), as the rollout of a LoRA run computes; the
fused MLP then folds fc1's adapter into its GEMM.
``--modulation``: ``table`` (the default, as EmbeddedEngine runs): every row at one sigma, the blocks' adaLN
modulations read from a ModulationTable built once for a rollout's 10 sigmas (its time per batch printed apart;
the modulation products are then not counted in the forward's FLOPs); ``computed``: each forward computes them,
rows at random sigmas.
``--blocks-per-graph``: under --compile, consecutive blocks per compiled graph (megatron_omni.compile; default its
BLOCKS_PER_GRAPH).

MFU is against the measured bf16 matmul peak of an H200 (792 TFLOP/s, docs/benchmarks.md); FLOPs from
model_specs/qwen_image/flops.py (16.6 TFLOP per image at 512x512).
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

import megatron_omni  # noqa: F401  (quiet upstream notices)
from _profile import median_ms
from model_specs.qwen_image.config import QwenImageConfig
from model_specs.qwen_image.flops import forward_flops

PEAK = 792e12
FHW, TEXT = (1, 32, 32), 128


def _inputs(arch: QwenImageConfig, batch: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = FHW[0] * FHW[1] * FHW[2]
    return (torch.randn(batch, n, arch.in_channels, device="cuda", generator=g, dtype=torch.bfloat16),
            torch.randn(batch, TEXT, arch.joint_attention_dim, device="cuda", generator=g, dtype=torch.bfloat16),
            torch.rand(batch, device="cuda", generator=g))


def ours(arch, batches, repeats, compile_mode=None, profile=False, fused=True, lora_rank=0, table=True,
         blocks_per_graph=None, top=12):
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from model_specs.qwen_image.model import QwenImageModel
    from model_specs.qwen_image.spec import qwen_image_block_spec

    state = init_parallel(device="cuda")
    cfg = arch.transformer_config(1, params_dtype=torch.bfloat16, use_cpu_initialization=False)
    model = QwenImageModel(arch, cfg, state.tp_group, qwen_image_block_spec("local")).cuda().eval()
    if lora_rank:
        from checkpoints_convert.qwen_image import qwen_image_rules
        from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules

        apply_lora(model, lora_rank, 2.0 * lora_rank, FLOW_GRPO_TARGETS, qwen_image_rules(arch))
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B, std=1e-3)  # nonzero, as after training
    if fused:
        from model_specs.common.fusion import fuse_inference

        fuse_inference(model, strict=True)
    if fused == "qkv-sum":  # the QKV's bias and LoRA output added by their own pass (the path before 2026-12-01)
        import model_specs.qwen_image.layers as layers
        from model_specs.common.fusion import column_parts
        from model_specs.common.lora import LoRALinear

        layers.column_parts = lambda linear, x: ((linear(x)[0], None, None) if isinstance(linear, LoRALinear)
                                                 else column_parts(linear, x))
    out = {}
    if compile_mode:
        from megatron_omni.compile import compile_blocks

        compile_blocks(model, compile_mode, blocks_per_graph)
    with torch.no_grad():
        steps_N = torch.linspace(1.0, 0.1, 10, device="cuda")  # a rollout's sigmas
        if table:
            ms = median_ms(lambda: model.modulation_table(steps_N), repeats)
            print(f"modulation table for {len(steps_N)} sigmas: {ms:.2f} ms (once per rollout batch)", flush=True)
            step = model.modulation_table(steps_N).step(3)  # the same for every batch size
        for b in batches:
            img, txt, sigma = _inputs(arch, b)
            kw = {}
            if table:  # every row at one sigma, as in a rollout step
                sigma, kw = steps_N[3].expand(b), {"modulation": step}
            t0 = time.perf_counter()
            model(img, txt, sigma, FHW, None, **kw)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            out[b] = median_ms(lambda: model(img, txt, sigma, FHW, None, **kw), repeats)
            print(f"ours{' compiled ' + compile_mode if compile_mode else ''} batch {b}: first call {first:.1f} s, "
                  f"{out[b]:.1f} ms", flush=True)
            if profile and b == max(batches):
                from _profile import graph_breaks, profile_kernels

                profile_kernels(lambda: model(img, txt, sigma, FHW, None, **kw),
                                f"forward batch {b} {compile_mode or 'eager'}", top=top, shapes=True)
                print(graph_breaks(), flush=True)
    del model
    destroy_parallel()
    if fused == "qkv-sum":
        layers.column_parts = column_parts
    return out


def reference(arch, batches, repeats):
    from diffusers import QwenImageTransformer2DModel

    kwargs = {k: v for k, v in arch.to_diffusers().items() if not k.startswith("_")}
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**kwargs).to(torch.bfloat16)
    model = model.to_empty(device="cuda").eval()
    # the RoPE tables are plain attributes, not buffers: rebuild them off the meta device
    model.pos_embed = type(model.pos_embed)(theta=10000, axes_dim=list(arch.axes_dims_rope), scale_rope=True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    out = {}
    with torch.no_grad():
        for b in batches:
            img, txt, sigma = _inputs(arch, b)
            out[b] = median_ms(lambda: model(hidden_states=img, encoder_hidden_states=txt, timestep=sigma,
                                         img_shapes=[[FHW]] * b, return_dict=False), repeats)
    del model
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--layers", type=int, default=60, help="blocks (60 = full size)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", nargs="*", default=[], metavar="MODE",
                   help="also time ours with every block under torch.compile(mode=MODE), e.g. default "
                        "max-autotune-no-cudagraphs")
    p.add_argument("--no-reference", action="store_true", help="skip diffusers")
    p.add_argument("--no-eager", action="store_true", help="time ours only under the --compile modes")
    p.add_argument("--profile", action="store_true", help="kernel breakdown of ours at the largest batch")
    p.add_argument("--top", type=int, default=12, help="heaviest kernels listed by --profile")
    p.add_argument("--fusion", nargs="+", choices=("fused", "unfused", "qkv-sum"), default=["fused"],
                   help="ours with the engine's inference fusions, and / or without; qkv-sum: fused, but a LoRA'd "
                        "QKV's bias and adapter output summed by their own pass, not in the q / k norm kernel")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank on the FlowGRPO targets (0 = none)")
    p.add_argument("--modulation", nargs="+", choices=("table", "computed"), default=["table"],
                   help="ours reading the adaLN modulations from a table built once per rollout batch, and / or "
                        "computing them in every forward")
    p.add_argument("--blocks-per-graph", type=int, nargs="+", default=[None], metavar="K",
                   help="under --compile: consecutive blocks per compiled graph, one run per K (default: "
                        "megatron_omni.compile.BLOCKS_PER_GRAPH)")
    args = p.parse_args()
    arch = QwenImageConfig(num_layers=args.layers)
    results = {}
    lora = f" lora{args.lora}" if args.lora else ""
    for mode in ([None] if not args.no_eager else []) + args.compile:
        for fusion, modulation, per_graph in [(f, m, k) for f in args.fusion for m in args.modulation
                                              for k in (args.blocks_per_graph if mode else [None])]:
            gc.collect()
            torch.cuda.empty_cache()
            graphs = "" if per_graph is None else f" {per_graph}/graph"
            name = f"ours {mode or 'eager'}{lora}{graphs} {fusion}{' table' if modulation == 'table' else ''}"
            print(f"--- {name}", flush=True)
            results[name] = ours(arch, args.batches, args.repeats, mode, args.profile,
                                 {"fused": True, "unfused": False}.get(fusion, fusion), args.lora,
                                 modulation == "table", per_graph, args.top)
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_reference:
        results["diffusers"] = reference(arch, args.batches, args.repeats)
    print(f"\n{torch.cuda.get_device_name()}, {args.layers} blocks, bf16, 512x512 + {TEXT} text tokens, eager")
    print(f"{'model':<44} {'batch':>5} {'forward ms':>11} {'img*steps/s':>12} {'TFLOP/s':>8} {'MFU':>6}")
    for name, rows in results.items():
        for b, ms in rows.items():
            flops = forward_flops(arch, b, FHW[0] * FHW[1] * FHW[2], TEXT, modulation=not name.endswith(" table"))
            print(f"{name:<44} {b:>5} {ms:>11.1f} {b / ms * 1e3:>12.1f} {flops / ms / 1e9:>8.0f} "
                  f"{flops / ms / 1e9 / (PEAK / 1e12):>6.1%}")


if __name__ == "__main__":
    main()
