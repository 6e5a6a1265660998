"""``megatron-omni bench``: a run config's RL step timed as ``megatron-omni train`` runs it, one table.

    megatron-omni bench --recipe digits_flow_grpo model.arch.num_layers=2
    megatron-omni bench --recipe qwen_image_flow_grpo model.path=Qwen-Image rollout.fp8=true --steps 5 --json step.json
    torchrun --nproc-per-node 2 -m megatron_omni.cli bench --recipe digits_flow_grpo parallel.tp=2

The config resolves as ``train``'s does (the recipe, then ``--config``, then the KEY=VALUE overrides).  The run is
built by the trainer's own ``build_run`` and every step is the loop's ``rl_step`` (megatron_omni.trainer.loop): the
first ``--warmup`` steps (compilation, first allocations) are reported apart, then the medians of the ``--steps``
timed ones are printed, each phase as the loop times it:

* rollout = rollout_sampling (the engine's generate, its text encoding included, to the device's last kernel) +
  rollout_scoring (the VAE decode and the reward submission); reward (the log-prob check beside the reward
  workers); train; sync (the weights into the engine);
* **DiT side** = rollout_sampling + train + sync: the denoiser's work, without the text encoder's prompts after the
  first, the VAE and the reward (``DIT_PHASES``; docs/benchmarks.md);
* end to end = the loop's step_seconds;
* TFLOP per step, TFLOP/s and MFU are the algorithm's FLOP count of the step (megatron_omni.trainer.mfu: the forwards
  it runs, LoRA adapters included) over those seconds, MFU against the device's dense peak where it is known;
  images/s the step's images (all data-parallel ranks) over those seconds.

Nothing is saved: no checkpoint, no evaluation, wandb off; ``train.output_dir`` is a temporary folder unless given.
``--json FILE`` writes the medians, the warm-up seconds and every timed step's metrics (rank 0).  For the Qwen-Image
OCR recipe's shape on a random full-size folder and the diffusers + peft loop beside it: bench/flow_grpo_step.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

PROG = "megatron-omni bench"
EXIT_USAGE = 2
DIT_PHASES = ("rollout_sampling", "train", "sync")  # the DiT's share of a step (the module docstring)
PHASES = ("rollout", "rollout_sampling", "rollout_scoring", "reward", "train", "sync")
FORCED = ("train.save_every=0", "train.eval_every=0", "logging.wandb_mode=disabled")


def check_counts(warmup: int, steps: int) -> None:
    """A ValueError naming ``--steps`` / ``--warmup`` unless there is a timed step and no negative warm-up."""
    if steps < 1:
        raise ValueError(f"--steps {steps}: expected an integer >= 1 (the timed RL steps)")
    if warmup < 0:
        raise ValueError(f"--warmup {warmup}: expected an integer >= 0 (the RL steps run before the timed ones)")


def time_steps(run, first: int, warmup: int, steps: int,
               report: Callable[[int, dict], None] | None = None) -> dict:
    """``warmup`` then ``steps`` timed ``rl_step`` calls of ``run`` from step ``first``: {"medians": the timed steps'
    numeric metrics, each the median, with dit_seconds, dit_images_per_second and step_tflop added; "warmup": the
    warm-up steps' seconds; "steps": the timed steps' metrics, in order}.  ``report(step, metrics)`` after every
    step."""
    from megatron_omni.trainer.loop import rl_step

    check_counts(warmup, steps)
    warm, timed = [], []
    for step in range(first, first + warmup + steps):
        metrics = rl_step(run, step)["metrics"]
        if report is not None:
            report(step, metrics)
        if step < first + warmup:
            warm.append(metrics["step_seconds"])
            continue
        images = metrics["images_per_second"] * metrics["step_seconds"]
        metrics["dit_seconds"] = sum(metrics[f"{p}_seconds"] for p in DIT_PHASES)
        metrics["dit_images_per_second"] = images / metrics["dit_seconds"]
        metrics["step_tflop"] = metrics["tflops_per_second"] * metrics["step_seconds"]
        timed.append(metrics)
    keys = [k for k, v in timed[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {"medians": {k: statistics.median(float(m[k]) for m in timed) for k in keys}, "warmup": warm,
            "steps": timed}


def table(result: dict, title: str, peak_flops: float | None):
    """The rich table of ``time_steps``' result: a row per phase, the DiT side and end to end with their rates (the
    labels short enough for an 80-column terminal; ``_bench``'s notes define the two totals)."""
    from rich.table import Table

    m = result["medians"]
    images = m["images_per_second"] * m["step_seconds"]
    out = Table(title=title)
    for col in ("phase", "s / step", "TFLOP / step", "TFLOP/s", "MFU", "images/s"):
        out.add_column(col, justify="left" if col == "phase" else "right")
    for phase in PHASES:
        if f"{phase}_seconds" in m:
            label = f"  {phase}" if phase in ("rollout_sampling", "rollout_scoring") else phase  # (the rollout's parts)
            out.add_row(label, f"{m[f'{phase}_seconds']:.3f}", "", "", "", "")
    out.add_section()
    for name, seconds in (("DiT side", m["dit_seconds"]), ("end to end", m["step_seconds"])):
        rate = m["step_tflop"] / seconds
        mfu = f"{rate * 1e12 / peak_flops:.1%}" if peak_flops else "-"
        out.add_row(name, f"{seconds:.3f}", f"{m['step_tflop']:.4g}", f"{rate:.4g}", mfu, f"{images / seconds:.3f}")
    return out


def build_parser() -> argparse.ArgumentParser:
    from megatron_omni.config import recipe_names

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--recipe", choices=recipe_names(), help="named recipe to start from")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file merged on top of the recipe")
    p.add_argument("--steps", type=int, default=3, help="timed RL steps (medians over them; default 3)")
    p.add_argument("--warmup", type=int, default=2,
                   help="RL steps run first and reported apart: compilation, first allocations (default 2)")
    p.add_argument("--json", metavar="FILE", help="write the medians, the warm-up seconds and every timed step's metrics")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as for train")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from megatron_omni.config import ConfigError, load_config, recipe_names

    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help (0) and usage errors (2)
        return int(e.code or 0)
    if args.recipe is None and args.config is None:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: give --recipe NAME and/or --config FILE.yaml (recipes: {', '.join(recipe_names())})",
              file=sys.stderr)
        return EXIT_USAGE
    overrides = list(args.overrides) + list(FORCED) + [f"train.steps={args.warmup + args.steps}"]
    with tempfile.TemporaryDirectory(prefix="megatron-omni-bench-") as tmp:
        if not any(o.startswith("train.output_dir=") for o in args.overrides):
            overrides.append(f"train.output_dir={tmp}")
        try:
            check_counts(args.warmup, args.steps)
            cfg = load_config(args.recipe, args.config, overrides)
            return _bench(cfg, args)
        except (ConfigError, ValueError) as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return EXIT_USAGE


def _bench(cfg, args) -> int:
    from rich.console import Console

    from megatron_omni.data.tasks import task_for
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from megatron_omni.trainer.build import build_run
    from megatron_omni.trainer.memory import check_fits, device_memory, estimate
    from megatron_omni.trainer.mfu import replica_peak_flops
    from megatron_omni.trainer.run import check_data_parallel, check_loop_layout, check_task_fits

    check_loop_layout(cfg)
    q = cfg.parallel
    state = init_parallel(tp=q.tp, cp=q.cp, pp=q.pp, vpp=q.vpp, ulysses=q.ulysses, seed=cfg.train.seed,
                          device=q.device)
    run, rank0 = None, state.rank == 0
    try:
        check_data_parallel(cfg, state.dp)
        if device_bytes := device_memory(state):
            check_fits(estimate(cfg, state.world_size, state=state), device_bytes)
        start = time.perf_counter()
        task = task_for(cfg, state.torch_device)
        check_task_fits(cfg, task)
        run, first = build_run(cfg, state, task, Path(cfg.train.output_dir), resume=False)
        ready = time.perf_counter() - start
        say = (lambda step, m: print(f"step {step}: {m['step_seconds']:.2f} s", flush=True)) if rank0 else None
        result = time_steps(run, first, args.warmup, args.steps, report=say)
        device = state.torch_device
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    finally:
        if run is not None:
            run.close()
        destroy_parallel()
    if not rank0:
        return 0
    last = result["steps"][-1]
    result.update(ready_seconds=ready, peak_gib=peak, layout=dict(dp=state.dp, tp=q.tp, cp=q.cp, pp=q.pp),
                  recipe=args.recipe, config=args.config, overrides=list(args.overrides))
    title = (f"{PROG}: {args.recipe or args.config}, {cfg.model.family} {cfg.model.dtype}, "
             f"{cfg.rollout.prompts_per_step * cfg.rollout.group_size} images per step, dp {state.dp} x tp {q.tp} x "
             f"cp {q.cp} x pp {q.pp} on {state.torch_device.type}; median of {args.steps} steps")
    console = Console()
    console.print(table(result, title, replica_peak_flops(cfg.model.torch_dtype, state)))  # MFU per device
    notes = [f"DiT side = {' + '.join(DIT_PHASES)}; end to end = the loop's step_seconds",
             f"ready in {ready:.1f} s (task and build_run); warm-up steps "
             + (", ".join(f"{s:.1f}" for s in result["warmup"]) or "none") + " s"]
    if "logprob_abs_diff" in last:
        notes.append(f"log-prob check (last step): mean |Δ| {last['logprob_abs_diff']:.3g}, Pearson "
                     f"{last['logprob_pearson']:.4f}")
    if peak is not None:
        notes.append(f"peak {peak:.1f} GiB allocated")
    console.print("\n".join(notes))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
