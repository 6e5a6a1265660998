"""One FlowGRPO step of ``megatron-omni train --recipe qwen_image_flow_grpo`` (VeRL-Omni's Qwen-Image OCR recipe)
at one GPU's share of its shape, timed as the product runs it, beside the diffusers + peft peer loop.  One table.

    python bench/flow_grpo_step.py [--model DIR | --layers 60 --text-layers 28 --build-dir DIR] [--steps 5] [--warmup N]
                                   [--group 16] [--prompts 1] [--micro-batch 4] [--compile default]
                                   [--compile-train default] [--reward NAME] [--no-reuse-uncond]
                                   [--skip-reference] [--profile [step | sampling train] [--trace DIR]]
    python bench/flow_grpo_step.py --smoke      # tiny folder on the CPU: checks the script runs; times mean nothing
    torchrun --nproc-per-node 2 bench/flow_grpo_step.py --smoke --pp 2   # the loop at a layout (gloo on the CPU)

Ours is the product: the run config is the ``qwen_image_flow_grpo`` recipe (megatron_omni.config.load_config) with
this bench's shape as overrides -- prompts_per_step 1 x group 16 (16 images), 512x512, 10 steps, true CFG 4, an
SDE window of 2 steps, LoRA r64 / alpha 128, micro-batches of 4 pairs, one optimizer step per RL step
(global batch = the step's 32 pairs); ``--compile`` / ``--compile-train`` set rollout.compile / train.compile.
``megatron_omni.trainer.build.build_run`` builds the run from a pipeline folder (model.path, data.task=pipeline:
the family's text encoder, VAE, schedule and initial noise) and ``megatron_omni.trainer.loop.rl_step`` runs the
warm-up steps (``--warmup``: 2 under --compile / --compile-train, else 1), then ``--steps`` timed ones; the table
shows the medians of the loop's own metrics:
* the loop's phases, rollout_seconds (text encoding, the engine's sampling, VAE decode, reward submission;
  split into rollout_sampling_seconds, the engine's generate to its last kernel, and rollout_scoring_seconds,
  the decode and the submission), reward_seconds (the log-prob check and the wait for the reward threads: they
  overlap), train_seconds, sync_seconds (the LoRA weight update of the engine), and step_seconds (end to end);
* DiT side = rollout_sampling + train + sync (docs/benchmarks.md's peer loop leaves out the text encoder, the
  VAE, the reward and the sync: ours keeps the sync; the table also shows rollout + train + sync, the DiT side as
  recorded up to 2026-12-02, with the VAE decode and the reward submission in it); TFLOP per step, TFLOP/s, MFU and
  images/s are the loop's own (tflops_per_second x step_seconds = the algorithm's FLOP count of the step, LoRA
  adapters and the log-prob check included); the DiT side's rate is that count over its seconds.
The pipeline folder: ``--model DIR`` (a real Qwen-Image snapshot or a folder built before), else a random-init
folder with Qwen-Image's shapes is written first (megatron_omni.testing.tiny_pipelines.
build_full_size_qwen_image_pipeline: the transformer at ``--layers`` blocks, 60 = Qwen-Image 20.4 B, ~41 GB in
bf16; a Qwen2.5-VL-7B-shaped text encoder at ``--text-layers``, 28 = ~13 GB; the VAE at Qwen-Image's config) into
``--build-dir`` (kept, for ``--model`` next time) or a temporary folder (deleted after).  Mind the disk: ~55 GB
at full size (a 64 GiB disk barely holds it; ``--layers 30`` halves the transformer).  With LoRA the product's
in-process engine reads the policy's own base tensors (one 41 GB copy on the GPU at 60 blocks).  The full-size
GPU run is not exercised by the tests and has not been run from this version (no GPU where it was written);
``--smoke`` (tests/bench/test_flow_grpo_step_smoke.py) writes a tiny folder (build_qwen_image_pipeline) and runs
it on the CPU in float32 at 64x64 with group 4.

A random folder carries the tiny byte-level tokenizer (build_tokenizer): an OCR prompt becomes ~100 text tokens
(about the 128 of docs/benchmarks.md's shape; the real Qwen2.5-VL tokenizer gives fewer); the table notes the
lengths the loop ran.

The reward is the recipe's (``ocr``: tesseract) unless ``--reward`` names another; where tesseract is not
installed (the GPU machine) it falls back to ``jpeg_compressibility`` with a note.

Reference: the diffusers + peft loop (bench/_flow_grpo_reference.py), rollout -> train, DiT side only, on the same
transformer config at the text lengths ours ran (random embeddings, no text encoder, VAE or reward), training in
micro-batches of 4 pairs as docs/benchmarks.md defines the peer loop, whatever ``--micro-batch`` gives ours.  The two
models are never resident together: ours is freed before the reference is built.  Its MFU counts its work with the
same FLOP counters (26 forwards per image: it recomputes the uncond rows in training).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts: less fragmentation

import torch  # noqa: E402

import megatron_omni  # noqa: E402,F401  (quiet upstream notices)
from _flow_grpo_parts import Recipe, free_device_memory, make_recipe, medians, peak_gib, phase_flops  # noqa: E402
from megatron_omni.bench import PHASES, time_steps  # noqa: E402
from megatron_omni.trainer.mfu import replica_peak_flops  # noqa: E402

RECIPE = "qwen_image_flow_grpo"
# the DiT side as recorded up to 2026-12-02: the whole rollout (the VAE decode and the reward submission in it)
DIT_WITH_DECODE_PHASES = ("rollout", "train", "sync")
WINDOW, NUM_STEPS, GUIDANCE, LORA_RANK, LORA_ALPHA = 2, 10, 4.0, 64, 128
SMOKE_SIZE, SMOKE_GROUP = 64, 4
INDUCTOR = "torch._inductor.config"  # the module --inductor KEY=VALUE sets


@dataclass
class LoopResult:
    name: str
    seconds: dict[str, float] = field(default_factory=dict)  # medians per phase, and "dit" / "e2e" totals
    metrics: dict[str, float] = field(default_factory=dict)  # ours: medians of the loop's metrics; ref: last step's
    last: dict[str, float] = field(default_factory=dict)  # the last timed step's metrics
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    flops: float | None = None  # DiT FLOPs per step (ours: the loop's count)
    phase_flops: dict[str, float] = field(default_factory=dict)  # the reference's, by phase
    peak_gib: float | None = None  # the device's peak allocation over the loop (None on the CPU)


# ---- the pipeline folder ---------------------------------------------------------------------------------

def pipeline_folder(args, scratch: Path) -> tuple[Path, str]:
    """(model.path, what it is): ``--model``, a tiny folder (``--smoke``) or a full-size-shaped random one."""
    from megatron_omni.testing.tiny_pipelines import build_full_size_qwen_image_pipeline, build_qwen_image_pipeline

    if args.model:
        return Path(args.model), f"pipeline folder {args.model}"
    start = time.perf_counter()
    if args.smoke:
        folder = build_qwen_image_pipeline(scratch / "tiny_qwen_image", seed=0)
        return folder, f"tiny random QwenImagePipeline folder (build_qwen_image_pipeline, {_secs(start)})"
    out = Path(args.build_dir) if args.build_dir else scratch / "qwen_image_random"
    folder = build_full_size_qwen_image_pipeline(out, layers=args.layers, text_layers=args.text_layers,
                                                 device=torch.device("cuda", torch.cuda.current_device()),
                                                 transformer_weights=not args.random_transformer)
    return folder, (f"random QwenImagePipeline folder with Qwen-Image's shapes ({args.layers} transformer blocks, "
                    f"{args.text_layers} text-encoder layers; build_full_size_qwen_image_pipeline, {_secs(start)}, "
                    f"{_disk_gb(folder):.1f} GB on disk{', kept at ' + str(folder) if args.build_dir else ''})")


def _secs(start: float) -> str:
    return f"written in {time.perf_counter() - start:.1f} s"


def _disk_gb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9


def reward_name(args) -> tuple[str, str | None]:
    """The reward and a note when it is not the recipe's."""
    from megatron_omni.config.recipes import get_recipe

    recipe_reward = get_recipe(RECIPE).reward.name
    if args.reward:
        return args.reward, None if args.reward == recipe_reward else f"reward {args.reward} (--reward; the recipe's: " \
                                                                     f"{recipe_reward})"
    if recipe_reward == "ocr" and shutil.which("tesseract") is None:
        return "jpeg_compressibility", ("reward jpeg_compressibility: tesseract (the recipe's ocr reward) is not "
                                        "installed here")
    return recipe_reward, None


def run_config(args, folder: Path, run_dir: Path, reward: str, steps: int):
    """The recipe with this bench's shape as overrides."""
    from megatron_omni.config import load_config

    size = SMOKE_SIZE if args.smoke else 512
    overrides = [f"model.path={folder}", f"data.height={size}", f"data.width={size}",
                 f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
                 f"rollout.num_steps={NUM_STEPS}", f"rollout.guidance_scale={GUIDANCE}", f"rollout.window_size={WINDOW}",
                 f"lora.rank={LORA_RANK}", f"lora.alpha={LORA_ALPHA}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.global_batch_size={args.prompts * args.group * WINDOW}",  # one optimizer step per RL step
                 f"train.steps={steps}", "train.eval_every=0", "train.save_every=0", f"train.output_dir={run_dir}",
                 "logging.wandb_mode=disabled", f"reward.name={reward}"]
    overrides += [f"parallel.tp={args.tp}", f"parallel.cp={args.cp}", f"parallel.ulysses={args.ulysses}",
                  f"parallel.pp={args.pp}"]
    if args.smoke:
        overrides += ["model.dtype=float32", "parallel.device=cpu", "data.eval_prompts=4"]
    if args.random_transformer and not args.smoke:
        overrides.append("model.random_init=true")
    if args.compile:
        overrides.append(f"rollout.compile={args.compile}")
    if args.compile_train:
        overrides.append(f"train.compile={args.compile_train}")
    if args.no_reuse_uncond:
        overrides.append("algorithm.reuse_rollout_uncond=false")
    if args.fp8:
        overrides.append("rollout.fp8=true")
    return load_config(RECIPE, None, overrides + list(args.set))


# ---- the loops -------------------------------------------------------------------------------------------

def _text_lengths(run, step: int) -> tuple[float, int]:
    """(mean prompt tokens, negative prompt tokens) of a step's requests, as the loop encoded them."""
    def tokens(prompt: str) -> int:
        emb, mask = run.text_cache[prompt]
        return emb.shape[0] if mask is None else int(mask.sum())

    requests = run.algorithm.requests(run, step)
    return statistics.mean(tokens(r.prompt) for r in requests), tokens(requests[0].negative_prompt)


def run_ours(cfg, steps: int, warmup: int, profile: tuple[str, ...],
             trace_dir: str | None = None) -> tuple[LoopResult, dict]:
    """The product's loop: build_run, then rl_step; (result, the shape it ran for the reference)."""
    from megatron_omni.data.tasks import task_for
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from megatron_omni.trainer.build import build_run
    from megatron_omni.trainer.loop import rl_step
    from megatron_omni.trainer.run import check_device_fits, check_loop_layout, check_task_fits

    compiled = ", ".join(f"{what}: {mode}" for what, mode in (("rollout", cfg.rollout.compile),
                                                               ("train", cfg.train.compile)) if mode)
    reuse = cfg.algorithm.reuse_rollout_uncond
    result = LoopResult("ours: megatron-omni train's rl_step" + (f" (compiled {compiled})" if compiled else " (eager)")
                        + ("" if reuse else ", uncond recomputed"))
    check_loop_layout(cfg)
    q = cfg.parallel
    state = init_parallel(tp=q.tp, cp=q.cp, pp=q.pp, ulysses=q.ulysses, seed=cfg.train.seed, device=q.device)
    run, shape, device = None, {}, state.torch_device
    try:
        try:
            check_device_fits(cfg, state)
        except ValueError as e:  # a card too small for the shape: refused here, not at its first step
            result.error = str(e).splitlines()[0]
            return result, shape
        start = time.perf_counter()
        task = task_for(cfg, state.torch_device)
        check_task_fits(cfg, task)
        loaded = time.perf_counter()
        run, first = build_run(cfg, state, task, Path(cfg.train.output_dir), resume=False)
        built = time.perf_counter()
        # the warm-up steps compile (static, then dynamic)
        timing = time_steps(run, first, warmup, steps,
                            report=lambda step, m: print(f"ours step {step}: {m['step_seconds']:.2f} s", flush=True))
        warm, timed = timing["warmup"], timing["steps"]
        result.metrics, result.last = timing["medians"], timed[-1]
        with_decode = statistics.median(sum(m[f"{p}_seconds"] for p in DIT_WITH_DECODE_PHASES) for m in timed)
        result.seconds = {p: result.metrics[f"{p}_seconds"] for p in PHASES}
        result.seconds.update(dit=result.metrics["dit_seconds"], e2e=result.metrics["step_seconds"],
                              dit_with_decode=with_decode)
        result.flops = result.metrics["step_tflop"] * 1e12
        trainable = sum(p.numel() for p in run.policy.module.parameters() if p.requires_grad)
        result.notes.append(f"ours ready in {built - start:.1f} s: the task (text encoder, VAE: data.task=pipeline) "
                            f"{loaded - start:.1f} s, build_run {built - loaded:.1f} s (policy with LoRA "
                            f"{trainable / 1e6:.1f} M trainable params, optimizer, engine, first weight push); "
                            f"warm-up steps " + ", ".join(f"{w:.1f}" for w in warm) + " s"
                            + (" (compile included: static graphs, then dynamic ones at the second text length)"
                               if compiled else ""))
        prompt_tokens, negative_tokens = _text_lengths(run, first + warmup + steps - 1)
        shape = dict(arch=cfg.model.arch, img_fhw=task.img_fhw, text_tokens=round(prompt_tokens),
                     negative_tokens=negative_tokens)
        result.notes.append(f"ours: {len(task.prompts)} training prompts (the packaged OCR set less "
                            f"{len(task.eval_prompts)} held out), the last step's {prompt_tokens:.0f} prompt tokens "
                            f"on average, {negative_tokens} for the negative prompt; image grid {task.img_fhw}")
        if profile and device.type == "cuda":
            _profile(run, rl_step, first + warmup + steps, profile, trace_dir)
    except torch.OutOfMemoryError as e:
        result.error = f"out of memory ({str(e).splitlines()[0]}); --layers N / --text-layers N shrink the model"
    finally:
        if run is not None:
            run.close()
        del run
        destroy_parallel()
    result.notes += _memory_note(result, "ours")
    free_device_memory(device)
    return result, shape


def profile_phases(parser, given: list[str] | None) -> tuple[str, ...]:
    """--profile's phases: () without the flag, ('step',) for the bare flag."""
    if given is None:
        return ()
    if not given:
        return ("step",)
    if "step" in given and len(set(given)) > 1:
        parser.error(f"--profile {' '.join(given)}: 'step' profiles a whole step on its own; expected 'step' alone, "
                     f"or 'sampling' and / or 'train'")
    return tuple(dict.fromkeys(given))


PROFILED_PHASES = {"sampling": ("engine", "generate", "sampling phase (the engine's generate)"),
                   "train": ("algorithm", "train", "training phase")}


def _profile(run, rl_step, step: int, what: tuple[str, ...], trace_dir: str | None = None) -> None:
    """'step': one more step with the host's waits for the device listed, then one more under the profiler;
    'sampling' / 'train' (either or both): one more step with only that phase under the profiler -- the engine's
    generate, the algorithm's ``train`` -- each on its own (kernels, host ops, idle gaps, the caching allocator).
    ``trace_dir``: each profiled step's / phase's Chrome trace is written there too (``<what>.json.gz``)."""
    from _profile import profile_kernels, sync_points

    def trace(name: str) -> str | None:
        return str(Path(trace_dir) / f"{name}.json.gz") if trace_dir else None

    if "step" in what:
        print("--- ours, one more RL step: where the host waits for the device ---")
        sync_points(lambda: rl_step(run, step))
        profile_kernels(lambda: rl_step(run, step + 1), "ours, one more RL step", top=14, host=True,
                        trace=trace("step"))
        return
    patched = []
    for phase in what:
        owner_name, attr, title = PROFILED_PHASES[phase]
        owner = getattr(run, owner_name)
        patched.append((owner, attr))
        object.__setattr__(owner, attr, _profiled(getattr(owner, attr), f"ours, one more RL step's {title}",
                                                          trace(phase)))
    try:
        rl_step(run, step)
    finally:
        for owner, attr in patched:  # these instances only, for one step
            object.__delattr__(owner, attr)


def _profiled(method, title: str, trace: str | None = None):
    """``method`` run once under the profiler (kernels, host ops, idle) with the caching allocator's device calls
    during it; ``trace``: its Chrome trace's path."""
    from _profile import profile_kernels

    def profiled(*args, **kwargs):
        result, before = {}, torch.cuda.memory_stats()
        profile_kernels(lambda: result.setdefault("out", method(*args, **kwargs)), title, top=24, host=True,
                        trace=trace)
        after = torch.cuda.memory_stats()
        # the caching allocator's device calls: a retry frees the cache (a device-wide synchronisation)
        print("  caching allocator during the phase: " + ", ".join(
            f"{key} +{after.get(key, 0) - before.get(key, 0)}" for key in
            ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")))
        return result["out"]

    return profiled


def run_reference(recipe: Recipe, steps: int) -> LoopResult:
    from _flow_grpo_reference import build_reference, reference_step

    result = LoopResult("reference (diffusers + peft)")
    ref = None
    try:
        ref = build_reference(recipe)
        timed = []
        for step in range(steps + 1):  # step 0 warms up
            seconds, result.last = reference_step(ref, step)
            seconds["dit"] = seconds["rollout"] + seconds["train"]
            if step:
                timed.append(seconds)
        result.seconds = medians(timed)
        result.phase_flops = phase_flops(recipe)
        result.flops = result.phase_flops["rollout"] + result.phase_flops["train"]
    except torch.OutOfMemoryError as e:
        result.error = f"out of memory: {str(e).splitlines()[0]}"
    finally:
        del ref
    result.notes += _memory_note(result, result.name)
    free_device_memory(recipe.device)
    return result


def _memory_note(result: LoopResult, name: str) -> list[str]:
    result.peak_gib = peak = peak_gib(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return [f"{name}: peak {peak:.1f} GiB allocated"] if peak is not None else []


# ---- the table ------------------------------------------------------------------------------------------

def _tera(value: float) -> str:
    return f"{value / 1e12:.0f}" if value > 1e12 else f"{value / 1e12:.2g}"  # the smoke model's are tiny


def _row(table, loop: str, phase: str, seconds: float, flops: float | None = None, peak: float | None = None,
         images: int | None = None, mfu: float | None = None) -> None:
    cells = [""] * 3
    if flops:
        rate = flops / seconds
        mfu = rate / peak if mfu is None and peak else mfu
        cells = [_tera(flops), _tera(rate), f"{mfu:.1%}" if mfu is not None else "-"]
    table.add_row(loop, phase, f"{seconds:.3f}", *cells, f"{images / seconds:.3f}" if images else "")


def _ours_note(r: LoopResult) -> str:
    m = r.last
    keys = ("logprob_abs_diff", "logprob_pearson", "ratio_mean", "clipfrac_above", "clipfrac_below", "grad_norm",
            "optimizer_steps", "reward_mean", "reward_std")
    return f"{r.name}, last step (the loop's metrics): " + ", ".join(f"{k} {m[k]:.3g}" for k in keys if k in m)


def _reference_note(r: LoopResult) -> str:
    m = dict(r.last, rms_log_ratio=(2 * r.last["approx_kl"]) ** 0.5)
    text = ", ".join(f"{k} {m[k]:.3g}" for k in ("ratio_mean", "rms_log_ratio", "clipfrac_above", "clipfrac_below",
                                                   "grad_norm") if k in m)
    return f"{r.name}, last step: {int(m['pairs'])} trained pairs, {text} (random rewards)"


def print_table(cfg, results: list[LoopResult], steps: int, notes: list[str], smoke: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    peak = replica_peak_flops(cfg.model.torch_dtype, cfg.parallel)  # MFU per device
    device = torch.cuda.get_device_name() if cfg.parallel.device != "cpu" and torch.cuda.is_available() \
        else "CPU (smoke: times mean nothing)"
    r = cfg.rollout
    n = r.prompts_per_step * r.group_size
    size = "tiny smoke folder" if smoke else f"Qwen-Image {cfg.model.arch.num_layers} blocks ({cfg.model.dtype})"
    table = Table(title=f"FlowGRPO step of {RECIPE}, {size}, {device}: {n} images ({r.prompts_per_step} prompt(s) x "
                        f"group {r.group_size}), {cfg.data.height}x{cfg.data.width}, {r.num_steps} steps, true CFG "
                        f"{r.guidance_scale:g}, window {r.window_size}, LoRA r{cfg.lora.rank} "
                        f"(rollout.lora_weights={r.lora_weights}), micro-batch "
                        f"{cfg.train.micro_batch_size}, rollout GEMMs {'FP8' if r.fp8 else cfg.model.dtype}; median of "
                        f"{steps} steps")
    for col in ("loop", "phase", "s / step", "TFLOP / step", "TFLOP/s", "MFU", "images/s"):
        table.add_column(col, justify="left" if col in ("loop", "phase") else "right")
    dit = {}
    for res in results:
        if res.error:
            table.add_row(res.name, res.error, "", "", "", "", "")
            table.add_section()
            continue
        if res.name.startswith("ours"):
            for phase in PHASES:
                _row(table, res.name, phase, res.seconds[phase])
            _row(table, res.name, "DiT side: sampling + train + sync", res.seconds["dit"], res.flops, peak, n)
            _row(table, res.name, "rollout (decode incl.) + train + sync", res.seconds["dit_with_decode"], res.flops,
                 peak, n)
            _row(table, res.name, "end to end: the loop's step_seconds", res.seconds["e2e"], res.flops, peak, n,
                 mfu=res.metrics.get("mfu"))
        else:
            for phase in ("rollout", "train"):
                _row(table, res.name, phase, res.seconds[phase], res.phase_flops[phase], peak)
            _row(table, res.name, "DiT side: rollout + train", res.seconds["dit"], res.flops, peak, n)
        dit[res.name] = res.seconds["dit"]
        table.add_section()
    if len(dit) == 2:
        ours, ref = dit.values()
        table.add_row("ours / reference", "DiT-side speed-up", "", "", "", "", f"{ref / ours:.2f} x")
    notes = notes + [note for res in results for note in res.notes]
    notes += [(_ours_note if res.name.startswith("ours") else _reference_note)(res) for res in results if res.last]
    notes.append("ours: the phases are the loop's (megatron_omni.trainer.loop.rl_step): 'rollout' holds the text "
                 "encoding, the engine's sampling (rollout_sampling, to its last kernel), the VAE decode and the reward "
                 "submission (rollout_scoring); 'reward' the log-prob "
                 "check with the reward threads scoring beside it; TFLOP / step is the algorithm's count (rollout, "
                 "check and training forwards, LoRA adapters included, the rollout's uncond outputs reused in "
                 "training unless --no-reuse-uncond), the end-to-end MFU the loop's 'mfu'")
    notes.append("targets (docs/benchmarks.md): DiT side >= 1.5 images/s and >= 2.5x the reference; end to end >= 1.3 "
                 "images/s; rollout >= 80 % MFU at batch >= 8; train >= 60 % MFU")
    table.caption, table.caption_justify = "\n".join(notes), "left"
    Console(width=200).print(table)


def set_constant(item: str, module: str | None = None) -> str | None:
    """Set one module-level constant from ``MODULE.NAME=VALUE`` (VALUE a Python literal of the constant's type; with
    ``module`` given, ``NAME=VALUE`` in that module): the error, or None.  Set before anything is built or compiled,
    so an A/B of a constant the code reads at call time (``model_specs.common.fp8.MIN_ROWS``) needs no patched tree."""
    import ast
    import importlib

    key, sep, text = item.partition("=")
    path, _, name = (f"{module}.{key}" if module else key).rpartition(".")
    if not sep or not path or not name:
        return f"expected {'KEY' if module else 'MODULE.NAME'}=VALUE"
    try:
        target = importlib.import_module(path)
    except ImportError as e:
        return f"module {path!r} does not import ({e})"
    if not hasattr(target, name):
        return f"expected KEY=VALUE with KEY an option of {path}" if module else f"{path} has no constant {name!r}"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return f"VALUE {text!r} is not a Python literal (True, 4, 'name')"
    old = getattr(target, name)
    if old is not None and type(value) is not type(old) and not (isinstance(old, float) and type(value) is int):
        return f"VALUE {text!r} is a {type(value).__name__}; {path}.{name} is a {type(old).__name__} ({old!r})"
    setattr(target, name, value)
    return None


def set_inductor(item: str) -> str | None:
    """Set one ``torch._inductor.config`` option from ``KEY=VALUE`` (VALUE a Python literal); the error, or None."""
    return set_constant(item, module=INDUCTOR)


def constant_value(path: str):
    """The value a ``MODULE.NAME`` constant holds now (after --constant / --inductor set it)."""
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def write_json(path: str, argv: list[str], cfg, results: list[LoopResult], steps: int, constants: list[str]) -> None:
    """The table's numbers for a driver (bench/ab.py): per loop its phases' median seconds (the DiT side and end to
    end among them), its images per step, the last step's metrics (the log-prob check) and peak memory; the constants
    as the run ended with them (``constants``: MODULE.NAME paths)."""
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    loops = []
    for res in results:
        row = {"name": res.name, "error": res.error, "seconds": res.seconds, "images": n, "peak_gib": res.peak_gib}
        if not res.error:
            row["last"] = {k: v for k, v in res.last.items() if isinstance(v, (int, float))}
        loops.append(row)
    device = torch.cuda.get_device_name() if cfg.parallel.device != "cpu" and torch.cuda.is_available() else "cpu"
    Path(path).write_text(json.dumps({"argv": argv, "device": device, "steps": steps, "loops": loops,
                                      "constants": {c: constant_value(c) for c in constants}}, indent=1) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="a QwenImagePipeline folder (default: write a random one)")
    p.add_argument("--layers", type=int, default=60, help="transformer blocks of the random folder (60 = Qwen-Image)")
    p.add_argument("--text-layers", type=int, default=28,
                   help="text-encoder layers of the random folder (28 = Qwen2.5-VL-7B)")
    p.add_argument("--build-dir", metavar="DIR", help="write the random folder here and keep it (for --model)")
    p.add_argument("--random-transformer", action="store_true",
                   help="the transformer at random init (model.random_init=true): the random folder then holds its "
                        "config.json only (no 41 GB of weights written and read; the FLOPs are the same)")
    p.add_argument("--steps", type=int, default=5, help="timed RL steps after one warm-up (median)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed RL steps first (default 2 with --compile / --compile-train: the compiled blocks "
                        "recompile once, dynamic, at the second text length; else 1)")
    p.add_argument("--group", type=int, default=None, help=f"samples per prompt (16; --smoke: {SMOKE_GROUP})")
    p.add_argument("--prompts", type=int, default=1, help="prompts per RL step")
    p.add_argument("--micro-batch", type=int, default=4, help="(sample, step) pairs per training forward")
    p.add_argument("--compile", metavar="MODE", help="rollout.compile, e.g. default")
    p.add_argument("--compile-train", metavar="MODE", help="train.compile, e.g. default")
    p.add_argument("--reward", metavar="NAME", help="reward.name (default: the recipe's, ocr)")
    p.add_argument("--no-reuse-uncond", action="store_true",
                   help="algorithm.reuse_rollout_uncond=false: training recomputes the uncond rows")
    p.add_argument("--fp8", action="store_true",
                   help="rollout.fp8: the rollout engine's GEMMs in FP8 (training bf16, the trainer's own pi_old)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of the run config (repeatable), e.g. --set rollout.fuse=false")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="set torch._inductor.config.KEY to the Python literal VALUE before anything compiles "
                        "(repeatable; an A/B of inductor's options), e.g. --inductor combo_kernels=True")
    p.add_argument("--constant", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a module-level constant to the Python literal VALUE (its type) before anything is built "
                        "(repeatable; an A/B of a constant), e.g. --constant model_specs.common.fp8.MIN_ROWS=256")
    p.add_argument("--json", metavar="FILE", help="also write the table's numbers to FILE (bench/ab.py reads it)")
    p.add_argument("--skip-reference", action="store_true", help="time ours only")
    p.add_argument("--profile", nargs="*", choices=("step", "sampling", "train"), metavar="PHASE",
                   help="after ours' timed steps: 'step' (alone: the default) lists where a whole RL step's host "
                        "waits and its kernels; 'sampling' and / or 'train' profile one more step's engine sampling "
                        "/ training phase alone (kernels, host ops, idle gaps)")
    p.add_argument("--trace", metavar="DIR", help="with --profile: also write each profiled step's / phase's Chrome "
                                                  "trace to DIR (<step|sampling|train>.json.gz)")
    p.add_argument("--smoke", action="store_true", help="tiny folder on the CPU: checks the script")
    for flag, what in (("--tp", "tensor"), ("--cp", "context (Ulysses x ring)"), ("--ulysses", "Ulysses (inside cp)"),
                       ("--pp", "pipeline")):
        p.add_argument(flag, type=int, default=1, help=f"{what}-parallel size (parallel.{flag[2:]}); launch "
                                                       f"tp x cp x pp x dp ranks with torchrun")
    args = p.parse_args(argv)
    args.group = args.group or (SMOKE_GROUP if args.smoke else 16)
    if args.warmup is None:
        args.warmup = 2 if args.compile or args.compile_train else 1
    if args.trace and args.profile is None:
        p.error(f"--trace {args.trace}: writes the profiled phases' traces; expected --profile with it")
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: expected an integer >= 0")
    if min(args.steps, args.group, args.prompts, args.micro_batch, args.layers, args.text_layers) < 1:
        p.error(f"--steps {args.steps}, --group {args.group}, --prompts {args.prompts}, --micro-batch "
                f"{args.micro_batch}, --layers {args.layers}, --text-layers {args.text_layers}: expected integers >= 1")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device; the full-size run needs one (use --smoke on a CPU)")
    for item in args.inductor:
        if (err := set_inductor(item)) is not None:
            p.error(f"--inductor {item}: {err}")
    for item in args.constant:
        if (err := set_constant(item)) is not None:
            p.error(f"--constant {item}: {err}")
    steps = min(args.steps, 2) if args.smoke else args.steps
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and not (args.model or args.smoke):
        p.error(f"under torchrun ({world} ranks) give --model DIR (a folder every rank reads: write one first with "
                f"--build-dir on one GPU) or --smoke; each rank would write its own random folder")
    scratch = Path(tempfile.mkdtemp(prefix="flow_grpo_step_"))
    try:
        folder, about = pipeline_folder(args, scratch)
        reward, reward_note = reward_name(args)
        cfg = run_config(args, folder, scratch / "run", reward, args.warmup + steps + 3)
        notes = [f"model.path: {about}"] + ([reward_note] if reward_note else [])
        ours, shape = run_ours(cfg, steps, args.warmup, profile_phases(p, args.profile), args.trace)
        results = [ours]
        if world > 1:
            notes.append(f"{world} ranks (torchrun): tp {args.tp} x cp {args.cp} x pp {args.pp} x dp "
                         f"{world // (args.tp * args.cp * args.pp)}; the loop's metrics, alike on every rank; no "
                         f"reference (a one-device loop)")
        if not args.skip_reference and shape and world == 1:
            recipe = make_recipe(args.smoke, group=args.group, prompts=args.prompts, **shape)
            results.append(run_reference(recipe, steps))
            notes.append(f"reference: the same transformer config (random init, normal 0.02), random text "
                         f"embeddings of {recipe.text_tokens} prompt / {recipe.uncond_tokens} negative tokens (ours' "
                         f"lengths), a static shift; training in micro-batches of {recipe.reference_micro_batch} "
                         f"pairs (the peer loop's, whatever --micro-batch gives ours), the uncond rows recomputed "
                         f"under no_grad")
        if rank == 0:
            print_table(cfg, results, steps, notes, args.smoke)
            if args.json:
                constants = [item.partition("=")[0] for item in args.constant]
                constants += [f"{INDUCTOR}.{item.partition('=')[0]}" for item in args.inductor]
                write_json(args.json, sys.argv[1:] if argv is None else list(argv), cfg, results, steps, constants)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
