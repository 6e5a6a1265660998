"""FlowGRPO training step of the full-size Qwen-Image DiT on one GPU: LoRA r64 and full fine-tuning, eager and
under torch.compile, per micro-batch size.  Prints one table (s / optimizer step, TFLOP/s, MFU, peak memory).

    python bench/train_step.py [--modes lora full] [--micro-batches 4 8] [--compile default] [--steps 3]
                               [--full-layers 12] [--layers 60] [--profile]
                               [--grad-accumulation auto batched batched-per-tensor hooks]
    python bench/train_step.py --smoke      # tiny model on the CPU: checks the script runs; times mean nothing

One optimizer step = the recipe's 32 (sample, step) pairs (group 16 x SDE window 2, 512x512 + 128 text
tokens, true CFG 4 with the rollout's uncond output reused: cond rows only, as the end-to-end loop's first
optimizer step after a rollout) through megatron-core's schedule with the project's FlowGRPO loss, then the
optimizer.  Old log-probs come from a forward-only pass first, so the ratios are 1 and nothing is clipped.
* lora: LoRA r64 / alpha 128 on the 12 usual linears of all 60 blocks (base frozen): a pair costs a forward and
  an activation-gradient backward, 2 forwards' FLOPs (LoRA's own FLOPs not counted).
* full: every parameter trained (megatron's Adam, fp32 main weights and grads): 3 forwards' FLOPs per pair.
  The 20.4 B model's optimizer state does not fit one GPU, so this runs ``--full-layers`` blocks (same
  block shapes; MFU per block is what the full model would reach, the embedders are a rounding error).
MFU is against the measured bf16 matmul peak (792 TFLOP/s on an H200, docs/benchmarks.md) and counts the LoRA adapters'
FLOPs (forward, activation and adapter weight gradients: megatron_omni.trainer.mfu); "base MFU" counts the base
model's alone (a LoRA pair = 2 forward-equivalents, a full fine-tuning pair 3), as this bench did before 2026-12-01.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import megatron_omni  # noqa: E402,F401  (quiet upstream notices)
from _flow_grpo_parts import Recipe, free_device_memory, make_recipe, peak_gib, synchronize  # noqa: E402
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig, FlowGRPOMicroBatch, flow_grpo_forward_step  # noqa: E402
from megatron_omni.trainer import grad_flush  # noqa: E402
from megatron_omni.trainer.mfu import device_peak_flops, forward_flops, lora_forward_flops  # noqa: E402
from model_specs.common.lora import FLOW_GRPO_TARGETS  # noqa: E402


def _microbatches(recipe: Recipe, size: int) -> list[FlowGRPOMicroBatch]:
    """The recipe's 32 pairs in micro-batches of ``size``, random inputs of the real shapes."""
    g = torch.Generator(device=recipe.device).manual_seed(0)
    dev, pairs = recipe.device, recipe.samples * recipe.window
    i, c, t, e = recipe.image_tokens, recipe.arch.in_channels, recipe.text_tokens, recipe.arch.joint_attention_dim
    out = []
    for k in range(0, pairs, size):
        b = min(size, pairs - k)
        t_B = torch.full((b,), 0.9, device=dev)
        out.append(FlowGRPOMicroBatch(
            x_t=torch.randn(b, i, c, device=dev, generator=g), txt=torch.randn(b, t, e, device=dev, generator=g),
            txt_mask=None, img_fhw=recipe.img_fhw, x_next=torch.randn(b, i, c, device=dev, generator=g),
            t=t_B, t_next=t_B - 0.1, old_log_prob=torch.zeros(b, device=dev),
            advantage=torch.randn(b, device=dev, generator=g), noise_level=recipe.noise_level, sigma_1=0.95,
            guidance_scale=recipe.guidance, uncond_velocity=torch.randn(b, i, c, device=dev, generator=g)))
    return out


def _with_old_log_probs(policy, mbs: list[FlowGRPOMicroBatch], step) -> None:
    from megatron_omni.trainer.policy import run_microbatches

    out, _ = run_microbatches(policy, step, mbs, forward_only=True, collect_non_loss_data=True)
    for mb, o in zip(mbs, out):
        mb.old_log_prob = o["log_prob"].float()


def run(recipe: Recipe, mode: str, micro_batch: int, compile_mode: str | None, steps: int,
        profile: bool, batched_grads: bool | None = None, blocks_per_graph: int | None = None) -> dict:
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from megatron_omni.trainer.policy import build_policy, compile_policy, run_microbatches
    from model_specs.common.lora import apply_lora
    from checkpoints_convert.qwen_image import qwen_image_rules

    state = init_parallel(device=recipe.device.type, seed=0)
    torch.manual_seed(0)
    lora = mode == "lora"
    prepare = (lambda m: apply_lora(m, recipe.lora_rank, recipe.lora_alpha, FLOW_GRPO_TARGETS,
                                    qwen_image_rules(m.arch), seed=0)) if lora else None
    try:
        with torch.device(recipe.device):
            policy = build_policy(recipe.arch, state, lr=recipe.lr, clip_grad=1.0, dtype=recipe.dtype,
                                  backend="local", prepare=prepare, batched_grads=batched_grads)
        if compile_mode:
            compile_policy(policy, compile_mode, blocks_per_graph)
        step = flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=recipe.clip_range))
        mbs = _microbatches(recipe, micro_batch)
        start = time.perf_counter()
        _with_old_log_probs(policy, mbs, step)
        run_microbatches(policy, step, mbs)  # warm-up (compiles under --compile)
        synchronize(recipe.device)
        ready = time.perf_counter() - start
        times = []
        for _ in range(steps):
            synchronize(recipe.device)
            t0 = time.perf_counter()
            out, grad_norm = run_microbatches(policy, step, mbs)
            synchronize(recipe.device)
            times.append(time.perf_counter() - t0)
        if profile and recipe.device.type == "cuda":
            from _profile import graph_breaks, profile_kernels, sync_points

            profile_kernels(lambda: run_microbatches(policy, step, mbs),
                            f"train {mode} micro-batch {micro_batch} {compile_mode or 'eager'}", top=20, host=True,
                            shapes=True)
            sync_points(lambda: run_microbatches(policy, step, mbs))
            print(graph_breaks())
        ratio = torch.stack([torch.as_tensor(m["ratio_mean"]).float() for m in out]).mean().item()
        trained = sum(p.numel() for p in policy.module.parameters() if p.requires_grad)
        return dict(seconds=statistics.median(times), first=ready, peak=peak_gib(recipe.device), ratio=ratio,
                    grad_norm=float(grad_norm), trained=trained, layers=recipe.arch.num_layers)
    finally:
        policy = None
        destroy_parallel()
        free_device_memory(recipe.device)


FLAT_SPAN = grad_flush.FLAT_SPAN


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--compile", nargs="*", default=[], metavar="MODE",
                   help="also run with every block under torch.compile(mode=MODE); 'eager' is always run first")
    p.add_argument("--no-eager", action="store_true", help="only the --compile modes")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--full-layers", type=int, default=12, help="blocks of the full fine-tuning model")
    p.add_argument("--profile", action="store_true", help="kernel breakdown of one more step of every run")
    p.add_argument("--grad-accumulation", nargs="+", choices=("auto", "batched", "batched-per-tensor", "hooks"),
                   default=["auto"],
                   help="DDP's main_grad adds: the trainer's choice (auto: batched for LoRA, hooks for full "
                        "fine-tuning), batched once per micro-batch (megatron_omni.trainer.grad_flush: a span of "
                        "DDP's buffer per add), the same with one add per tensor (as before 2026-12-07: "
                        "grad_flush.FLAT_SPAN = 0) and / or megatron's per-parameter hooks")
    p.add_argument("--layers", type=int, default=None,
                   help="blocks of the LoRA model (default: Qwen-Image's 60; fewer where 60 do not fit)")
    p.add_argument("--blocks-per-graph", type=int, nargs="+", default=[None], metavar="K",
                   help="under --compile: consecutive blocks per compiled graph, one run per K (default: "
                        "megatron_omni.compile.BLOCKS_PER_GRAPH)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    peak = device_peak_flops(torch.bfloat16) if not args.smoke else None
    compile_modes = ([] if args.no_eager else [None]) + list(args.compile)
    rows = []
    for mode in args.modes:
        for mb in args.micro_batches:
            for cm, acc, k in [(cm, acc, k) for cm in compile_modes for acc in args.grad_accumulation
                               for k in (args.blocks_per_graph if cm else [None])]:
                recipe = make_recipe(args.smoke, micro_batch=mb)
                if mode == "full" and not args.smoke:
                    recipe.arch = type(recipe.arch)(num_layers=args.full_layers)
                elif args.layers and not args.smoke:
                    recipe.arch = type(recipe.arch)(num_layers=args.layers)
                name = (f"{mode} mb{mb} {cm or 'eager'}" + ("" if acc == "auto" else f" {acc}")
                        + ("" if k is None else f" {k}/graph"))
                grad_flush.FLAT_SPAN = 0 if acc == "batched-per-tensor" else FLAT_SPAN
                try:
                    r = run(recipe, mode, mb, cm, args.steps, args.profile, blocks_per_graph=k,
                            batched_grads={"auto": None, "batched": True, "batched-per-tensor": True,
                                           "hooks": False}[acc])
                except torch.OutOfMemoryError as err:
                    print(f"{name}: out of memory ({str(err).splitlines()[0][:120]})", flush=True)
                    rows.append((name, None, recipe))
                    free_device_memory(recipe.device)
                    continue
                print(f"{name}: {r}", flush=True)
                rows.append((name, r, recipe))
    r0 = make_recipe(args.smoke)
    print(f"\n{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}: FlowGRPO training step, "
          f"{r0.samples * r0.window} pairs ({r0.image_tokens} image + {r0.text_tokens} text tokens, cond rows, the "
          f"rollout's uncond reused), {str(r0.dtype).removeprefix('torch.')}")
    print(f"{'run':<36} {'blocks':>6} {'trained':>9} {'s/step':>8} {'ready s':>8} {'TFLOP/s':>8} {'MFU':>6} {'base MFU':>8} "
          f"{'peak GiB':>9} {'ratio':>7}")
    for name, r, recipe in rows:
        if r is None:
            print(f"{name:<36} out of memory")
            continue
        lora = name.startswith("lora")
        per_row = forward_flops(recipe.arch, 1, recipe.image_tokens, recipe.text_tokens)
        adapter = lora_forward_flops(recipe.arch, recipe.lora_rank if lora else 0, FLOW_GRPO_TARGETS, 1,
                                     recipe.image_tokens, recipe.text_tokens)
        base = per_row * recipe.samples * recipe.window * (2 if lora else 3)
        flops = base + 3 * adapter * recipe.samples * recipe.window
        tflops = flops / r["seconds"] / 1e12
        mfu = f"{flops / r['seconds'] / peak:.1%}" if peak else "-"
        mfu_base = f"{base / r['seconds'] / peak:.1%}" if peak else "-"
        peak_mem = f"{r['peak']:.1f}" if r["peak"] is not None else "-"
        print(f"{name:<36} {r['layers']:>6} {r['trained'] / 1e6:>8.1f}M {r['seconds']:>8.3f} {r['first']:>8.1f} "
              f"{tflops:>8.0f} {mfu:>6} {mfu_base:>8} {peak_mem:>9} {r['ratio']:>7.4f}")


if __name__ == "__main__":
    sys.exit(main())
