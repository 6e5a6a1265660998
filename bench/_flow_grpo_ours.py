"""Ours, one FlowGRPO step of the recipe: text encoding -> rollout (``EmbeddedEngine``, our samplers, true
CFG batched) -> VAE decode -> reward -> group advantages -> train (``build_policy`` / ``run_microbatches``
with the project's FlowGRPO forward step) -> LoRA weight sync (``megatron_omni.sync.push_weights``).
Training reuses the rollout's uncond outputs (``Recipe.reuse_uncond``): one optimizer step per RL step, right
after the sync the rollout ran with, so they are the current policy's and the loss and gradients are unchanged.

The rollout engine's model is a second ``QwenImageModel`` whose frozen base parameters ARE the policy's
(LoRA never changes the base, so sharing it is exact and saves 40.9 GB) and whose LoRA adapters are its own:
every sync pushes the trainer's adapters into them in-process, as a colocated LoRA engine receives them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from _flow_grpo_parts import NEGATIVE, EndToEnd, PhaseTimer, Recipe, encode_step, synchronize
from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.algorithms.advantages import group_advantages
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig, flow_grpo_forward_step
from megatron_omni.compile import compile_blocks
from megatron_omni.parallel.state import ParallelState
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request
from megatron_omni.sync import HFExporter, push_weights
from megatron_omni.algorithms.flow_grpo.microbatches import grpo_microbatches
from megatron_omni.trainer.policy import Policy, build_policy, compile_policy, run_microbatches
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, base_parameters, target_name
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec

SYNC_BUCKET = 1 << 30


@dataclass
class Ours:
    recipe: Recipe
    policy: Policy
    engine: EmbeddedEngine
    exporter: HFExporter  # LoRA adapters only; built once, reused every sync
    forward_step: object
    build_seconds: float
    first_forward_seconds: float  # the first rollout forward, compile included

    @property
    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.policy.module.parameters() if p.requires_grad)


def _lora(module: QwenImageModel, recipe: Recipe) -> None:
    apply_lora(module, recipe.lora_rank, recipe.lora_alpha, FLOW_GRPO_TARGETS, qwen_image_rules(module.arch), seed=0)


def rollout_model_sharing_base(policy: Policy, recipe: Recipe) -> QwenImageModel:
    """The engine's model: built on the meta device, LoRA applied like the policy's, then every base
    parameter replaced by the policy's own and the adapters given storage of their own (filled by a sync)."""
    arch = recipe.arch
    config = arch.transformer_config(1, params_dtype=recipe.dtype, perform_initialization=False)
    with torch.device("meta"):
        model = QwenImageModel(arch, config, policy.state.tp_group, qwen_image_block_spec("local"))
        _lora(model, recipe)
    shared = base_parameters(policy.module)
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        new = (torch.nn.Parameter(torch.empty_like(param, device=recipe.device), requires_grad=False)
               if leaf in ("lora_A", "lora_B") else shared[target_name(name)])
        setattr(model.get_submodule(owner), leaf, new)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"rollout model: {left[:3]} still on the meta device after sharing the policy's base")
    return model.eval()


def build_ours(recipe: Recipe, state: ParallelState, compile_mode: str | None,
               compile_train: str | None = None) -> Ours:
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(recipe.device):  # megatron's "CPU" init then draws on the device: seconds, not minutes
        policy = build_policy(recipe.arch, state, lr=recipe.lr, clip_grad=1.0, dtype=recipe.dtype, backend="local",
                              prepare=lambda m: _lora(m, recipe))
    engine = EmbeddedEngine(rollout_model_sharing_base(policy, recipe), recipe.arch,
                            config=EngineConfig(max_num_seqs=recipe.rollout_batch))
    exporter = HFExporter(policy.module, state.tp_group, mode="lora", bucket_bytes=SYNC_BUCKET)
    push_weights(engine, exporter, SYNC_BUCKET)  # the engine's adapters start as the policy's
    if compile_mode:
        compile_blocks(engine.model, compile_mode)
    if compile_train:
        compile_policy(policy, compile_train)
    forward_step = flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=recipe.clip_range))
    synchronize(recipe.device)
    built = time.perf_counter() - start
    return Ours(recipe, policy, engine, exporter, forward_step, built, _first_forward(engine, recipe))


@torch.no_grad()
def _first_forward(engine: EmbeddedEngine, recipe: Recipe) -> float:
    """Seconds of one rollout-shaped forward (CFG rows, no mask): compiles the blocks under ``--compile``."""
    rows = 2 * min(recipe.rollout_batch, recipe.samples)
    img = torch.randn(rows, recipe.image_tokens, recipe.arch.in_channels, device=recipe.device, dtype=recipe.dtype)
    txt = torch.randn(rows, recipe.text_tokens, recipe.arch.joint_attention_dim, device=recipe.device,
                      dtype=recipe.dtype)
    start = time.perf_counter()
    sigma = torch.full((1,), 0.5, device=recipe.device)  # a step's forward reads a modulation table, as the engine's
    table = engine.model.modulation_table(sigma)
    engine.model(img, txt, sigma.expand(rows), recipe.img_fhw, None, modulation=table.step(0))
    synchronize(recipe.device)
    return time.perf_counter() - start


def _requests(recipe: Recipe, prompts: list[str], emb_PTE: torch.Tensor, neg_TE: torch.Tensor,
              step: int, rank: int = 0) -> list[Request]:
    return [Request(prompt=p, prompt_id=k, prompt_emb=emb_PTE[k], negative_prompt=NEGATIVE, negative_prompt_emb=neg_TE,
                    seed=step * 100_003 + k * recipe.group + i + rank * 10_000_019, img_fhw=recipe.img_fhw,
                    num_steps=recipe.num_steps,
                    shift=recipe.shift, sampler="sde", noise_level=recipe.noise_level, window_size=recipe.window,
                    window_range=recipe.window_starts, guidance_scale=recipe.guidance,
                    keep_uncond_velocity=recipe.reuse_uncond)
            for k, p in enumerate(prompts) for i in range(recipe.group)]


def step_prompts(ours: Ours, step: int) -> list[str]:
    """This rank's prompts of RL step ``step``."""
    rank = ours.policy.state.dp_rank
    return [f'a sign that reads "step {step} prompt {k} rank {rank}"' for k in range(ours.recipe.prompts)]


def rollout(ours: Ours, prompts: list[str], emb_PTE: torch.Tensor, neg_TE: torch.Tensor, step: int) -> list:
    """The step's trajectories from the prompts' embeddings and the negative prompt's."""
    reqs = _requests(ours.recipe, prompts, emb_PTE, neg_TE, step, ours.policy.state.dp_rank)
    return ours.engine.generate(reqs)


def ours_step(ours: Ours, e2e: EndToEnd, step: int) -> tuple[dict[str, float], dict[str, float]]:
    """One RL step; (seconds per phase, train metrics).  Under data parallelism (torchrun) every rank runs
    its own prompts and seeds; the optimizer step averages the gradients over the ranks (megatron DDP)."""
    recipe, timer = ours.recipe, PhaseTimer(ours.recipe.device)
    prompts = step_prompts(ours, step)
    with timer("text"):
        emb_PTE, neg_TE = encode_step(e2e.text, recipe, prompts)
    with timer("rollout"):
        trajs = rollout(ours, prompts, emb_PTE, neg_TE, step)
    with timer("decode"):
        images = e2e.decode(torch.stack([t.final_sample for t in trajs]))
    with timer("reward"):
        rewards = e2e.reward(images, [t.request.prompt for t in trajs])
        adv = group_advantages(torch.as_tensor(rewards, dtype=torch.float32),
                               torch.tensor([t.request.prompt_id for t in trajs]))
    with timer("train"):
        table = {p: (e, torch.ones(e.shape[0], dtype=torch.bool, device=recipe.device))
                 for p, e in zip(prompts + [NEGATIVE], [*emb_PTE, neg_TE])}
        # one optimizer step right after the sync the rollout ran with: the rollout's uncond outputs are the
        # current policy's, so the training forward carries cond rows only (exact; megatron_omni.trainer.flow_grpo)
        mbs = grpo_microbatches(trajs, adv.advantages, table, recipe.micro_batch, reuse_uncond=recipe.reuse_uncond)
        out, grad_norm = run_microbatches(ours.policy, ours.forward_step, mbs)
    with timer("sync"):
        push_weights(ours.engine, ours.exporter, SYNC_BUCKET)
    metrics = {k: torch.stack([torch.as_tensor(m[k]).float() for m in out]).mean().item()
               for k in ("ratio_mean", "clipfrac_above", "clipfrac_below", "approx_kl")}
    metrics.update(grad_norm=float(grad_norm), reward_mean=float(rewards.mean()), pairs=sum(len(mb.t) for mb in mbs))
    return timer.seconds, metrics
