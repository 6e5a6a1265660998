"""One FlowGRPO step of the VeRL-Omni Qwen-Image OCR recipe's shape on a full-size random-init Qwen-Image DiT
(20.4 B, bf16), ours beside the diffusers + peft peer loop, on one GPU in one run.  Prints one table.

    python bench/flow_grpo_step.py [--steps 5] [--group 16] [--prompts 1] [--compile default]
                                   [--compile-train default] [--micro-batch 4] [--skip-reference] [--no-reuse-uncond]
    python bench/flow_grpo_step.py --smoke      # tiny model on the CPU: checks the script runs; times mean nothing
    torchrun --nproc-per-node=2 bench/flow_grpo_step.py --compile default --compile-train default
                                                # data parallel: weak scaling, 16 images per GPU

Recipe: 512x512 (1024 image tokens, 64 packed channels) + 128 text tokens, 10 rollout steps (SDE noise 1.2),
true CFG 4 (cond + uncond rows in one forward), an SDE window of 2 steps inside steps 0..4, group 16 per
prompt, LoRA r64 / alpha 128 on the 12 usual linears (424.7 M params), training micro-batches of 4 (sample,
step) pairs (ours: ``--micro-batch``; the reference keeps 4), one optimizer step per RL step, clip 1e-5, lr 3e-4.

Each loop runs one warm-up step, then ``--steps`` timed steps; the table shows medians, every phase timed
with the device synchronised at both ends.
* ours: text encoding -> rollout -> VAE decode -> reward -> train -> LoRA weight sync (bench/_flow_grpo_ours.py);
  DiT side = rollout + train + sync, end to end = all six, one after the other (nothing overlapped).
* reference: rollout -> train, DiT side only (bench/_flow_grpo_reference.py).  The two models are never
  resident together: ours is freed before the reference is built.
MFU counts the work each loop runs (megatron_omni.trainer.mfu.varlen_step_flops with the Qwen-Image FLOP
counters, each row at its text length: 26 forwards per image, 24 for ours when it reuses the rollout's uncond
outputs in training (the default; --no-reuse-uncond recomputes them); the LoRA adapters' FLOPs counted, and a
note gives the base model's alone) against the measured bf16 peak (792 TFLOP/s on an H200, docs/benchmarks.md).
``--negative-tokens N`` gives the negative prompt N tokens (default: as many as a prompt, docs/benchmarks.md's shape):
ours then runs cond and uncond rows as two unpadded forwards, the reference as diffusers' pipeline does (two).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts: less fragmentation

import torch  # noqa: E402

import megatron_omni  # noqa: E402,F401  (quiet upstream notices)
from _flow_grpo_parts import (EndToEnd, Recipe, free_device_memory, make_recipe, medians, peak_gib,  # noqa: E402
                              phase_flops)
from megatron_omni.trainer.mfu import device_peak_flops  # noqa: E402

OURS_PHASES = ("text", "rollout", "decode", "reward", "train", "sync")
DIT_PHASES = ("rollout", "train", "sync")


@dataclass
class LoopResult:
    name: str
    seconds: dict[str, float] = field(default_factory=dict)  # medians per phase, and "dit" / "e2e" totals
    metrics: dict[str, float] = field(default_factory=dict)  # of the last timed step
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    reused_uncond: bool = False  # trained on the rollout's uncond outputs (no uncond forward in 'train')


def _timed_steps(step_fn, steps: int, result: LoopResult, phases: tuple[str, ...]) -> None:
    timed = []
    for step in range(steps + 1):  # step 0 warms up
        seconds, result.metrics = step_fn(step)
        seconds["dit"] = sum(seconds.get(p, 0.0) for p in DIT_PHASES)
        seconds["e2e"] = sum(seconds[p] for p in phases)
        if step:
            timed.append(seconds)
    result.seconds = medians(timed)


def _profile(ours, e2e, step: int) -> None:
    """One more step with the host's waits for the device listed, then one more rollout under the profiler
    (kernels by kind, the GPU's busy fraction of the wall time: what the rollout loop adds to its forwards)."""
    from _flow_grpo_ours import ours_step, rollout, step_prompts
    from _flow_grpo_parts import encode_step
    from _profile import profile_kernels, sync_points

    print("--- ours, one more step: where the host waits for the device ---")
    sync_points(lambda: ours_step(ours, e2e, step))
    prompts = step_prompts(ours, step + 1)
    emb_PTE, neg_TE = encode_step(e2e.text, ours.recipe, prompts)
    profile_kernels(lambda: rollout(ours, prompts, emb_PTE, neg_TE, step + 1), "ours, one more rollout", top=14,
                    host=True)


def run_ours(recipe: Recipe, steps: int, compile_mode: str | None, compile_train: str | None = None,
             profile: bool = False) -> LoopResult:
    from _flow_grpo_ours import build_ours, ours_step
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    compiled = ", ".join(f"{what}: {mode}" for what, mode in (("rollout", compile_mode), ("train", compile_train))
                         if mode)
    result = LoopResult("ours" + (f" (compiled {compiled})" if compiled else " (eager)")
                        + ("" if recipe.reuse_uncond else ", uncond recomputed"), reused_uncond=recipe.reuse_uncond)
    state = init_parallel(device=recipe.device.type, seed=0)
    ours = e2e = None
    try:
        ours = build_ours(recipe, state, compile_mode, compile_train)
        build, first = ours.build_seconds, ours.first_forward_seconds
        result.notes.append(f"ours ready in {build + first:.1f} s: build {build:.1f} s (policy with LoRA "
                            f"{ours.trainable_params / 1e6:.1f} M params, DDP + optimizer, the engine's view of the "
                            f"base, first LoRA sync), first rollout forward {first:.1f} s"
                            + (" (compile included)" if compile_mode else ""))
        e2e = EndToEnd.build(recipe)
        result.notes += e2e.describe()
        _timed_steps(lambda step: ours_step(ours, e2e, step), steps, result, OURS_PHASES)
        if profile and recipe.device.type == "cuda":
            _profile(ours, e2e, steps + 1)
    except torch.OutOfMemoryError as e:
        result.error = (f"out of memory ({str(e).splitlines()[0]}); --text-layers N shrinks the text encoder "
                        f"(14 GB at 28 layers)")
    finally:
        if e2e is not None:
            e2e.reward.close()
        del ours, e2e
        destroy_parallel()
    result.notes += _memory_note(result.name, recipe)
    free_device_memory(recipe.device)
    return result


def run_reference(recipe: Recipe, steps: int) -> LoopResult:
    from _flow_grpo_reference import build_reference, reference_step

    result = LoopResult("reference (diffusers + peft)")
    ref = None
    try:
        ref = build_reference(recipe)
        _timed_steps(lambda step: reference_step(ref, step), steps, result, ("rollout", "train"))
    except torch.OutOfMemoryError as e:
        result.error = f"out of memory: {str(e).splitlines()[0]}"
    finally:
        del ref
    result.notes += _memory_note(result.name, recipe)
    free_device_memory(recipe.device)
    return result


def _memory_note(name: str, recipe: Recipe) -> list[str]:
    peak = peak_gib(recipe.device)
    return [f"{name}: peak {peak:.1f} GiB allocated"] if peak is not None else []


# ---- the table ------------------------------------------------------------------------------------------

def _tera(value: float) -> str:
    return f"{value / 1e12:.0f}" if value > 1e12 else f"{value / 1e12:.2g}"  # the smoke model's are tiny


def _row(table, loop: str, phase: str, seconds: float, flops: float | None, peak: float | None,
         images: float | None = None) -> None:
    """One phase: seconds, and where it runs the DiT, its FLOPs, rate and MFU; images/s on the totals."""
    cells = [""] * 3
    if flops:
        cells = [_tera(flops), _tera(flops / seconds), f"{flops / seconds / peak:.1%}" if peak else "-"]
    table.add_row(loop, phase, f"{seconds:.3f}", *cells, f"{images / seconds:.3f}" if images else "")


def _metrics_note(result: LoopResult) -> str:
    """The last step's loss metrics: rollout and trainer log-probs agree when ratio = 1 and nothing is clipped."""
    m = dict(result.metrics, rms_log_ratio=(2 * result.metrics["approx_kl"]) ** 0.5)
    text = ", ".join(f"{k} {m[k]:.3g}" for k in ("ratio_mean", "rms_log_ratio", "clipfrac_above", "clipfrac_below",
                                                   "grad_norm", "reward_mean") if k in m)
    return f"{result.name}, last step: {int(m['pairs'])} trained pairs, {text}"


def print_table(recipe: Recipe, results: list[LoopResult], steps: int) -> None:
    from rich.console import Console
    from rich.table import Table

    peak = device_peak_flops(recipe.dtype)
    device = torch.cuda.get_device_name() if recipe.device.type == "cuda" else "CPU (smoke: times mean nothing)"
    size = "tiny smoke model" if recipe.smoke else "full-size Qwen-Image DiT (random init, bf16)"
    table = Table(title=f"FlowGRPO step, {size}, {device}: {recipe.samples} images ({recipe.prompts} prompt(s) x "
                        f"group {recipe.group}), {recipe.num_steps} steps, true CFG {recipe.guidance:g}, window "
                        f"{recipe.window}, LoRA r{recipe.lora_rank}, micro-batch {recipe.micro_batch}; median of "
                        f"{steps} steps")
    for col in ("loop", "phase", "s / step", "TFLOP / step", "TFLOP/s", "MFU", "images/s"):
        table.add_column(col, justify="left" if col in ("loop", "phase") else "right")
    n = recipe.samples
    dit, notes_base = {}, []
    for r in results:
        if r.error:
            table.add_row(r.name, r.error, "", "", "", "", "")
            continue
        flops = phase_flops(recipe, reused_uncond=r.reused_uncond)  # the work this loop actually ran
        dit_flops = flops["rollout"] + flops["train"]
        for phase in (p for p in OURS_PHASES if p in r.seconds):
            _row(table, r.name, phase, r.seconds[phase], flops.get(phase), peak)
        dit[r.name] = r.seconds["dit"]
        if peak and recipe.lora_rank:
            base = phase_flops(recipe, reused_uncond=r.reused_uncond, adapters=False)
            notes_base.append(f"{r.name}: MFU of the base model's FLOPs alone (adapters not counted): "
                              + ", ".join(f"{p} {base[p] / r.seconds[p] / peak:.1%}" for p in ("rollout", "train")))
        _row(table, r.name, "DiT side: " + " + ".join(p for p in DIT_PHASES if p in r.seconds), r.seconds["dit"],
             dit_flops, peak, n)
        if "text" in r.seconds:
            _row(table, r.name, "end to end: all phases, in sequence", r.seconds["e2e"], dit_flops, peak, n)
        table.add_section()
    if len(dit) == 2:
        ours, ref = dit.values()
        table.add_row("ours / reference", "DiT-side speed-up", "", "", "", "", f"{ref / ours:.2f} x")
    notes = [note for r in results for note in r.notes] + [_metrics_note(r) for r in results if r.metrics]
    notes.append(f"MFU counts the LoRA r{recipe.lora_rank} adapters' FLOPs as work done (a forward's adapter FLOPs "
                 f"per policy forward, 3x per trained pair: forward, activation and adapter weight gradients)")
    notes += notes_base
    if recipe.reuse_uncond:
        notes.append("ours trains on the rollout's uncond outputs (same weights and inputs: exact): its training "
                     "forward carries cond rows only, and 'train' counts the 2 forward-equivalents per pair it runs "
                     "(cond forward + activation backward) plus the adapters'; the reference runs uncond under "
                     "no_grad (3)")
    else:
        notes.append("ours (--no-reuse-uncond) recomputes the uncond rows in their own forward under no_grad (the "
                     "loss detaches that branch), as the reference does: 3 forward-equivalents per pair")
    notes.append("targets (docs/benchmarks.md): DiT side >= 1.5 images/s and >= 2.5x the reference; end to end >= 1.3 "
                 "images/s; rollout >= 80 % MFU at batch >= 8; train >= 60 % MFU")
    table.caption, table.caption_justify = "\n".join(notes), "left"
    Console(width=200).print(table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed RL steps after one warm-up (median)")
    p.add_argument("--group", type=int, default=16, help="samples per prompt")
    p.add_argument("--prompts", type=int, default=1, help="prompts per RL step")
    p.add_argument("--compile", metavar="MODE", help="compile each block of our rollout model, e.g. default")
    p.add_argument("--compile-train", metavar="MODE", help="compile each block of our policy (training), e.g. default")
    p.add_argument("--micro-batch", type=int, default=4, help="(sample, step) pairs per training forward")
    p.add_argument("--text-layers", type=int, default=28, help="layers of the text encoder (28 = Qwen2.5-VL-7B)")
    p.add_argument("--skip-reference", action="store_true", help="time ours only")
    p.add_argument("--no-reuse-uncond", action="store_true",
                   help="ours recomputes the uncond branch in training (its own forward under no_grad) instead of "
                        "reusing the rollout's uncond outputs")
    p.add_argument("--negative-tokens", type=int, metavar="N",
                   help="tokens of the negative prompt (default: as many as a prompt's, 128)")
    p.add_argument("--profile", action="store_true", help="after ours' timed steps, list where a step's host waits")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, < 2 min: checks the script")
    args = p.parse_args(argv)
    if min(args.steps, args.group, args.prompts, args.text_layers, args.micro_batch, args.negative_tokens or 1) < 1:
        p.error(f"--steps {args.steps}, --group {args.group}, --prompts {args.prompts}, --text-layers "
                f"{args.text_layers}, --micro-batch {args.micro_batch}, --negative-tokens {args.negative_tokens}: "
                f"expected integers >= 1")
    steps = min(args.steps, 2) if args.smoke else args.steps
    overrides = dict(group=args.group, prompts=args.prompts, reuse_uncond=not args.no_reuse_uncond,
                     micro_batch=args.micro_batch, negative_tokens=args.negative_tokens)
    if not args.smoke:
        overrides["text_layers"] = args.text_layers
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not args.smoke:  # torchrun: data parallel, one GPU per rank (before the recipe picks one)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    recipe = make_recipe(args.smoke, **overrides)
    results = [run_ours(recipe, steps, args.compile, args.compile_train, args.profile)]
    if world > 1:
        results[0].notes.append(f"data parallel over {world} ranks (torchrun): every rank runs the recipe's "
                                f"{recipe.samples} images per step with its own prompts and seeds, gradients "
                                f"averaged by megatron DDP; times and images/s are rank 0's, per GPU (all GPUs: "
                                f"{world}x); the reference loop is single-GPU and not run")
    elif not args.skip_reference:
        results.append(run_reference(recipe, steps))
    if int(os.environ.get("RANK", 0)) == 0:
        print_table(recipe, results, steps)


if __name__ == "__main__":
    main()
