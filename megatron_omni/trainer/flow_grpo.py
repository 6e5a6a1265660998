"""The FlowGRPO loop: rollout -> reward -> advantages -> train -> push weights -> next step.

    for step in steps:
        trajectories = engine.generate(requests(step))       # G samples per prompt, SDE steps keep log-probs
        rewards      = reward_pool.submit(decode(...))        # scored in threads while the trainer ...
        consistency  = recompute_log_probs(some trajectories) # ... re-scores rollout log-probs (docs/design.md, decision 6)
        advantages   = group_advantages(rewards.result())
        train on (sample, trained step) micro-batches inside megatron-core's forward_backward_func
                                                              # (true CFG: the first optimizer step and the
                                                              # check reuse the rollout's uncond outputs)
        push_weights(engine, export(policy))                  # bucketed weight sync (megatron_omni.sync):
                                                              # LoRA adapters only, or the whole model
        log, checkpoint

Every random draw is a function of (seed, step, index), so a run resumed from a checkpoint continues
exactly as an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from checkpoints_convert.convert import mcore_state_from_hf
from checkpoints_convert.hf_folder import HFFolder
from checkpoints_convert.mcore_checkpoint import load_model
from megatron_omni.algorithms import flow_grpo_forward_step, group_advantages
from megatron_omni.compile import compile_blocks
from megatron_omni.config import config_to_yaml
from megatron_omni.config.schema import RunConfig
from megatron_omni.data.text_layout import padded_length
from megatron_omni.data.tasks import Task
from megatron_omni.logging import RunLogger
from megatron_omni.parallel.state import ParallelState
from megatron_omni.rewards import AsyncRewardPool, build_reward
from megatron_omni.rollout.engine import EmbeddedEngine, Request, Trajectory
from megatron_omni.sync import HFExporter, Rank0Engine, RemoteEngines, SyncError, push_weights
from megatron_omni.trainer.checkpoint import Checkpointer
from megatron_omni.trainer.microbatches import grpo_microbatches, without_reused_uncond
from megatron_omni.trainer.mfu import device_peak_flops, forward_flops, lora_forward_flops, varlen_step_flops
from megatron_omni.trainer.policy import Policy, build_policy, compile_policy, run_microbatches
from model_specs.common.lora import apply_lora, disable_adapters, lora_modules

@dataclass
class FlowGRPORun:
    """Everything the loop holds between steps."""

    cfg: RunConfig
    task: Task
    policy: Policy
    engine: EmbeddedEngine | Rank0Engine  # in this process, or engine processes (sync.engine_placement)
    rewards: AsyncRewardPool
    checkpointer: Checkpointer
    logger: RunLogger
    forward_step: Callable  # megatron forward_step_func computing the Flow-GRPO loss
    text_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    exporters: dict[tuple[str, int], HFExporter] = field(default_factory=dict)  # per (mode, bucket), reused
    engine_has_base: bool = False  # "lora" syncs: the engine holds the trainer's base weights (sent once)
    sync_restarts: int = 0  # engine restarts after failed syncs in this step's sync (logged)


def request_seed(seed: int, step: int, index: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + index) % (2**63)


def make_requests(cfg: RunConfig, task: Task, step: int) -> list[Request]:
    """prompts_per_step prompts drawn for this step (seeded by it), each repeated group_size times."""
    r = cfg.rollout
    g = torch.Generator().manual_seed(request_seed(cfg.train.seed, step, -1))
    picks = torch.randint(0, len(task.prompts), (r.prompts_per_step,), generator=g).tolist()
    # Each sample draws its own SDE window from its seed.  One window shared by the whole step
    # (MixGRPO's schedule) was tried on the digits demo: the judge fell to 0.14-0.3 by step 30-40 while
    # the reward rose (reward hacking), against 0.34 -> 0.62 with per-sample windows.
    return [Request(prompt=task.prompts[p], prompt_id=k, seed=request_seed(cfg.train.seed, step, k * r.group_size + i),
                    img_fhw=task.img_fhw, num_steps=r.num_steps, shift=r.shift, sampler=r.sampler,
                    noise_level=r.noise_level, log_prob_form=r.log_prob_form, window_size=r.window_size,
                    window_range=r.window_range,
                    guidance_scale=r.guidance_scale, cfg_rescale=cfg.model.family_impl.guidance_rescale,
                    keep_uncond_velocity=reuses_uncond(cfg))
            for k, p in enumerate(picks) for i in range(r.group_size)]


def reuses_uncond(cfg: RunConfig) -> bool:
    """Whether the rollout keeps its uncond outputs for the trainer to reuse (true CFG and the switch on)."""
    return cfg.algorithm.reuse_rollout_uncond and cfg.rollout.guidance_scale > 1


def export_hf(policy: Policy) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under HF names (LoRA merged), gathered over TP: a collective, every TP rank
    calls it.  Holds the whole model; the loop streams through ``push_weights`` instead."""
    exporter = HFExporter(policy.module, policy.state.tp_group, mode="merged" if lora_modules(policy.module) else "full")
    return [(name, t.detach().clone()) for name, t in exporter.tensors()]


def push_policy_weights(run: "FlowGRPORun") -> dict:
    """One weight sync, policy -> rollout engine(s), bucket by bucket (megatron_omni.sync).  When it fails
    (``SyncError``: an engine process died, the sync group broke) the engine processes are started again
    once and sent the whole model; a second failure in a row is raised."""
    try:
        return _sync(run)
    except SyncError as e:
        if not isinstance(run.engine, Rank0Engine):  # an in-process engine cannot be started again
            raise
        print(f"warning: weight sync failed, restarting the rollout engine processes and syncing again: {e}")
        run.engine.restart()
        run.engine_has_base, run.sync_restarts = False, run.sync_restarts + 1
        return _sync(run)


def _sync(run: "FlowGRPORun") -> dict:
    """The sync of ``sync.mode``; "lora" sends the trainer's base weights first while the engine lacks them."""
    s = run.cfg.sync
    mode, bucket = s.resolved_mode(run.cfg.lora.rank), s.bucket_mb << 20
    if mode == "lora" and not run.engine_has_base:
        push_weights(run.engine, _exporter(run, "full", bucket), bucket, s.checksum)
        run.engine_has_base = True
    return push_weights(run.engine, _exporter(run, mode, bucket), bucket, s.checksum)


def _exporter(run: "FlowGRPORun", mode: str, bucket: int) -> HFExporter:
    """The run's exporter of ``mode``, built at its first sync and reused: items, plan and the source
    tensors are resolved once (the optimizer updates the parameters in place)."""
    if (mode, bucket) not in run.exporters:
        run.exporters[mode, bucket] = HFExporter(run.policy.module, run.policy.state.tp_group, mode=mode,
                                                 bucket_bytes=bucket)
    return run.exporters[mode, bucket]


def _apply_lora(module: torch.nn.Module, cfg: RunConfig) -> None:
    apply_lora(module, cfg.lora.rank, cfg.lora.alpha or cfg.lora.rank, cfg.lora_targets,
               cfg.model.family_impl.rules(module.arch), seed=cfg.train.seed)


def _build_engine(cfg: RunConfig, state: ParallelState, task: Task):
    """The rollout engine of the run: in this process, or engine process(es) driven by trainer rank 0."""
    if cfg.sync.engine_placement == "in_process":
        family, arch, dtype = cfg.model.family_impl, cfg.model.arch, cfg.model.torch_dtype
        config = family.transformer_config(arch, 1, params_dtype=dtype, perform_initialization=False)
        model = family.build(arch, config, state.tp_group, cfg.model.backend).to(state.torch_device)
        if cfg.sync.resolved_mode(cfg.lora.rank) == "lora":  # adapters arrive at every sync, the base once
            _apply_lora(model, cfg)
        if cfg.rollout.compile:
            compile_blocks(model, cfg.rollout.compile)
        return EmbeddedEngine(model, arch, task.encode, cfg.rollout)  # the rollout section is the engine's config
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

    from megatron_omni.data.tasks import build_task
    from megatron_omni.parallel.state import init_parallel

    if cfg.sync.engine_placement == "process" and cfg.parallel.device != "cpu" and os.environ.get(
            "CUDA_VISIBLE_DEVICES") != "":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(trainer_world + index)
    state = init_parallel(seed=cfg.train.seed, device=cfg.parallel.device)
    task = build_task(cfg.data.task, cfg.data.text_max_tokens)
    return _build_engine(replace(cfg, sync=replace(cfg.sync, engine_placement="in_process")), state, task)


def _initial_weights(cfg: RunConfig, state: ParallelState):
    """``prepare`` hook of build_policy: load the configured weights, then attach LoRA adapters."""
    def prepare(module: torch.nn.Module) -> None:
        if cfg.model.mcore_path:
            load_model(module, cfg.model.mcore_path)
        elif cfg.model.hf_path:
            folder = HFFolder(cfg.model.hf_path)
            module.load_state_dict(mcore_state_from_hf(module.arch, folder.get, state.tp_rank, state.tp), strict=False)
        if cfg.lora.rank > 0:
            _apply_lora(module, cfg)
    return prepare


def build_run(cfg: RunConfig, state: ParallelState, task: Task, run_dir: Path, resume: bool) -> tuple[FlowGRPORun, int]:
    arch, dtype = cfg.model.arch, cfg.model.torch_dtype
    torch.manual_seed(cfg.train.seed)  # random init (no weights configured) is then a function of the seed
    policy = build_policy(arch, state, lr=cfg.train.lr, clip_grad=cfg.algorithm.clip_grad, dtype=dtype,
                          backend=cfg.model.backend, prepare=_initial_weights(cfg, state))
    if cfg.train.compile:
        compile_policy(policy, cfg.train.compile)
    loss_config = cfg.algorithm.loss_config()
    # the reference is taken before a checkpoint is loaded: it is the initial policy, resumed or not
    forward_step = flow_grpo_forward_step(loss_config, reference=reference_policy(cfg, policy))
    checkpointer = Checkpointer(run_dir / "checkpoints", run_config=config_to_yaml(cfg))
    start = 0
    if resume and checkpointer.latest_step() is not None:
        start = checkpointer.load(policy.model, policy.optimizer)["step"] + 1
    engine = _build_engine(cfg, state, task)
    fns = {"reward": build_reward(cfg.reward.name)}
    if cfg.reward.judge:
        fns["judge"] = build_reward(cfg.reward.judge)
    logger = RunLogger(run_dir, cfg.train.steps, cfg.logging.wandb_mode, cfg.logging.project,
                       config=_plain_config(cfg), start_step=start, curve_keys=tuple(f"{k}_mean" for k in fns),
                       log_every=cfg.logging.log_every)
    run = FlowGRPORun(cfg, task, policy, engine, AsyncRewardPool(fns, num_workers=cfg.reward.workers), checkpointer,
                      logger, forward_step)
    push_policy_weights(run)
    return run, start


def _plain_config(cfg: RunConfig) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def reference_policy(cfg: RunConfig, policy: Policy):
    """The KL term's reference: the adapters switched off (LoRA), or a frozen copy of the initial
    weights (full fine-tune); None without a KL term."""
    if cfg.algorithm.kl_beta == 0:
        return None
    if cfg.lora.rank > 0:
        return disable_adapters
    module = policy.module
    frozen = cfg.model.family_impl.build(module.arch, module.config, policy.state.tp_group,
                                         cfg.model.backend).to(policy.state.torch_device)
    frozen.load_state_dict(module.state_dict())
    frozen.requires_grad_(False).eval()
    return lambda _model: contextlib.nullcontext(frozen)


def logprob_consistency(run: FlowGRPORun, trajs: list[Trajectory], text) -> dict[str, float]:
    """docs/design.md, decision 6: the trainer re-scores the rollout's trained steps; mean |Δ log p| and Pearson r.  It runs
    before any update of this RL step, so the rollout's uncond outputs stand in for the uncond rows."""
    mbs = grpo_microbatches(trajs, torch.zeros(len(trajs)), text, run.cfg.train.micro_batch_size,
                            reuse_uncond=reuses_uncond(run.cfg),
                            text_pad_multiple=run.cfg.rollout.text_pad_multiple)
    out, _ = run_microbatches(run.policy, run.forward_step, mbs, forward_only=True, collect_non_loss_data=True)
    trainer_lp = torch.cat([o["log_prob"] for o in out]).cpu()
    rollout_lp = torch.cat([mb.old_log_prob for mb in mbs]).cpu()
    pearson = torch.corrcoef(torch.stack([trainer_lp, rollout_lp]))[0, 1].item() if len(trainer_lp) > 1 else 1.0
    return {"logprob_abs_diff": (trainer_lp - rollout_lp).abs().mean().item(), "logprob_pearson": pearson}


def optimizer_step_batches(mbs: list, per_opt_step: int) -> list[list]:
    """The micro-batches of each optimizer step.  Only the first step runs with the weights the rollout
    used: later ones recompute the uncond branch (a reused v_u there would be the old policy's and change
    the gradient)."""
    steps = [mbs[k:k + per_opt_step] for k in range(0, len(mbs), per_opt_step)]
    return steps[:1] + [without_reused_uncond(s) for s in steps[1:]]


def train_on(run: FlowGRPORun, trajs: list[Trajectory], advantages: torch.Tensor, text) -> dict[str, float]:
    """Optimizer steps over all (sample, trained step) pairs, ``train.global_batch_size`` pairs each."""
    mbs = grpo_microbatches(trajs, advantages, text, run.cfg.train.micro_batch_size,
                            reuse_uncond=reuses_uncond(run.cfg),
                            text_pad_multiple=run.cfg.rollout.text_pad_multiple)
    per_opt_step = max(1, run.cfg.train.global_batch_size // run.cfg.train.micro_batch_size)
    metrics, norms = [], []
    for batch in optimizer_step_batches(mbs, per_opt_step):
        out, grad_norm = run_microbatches(run.policy, run.forward_step, batch)
        metrics += out
        norms.append(float(grad_norm))
    summary = {key: torch.stack([torch.as_tensor(m[key]).float() for m in metrics]).mean().item() for key in metrics[0]}
    summary["grad_norm"] = sum(norms) / len(norms)
    summary["optimizer_steps"] = len(norms)
    return summary


def prompt_table(run: FlowGRPORun, prompts: set[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Text embeddings of ``prompts`` for the trainer, encoded once per prompt and cached."""
    missing = sorted(prompts - run.text_cache.keys())
    if missing:
        emb, mask = run.task.encode(missing)
        run.text_cache.update({p: (emb[i], mask[i]) for i, p in enumerate(missing)})
    return {p: run.text_cache[p] for p in prompts}


def rl_step(run: FlowGRPORun, step: int) -> dict[str, Any]:
    cfg, times = run.cfg, {}
    t0 = time.perf_counter()
    # two rollout halves (whole groups each): the first half is scored in reward threads while the
    # second is sampled, the second while the trainer re-scores log-probs
    requests = make_requests(cfg, run.task, step)
    half = (cfg.rollout.prompts_per_step // 2 or cfg.rollout.prompts_per_step) * cfg.rollout.group_size
    trajs, pending, images = [], [], []
    for part in (requests[:half], requests[half:]):
        if not part:
            continue
        part_trajs = run.engine.generate(part)
        part_images = run.task.decode(torch.stack([t.final_sample for t in part_trajs]).cpu())
        pending.append(run.rewards.submit(part_images, [t.request.prompt for t in part_trajs]))
        trajs += part_trajs
        images.append(part_images)
    images = torch.cat(images)
    prompts = [t.request.prompt for t in trajs]
    times["rollout_seconds"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    text = prompt_table(run, set(prompts) | ({t.request.negative_prompt for t in trajs} if cfg.rollout.guidance_scale > 1 else set()))
    check = logprob_consistency(run, trajs[: cfg.algorithm.logprob_check_samples], text)
    parts = [p.result() for p in pending]
    scores = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    times["reward_seconds"] = time.perf_counter() - t1
    if check["logprob_abs_diff"] > cfg.algorithm.logprob_warn_abs:
        print(f"warning: step {step}: rollout and trainer log-probs differ by {check['logprob_abs_diff']:.3g} on "
              f"average (threshold {cfg.algorithm.logprob_warn_abs}); Pearson r {check['logprob_pearson']:.4f}")

    rewards = torch.as_tensor(scores["reward"], dtype=torch.float32)
    adv = group_advantages(rewards, torch.tensor([t.request.prompt_id for t in trajs]), std=cfg.algorithm.adv_std,
                           clip_max=cfg.algorithm.adv_clip_max)
    t2 = time.perf_counter()
    train_metrics = train_on(run, trajs, adv.advantages, text)
    times["train_seconds"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    run.sync_restarts = 0
    push_policy_weights(run)
    times["sync_seconds"] = time.perf_counter() - t3
    step_seconds = time.perf_counter() - t0
    metrics = {f"{k}_mean": float(v.mean()) for k, v in scores.items()}
    metrics.update(_utilisation(cfg, run.task, trajs, step_seconds, text))
    metrics.update({f"{k}_std": float(v.std()) for k, v in scores.items()})
    metrics.update(zero_std_ratio=adv.zero_std_ratio, lr=cfg.train.lr, **train_metrics, **check, **times,
                   step_seconds=step_seconds, images_per_second=len(trajs) / step_seconds,
                   sync_restarts=run.sync_restarts)
    return {"metrics": metrics, "images": images}


def _utilisation(cfg: RunConfig, task: Task, trajs: list[Trajectory], seconds: float, text) -> dict[str, float]:
    """Achieved TFLOP/s of the step's DiT work, and MFU where the device's peak is known.  Counts the
    forwards actually run, each row at the text length it ran at (``text``: prompt -> (embedding, mask), laid
    out as the engine lays it out): no uncond rows where the rollout's uncond output was reused; with LoRA, no
    weight gradients of the frozen base and the adapters' own FLOPs."""
    arch, image_tokens = cfg.model.arch, task.img_fhw[0] * task.img_fhw[1] * task.img_fhw[2]
    lengths = {}

    def length(prompt: str) -> int:
        if prompt not in lengths:
            emb, mask = text[prompt]
            lengths[prompt] = padded_length([emb.shape[0] if mask is None else int(mask.sum())],
                                            cfg.rollout.text_pad_multiple)
        return lengths[prompt]

    def per_row(n: int) -> tuple[float, float]:
        return (forward_flops(arch, 1, image_tokens, n),
                lora_forward_flops(arch, cfg.lora.rank, cfg.lora_targets, 1, image_tokens, n))

    with_cfg = cfg.rollout.guidance_scale > 1
    samples = [(length(t.request.prompt), length(t.request.negative_prompt) if with_cfg else None,
                int(t.trained.sum())) for t in trajs]
    pairs = sum(n for _, _, n in samples)
    reused = min(pairs, max(cfg.train.global_batch_size, cfg.train.micro_batch_size)) if reuses_uncond(cfg) else 0
    flops = varlen_step_flops(per_row, samples, rollout_steps=cfg.rollout.num_steps, frozen_base=cfg.lora.rank > 0,
                              reused_uncond_pairs=reused, check_samples=cfg.algorithm.logprob_check_samples,
                              check_reuses_uncond=reuses_uncond(cfg), kl=cfg.algorithm.kl_beta > 0)
    out = {"tflops_per_second": flops / seconds / 1e12}
    peak = device_peak_flops(cfg.model.torch_dtype)
    if peak:
        out["mfu"] = flops / seconds / peak
    return out


def train(cfg: RunConfig, state: ParallelState, task: Task, run_dir: str | Path, resume: bool = False,
          stop_after: int | None = None) -> tuple[FlowGRPORun, list[dict]]:
    """Run (or resume) the FlowGRPO loop; returns the run (its policy is the trained one) and the metrics
    of the steps run here.  The last step is always checkpointed.  ``stop_after`` ends this call after
    that many steps without a final checkpoint, as a killed process would (used to test resume)."""
    run_dir = Path(run_dir)
    run, start = build_run(cfg, state, task, run_dir, resume)
    done, last = [], cfg.train.steps - 1
    try:
        for step in range(start, cfg.train.steps):
            result = rl_step(run, step)
            run.logger.log_step(step, result["metrics"])
            done.append({"step": step, **result["metrics"]})
            if step % max(1, cfg.train.steps // 4) == 0 or step == last:
                run.logger.log_images(step, result["images"][:64])
            if stop_after is not None and len(done) >= stop_after:
                break
            if step == last or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
                run.checkpointer.save(step, run.policy.model, run.policy.optimizer, {})
    finally:
        run.rewards.close()
        run.logger.finish()
        if isinstance(run.engine, Rank0Engine):  # stop the engine processes
            run.engine.close()
    return run, done
