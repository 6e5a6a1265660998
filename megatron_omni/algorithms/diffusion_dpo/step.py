"""Diffusion-DPO's micro-batches of preference pairs and its megatron-core forward step.

Legend: B pairs, rows 2B (the winners, then the losers), I image tokens, C packed channels, T text tokens,
E text width.  Each pair draws its ε [I, C] and t from its winner's request seed (draw ``NOISE_DRAW``), so a
resumed run trains on the same noise.  The reference's errors come from one forward-only pass of the same
micro-batches with the reference's weights in place before training (``with_reference_errors``): a pass of the
schedule, so it runs at every layout (under PP a stage's input is the reference's own previous stage).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial
from typing import Iterator

import torch

from megatron_omni.algorithms.clean_samples import noised, sample_generator
from megatron_omni.algorithms.diffusion_dpo.loss import diffusion_dpo_loss, flow_matching_error
from megatron_omni.algorithms.flow_grpo.microbatches import _text_rows
from megatron_omni.rollout.engine import Trajectory

NOISE_DRAW = -5  # of a winner's request seed: its pair's ε and t


@dataclass
class DPOMicroBatch:
    x_t: torch.Tensor  # [2B, I, C] (1 − t)·x0 + t·ε of the winners, then the losers (one ε and t per pair)
    target: torch.Tensor  # [2B, I, C] float32 ε − x0
    t: torch.Tensor  # [2B] the model's timestep input
    txt: torch.Tensor  # [2B, T, E]
    txt_mask: torch.Tensor | None  # [2B, T] True = real token; None = all real
    img_fhw: tuple[int, int, int]
    ref_error: torch.Tensor | None = None  # [2B] the reference's e; None before with_reference_errors
    # {denoiser keyword: [2B, ...]} the rows' text extras (model_specs.family: SD3's pooled text); None: none
    txt_extras: dict[str, torch.Tensor] | None = None


def pair_noise(winner: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    """(ε [I, C], t [1] in [0, 1)) of the pair whose winner is ``winner``."""
    g = sample_generator(winner, NOISE_DRAW)
    t = torch.rand(1, generator=g)
    return torch.randn(tuple(winner.final_sample.shape), generator=g), t


def dpo_microbatches(trajs: list[Trajectory], winners: list[int], losers: list[int], text, size: int,
                     text_pad_multiple: int = 1) -> list[DPOMicroBatch]:
    """Micro-batches of ``size`` pairs (winners[k], losers[k]), text laid out as the rollout engine lays it out."""
    if any(t.request.context_latents is not None for t in trajs):
        raise ValueError("diffusion_dpo: trajectories with context tokens (edit training) are not supported; expected "
                         "text-to-image requests")
    out = []
    for k in range(0, len(winners), size):
        rows = [trajs[i] for i in winners[k:k + size]] + [trajs[i] for i in losers[k:k + size]]
        noise = [pair_noise(trajs[i]) for i in winners[k:k + size]]
        eps, t = (torch.stack(parts) for parts in zip(*noise * 2))  # a pair's loser takes its winner's ε and t
        device = rows[0].latents.device
        eps, t = eps.to(device), t.view(-1).to(device)
        x0 = torch.stack([r.final_sample.float() for r in rows])
        (txt, mask, extras), = _text_rows(rows, text, False, text_pad_multiple, device)
        out.append(DPOMicroBatch(x_t=noised(x0, eps, t), target=eps - x0, t=t, txt=txt, txt_mask=mask,
                                 img_fhw=rows[0].request.img_fhw, txt_extras=extras or None))
    return out


def with_reference_errors(run, mbs: list[DPOMicroBatch], reference: AbstractContextManager) -> list[DPOMicroBatch]:
    """``mbs`` with the reference's e: one forward-only pass of the run's forward step inside ``reference`` (the
    policy's modules hold the reference's weights there), on the last pipeline stage."""
    with reference:
        out, _ = run.run_microbatches(mbs, forward_only=True, collect_non_loss_data=True)
    if not out:
        return mbs
    return [replace(mb, ref_error=o["error"]) for mb, o in zip(mbs, out)]


def loss_func(mb: DPOMicroBatch, beta: float, output: torch.Tensor, non_loss_data: bool = False):
    """megatron ``loss_func``: (L, metrics); with ``non_loss_data`` the detached per-row errors (the reference's
    pass)."""
    err_2B = flow_matching_error(output, mb.target)
    if non_loss_data:
        return {"error": err_2B.detach()}
    if mb.ref_error is None:
        raise ValueError("the Diffusion-DPO loss needs the reference's errors: build the micro-batches with "
                         "with_reference_errors")
    return diffusion_dpo_loss(err_2B, mb.ref_error, beta)


def dpo_forward_step(beta: float):
    """``forward_step_func(data_iterator, model)`` over ``DPOMicroBatch``es."""

    def forward_step(data_iterator: Iterator[DPOMicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        dtype = model.config.params_dtype
        extras = {k: v.to(dtype) for k, v in (mb.txt_extras or {}).items()}
        output = model(mb.x_t.to(dtype), mb.txt.to(dtype), mb.t, mb.img_fhw, mb.txt_mask, **extras)
        return output, partial(loss_func, mb, beta)

    return forward_step
