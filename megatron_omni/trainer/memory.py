"""Per-device memory of a run's layout, estimated before anything is built on a device, and a clear refusal when
it cannot fit.

Counted per device (bytes), for the trainer's TP x CP x PP x DP layout:
* parameters: the denoiser's, counted on the meta device, in the model dtype; a block's linear weights split
  over TP, the blocks over PP (the replicated rest: norms, embedders, counted whole);
* gradients: the trained parameters' fp32 ``main_grad`` (megatron DDP, ``grad_reduce_in_fp32``);
* optimizer: Adam's two fp32 moments, plus an fp32 master copy when the model is bf16 (the adapters with LoRA);
* activations: one training micro-batch's, kept for the backward, per block ``s·b·h·(10 + 24/tp)`` bytes in 16-bit
  (Korthikanti et al.'s transformer-layer count with flash attention: no s² term; doubled in float32), s the
  rank's share of image + text tokens (/ CP), b the micro-batch rows (x 2 with uncond rows recomputed); with
  ``train.recompute=full`` each chunk of ``recompute_num_layers`` blocks keeps only its input (``2·s·b·h``) plus
  one chunk's whole count while the backward recomputes it; ``selective`` (core attention) changes nothing here,
  since the flash-attention count has no s² term to save;
* engine: the in-process rollout engine's copy of every block (none when it reads the policy's frozen base: LoRA
  syncs at PP = 1 with the engine sharded as the policy), whole, or at the trainer's TP shard with
  ``rollout.engine_parallel=tp`` / ``tp_cp`` (``auto``: sharded when the whole copy would not fit the device), plus
  one block's transient at the rollout batch, ``12·s·b·h`` 16-bit values (whole: an upper bound when sharded);
* trajectories: this replica's samples' latents of every step and, with true CFG reuse, the uncond outputs of
  the trained steps, float32; none on the device with ``rollout.trajectories_on=host``;
* merged LoRA weights: with ``rollout.lora_weights=merged`` (without FP8) a model-dtype copy of the engine's adapted
  linears' weights, held in the rollout only (freed while the trainer runs), so only what exceeds the training
  activations left over by the offloaded encoders counts; ``auto`` merges when the estimate with them fits the device;
* FP8 weights (``rollout.fp8``): the engine's e4m3 copy of every FP8-capable linear's weight, one byte a value
  (``model_specs.common.rollout_linear``); those holding a merged adapter (LoRA in process, ``lora_weights`` not
  ``separate``) are freed while the trainer runs and count like the merged weights, the others throughout;
* the text encoder + VAE of a pipeline task (their files' size, when ``model.path`` is a local folder); with
  ``data.offload_encoders`` they are on the device in the rollout only, where the training activations are not, so
  only what exceeds the activations counts; with ``model.path`` not a local folder they are not counted, and the
  table says so.
Not counted: allocator fragmentation and CUDA/NCCL workspaces (the ``headroom`` fraction is kept free for
them).  An estimate for planning a layout, not a measurement: ``bench/RESULTS.md`` holds measured peaks.  Against
one: the OCR recipe's step on one H200 at 1 prompt x group 16 peaked at 98.8 GiB allocated (bench/RESULTS.md,
30d6c35); this estimate gives 73.8 GiB for that shape plus its 13.3 GB text encoder, 86 GiB: it undercounts by ~13 %
(the rollout's transients and the VAE decode), inside the headroom a refusal leaves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

GIB = 1 << 30
HEADROOM = 0.1  # of the device's memory left for fragmentation, workspaces and what is not counted


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, float]  # name -> bytes per device
    layout: str
    engine_tp: int = 1  # the in-process engine's TP degree counted (rollout.engine_parallel resolved)
    lora_merged: bool = False  # the engine's adapters counted merged (rollout.lora_weights resolved)
    uncounted: tuple[str, ...] = ()  # what this estimate could not count, said under its table

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def table(self, device_bytes: float | None = None) -> str:
        w = max(26, *map(len, self.parts))
        lines = [f"memory per device, {self.layout} (estimate: megatron_omni.trainer.memory)"]
        lines += [f"  {name:<{w}} {value / GIB:9.2f} GiB" for name, value in self.parts.items()]
        lines.append(f"  {'total':<{w}} {self.total / GIB:9.2f} GiB")
        if device_bytes:
            usable = device_bytes * (1 - HEADROOM)
            lines.append(f"  {'device (less headroom)':<{w}} {usable / GIB:9.2f} GiB of {device_bytes / GIB:.1f}: "
                         + ("fits" if self.total <= usable else "does NOT fit"))
        lines += [f"  not counted: {what}" for what in self.uncounted]
        return "\n".join(lines)


class ParamCounts(NamedTuple):
    """The denoiser's parameters at TP=1, by what the estimate does with them."""

    split: int  # the blocks' TP-split linears'
    block_rest: int  # the blocks' others
    outside: int  # outside the blocks
    adapters: int  # LoRA's A and B
    adapted: int  # the adapted linears' base weights
    fp8_split: int  # FP8-capable linears' weights: TP-split ones
    fp8_whole: int  # ... and the others
    fp8_adapted: int  # ... of them, the adapted ones' (all TP-split)


# (family, arch, dtype, backend, LoRA rank, alpha, targets) -> _counts: a run's start-up estimates (the engine's
# layout, the adapters' merge) count one model once
_COUNTS: dict[tuple, ParamCounts] = {}


def _counts(cfg, state=None) -> ParamCounts:
    """The denoiser's parameter counts at TP=1, counted on the meta device (under a single-process group when none
    is up) once per model and LoRA."""
    key = (cfg.model.family, repr(cfg.model.arch), str(cfg.model.torch_dtype), cfg.model.backend, cfg.lora.rank,
           cfg.lora.alpha, repr(cfg.lora_targets))  # (an arch is an unhashable dataclass: its repr)
    if key not in _COUNTS:
        _COUNTS[key] = _count_parameters(cfg, state)
    return _COUNTS[key]


def _count_parameters(cfg, state) -> ParamCounts:
    import torch.distributed as dist
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_omni.parallel.state import destroy_parallel, init_parallel, single_rank_group
    from model_specs.common.lora import apply_lora
    from model_specs.common.rollout_linear import RolloutLinear

    family, arch = cfg.model.family_impl, cfg.model.arch
    owned = state is None and not dist.is_initialized()
    if state is None and not owned and dist.get_world_size() > 1:
        raise ValueError("memory.estimate on several ranks needs the run's ParallelState (state=)")
    state = init_parallel(tp=1, seed=0, device="cpu") if owned else state
    try:
        config = family.transformer_config(arch, 1, params_dtype=cfg.model.torch_dtype, perform_initialization=False)
        group = dist.group.WORLD if state is None else single_rank_group(state)  # (a world of one)
        with torch.device("meta"):
            model = family.build(arch, config, group, cfg.model.backend)
            if cfg.lora.rank > 0:
                apply_lora(model, cfg.lora.rank, cfg.lora.alpha or cfg.lora.rank, cfg.lora_targets,
                           family.rules(arch), seed=0)
        named = dict(model.named_parameters())
        adapters = {n for n in named if n.endswith((".lora_A", ".lora_B"))}
        blocks = {f"blocks.{n}" for n, _ in model.blocks.named_parameters()}
        split = {f"blocks.{name}.{leaf}" if name else f"blocks.{leaf}" for name, m in model.blocks.named_modules()
                 if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                 for leaf, _ in m.named_parameters(recurse=False)}
        count = lambda names: sum(named[n].numel() for n in names)  # noqa: E731
        base = set(named) - adapters
        adapted = {n.removesuffix("lora_A") + "base.weight" for n in adapters if n.endswith(".lora_A")}
        fp8 = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, RolloutLinear) and m.fp8_capable()}
        return ParamCounts(count(base & split), count((base & blocks) - split), count(base - blocks), count(adapters),
                           count(adapted), count(fp8 & split), count(fp8 - split), count(fp8 & adapted))
    finally:
        if owned:
            destroy_parallel()


def estimate(cfg, world_size: int, image_tokens: int | None = None, text_tokens: int = 128,
             state=None, device_bytes: float | None = None) -> MemoryEstimate:
    """The per-device estimate of ``cfg`` on ``world_size`` ranks (see the module docstring); ``image_tokens``:
    the rows' image tokens (default: the pipeline task's grid at data.height x data.width, 16 pixels a token);
    ``state``: the run's ParallelState when torch.distributed is up; ``device_bytes`` (default: the state's
    accelerator's) resolves ``rollout.engine_parallel=auto``: the engine is counted TP-sharded when the whole one
    does not fit it (whole on a CPU); then ``rollout.lora_weights=auto``: merged when the copies fit too (separate on
    a CPU)."""
    p, choice = cfg.parallel, cfg.rollout.engine_parallel
    in_process = cfg.sync.engine_placement == "in_process"
    sharded = in_process and p.tp > 1 and choice in ("tp", "tp_cp")
    if device_bytes is None and state is not None:
        device_bytes = device_memory(state)
    adapters = in_process and cfg.sync.resolved_mode(cfg.lora.rank) == "lora" and not cfg.rollout.fp8
    merged = adapters and (cfg.rollout.lora_weights == "merged" or (cfg.rollout.lora_weights == "auto"
                                                                     and bool(device_bytes)))
    fits = lambda e: e.total <= device_bytes * (1 - HEADROOM)  # noqa: E731
    est = _estimate(cfg, world_size, image_tokens, text_tokens, state, p.tp if sharded else 1)
    if in_process and p.tp > 1 and choice == "auto" and device_bytes and not fits(est):
        est = _estimate(cfg, world_size, image_tokens, text_tokens, state, p.tp)
    if merged:  # (auto: merged only where the copies fit beside that engine)
        with_copies = _estimate(cfg, world_size, image_tokens, text_tokens, state, est.engine_tp, True)
        if cfg.rollout.lora_weights == "merged" or fits(with_copies):
            est = with_copies
    return est


def _estimate(cfg, world_size: int, image_tokens: int | None, text_tokens: int, state,
              engine_tp: int, merged: bool = False) -> MemoryEstimate:
    from megatron_omni.trainer.build import shares_base

    p, family, arch = cfg.parallel, cfg.model.family_impl, cfg.model.arch
    dp = p.data_parallel_size(world_size)
    counts = _counts(cfg, state)
    split, block_rest, outside, adapters, adapted = counts[:5]
    model_params = split + block_rest + outside
    per_device = split / (p.tp * p.pp) + block_rest / p.pp + outside
    dtype_bytes = torch.empty((), dtype=cfg.model.torch_dtype).element_size()
    trained = adapters / (p.tp * p.pp) if cfg.lora.rank > 0 else per_device
    full_precision = cfg.model.torch_dtype == torch.float32
    if image_tokens is None:
        image_tokens = (cfg.data.height // 16) * (cfg.data.width // 16) if cfg.data.task == "pipeline" else 64
    hidden = family.num_heads(arch) * getattr(arch, "attention_head_dim", 128)
    reuse = cfg.algorithm.reuse_rollout_uncond and cfg.rollout.guidance_scale > 1
    rows = cfg.train.micro_batch_size * (2 if cfg.rollout.guidance_scale > 1 and not reuse else 1)
    tokens = (image_tokens + text_tokens) / p.cp
    activations = _activations(cfg.train, family.num_blocks(arch) / p.pp, tokens * rows * hidden, p.tp)
    layout = type("Layout", (), {"tp": p.tp, "pp": p.pp, "cp": p.cp})()
    engine_params = split / engine_tp + block_rest + outside + adapters / engine_tp  # every block, at its TP shard
    engine = 0 if shares_base(cfg, layout, engine_tp) else engine_params * dtype_bytes
    engine += 12 * (image_tokens + text_tokens) * cfg.rollout.max_num_seqs * hidden * 2  # one block's transient
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size / dp
    window = cfg.rollout.window_size or cfg.rollout.num_steps
    latents = cfg.rollout.num_steps + 1 + (window if reuse else 0)
    parts = {
        "parameters": per_device * dtype_bytes,
        "gradients (fp32 main_grad)": trained * 4,
        "optimizer (Adam)": trained * (8 if full_precision else 12),
        "activations (1 micro-batch)": activations * (2 if full_precision else 1),
        "rollout engine": engine,
    }
    on_host = cfg.rollout.trajectories_on == "host"
    parts["trajectories" + (" (in host memory)" if on_host else "")] = \
        0 if on_host else samples * image_tokens * family.latent_channels(arch) * 4 * latents
    room = parts["activations (1 micro-batch)"]  # what the rollout-only parts may take: training's activations
    fp8_rollout_only = 0.0
    if cfg.sync.engine_placement == "in_process" and cfg.rollout.fp8:
        merged_fp8 = cfg.sync.resolved_mode(cfg.lora.rank) == "lora" and cfg.rollout.lora_weights != "separate"
        fp8_rollout_only = counts.fp8_adapted / engine_tp if merged_fp8 else 0.0  # merged copies: freed in training
        parts["FP8 weights"] = (counts.fp8_split / engine_tp + counts.fp8_whole) - fp8_rollout_only
    uncounted = []
    if cfg.data.task == "pipeline" and not (cfg.model.path and Path(cfg.model.path).is_dir()):
        uncounted.append(f"the text encoder + VAE (model.path={cfg.model.path!r} is not a local pipeline folder: their "
                         f"files' size is what counts)")
    elif cfg.data.task == "pipeline":
        files = sum(f.stat().st_size for sub in ("text_encoder", "vae")
                    for f in (Path(cfg.model.path) / sub).rglob("*.safetensors"))
        if cfg.data.offload_encoders:  # the rollout holds them, training the activations: the larger counts
            parts["text encoder + VAE (offloaded: beyond the activations)"] = max(0.0, files - room)
            room = max(0.0, room - files)
        else:
            parts["text encoder + VAE"] = files
    if merged:  # (held in the rollout only)
        parts["merged LoRA weights (beyond the activations)"] = max(0.0, adapted / engine_tp * dtype_bytes - room)
    if fp8_rollout_only:
        parts["merged FP8 weights (beyond the activations)"] = max(0.0, fp8_rollout_only - room)
    what = (f"TP{p.tp} x CP{p.cp}" + (f" (Ulysses {p.ulysses})" if p.cp > 1 else "") + f" x PP{p.pp} x DP{dp} on "
            f"{world_size} ranks, {family.name} {model_params / 1e9:.2f} B params"
            + (f" + LoRA r{cfg.lora.rank} {adapters / 1e6:.0f} M" if adapters else "") + f", {cfg.model.dtype}, "
            f"micro-batch {cfg.train.micro_batch_size}, {image_tokens} + {text_tokens} tokens"
            + (f", recompute {cfg.train.recompute}" if cfg.train.recompute != "none" else "")
            + (f", engine TP{engine_tp}-sharded" if engine_tp > 1 else "")
            + (", LoRA merged in the rollout" if merged else ""))
    return MemoryEstimate(parts, what, engine_tp, merged, tuple(uncounted))


def _activations(train, blocks: float, sbh: float, tp: int) -> float:
    """One micro-batch's kept activations in 16-bit bytes over ``blocks`` blocks of ``sbh`` = s·b·h values."""
    per_block = sbh * (10 + 24 / tp)
    if train.recompute != "full":
        return blocks * per_block
    chunk = min(train.recompute_num_layers, blocks)
    return math.ceil(blocks / chunk) * 2 * sbh + chunk * per_block  # chunk inputs + the chunk being recomputed


def check_fits(est: MemoryEstimate, device_bytes: float) -> None:
    """ValueError naming the layout, the estimate and the device when it cannot fit (before the first step)."""
    usable = device_bytes * (1 - HEADROOM)
    if est.total > usable:
        largest = max(est.parts, key=est.parts.get)
        raise ValueError(f"this layout does not fit the device: an estimated {est.total / GIB:.1f} GiB per device "
                         f"({largest} {est.parts[largest] / GIB:.1f} GiB the largest part) against "
                         f"{usable / GIB:.1f} GiB usable of {device_bytes / GIB:.1f} GiB; expected a layout that "
                         f"splits more (parallel.tp / cp / pp), a smaller train.micro_batch_size or "
                         f"rollout.max_num_seqs, train.recompute=full, rollout.trajectories_on=host, "
                         f"rollout.engine_parallel=tp, data.offload_encoders=true, or LoRA\n{est.table(device_bytes)}")


def device_memory(state) -> float | None:
    """The accelerator's total memory in bytes (None on a CPU)."""
    if state.torch_device.type == "cuda":
        return float(torch.cuda.get_device_properties(state.torch_device).total_memory)
    return None


__all__ = ["GIB", "MemoryEstimate", "check_fits", "device_memory", "estimate"]
