"""The peer loop, DiT side: the usual way (docs/benchmarks.md) -- diffusers ``QwenImageTransformer2DModel`` + peft
LoRA on the same 12 modules, a plain PyTorch loop as flow_grpo builds it: fp32 adapters (peft's
``get_peft_model``), bf16 autocast (accelerate's mixed precision), rollout with cond + uncond batched (32 rows
per forward), training micro-batches of 4 pairs with the uncond branch recomputed under ``no_grad``, AdamW.

The step math (CFG combine, SDE mean / log-prob, clipped loss, group advantages) is the project's, so the
two loops differ only in how the model, LoRA, batching and optimizer run.  No text encoder, VAE or reward
(random rewards feed the advantages) and no weight sync: the model samples and trains in place.

Shape legend: B samples of a rollout batch; W window steps; I image tokens; C packed channels; T text tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from _flow_grpo_parts import PhaseTimer, Recipe, default_dtype, synchronize
from megatron_omni.algorithms.advantages import group_advantages
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig, flow_grpo_loss
from megatron_omni.rollout.samplers import cfg_combine, gaussian_log_prob, ode_mean_std, sde_mean_std
from megatron_omni.rollout.schedule import sde_window, sigmas
from model_specs.common.lora import FLOW_GRPO_TARGETS


@dataclass
class Reference:
    recipe: Recipe
    model: torch.nn.Module  # peft-wrapped
    optimizer: torch.optim.Optimizer
    trainable: list[torch.nn.Parameter]
    txt_PTE: torch.Tensor  # fixed random prompt embeddings (no text encoder on this side)
    neg_TE: torch.Tensor
    build_seconds: float


def build_reference(recipe: Recipe) -> Reference:
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig, get_peft_model

    start = time.perf_counter()
    kwargs = {k: v for k, v in recipe.arch.to_diffusers().items() if not k.startswith("_")}
    with torch.device("meta"), default_dtype(recipe.dtype):
        model = QwenImageTransformer2DModel(**kwargs)
    model = model.to_empty(device=recipe.device)
    # the RoPE tables are plain attributes, not buffers: rebuild them off the meta device
    model.pos_embed = type(model.pos_embed)(theta=10000, axes_dim=list(recipe.arch.axes_dims_rope), scale_rope=True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.requires_grad_(False)
    lora = LoraConfig(r=recipe.lora_rank, lora_alpha=recipe.lora_alpha, init_lora_weights="gaussian",
                      target_modules=list(FLOW_GRPO_TARGETS))
    model = get_peft_model(model, lora)  # fp32 adapters on the bf16 base (peft's autocast_adapter_dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=recipe.lr, betas=(0.9, 0.999), weight_decay=0.0,
                                  fused=recipe.device.type == "cuda")
    g = torch.Generator(device=recipe.device).manual_seed(1)
    txt, neg = (torch.randn(n, tokens, recipe.arch.joint_attention_dim, generator=g, device=recipe.device).to(
        recipe.dtype) for n, tokens in ((recipe.prompts, recipe.text_tokens), (1, recipe.uncond_tokens)))
    synchronize(recipe.device)
    return Reference(recipe, model, optimizer, trainable, txt, neg[0], time.perf_counter() - start)


def _velocity(ref: Reference, x_BIC: torch.Tensor, txt_BTE: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    r = ref.recipe
    with r.autocast:
        return ref.model(hidden_states=x_BIC.to(r.dtype), encoder_hidden_states=txt_BTE, timestep=t_B,
                         img_shapes=[[r.img_fhw]] * x_BIC.shape[0], return_dict=False)[0]


@torch.no_grad()
def _rollout_batch(ref: Reference, prompt_B: torch.Tensor, g: torch.Generator, seed: int) -> dict[str, torch.Tensor]:
    """One batch of B samples: 10 steps, cond + uncond rows in one forward (two, as diffusers' pipeline runs them,
    when the negative prompt has another length), SDE on the window's steps (one window for the batch, drawn from
    ``seed``; where it lies does not change the work)."""
    r = ref.recipe
    sig = sigmas(r.num_steps, r.shift).to(r.device)
    mask_N, _ = sde_window(r.num_steps, r.window, r.window_starts, torch.Generator().manual_seed(seed))
    b = prompt_B.numel()
    txt_BTE, neg_BTE = ref.txt_PTE[prompt_B], ref.neg_TE.expand(b, -1, -1)
    joint = txt_BTE.shape == neg_BTE.shape
    x_BIC = torch.randn(b, r.image_tokens, r.arch.in_channels, generator=g, device=r.device)
    kept = {"x_t": [], "x_next": [], "t": [], "t_next": [], "log_prob": []}
    for i in range(r.num_steps):
        t, t_next = sig[i], sig[i + 1]
        if joint:
            v_c, v_u = _velocity(ref, torch.cat([x_BIC, x_BIC]), torch.cat([txt_BTE, neg_BTE]),
                                 t.expand(2 * b)).chunk(2)
        else:
            v_c, v_u = (_velocity(ref, x_BIC, txt, t.expand(b)) for txt in (txt_BTE, neg_BTE))
        v_BIC = cfg_combine(v_c, v_u, r.guidance, "token")
        if not mask_N[i]:
            x_BIC = ode_mean_std(x_BIC, v_BIC, t, t_next)[0]
            continue
        mean_BIC, std = sde_mean_std(x_BIC, v_BIC, t, t_next, r.noise_level, sig[1])
        x_next = mean_BIC + std * torch.randn(mean_BIC.shape, generator=g, device=r.device)
        for key, value in (("x_t", x_BIC), ("x_next", x_next), ("t", t.expand(b)), ("t_next", t_next.expand(b)),
                           ("log_prob", gaussian_log_prob(x_next, mean_BIC, std))):
            kept[key].append(value)
        x_BIC = x_next
    # (sample, step) pairs in sample order: [B, W] -> [B*W]
    out = {k: torch.stack(v, dim=1).flatten(0, 1) for k, v in kept.items()}
    out["prompt"] = prompt_B.repeat_interleave(r.window)
    return out


def _train(ref: Reference, pairs: dict[str, torch.Tensor], adv: torch.Tensor) -> tuple[list[dict], float]:
    r = ref.recipe
    loss_config = FlowGRPOLossConfig(clip_range=r.clip_range)
    n = pairs["t"].numel()
    chunks = [slice(k, k + r.reference_micro_batch) for k in range(0, n, r.reference_micro_batch)]
    metrics = []
    for s in chunks:
        x_t, t, prompt = pairs["x_t"][s], pairs["t"][s], pairs["prompt"][s]
        with torch.no_grad():  # the uncond branch needs no gradient: its own forward under no_grad
            v_u = _velocity(ref, x_t, ref.neg_TE.expand(len(t), -1, -1), t)
        v_c = _velocity(ref, x_t, ref.txt_PTE[prompt], t)
        mean, std = sde_mean_std(x_t, cfg_combine(v_c, v_u, r.guidance, "token"), t, pairs["t_next"][s],
                                 r.noise_level, pairs["sigma_1"])
        loss, m = flow_grpo_loss(gaussian_log_prob(pairs["x_next"][s], mean, std), pairs["log_prob"][s], adv[s],
                                 loss_config)
        (loss / len(chunks)).backward()
        metrics.append(m)
    grad_norm = torch.nn.utils.clip_grad_norm_(ref.trainable, 1.0)
    ref.optimizer.step()
    ref.optimizer.zero_grad(set_to_none=True)
    return metrics, float(grad_norm)


def reference_step(ref: Reference, step: int) -> tuple[dict[str, float], dict[str, float]]:
    """One RL step, DiT side; (seconds per phase, train metrics)."""
    r, timer = ref.recipe, PhaseTimer(ref.recipe.device)
    g = torch.Generator(device=r.device).manual_seed(step)
    prompt_N = torch.arange(r.prompts, device=r.device).repeat_interleave(r.group)
    with timer("rollout"):
        batches = [_rollout_batch(ref, prompt_N[k:k + r.rollout_batch], g, seed=step * 100_003 + k)
                   for k in range(0, r.samples, r.rollout_batch)]
        pairs = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        pairs["sigma_1"] = sigmas(r.num_steps, r.shift)[1].item()
    # random rewards: this side has no decoder or reward; the advantages are computed as ours are
    rewards = torch.randn(r.samples, generator=torch.Generator().manual_seed(step))
    adv_N = group_advantages(rewards, prompt_N.cpu()).advantages.to(r.device)
    with timer("train"):
        metrics, grad_norm = _train(ref, pairs, adv_N.repeat_interleave(r.window))
    out = {k: torch.stack([m[k] for m in metrics]).float().mean().item()
           for k in ("ratio_mean", "clipfrac_above", "clipfrac_below", "approx_kl")}
    out.update(grad_norm=grad_norm, pairs=pairs["t"].numel())
    return timer.seconds, out
