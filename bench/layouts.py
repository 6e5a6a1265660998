"""The product's RL loop (``megatron_omni.trainer.loop.rl_step`` on a run built by ``build_run`` from the
``qwen_image_flow_grpo`` recipe) at several parallel layouts in one torchrun launch; one table on rank 0: seconds
per RL step, images per second per GPU, the phases, peak memory per rank.

    torchrun --standalone --nproc-per-node=N bench/layouts.py --model DIR [--layout tp=2 --layout pp=2,vpp=2 ...]
                                          [--steps 3] [--warmup 1] [--group 16] [--micro-batch 4]
                                          [--compile default] [--compile-train default] [--profile LAYOUT]
    torchrun --standalone --nproc-per-node=2 bench/layouts.py --smoke      # tiny folder, CPU gloo: checks the script

A layout is ``tp=..,cp=..,ulysses=..,pp=..,vpp=..`` (unnamed sizes 1, vpp none); data parallelism takes the
rest of the world (DP = world / (tp * cp * pp)).  Without ``--layout``: TP, CP (Ulysses), CP (ring), PP and DP
at the world's size each, those the world holds.  Every layout runs the same run config: the recipe with
flow_grpo_step.py's shape (its ``run_config``: prompts_per_step x group images, 512x512 (``--smoke``: 64x64),
10 steps, true CFG 4, a window of 2 SDE steps, LoRA r64, one optimizer step per RL step) and the layout's
``parallel.*``; the loop's own checks (``check_loop_layout``, ``check_data_parallel``) refuse a layout it cannot
run before anything is built.  A step's seconds are the slowest rank's (the median over ``--steps`` after
``--warmup``); images/s per GPU is the loop's ``images_per_second`` over the world size.

The pipeline folder: ``--model DIR`` (every rank reads it: write one first with flow_grpo_step.py ``--build-dir``
on one GPU), or with ``--smoke`` a tiny random folder per rank (build_qwen_image_pipeline, seeded: alike).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_omni  # noqa: F401  (quiet upstream notices)
from _flow_grpo_parts import free_device_memory, peak_gib
from flow_grpo_step import pipeline_folder, reward_name, run_config

SIZES = ("tp", "cp", "ulysses", "pp", "vpp")
PHASES = ("rollout", "reward", "train", "sync")  # rl_step's <phase>_seconds


def parse_layout(text: str) -> dict[str, int]:
    """``tp=2,pp=2`` -> {tp: 2, cp: 1, ulysses: 1, pp: 2, vpp: None}; ValueError naming the bad part."""
    layout: dict = {"tp": 1, "cp": 1, "ulysses": 1, "pp": 1, "vpp": None}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in SIZES or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"layout {text!r}: part {part!r}; expected comma-separated size=integer >= 1 with "
                             f"sizes among {SIZES}, e.g. tp=2,pp=2")
        layout[key.strip()] = int(value)
    return layout


def default_layouts(world: int) -> list[dict[str, int]]:
    """TP, CP Ulysses, CP ring, PP at the world's size (where it is > 1), and plain DP."""
    if world == 1:
        return [parse_layout("")]
    return [parse_layout(s) for s in (f"tp={world}", f"cp={world},ulysses={world}", f"cp={world}", f"pp={world}", "")]


def layout_name(layout: dict, world: int) -> str:
    """E.g. "DP1 x TP1 x CP2 (Ulysses 2 x ring 1) x PP2 vpp2"; DP? where the world does not split into replicas."""
    model_ranks = layout["tp"] * layout["cp"] * layout["pp"]
    dp = world // model_ranks if world % model_ranks == 0 else "?"
    parts = [f"DP{dp}", f"TP{layout['tp']}"]
    cp, ulysses = layout["cp"], layout["ulysses"]
    parts.append(f"CP{cp}" + (f" (Ulysses {ulysses} x ring {cp // ulysses})" if cp > 1 else ""))
    parts.append(f"PP{layout['pp']}" + (f" vpp{layout['vpp']}" if layout["vpp"] else ""))
    return " x ".join(parts)


class _Unset(Namespace):
    """flow_grpo_step.py's flags that this bench does not expose read as unset (None: off)."""

    def __getattr__(self, name: str):
        return None


def layout_config(args, folder: Path, run_dir: Path, reward: str, layout: dict):
    """flow_grpo_step.py's run config with the layout's parallel sizes."""
    cfg = run_config(_Unset(**{**vars(args), **layout}), folder, run_dir, reward, args.warmup + args.steps + 3)
    cfg.parallel.vpp = layout["vpp"]
    cfg.validate()
    return cfg


def time_layout(cfg, args, name: str) -> dict:
    """Warm-up + timed rl_steps of the loop at cfg's layout; the medians of this rank's metrics and its peak."""
    from megatron_omni.data.tasks import task_for
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from megatron_omni.trainer.build import build_run
    from megatron_omni.trainer.loop import rl_step
    from megatron_omni.trainer.run import check_data_parallel, check_loop_layout, check_task_fits

    check_loop_layout(cfg)
    q = cfg.parallel
    state = init_parallel(tp=q.tp, cp=q.cp, pp=q.pp, vpp=q.vpp, ulysses=q.ulysses, seed=cfg.train.seed,
                          device=q.device)
    run, device = None, state.torch_device
    try:
        check_data_parallel(cfg, state.dp)
        task = task_for(cfg, device)
        check_task_fits(cfg, task)
        run, first = build_run(cfg, state, task, Path(cfg.train.output_dir), resume=False)
        timed = []
        for step in range(first, first + args.warmup + args.steps):
            metrics = rl_step(run, step)["metrics"]
            if step >= first + args.warmup:
                timed.append(metrics)
        if args.profile == name:
            from flow_grpo_step import _profile

            _profile(run, rl_step, first + args.warmup + args.steps)
        keys = ["step_seconds", "images_per_second", "logprob_abs_diff"] + [f"{p}_seconds" for p in PHASES]
        row = {k: statistics.median(float(m[k]) for m in timed) for k in keys}
        row["peak_gib"] = peak_gib(device)
        return row
    finally:
        if run is not None:
            run.close()
        del run
        destroy_parallel(keep_default_group=True)  # the next layout lays out the same ranks again
        free_device_memory(device)


def over_ranks(row: dict) -> dict:
    """The slowest rank's seconds, the largest peak; images/s from the slowest step (alike in the loop's metric)."""
    keys = sorted(row)
    values = torch.tensor([float("nan") if row[k] is None else row[k] for k in keys], dtype=torch.float64)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, values)
    stacked = torch.stack(rows)
    out = {k: float(stacked[:, i].max()) for i, k in enumerate(keys)}
    out["images_per_second"] = float(stacked[:, keys.index("images_per_second")].min())
    return out


def print_table(args, results: list[tuple[str, dict | str]], cfg) -> None:
    from rich.console import Console
    from rich.table import Table

    world, r = dist.get_world_size(), cfg.rollout
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and cfg.parallel.device != "cpu" \
        else "CPU (smoke: times mean nothing)"
    size = "tiny smoke folder" if args.smoke else f"Qwen-Image {cfg.model.arch.num_layers} blocks ({cfg.model.dtype})"
    table = Table(title=f"RL step of qwen_image_flow_grpo at each layout, {world} ranks, {size}, {device}: "
                        f"{r.prompts_per_step * r.group_size} images, {cfg.data.height}x{cfg.data.width}, "
                        f"{r.num_steps} steps, LoRA r{cfg.lora.rank}, micro-batch {cfg.train.micro_batch_size}; "
                        f"median of {args.steps} steps")
    for col in ("layout", "s / step", "images/s / GPU", *(f"{p} s" for p in PHASES), "peak GiB / rank",
                "logprob_abs_diff"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for name, row in results:
        if isinstance(row, str):  # the loop refused the layout, or it ran out of memory
            table.add_row(name, row, *[""] * 7)
            continue
        peak = row["peak_gib"]
        table.add_row(name, f"{row['step_seconds']:.3f}", f"{row['images_per_second'] / world:.3f}",
                      *(f"{row[f'{p}_seconds']:.3f}" for p in PHASES), "-" if peak != peak else f"{peak:.1f}",
                      f"{row['logprob_abs_diff']:.3g}")
    Console(width=220).print(table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="a QwenImagePipeline folder every rank reads")
    p.add_argument("--smoke", action="store_true", help="a tiny random folder on the CPU (gloo): checks the script")
    p.add_argument("--layout", action="append", metavar="SPEC", help="e.g. tp=2,pp=2 (repeatable; default: TP, "
                   "CP Ulysses, CP ring, PP, DP at the world's size)")
    p.add_argument("--steps", type=int, default=3, help="timed RL steps per layout (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed RL steps per layout first")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (16; --smoke: 4)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per RL step (default: the world size)")
    p.add_argument("--micro-batch", type=int, default=4, help="(sample, step) pairs per training forward")
    p.add_argument("--compile", metavar="MODE", help="rollout.compile, e.g. default")
    p.add_argument("--compile-train", metavar="MODE", help="train.compile, e.g. default")
    p.add_argument("--reward", metavar="NAME", help="reward.name (default: the recipe's, ocr)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a run-config override for every layout, e.g. train.recompute=full (repeatable)")
    p.add_argument("--profile", metavar="LAYOUT", help="one more step of the layout of that name (as the table "
                   "names it) under the profiler")
    args = p.parse_args(argv)
    try:
        layouts = [parse_layout(s) for s in args.layout] if args.layout else None
    except ValueError as e:
        p.error(str(e))
    if min(args.steps, args.micro_batch) < 1 or args.warmup < 0:
        p.error(f"--steps {args.steps}, --micro-batch {args.micro_batch}, --warmup {args.warmup}: expected "
                f"integers >= 1 (--warmup >= 0)")
    if not (args.model or args.smoke):
        p.error("give --model DIR (a pipeline folder every rank reads) or --smoke")
    if "RANK" not in os.environ:
        p.error("launch under torchrun (e.g. torchrun --standalone --nproc-per-node=2 bench/layouts.py --smoke)")
    world = int(os.environ["WORLD_SIZE"])
    args.group = args.group or (4 if args.smoke else 16)
    args.prompts = args.prompts or world  # whole prompt groups per DP replica at every layout
    # flow_grpo_step.run_config's other fields, at their defaults there
    args.layers, args.text_layers, args.build_dir, args.random_transformer = 60, 28, None, False
    scratch = Path(tempfile.mkdtemp(prefix="layouts_"))
    try:
        folder, _ = pipeline_folder(args, scratch)  # (before the process group: a writer under one saves on rank 0)
        reward, _ = reward_name(args)
        dist.init_process_group("gloo" if args.smoke or not torch.cuda.is_available() else "nccl")
        results, cfg = [], None
        for layout in layouts or default_layouts(world):
            name = layout_name(layout, world)
            try:
                cfg = layout_config(args, folder, scratch / "run", reward, layout)
                row = over_ranks(time_layout(cfg, args, name))
            except ValueError as e:  # a layout the config or the loop refuses: one line in the table, alike on all
                row = f"refused: {e}"
            except torch.OutOfMemoryError as e:
                row = f"out of memory: {str(e).splitlines()[0]}"
            results.append((name, row))
            if dist.get_rank() == 0:
                done = row if isinstance(row, str) else f"{row['step_seconds']:.3f} s / step"
                print(f"{name}: {done}", flush=True)
        if dist.get_rank() == 0 and cfg is not None:
            print_table(args, results, cfg)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
