"""What a run is made of, built once: the policy, its rollout engine(s) and weight updater, the algorithm with its
reference, rewards, checkpointer and logger (``build_run``); the loop (megatron_omni.trainer.loop) only calls them.

Nothing here names a model family or an algorithm: both come from their registries (``model.family``,
``algorithm.name``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from checkpoints_convert.convert import mcore_state_from_hf
from checkpoints_convert.hf_folder import HFFolder
from checkpoints_convert.mcore_checkpoint import load_model
from megatron_omni.algorithms import get_algorithm
from megatron_omni.compile import compile_blocks
from megatron_omni.config import config_to_yaml
from megatron_omni.config.schema import RunConfig
from megatron_omni.data.tasks import Task
from megatron_omni.logging import RunLogger
from megatron_omni.parallel.pipeline import broadcast_from_last_stage
from megatron_omni.parallel.state import ParallelState, single_rank_group
from megatron_omni.rewards import AsyncRewardPool, build_reward, reads_of
from megatron_omni.rollout.engine import EmbeddedEngine, Trajectory
from megatron_omni.sync import HFExporter, Rank0Engine, RemoteEngines
from megatron_omni.sync.updaters import EngineProcessUpdater, InProcessUpdater
from megatron_omni.trainer.checkpoint import Checkpointer
from megatron_omni.trainer.offload import OnDevice, to_host
from megatron_omni.trainer.policy import Policy, build_policy, compile_policy, run_microbatches
from model_specs.common.lora import apply_lora, base_parameters, disable_adapters, lora_modules, target_name
from model_specs.family import split_encoding

# prompt -> (emb [T, E], mask [T]), or (emb, mask, extras {name: one prompt's tensor}) where its family's text
# encoder gives further denoiser inputs (model_specs.family: SD3's pooled text)
TextTable = dict[str, tuple]


@dataclass
class Run:
    """Everything the loop holds between steps."""

    cfg: RunConfig
    task: Task
    algorithm: Any  # megatron_omni.algorithms.base.Algorithm
    policy: Policy
    engine: EmbeddedEngine | Rank0Engine  # in this process, or engine processes (sync.engine_placement)
    updater: InProcessUpdater | EngineProcessUpdater
    rewards: AsyncRewardPool
    checkpointer: Checkpointer
    logger: RunLogger
    forward_step: Callable  # megatron forward_step_func computing the algorithm's loss
    text_cache: TextTable = field(default_factory=dict)
    algorithm_state: Any = None  # the algorithm's state between steps (Algorithm.build_state), checkpointed

    @property
    def family(self):
        return self.cfg.model.family_impl

    def run_microbatches(self, microbatches: list, **kwargs):
        """One pass of megatron's schedule over ``microbatches`` with the algorithm's forward step (then the
        optimizer step unless ``forward_only``): megatron_omni.trainer.policy.run_microbatches.  Its per-micro-
        batch metrics (the last pipeline stage's) on every pipeline rank."""
        if self.cfg.rollout.trajectories_on == "host":  # built from host trajectories: to the device one by one
            microbatches = OnDevice(microbatches, self.policy.state.torch_device)
        if self.policy.state.vpp:  # the interleaved schedule sends tensors of one shape, given up front
            self.cfg.parallel.check_microbatches(len(microbatches))
            kwargs["boundary_shape"] = self.boundary_shape(microbatches)
        metrics, grad_norm = run_microbatches(self.policy, self.forward_step, microbatches, **kwargs)
        return broadcast_from_last_stage(metrics, self.policy.state.pp_group), grad_norm

    def boundary_shape(self, microbatches) -> tuple[int, int]:
        """(sequence, rows) of the hidden state the pipeline stages pass for every one of ``microbatches``, which
        the interleaved schedule needs fixed: the first stage's first chunk runs each micro-batch's forward under
        no_grad (1 / (pp * vpp) of a forward; whatever the algorithm's rows are: CFG's uncond rows, a context) and
        tells the other stages.  ValueError when they differ."""
        state = self.policy.state
        box = [None]
        if state.pp_rank == 0:
            with torch.no_grad():
                box[0] = sorted({tuple(self.forward_step(iter([mb]), self.policy.models[0])[0].shape[:2])
                                 for mb in microbatches})
        dist.broadcast_object_list(box, src=dist.get_global_rank(state.pp_group, 0), group=state.pp_group)
        if len(box[0]) != 1:
            raise ValueError(f"parallel.vpp={state.vpp}: the interleaved pipeline needs one stage-boundary shape per "
                             f"pass, got (tokens, rows) {box[0]}; expected prompts of one padded text length "
                             f"(rollout.text_pad_multiple >= the longest prompt's tokens) and equal micro-batches "
                             f"(train.micro_batch_size dividing every pass's pairs), or parallel.vpp=null")
        return box[0][0]

    def rollout(self, requests: list, clock: Callable | None = None) -> tuple[list[Trajectory], torch.Tensor | None,
                                                                              list]:
        """Trajectories, decoded images (None when no reward reads images) and pending reward futures.  Two halves
        (whole groups each): the first is scored in reward threads while the second is sampled, the second while
        the trainer checks log-probs.  With ``rollout.trajectories_on=host`` the trajectories wait in host memory.
        ``clock`` (the loop's ``StepClock``) times the parts: ``sampling`` (the engine's generate, its text encoding
        included, to the device's last kernel) and ``scoring`` (the VAE decode and the reward submission)."""
        r, device = self.cfg.rollout, self.policy.state.torch_device
        half = (r.prompts_per_step // 2 or r.prompts_per_step) * r.group_size
        trajs, pending, images = [], [], []
        clock = clock or (lambda part: contextlib.nullcontext())
        for part in (requests[:half], requests[half:]):
            if not part:
                continue
            with clock("sampling"):
                part_trajs = self.engine.generate(part)
                if r.trajectories_on == "host":  # (pinned for asynchronous copies back when the device is a GPU)
                    part_trajs = [to_host(t, device.type == "cuda") for t in part_trajs]
                if device.type != "cpu":  # (the decode's host copy waits for the same kernels anyway)
                    getattr(torch, device.type).synchronize()
            with clock("scoring"):
                part_images, future = self.score(part_trajs)
                pending.append(future)
            trajs += part_trajs
            images.append(part_images)
        return trajs, None if images[0] is None else torch.cat(images), pending

    def score(self, trajs: list[Trajectory]) -> tuple[torch.Tensor | None, Any]:
        """The decoded final samples of ``trajs`` and the future of their rewards.  Each reward gets what it reads:
        the images (the task's decode: the VAE) or the latent images (``task.latents``); when no reward reads images
        nothing is decoded and the images are None."""
        final_NIC = torch.stack([t.final_sample for t in trajs]).cpu()
        images = self.task.decode(final_NIC) if self.rewards.reads("images") else None
        latents = self.task.latents(final_NIC) if self.rewards.reads("latents") else None
        return images, self.rewards.submit(images, [t.request.prompt for t in trajs], latents=latents)

    def preview(self, images: torch.Tensor) -> torch.Tensor:
        """Decoded images as [N, H, W] / [N, C, H, W] floats in [0, 1], for grids."""
        return images if self.task.preview is None else self.task.preview(images)

    def text_for(self, trajs: list[Trajectory]) -> TextTable:
        """Text embeddings of the trajectories' prompts (and negative prompts with CFG) for the trainer, encoded
        once per prompt and cached; a request that carries its own embeddings (an edit's) needs none."""
        prompts = {t.request.prompt for t in trajs if t.request.prompt_emb is None}
        prompts |= {t.request.negative_prompt for t in trajs
                    if t.request.cfg and t.request.negative_prompt_emb is None}
        missing = sorted(prompts - self.text_cache.keys())
        if missing:
            emb, mask, extras = split_encoding(self.task.encode(missing))
            self.text_cache.update({p: (emb[i], mask[i], {k: v[i] for k, v in extras.items()}) if extras
                                    else (emb[i], mask[i]) for i, p in enumerate(missing)})
        return {p: self.text_cache[p] for p in prompts}

    def close(self) -> None:
        self.rewards.close()
        self.logger.finish()
        self.engine.close()  # engine processes stop; an in-process engine stops its submit() worker


def scores_of(pending: list) -> dict[str, np.ndarray]:
    """The reward workers' results, per reward name, in request order."""
    parts = [p.result() for p in pending]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def export_hf(policy: Policy) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under HF names (LoRA merged), gathered over TP: a collective, every TP rank
    calls it.  Holds the whole model; the loop streams through its updater instead."""
    exporter = HFExporter(policy.module, policy.state.tp_group, mode="merged" if lora_modules(policy.module) else "full")
    return [(name, t.detach().clone()) for name, t in exporter.tensors()]


def _apply_lora(module: torch.nn.Module, cfg: RunConfig) -> None:
    apply_lora(module, cfg.lora.rank, cfg.lora.alpha or cfg.lora.rank, cfg.lora_targets,
               cfg.model.family_impl.rules(module.arch), seed=cfg.train.seed)


def engine_tp(cfg: RunConfig, state: ParallelState) -> int:
    """The in-process engine's TP degree, ``rollout.engine_parallel`` resolved: the trainer's TP (``tp``, ``tp_cp``;
    ``auto`` when the run's memory estimate with a whole engine does not fit the accelerator) or 1 (``whole``, and
    ``auto`` otherwise: always on a CPU)."""
    choice = cfg.rollout.engine_parallel
    if state.tp == 1 or choice == "whole" or cfg.sync.engine_placement != "in_process":
        return 1
    if choice in ("tp", "tp_cp"):
        return state.tp
    from megatron_omni.trainer.memory import device_memory, estimate

    device_bytes = device_memory(state)
    return estimate(cfg, state.world_size, state=state, device_bytes=device_bytes).engine_tp if device_bytes else 1


def lora_weights(cfg: RunConfig, state: ParallelState) -> str:
    """``rollout.lora_weights`` resolved for this run: ``auto`` is merged when the in-process engine holds adapters
    (LoRA syncs) on an accelerator, with FP8 (its quantized copy holds them at no cost) or where the memory
    estimate with the merged copies fits the device; else separate (always on a CPU, and for engine processes,
    which hold their copies throughout)."""
    choice = cfg.rollout.lora_weights
    if choice != "auto":
        return choice
    if (state.torch_device.type == "cpu" or cfg.sync.engine_placement != "in_process"
            or cfg.sync.resolved_mode(cfg.lora.rank) != "lora"):
        return "separate"
    from megatron_omni.trainer.memory import device_memory, estimate

    device_bytes = device_memory(state)
    if cfg.rollout.fp8 or not device_bytes:
        return "merged"
    return "merged" if estimate(cfg, state.world_size, state=state, device_bytes=device_bytes).lora_merged \
        else "separate"


def shares_base(cfg: RunConfig, state: ParallelState, engine_tp: int) -> bool:
    """Whether the in-process engine reads the policy's own frozen base weights: LoRA syncs, one pipeline stage and
    the engine at the policy's TP (its ``engine_tp``): the same tensors (CP replicates the weights), so no second
    copy of the base, and only the adapters move."""
    return (cfg.sync.engine_placement == "in_process" and cfg.sync.resolved_mode(cfg.lora.rank) == "lora"
            and state.pp == 1 and engine_tp == state.tp)


def _engine_model(cfg: RunConfig, state: ParallelState, policy: Policy | None, tp: int,
                  split_cp: bool) -> torch.nn.Module:
    """The in-process engine's denoiser: every block, whole (``tp`` = 1: a group of one) or at this rank's shard of
    the trainer's TP group; its image tokens split over the CP group with ``split_cp`` (the forward gathers them);
    adapters when syncs send them.  Sharing the policy's base, it is built on the meta device and every base
    parameter and buffer is replaced by the policy's own; its adapters get storage of their own, filled by the
    first sync."""
    family, arch, dtype = cfg.model.family_impl, cfg.model.arch, cfg.model.torch_dtype
    config = family.transformer_config(arch, tp, params_dtype=dtype, perform_initialization=False)
    share = policy is not None and shares_base(cfg, state, tp)
    group = state.tp_group if tp > 1 else single_rank_group(state)
    with torch.device("meta") if share else contextlib.nullcontext():
        model = family.build(arch, config, group, cfg.model.backend, cp_groups=state.cp_groups if split_cp else None)
    if cfg.sync.resolved_mode(cfg.lora.rank) == "lora":  # adapters arrive at every sync
        _apply_lora(model, cfg)
    if not share:
        return model.to(state.torch_device)
    shared = base_parameters(policy.module)
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        new = (torch.nn.Parameter(torch.empty_like(param, device=state.torch_device), requires_grad=False)
               if leaf in ("lora_A", "lora_B") else shared[target_name(name)])
        setattr(model.get_submodule(owner), leaf, new)
    shared_buffers = {target_name(n): b for n, b in policy.module.named_buffers()}  # e.g. SD3's position table
    for name, _ in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, shared_buffers[target_name(name)])
    if left := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise RuntimeError(f"rollout model: {left[:3]} still on the meta device after sharing the policy's base")
    return model


def _build_engine(cfg: RunConfig, state: ParallelState, task: Task, policy: Policy | None = None):
    """The rollout engine of the run: in this process, or engine process(es) driven by trainer rank 0."""
    if cfg.sync.engine_placement == "in_process":
        tp, split_cp = engine_tp(cfg, state), cfg.rollout.engine_parallel == "tp_cp" and state.cp > 1
        model = _engine_model(cfg, state, policy, tp, split_cp)
        if cfg.rollout.compile:
            compile_blocks(model, cfg.rollout.compile)
        # the rollout section is the engine's config; the task draws initial noise as its pipeline does.  A sharded
        # engine's ranks generate together: the requests are sharded over DP only, so its TP / CP ranks hold the same
        groups = ([state.tp_group] if tp > 1 else []) + ([state.cp_group] if split_cp else [])
        return EmbeddedEngine(model, cfg.model.arch, task.encode, cfg.rollout, initial_noise=task.noise,
                              tp_rank=state.tp_rank if tp > 1 else 0, tp_size=tp, groups=groups)
    engines = None
    if state.rank == 0:
        s = cfg.sync
        backend = s.backend if s.backend != "auto" else state.device.backend
        engines = RemoteEngines.spawn(partial(engine_process, cfg, state.world_size), n=s.num_engines,
                                      placement=s.engine_placement, backend=backend, timeout_s=s.timeout_s,
                                      bucket_bytes=s.bucket_mb << 20, device=str(state.torch_device))
    return Rank0Engine(engines)


def engine_process(cfg: RunConfig, trainer_world: int, index: int) -> EmbeddedEngine:
    """Factory run inside an engine process: a world of its own, the task's text encoder, a TP=1 model
    (weights arrive by the first sync).  "process" engines on GPUs take the GPUs after the trainer's."""
    import os

    from megatron_omni.data.tasks import task_for
    from megatron_omni.parallel.state import init_parallel

    if cfg.sync.engine_placement == "process" and cfg.parallel.device != "cpu" and os.environ.get(
            "CUDA_VISIBLE_DEVICES") != "":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(trainer_world + index)
    state = init_parallel(seed=cfg.train.seed, device=cfg.parallel.device)
    task = task_for(cfg, state.torch_device)
    return _build_engine(replace(cfg, sync=replace(cfg.sync, engine_placement="in_process")), state, task)


def _updater(cfg: RunConfig, policy: Policy, engine):
    s = cfg.sync
    kind = InProcessUpdater if s.engine_placement == "in_process" else EngineProcessUpdater
    pp_group = policy.state.pp_group if kind is InProcessUpdater else None  # (engine processes: TP only today)
    updater = kind(policy.module, policy.state.tp_group, engine, s.resolved_mode(cfg.lora.rank), s.bucket_mb << 20,
                   s.checksum, pp_group=pp_group)
    updater.chunks = policy.modules or [policy.module]  # (interleaved PP: every virtual stage of this rank)
    tp = getattr(engine, "tp_size", 1)  # (engine processes: TP=1)
    updater.engine_has_base = shares_base(cfg, policy.state, tp)  # the same tensors: nothing to send
    return updater


def _initial_weights(cfg: RunConfig, state: ParallelState):
    """``prepare`` hook of build_policy: load the configured weights, then attach LoRA adapters."""
    def prepare(module: torch.nn.Module) -> None:
        if cfg.model.mcore_path and not cfg.model.random_init:
            load_model(module, cfg.model.mcore_path)
        elif cfg.model.weights_folder:
            folder = HFFolder(cfg.model.weights_folder)
            module.load_state_dict(mcore_state_from_hf(module.arch, folder.get, state.tp_rank, state.tp), strict=False)
        elif state.pp > 1:
            _stage_of_whole_random_init(module, cfg, state)
        if cfg.lora.rank > 0:
            _apply_lora(module, cfg)
    return prepare


def _stage_of_whole_random_init(module: torch.nn.Module, cfg: RunConfig, state: ParallelState) -> None:
    """A pipeline stage at random init takes its tensors from the whole model drawn from the run's seed (blocks
    keep their global index), so random init is a function of the seed, not of the layout: a run at PP = 2 starts
    where the run at PP = 1 does.  Holds the whole model (at this TP shard) for a moment."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)  # as build_run seeds the single-stage build
        whole = cfg.model.family_impl.build(module.arch, module.config, state.tp_group, cfg.model.backend)
    own = module.state_dict()
    drawn = {k: v for k, v in whole.state_dict().items() if k in own}
    if missing := sorted(own.keys() - drawn.keys() - {k for k in own if k.endswith("_extra_state")}):
        raise RuntimeError(f"pipeline stage tensors {missing[:3]} are not in the whole model's state dict")
    module.load_state_dict(drawn, strict=False)


def reference_policy(cfg: RunConfig, policy: Policy, algorithm):
    """The initial policy as a reference: the adapters switched off (LoRA), or a frozen copy of the initial
    weights (full fine-tune); None when the algorithm needs none."""
    if not algorithm.needs_reference(cfg):
        return None
    if cfg.lora.rank > 0:
        return disable_adapters
    module = policy.module
    frozen = cfg.model.family_impl.build(module.arch, module.config, policy.state.tp_group,
                                         cfg.model.backend).to(policy.state.torch_device)
    frozen.load_state_dict(module.state_dict())
    frozen.requires_grad_(False).eval()
    return lambda _model: contextlib.nullcontext(frozen)


def build_run(cfg: RunConfig, state: ParallelState, task: Task, run_dir: Path, resume: bool) -> tuple[Run, int]:
    """The run, its weights pushed to the engines once, and the step to start from."""
    algorithm = get_algorithm(cfg.algorithm.name)
    torch.manual_seed(cfg.train.seed)  # random init (no weights configured) is then a function of the seed
    # built on its device: megatron's seeded "CPU" initialisation then draws there (seconds, not minutes, at 20 B)
    with torch.device(state.torch_device):
        policy = build_policy(cfg.model.arch, state, lr=cfg.train.lr, clip_grad=cfg.algorithm.clip_grad,
                              dtype=cfg.model.torch_dtype, backend=cfg.model.backend,
                              prepare=_initial_weights(cfg, state), recompute=cfg.train.recompute,
                              recompute_num_layers=cfg.train.recompute_num_layers)
    if cfg.train.compile:
        compile_policy(policy, cfg.train.compile)
    # the reference is taken before a checkpoint is loaded: it is the initial policy, resumed or not
    forward_step = algorithm.forward_step(cfg, reference_policy(cfg, policy, algorithm))
    checkpointer = Checkpointer(run_dir / "checkpoints", run_config=config_to_yaml(cfg))
    algorithm_state = algorithm.build_state(cfg, policy)  # from the initial weights; a resume loads its own
    start = 0
    if resume and checkpointer.latest_step() is not None:
        start = checkpointer.load(policy.models, policy.optimizer, algorithm_state=algorithm_state)["step"] + 1
    # resolved once: the engines (this process's or engine processes') and the algorithm's pi_old read it
    cfg.rollout.lora_weights = lora_weights(cfg, state)
    engine = _build_engine(cfg, state, task, policy)
    fns = {"reward": build_reward(cfg.reward.name, **cfg.reward.options)}
    if cfg.reward.judge:
        fns["judge"] = build_reward(cfg.reward.judge)
    if task.latents is None and (latent := [n for n, fn in fns.items() if reads_of(fn) == "latents"]):
        raise ValueError(f"rewards {latent} read latents, but task {task.name!r} gives no latent images; expected "
                         f"image rewards, or a task with latents")
    logger = RunLogger(run_dir, cfg.train.steps, cfg.logging.wandb_mode, cfg.logging.project,
                       config=_plain_config(cfg), start_step=start, curve_keys=tuple(f"{k}_mean" for k in fns),
                       log_every=cfg.logging.log_every, enabled=state.rank == 0)  # the metrics are alike everywhere
    run = Run(cfg, task, algorithm, policy, engine, _updater(cfg, policy, engine),
              AsyncRewardPool(fns, num_workers=cfg.reward.workers), checkpointer, logger, forward_step,
              algorithm_state=algorithm_state)
    run.updater.push()
    return run, start


def _plain_config(cfg: RunConfig) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))
