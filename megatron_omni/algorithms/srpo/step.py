"""SRPO's micro-batches and megatron-core forward step.

Legend: B rows, I image tokens, C packed channels, T text tokens, E text width.  Each sample of the step gives
``timesteps`` rows: its clean x0 (the rollout's final sample) noised at t ~ U[t_lo, t_hi] with a kept ε, both drawn
from its request seed (draw ``NOISE_DRAW``), so a resumed run trains on the same rows.  A micro-batch carries the
differentiable reward its loss back-propagates (the task's decode and the reward's scorer, bound by the algorithm)
and each row's positive and negative reward prompts.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

from megatron_omni.algorithms.clean_samples import noised, row_tensors, sample_generator
from megatron_omni.algorithms.srpo.loss import DifferentiableReward, SRPOLossConfig, srpo_loss
from megatron_omni.rollout.engine import Trajectory

NOISE_DRAW = -7  # of a sample's request seed: its training rows' t and ε


@dataclass
class SRPOMicroBatch:
    x_t: torch.Tensor  # [B, I, C] the model input (1 − t)·x0 + t·ε
    x0: torch.Tensor  # [B, I, C] float32 the clean sample
    t: torch.Tensor  # [B]
    txt: torch.Tensor  # [B, T, E] the denoiser's text (the sample's prompt)
    txt_mask: torch.Tensor | None  # [B, T]
    img_fhw: tuple[int, int, int]
    positive: list[str]  # [B] the reward's positive prompt of each row
    negative: list[str] | None  # [B] its negative prompt; None: no negative term
    reward: DifferentiableReward


def reward_prompt(template: str, prompt: str) -> str:
    """A reward prompt from its template: ``{prompt}`` is the sample's prompt (SRPO's control words around it)."""
    return template.replace("{prompt}", prompt)


def srpo_rows(trajs: list[Trajectory], timesteps: int,
              t_range: tuple[float, float]) -> list[tuple[int, float, torch.Tensor]]:
    """(sample, t, ε [I, C]) per training row, drawn from each sample's request seed."""
    lo, hi = t_range
    rows = []
    for i, traj in enumerate(trajs):
        g = sample_generator(traj, NOISE_DRAW)
        ts = lo + (hi - lo) * torch.rand(timesteps, generator=g, dtype=torch.float64)
        eps = torch.randn((timesteps, *traj.final_sample.shape), generator=g)
        rows += [(i, float(ts[k]), eps[k]) for k in range(timesteps)]
    return rows


def srpo_microbatches(trajs: list[Trajectory], text, reward: DifferentiableReward, *, timesteps: int,
                      t_range: tuple[float, float], positive: str, negative: str | None, size: int,
                      text_pad_multiple: int = 1) -> list[SRPOMicroBatch]:
    """Micro-batches of ``size`` rows in (sample, t) order, text laid out as the rollout engine lays it out;
    ``positive`` / ``negative``: the reward prompts' templates."""
    if any(t.request.context_latents is not None for t in trajs):
        raise ValueError("srpo: trajectories with context tokens (edit training) are not supported; expected "
                         "text-to-image requests")
    rows, out = srpo_rows(trajs, timesteps, t_range), []
    for k in range(0, len(rows), size):
        samples, x0, eps, t, (txt, mask, extras) = row_tensors(trajs, rows[k:k + size], text, text_pad_multiple)
        if extras:  # (a family's per-prompt conditioning beside the text, e.g. SD3's pooled embedding)
            raise ValueError(f"srpo: text extras {sorted(extras)} are not carried by its micro-batches yet; expected "
                             f"a family without them (Qwen-Image)")
        prompts = [s.request.prompt for s in samples]
        out.append(SRPOMicroBatch(
            x_t=noised(x0, eps, t), x0=x0, t=t, txt=txt, txt_mask=mask, img_fhw=samples[0].request.img_fhw,
            positive=[reward_prompt(positive, p) for p in prompts],
            negative=None if negative is None else [reward_prompt(negative, p) for p in prompts], reward=reward))
    return out


def loss_func(mb: SRPOMicroBatch, config: SRPOLossConfig, output: torch.Tensor):
    """megatron ``loss_func``: (L, metrics) of ``srpo.loss``."""
    return srpo_loss(output, mb.x_t, mb.x0, mb.t, mb.reward, mb.positive, mb.negative, config)


def srpo_forward_step(config: SRPOLossConfig):
    """``forward_step_func(data_iterator, model)`` over ``SRPOMicroBatch``es (the conditional velocity only)."""

    def forward_step(data_iterator: Iterator[SRPOMicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        dtype = model.config.params_dtype
        output = model(mb.x_t.to(dtype), mb.txt.to(dtype), mb.t, mb.img_fhw, mb.txt_mask)
        return output, partial(loss_func, mb, config)

    return forward_step
