"""Time one FlowGRPO training step of a ~2.5 B-parameter Qwen-Image-architecture MMDiT (16 blocks, hidden
2048, 16 heads) at 1024x1024 (4096 image tokens; 2.44 B parameters) + 128 text tokens under each parallel layout that fits
the world: TP=2, CP=2 (Ulysses), CP=2 (ring), PP=2, DP=2 (on 2 GPUs), all in one launch.  Prints a table
on rank 0: seconds per step (median), sample-steps per second, peak memory.

    torchrun --standalone --nproc-per-node=2 bench/layouts.py [--steps 5] [--micro-batches 4] [--batch 1]
                              [--compile default] [--only "CP=2 Ulysses" DP=2] [--profile "CP=2 Ulysses"]
    torchrun --standalone --nproc-per-node=2 bench/layouts.py --smoke      # tiny model, CPU gloo, seconds

A step = forward + backward of ``--micro-batches`` micro-batches through megatron-core's schedule (1F1B
under PP) + the optimizer step; every rank gets the same random micro-batches (DP ranks then do the work
of different samples, as in training).  bf16 on GPU, float32 on the CPU.  ``--compile``: the blocks under
torch.compile as the trainer's ``train.compile`` puts them (in eager TP=2 steps the all-reduces averaged ~27 GB/s,
a sign of ranks waiting on each other's host: bench/RESULTS.md); the warm-up steps then include compiling.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

import megatron_omni  # noqa: F401  (quiet upstream notices)
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig
from megatron_omni.algorithms.flow_grpo.step import FlowGRPOMicroBatch, flow_grpo_forward_step
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.trainer.policy import build_policy, compile_policy, run_microbatches
from model_specs.qwen_image.config import QwenImageConfig, tiny_config

# name, tp, cp, ulysses, pp
LAYOUTS = [("TP=2", 2, 1, 1, 1), ("CP=2 Ulysses", 1, 2, 2, 1), ("CP=2 ring", 1, 2, 1, 1), ("PP=2", 1, 1, 1, 2),
           ("DP=2", 1, 1, 1, 1)]


def bench_arch(smoke: bool) -> tuple[QwenImageConfig, tuple[int, int, int], int]:
    """(architecture, token grid, text tokens): 2.44 B params at 1024^2, or the tiny test model."""
    if smoke:
        return tiny_config(num_layers=4), (1, 4, 4), 8
    arch = QwenImageConfig(num_layers=16, num_attention_heads=16, attention_head_dim=128, joint_attention_dim=3584,
                           axes_dims_rope=(16, 56, 56))
    return arch, (1, 64, 64), 128  # 1024 px / 8 (VAE) / 2 (packing) = 64 tokens a side


def micro_batches(arch, fhw, text_len, count, batch, device, dtype):
    g = torch.Generator().manual_seed(0)
    n_img = fhw[0] * fhw[1] * fhw[2]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    t = torch.full((batch,), 0.7, device=device)
    return [FlowGRPOMicroBatch(x_t=rand(batch, n_img, arch.in_channels), txt=rand(batch, text_len, arch.joint_attention_dim),
                               txt_mask=None, img_fhw=fhw, x_next=rand(batch, n_img, arch.in_channels), t=t,
                               t_next=t - 0.1, old_log_prob=torch.zeros(batch, device=device),
                               advantage=torch.ones(batch, device=device), noise_level=0.7, sigma_1=0.95)
            for _ in range(count)]


def time_layout(args, name, tp, cp, ulysses, pp):
    state = init_parallel(tp=tp, cp=cp, pp=pp, ulysses=ulysses, seed=0)
    arch, fhw, text_len = bench_arch(args.smoke)
    dtype = torch.bfloat16 if state.torch_device.type == "cuda" else torch.float32
    policy = build_policy(arch, state, lr=1e-6, dtype=dtype)
    if args.compile:
        compile_policy(policy, args.compile)
    mbs = micro_batches(arch, fhw, text_len, args.micro_batches, args.batch, state.torch_device, dtype)
    step = flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=1e-4))
    shape = (text_len + fhw[0] * fhw[1] * fhw[2], args.batch)
    if state.torch_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        run_microbatches(policy, step, mbs, boundary_shape=shape)
        if state.torch_device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    if args.profile == name:
        _profile(partial(run_microbatches, policy, step, mbs, boundary_shape=shape), name)
    peak = torch.cuda.max_memory_allocated() / 2**30 if state.torch_device.type == "cuda" else float("nan")
    params = sum(p.numel() for m in policy.modules for p in m.parameters())
    row = torch.tensor([statistics.median(times), peak, float(params)], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather_object(rows, row)
    del policy
    destroy_parallel(keep_default_group=True)
    return state.dp, rows


def _profile(fn, name: str) -> None:
    """One more step under torch.profiler (kernels by kind, heaviest kernels, host ops), then one under CUDA's
    sync-debug mode (where the host waited for the GPU); every rank runs them (collectives), rank 0 prints."""
    import contextlib
    import io

    from _profile import profile_kernels, sync_points

    quiet = contextlib.redirect_stdout(io.StringIO()) if dist.get_rank() else contextlib.nullcontext()
    with quiet:
        profile_kernels(fn, f"one step, {name} (rank 0)", top=16, host=True)
        sync_points(fn)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU gloo (checks the script runs)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--compile", metavar="MODE", help="blocks under torch.compile (e.g. default)")
    parser.add_argument("--batch", type=int, default=1, help="samples per micro-batch")
    names = [layout[0] for layout in LAYOUTS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="LAYOUT", help=f"run these layouts only: {names}")
    parser.add_argument("--profile", choices=names, metavar="LAYOUT",
                        help="profile one more step of that layout: kernels by kind, host ops, host waits")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    results = []
    for name, tp, cp, ulysses, pp in LAYOUTS:
        world = dist.get_world_size() if dist.is_initialized() else None
        if (world is not None and world % (tp * cp * pp)) or (args.only and name not in args.only):
            continue
        dp, rows = time_layout(args, name, tp, cp, ulysses, pp)
        slowest = max(float(r[0]) for r in rows)  # a step ends when the slowest rank ends
        samples = args.micro_batches * args.batch * dp
        results.append((name, slowest, samples / slowest, max(float(r[1]) for r in rows), float(rows[0][2])))
    if dist.get_rank() == 0:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"FlowGRPO step, {'tiny smoke model' if args.smoke else '2.5B MMDiT @ 1024^2'}, "
                            f"{dist.get_world_size()} ranks, {args.micro_batches} micro-batches x {args.batch}, "
                            f"{'compiled: ' + args.compile if args.compile else 'eager'}")
        for col in ("layout", "s / step", "sample-steps / s", "peak GiB / rank", "params / rank"):
            table.add_column(col, justify="right")
        for name, sec, rate, peak, params in results:
            table.add_row(name, f"{sec:.3f}", f"{rate:.2f}", f"{peak:.1f}", f"{params / 1e9:.3f} B")
        Console().print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
