"""Rollout forward throughput of a full-size DiT: ours (megatron-core specs, TP=1) beside diffusers' model of the
family, same GPU, same run.  Random init, bf16, 512x512 (1024 image tokens), no text padding, under torch.no_grad.
Prints one table.

    python bench/rollout_forward.py [--family qwen_image | sd3] [--batches 1 8 16] [--layers N] [--repeats 5]
                                    [--compile default] [--no-eager] [--no-reference] [--profile]
                                    [--fusion fused unfused qkv-sum] [--lora 64] [--modulation table computed]
                                    [--blocks-per-graph 1 2 4] [--fp8 none handoff plain adaln]
                                    [--lora-weights separate merged] [--adaln-launch ROWS,WARPS,ROUND]
                                    [--dynamic-text] [--smoke]

``--family``: ``qwen_image`` (the default): Qwen-Image 20 B (60 blocks) against QwenImageTransformer2DModel, 128 text
tokens, batches 1 8 16; ``sd3``: SD3.5-Medium (24 blocks, MMDiT-X) against SD3Transformer2DModel at the
``sd35_flow_grpo`` recipe's shape: 77 + 256 text tokens and the pooled text, batches 1, 8 (one group) and the
recipe's rollout batch (``rollout.max_num_seqs``, 32).
``--fusion``: ours with the rollout engine's inference fusions (model_specs.common.fusion: fc1 bias + GELU-tanh in
the GEMM epilogue; Qwen-Image's q / k RMSNorm + RoPE + the joint layout in one Triton kernel; the default, as
EmbeddedEngine runs) and / or without them (megatron-core's MLP, the norms, RoPE and concatenation as torch.compile
fuses them).  ``qkv-sum`` (Qwen-Image): fused, a LoRA'd QKV's bias and adapter output added by their own pass.
``--lora R``: ours with LoRA rank R on the family's LoRA targets (nonzero B), as the rollout of a LoRA run computes.
``--modulation``: ``table`` (the default, as EmbeddedEngine runs): every row at one sigma, with the per-step inputs
the family computes once for a rollout's 10 sigmas (``ModelFamily.step_inputs``: Qwen-Image's ModulationTable, its
time per batch printed apart, the modulation products then not counted in the forward's FLOPs; SD3 has none);
``computed``: rows at random sigmas.
``--blocks-per-graph``: under --compile, consecutive blocks per compiled graph (megatron_omni.compile).
``--fp8``: ours with the FP8 rollout GEMMs (model_specs.common.fp8, as ``rollout.fp8=true`` runs them): ``handoff``
as the engine runs them with ``rollout.fp8_adaln_kernel=false``, ``plain`` with the MLPs unfused (fc2 quantizing its
own input), ``adaln`` the handoff with the one-pass adaLN -> FP8 input (``rollout.fp8_adaln_kernel``, the engine's
default; model_specs.common.norm_quantize), ``none`` bf16 (the default); MFU stays against the bf16 peak. An arm
named twice runs twice (alternating A/B in one run: ``--fp8 handoff adaln handoff adaln``), its rows numbered.
``--adaln-launch``: the ``adaln`` arms' kernel launch (rows per program, warps, eager's roundings:
bench/norm_quantize.py's ``best:`` line) instead of the product's ``norm_quantize.launch_of``.
``--dynamic-text``: under --compile, one call a text token shorter before timing, so the timed graphs are those
compiled with the text length dynamic, as the RL step's are after its second prompt length.
``--lora-weights`` (with ``--lora``): ``separate`` (the default) the base's and the adapters' products apart, as the
trainer computes them; ``merged`` the adapters merged into the rollout's weights (``rollout.lora_weights=merged``,
model_specs.common.rollout_linear), with the time to rebuild the merged copies after a weight change printed (what
each RL step's first rollout batch pays).
``--smoke``: the family's tiny random config in float32 on the CPU (batch 2, a 4x4 token grid): the whole script
runs without a GPU (tests/bench/test_rollout_forward_smoke.py); its times mean nothing.

MFU is against the measured bf16 matmul peak of an H200 (792 TFLOP/s, docs/benchmarks.md); FLOPs from the family's
flops.py (Qwen-Image: 16.6 TFLOP per image at 512x512).
"""
from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field, replace

import torch

import megatron_omni  # noqa: F401  (quiet upstream notices)
from _profile import median_ms
from model_specs.family import get_family

PEAK = 792e12


@dataclass
class Workload:
    """One family's benchmark shape: its arch, token grid, text length and dtype on a device."""

    family: str
    arch: object
    fhw: tuple[int, int, int]
    text: int
    batches: list[int]
    device: torch.device
    dtype: torch.dtype
    extras: dict = field(default_factory=dict)  # name -> width of further per-sample inputs (SD3's pooled text)

    @property
    def image_tokens(self) -> int:
        return self.fhw[0] * self.fhw[1] * self.fhw[2]

    def inputs(self, batch: int):
        """(image tokens [B, I, C], text [B, T, E], sigma [B], {extra: [B, P]}) drawn from a fixed seed."""
        g = torch.Generator(device=self.device).manual_seed(0)
        arch, kw = self.arch, dict(device=self.device, generator=g, dtype=self.dtype)
        in_features = getattr(arch, "in_features", None) or arch.in_channels
        return (torch.randn(batch, self.image_tokens, in_features, **kw),
                torch.randn(batch, self.text, arch.joint_attention_dim, **kw),
                torch.rand(batch, device=self.device, generator=g),
                {name: torch.randn(batch, width, **kw) for name, width in self.extras.items()})

    def flops(self, batch: int, modulation: bool) -> float:
        if self.family == "qwen_image":
            from model_specs.qwen_image.flops import forward_flops

            return forward_flops(self.arch, batch, self.image_tokens, self.text, modulation=modulation)
        return get_family(self.family).forward_flops(self.arch, batch, self.image_tokens, self.text)


def workload(family: str, layers: int | None, smoke: bool) -> Workload:
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    if family == "qwen_image":
        from model_specs.qwen_image.config import QwenImageConfig, tiny_config

        arch = tiny_config() if smoke else QwenImageConfig(num_layers=layers or 60)
        return Workload(family, arch, (1, 4, 4) if smoke else (1, 32, 32), 8 if smoke else 128,
                        [2] if smoke else [1, 8, 16], device, dtype)
    from megatron_omni.config.recipes import get_recipe
    from model_specs.sd3.config import sd35_medium, tiny_config
    from model_specs.sd3.pipeline import POOLED, T5_TOKENS

    arch = tiny_config() if smoke else sd35_medium()
    if layers and not smoke:  # fewer blocks: MMDiT-X keeps those of its dual-attention blocks that remain
        arch = replace(arch, num_layers=layers, dual_attention_layers=tuple(i for i in arch.dual_attention_layers
                                                                           if i < layers))
    rollout_batch = get_recipe("sd35_flow_grpo").rollout.max_num_seqs
    return Workload(family, arch, (1, 4, 4) if smoke else (1, 32, 32), 8 if smoke else 77 + T5_TOKENS,
                    [2] if smoke else [1, 8, rollout_batch], device, dtype, {POOLED: arch.pooled_projection_dim})


def ours(w: Workload, repeats, compile_mode=None, profile=False, fused=True, lora_rank=0, table=True,
         blocks_per_graph=None, top=12, fp8="none", lora_weights="separate", dynamic_text=False):
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    family = get_family(w.family)
    state = init_parallel(device=w.device.type)
    overrides = {"use_cpu_initialization": False} if w.device.type == "cuda" else {}
    cfg = family.transformer_config(w.arch, 1, params_dtype=w.dtype, **overrides)
    model = family.build(w.arch, cfg, state.tp_group, "local").to(w.device).eval()
    if lora_rank:
        from model_specs.common.lora import apply_lora, lora_modules

        apply_lora(model, lora_rank, 2.0 * lora_rank, family.lora_targets, family.rules(w.arch))
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B, std=1e-3)  # nonzero, as after training
    if fp8 != "none":  # the engine's order: FP8 linears first, then the fusions
        from model_specs.common.rollout_linear import enable_fp8

        print(f"FP8 linears: {enable_fp8(model)}", flush=True)
    if lora_rank and lora_weights == "merged":  # (before the fusions, as the engine does)
        from model_specs.common.rollout_linear import merge_adapters

        print(f"merged adapters: {merge_adapters(model)}", flush=True)
        _time_merge(model, w.device, repeats)
    if fused:
        from model_specs.common.fusion import fuse_inference

        # strict on a GPU, where every member must take its fused path; the CPU smoke run takes those that do
        count = fuse_inference(model, strict=w.device.type == "cuda")
        if fp8 == "plain":  # the MLPs' FP8 path before the handoff: megatron's MLP, fc2 quantizing its own input
            from model_specs.common.gelu_mlp import GeluMLP

            for m in (m for m in model.modules() if isinstance(m, GeluMLP) and m.fused):
                m.fused, count = False, count - 1
        print(f"fused modules: {count}", flush=True)
    if fp8 == "adaln":  # after the fusions, as the engine does (its blocks must run fused in FP8)
        from model_specs.common.norm_quantize import enable_adaln_fp8

        print(f"blocks with the one-pass adaLN -> FP8 input: {enable_adaln_fp8(model)}", flush=True)
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
        steps_N = torch.linspace(1.0, 0.1, 10, device=w.device)  # a rollout's sigmas
        if table:
            ms = median_ms(lambda: family.step_inputs(model, steps_N), repeats)
            print(f"per-step inputs for {len(steps_N)} sigmas: {ms:.2f} ms (once per rollout batch)", flush=True)
            step = family.step_inputs(model, steps_N)[3]  # the same for every batch size
        for b in w.batches:
            img, txt, sigma, extras = w.inputs(b)
            kw = dict(extras)
            if table:  # every row at one sigma, as in a rollout step
                sigma, kw = steps_N[3].expand(b), {**kw, **step}
            t0 = time.perf_counter()
            model(img, txt, sigma, w.fhw, None, **kw)
            if w.device.type == "cuda":
                torch.cuda.synchronize()
            first = time.perf_counter() - t0
            if dynamic_text:  # one call a token shorter: the blocks recompile with the text length dynamic, as the
                model(img, txt[:, :-1], sigma, w.fhw, None, **kw)  # RL step's graphs are after its second length
                print(f"recompiled at {txt.shape[1] - 1} text tokens ({time.perf_counter() - t0 - first:.1f} s)",
                      flush=True)
            out[b] = median_ms(lambda: model(img, txt, sigma, w.fhw, None, **kw), repeats)
            print(f"ours{' compiled ' + compile_mode if compile_mode else ''} batch {b}: first call {first:.1f} s, "
                  f"{out[b]:.1f} ms", flush=True)
            if profile and b == max(w.batches):
                from _profile import graph_breaks, profile_kernels

                profile_kernels(lambda: model(img, txt, sigma, w.fhw, None, **kw),
                                f"forward batch {b} {compile_mode or 'eager'}", top=top, shapes=True)
                print(graph_breaks(), flush=True)
    del model
    destroy_parallel()
    if fused == "qkv-sum":
        layers.column_parts = column_parts
    return out


def _time_merge(model, device, repeats) -> None:
    """The rebuild of every merged copy after the adapters changed (as after each sync), median ms."""
    from model_specs.common.lora import lora_modules
    from model_specs.common.rollout_linear import refresh_rollout_weights

    adapters = [m.lora_B for m in lora_modules(model).values()]

    def rebuild():
        with torch.no_grad():
            torch._foreach_mul_(adapters, 1.0)  # (in place: the version counters move, as a sync's copy moves them)
        refresh_rollout_weights(model)

    print(f"merged copies rebuilt after a weight change: {median_ms(rebuild, repeats):.1f} ms", flush=True)


def reference(w: Workload, repeats):
    """diffusers' model of the family at random init on the same inputs, timed the same way."""
    kwargs = {k: v for k, v in w.arch.to_diffusers().items() if not k.startswith("_")}
    if w.family == "qwen_image":
        from diffusers import QwenImageTransformer2DModel

        with torch.device("meta"):
            model = QwenImageTransformer2DModel(**kwargs).to(w.dtype)
        model = model.to_empty(device=w.device).eval()
        # the RoPE tables are plain attributes, not buffers: rebuild them off the meta device
        model.pos_embed = type(model.pos_embed)(theta=10000, axes_dim=list(w.arch.axes_dims_rope), scale_rope=True)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)

        def call(img, txt, sigma, extras):
            return model(hidden_states=img, encoder_hidden_states=txt, timestep=sigma,
                         img_shapes=[[w.fhw]] * img.shape[0], return_dict=False)
    else:
        from diffusers import SD3Transformer2DModel

        from model_specs.sd3.conditioning import unpack
        from model_specs.sd3.pipeline import POOLED

        with torch.device(w.device):  # its own init (seconds on a GPU); the position table is a real buffer
            model = SD3Transformer2DModel(**kwargs).to(w.dtype).eval()

        def call(img, txt, sigma, extras):  # the pipeline passes the latent image and timestep = 1000 sigma
            z_BZHW = unpack(img, w.fhw[1], w.fhw[2], w.arch.patch_size)
            return model(hidden_states=z_BZHW, encoder_hidden_states=txt, pooled_projections=extras[POOLED],
                         timestep=1000 * sigma, return_dict=False)
    out = {}
    with torch.no_grad():
        for b in w.batches:
            inputs = w.inputs(b)
            out[b] = median_ms(lambda: call(*inputs), repeats)
    del model
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("qwen_image", "sd3"), default="qwen_image",
                   help="qwen_image: Qwen-Image 20 B; sd3: SD3.5-Medium at the sd35_flow_grpo recipe's shape")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="default: qwen_image 1 8 16; sd3 1 8 and the recipe's rollout batch (32)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the full size, 60 / 24)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", nargs="*", default=[], metavar="MODE",
                   help="also time ours with every block under torch.compile(mode=MODE), e.g. default "
                        "max-autotune-no-cudagraphs")
    p.add_argument("--no-reference", action="store_true", help="skip diffusers")
    p.add_argument("--no-eager", action="store_true", help="time ours only under the --compile modes")
    p.add_argument("--profile", action="store_true", help="kernel breakdown of ours at the largest batch")
    p.add_argument("--top", type=int, default=12, help="heaviest kernels listed by --profile")
    p.add_argument("--fusion", nargs="+", choices=("fused", "unfused", "qkv-sum"), default=["fused"],
                   help="ours with the engine's inference fusions, and / or without; qkv-sum (qwen_image): fused, "
                        "but a LoRA'd QKV's bias and adapter output summed by their own pass, not in the q / k norm "
                        "kernel")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank on the family's targets (0 = none)")
    p.add_argument("--modulation", nargs="+", choices=("table", "computed"), default=["table"],
                   help="ours with the per-step inputs built once per rollout batch (Qwen-Image: the adaLN "
                        "modulation table), and / or computing everything in every forward")
    p.add_argument("--blocks-per-graph", type=int, nargs="+", default=[None], metavar="K",
                   help="under --compile: consecutive blocks per compiled graph, one run per K (default: "
                        "megatron_omni.compile.BLOCKS_PER_GRAPH)")
    p.add_argument("--dynamic-text", action="store_true",
                   help="under --compile: before timing, one call a text token shorter, so that the timed graphs "
                        "are the ones compiled with the text length dynamic (as in the RL step, whose prompts "
                        "differ in length)")
    p.add_argument("--fp8", nargs="+", choices=("none", "handoff", "plain", "adaln"), default=["none"],
                   help="ours with the rollout's FP8 GEMMs (rollout.fp8): handoff = as the engine runs them without "
                        "the adaLN kernel (fc1's output reaches fc2 quantized in one pass, fp8.gelu_quantize_rows), "
                        "plain = the MLPs unfused (fc2 quantizes its own input), adaln = handoff with the one-pass "
                        "adaLN -> FP8 input (rollout.fp8_adaln_kernel, the engine's default); none = bf16.  An arm "
                        "named twice runs twice (A/B)")
    p.add_argument("--lora-weights", nargs="+", choices=("separate", "merged"), default=["separate"],
                   help="with --lora: the adapters apart (the trainer's ops) and / or merged into the rollout's "
                        "weights (rollout.lora_weights=merged)")
    p.add_argument("--adaln-launch", default=None, metavar="ROWS,WARPS,ROUND",
                   help="the adaln arms' kernel launch, e.g. 4,8,false (default: norm_quantize.launch_of)")
    p.add_argument("--smoke", action="store_true", help="the family's tiny config in float32 on the CPU")
    args = p.parse_args()
    if args.adaln_launch is not None:
        from model_specs.common import norm_quantize

        if "adaln" not in args.fp8:
            p.error(f"--adaln-launch {args.adaln_launch} sets the adaln arms' kernel; expected --fp8 adaln too")
        try:
            norm_quantize._LAUNCH = norm_quantize.parse_launch(args.adaln_launch)
        except ValueError as e:
            p.error(str(e))
    if "merged" in args.lora_weights and not args.lora:
        p.error("--lora-weights merged merges LoRA adapters; expected --lora R too")
    if args.dynamic_text and not args.compile:
        p.error("--dynamic-text times the graphs compiled with a dynamic text length; expected --compile MODE too")
    if "adaln" in args.fp8 and args.fusion != ["fused"]:
        p.error(f"--fp8 adaln runs the fused blocks' FP8 path; expected --fusion fused alone, got {args.fusion}")
    if "qkv-sum" in args.fusion and args.family != "qwen_image":
        p.error(f"--fusion qkv-sum patches Qwen-Image's attention; expected --family qwen_image, got {args.family}")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device: the bench times a GPU; expected one, or --smoke for the tiny CPU run")
    w = workload(args.family, args.layers, args.smoke)
    w.batches = args.batches or w.batches
    results = {}
    lora = f" lora{args.lora}" if args.lora else ""
    arms = [(m, f, mo, k, q, lw) for m in ([None] if not args.no_eager else []) + args.compile for f in args.fusion
            for mo in args.modulation for k in (args.blocks_per_graph if m else [None]) for q in args.fp8
            for lw in args.lora_weights]
    repeated = {a for a in arms if arms.count(a) > 1}  # numbered from their first run: "#1", "#2", ...
    for arm in arms:
        mode, fusion, modulation, per_graph, fp8, merge = arm
        _release()
        graphs = "" if per_graph is None else f" {per_graph}/graph"
        quant = "" if fp8 == "none" else f" fp8-{fp8}"
        merged = " merged" if merge == "merged" else ""
        name = (f"ours {mode or 'eager'}{lora}{merged}{graphs}{quant} {fusion}"
                f"{' table' if modulation == 'table' else ''}")
        name += f" #{sum(n.startswith(name + ' #') for n in results) + 1}" if arm in repeated else ""
        print(f"--- {name}", flush=True)
        results[name] = ours(w, args.repeats, mode, args.profile,
                             {"fused": True, "unfused": False}.get(fusion, fusion), args.lora,
                             modulation == "table", per_graph, args.top, fp8, merge, args.dynamic_text)
    _release()
    if not args.no_reference:
        results["diffusers"] = reference(w, args.repeats)
    device = torch.cuda.get_device_name() if w.device.type == "cuda" else "cpu (smoke: times mean nothing)"
    side = w.fhw[1] * 16  # pixels: 8x VAE, 2x2 patches
    launch = f", adaln launch {args.adaln_launch}" if args.adaln_launch else ""
    print(f"\n{device}, {args.family} {get_family(args.family).num_blocks(w.arch)} blocks, {w.dtype}, "
          f"{side}x{side} + {w.text} text tokens"
          f"{' (compiled graphs dynamic in it)' if args.dynamic_text else ''}, eager{launch}")
    print(f"{'model':<54} {'batch':>5} {'forward ms':>11} {'img*steps/s':>12} {'TFLOP/s':>8} {'MFU':>6}")
    for name, rows in results.items():
        for b, ms in rows.items():
            flops = w.flops(b, modulation=not name.endswith(" table"))
            print(f"{name:<54} {b:>5} {ms:>11.1f} {b / ms * 1e3:>12.1f} {flops / ms / 1e9:>8.0f} "
                  f"{flops / ms / 1e9 / (PEAK / 1e12):>6.1%}")


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
