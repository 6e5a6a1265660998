"""DiffusionNFT's micro-batches and megatron-core forward step.

Legend: B rows, I image tokens, C packed channels, T text tokens, E text width.  Each sample of the step gives
``timesteps`` rows: its clean x0 (the rollout's final sample) noised at t drawn from the rollout's schedule
(sigmas[0..N−1]) with ε, both from its request seed (draw ``NOISE_DRAW``).  The old policy's velocity on every row
comes from a forward-only pass before the step's first update (``with_old_velocity``), i.e. the rollout's policy.
The reference term's v_ref is an inline forward of the reference in each training forward on a whole model (PP = 1);
under PP it comes from a forward-only pass of its own with the reference's weights in place
(``with_reference_velocity``): one pass of the schedule carries one hidden state per micro-batch between stages, so
a stage's reference chunk must be fed by the reference's previous stage, not the policy's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Iterator

import torch

from megatron_omni.algorithms.clean_samples import noised, row_tensors, sample_generator
from megatron_omni.algorithms.diffusion_nft.loss import NFTLossConfig, diffusion_nft_loss
from megatron_omni.algorithms.flow_grpo.step import ReferenceFn
from megatron_omni.rollout.engine import Trajectory

NOISE_DRAW = -6  # of a sample's request seed: its training rows' t and ε


@dataclass
class NFTMicroBatch:
    x_t: torch.Tensor  # [B, I, C] the model input
    x0: torch.Tensor  # [B, I, C] float32 the clean sample
    t: torch.Tensor  # [B]
    advantage: torch.Tensor  # [B] the sample's Â
    txt: torch.Tensor  # [B, T, E]
    txt_mask: torch.Tensor | None  # [B, T]
    img_fhw: tuple[int, int, int]
    old_velocity: torch.Tensor | None = None  # [B, I, C] float32 v_old; None before with_old_velocity
    # [B, I, C] float32 v_ref from the reference's own forward-only pass (with_reference_velocity, under PP); None: the
    # forward step runs the reference inline, or there is no reference term
    ref_velocity: torch.Tensor | None = None
    # {denoiser keyword: [B, ...]} the rows' text extras (model_specs.family: SD3's pooled text); None: none
    txt_extras: dict[str, torch.Tensor] | None = None


def training_rows(trajs: list[Trajectory], timesteps: int) -> list[tuple[int, float, torch.Tensor]]:
    """(sample, t, ε [I, C]) per training row: ``timesteps`` distinct steps of the sample's schedule and their noise,
    drawn from its request seed."""
    rows = []
    for i, traj in enumerate(trajs):
        n = traj.sigmas.numel() - 1
        if timesteps > n:
            raise ValueError(f"diffusion_nft.timesteps_per_sample={timesteps} exceeds the rollout's {n} steps")
        g = sample_generator(traj, NOISE_DRAW)
        steps = torch.randperm(n, generator=g)[:timesteps].sort().values
        eps = torch.randn((timesteps, *traj.final_sample.shape), generator=g)
        rows += [(i, float(traj.sigmas[j]), eps[k]) for k, j in enumerate(steps.tolist())]
    return rows


def nft_microbatches(trajs: list[Trajectory], advantages_N: torch.Tensor, text, timesteps: int, size: int,
                     text_pad_multiple: int = 1) -> list[NFTMicroBatch]:
    """Micro-batches of ``size`` training rows in (sample, t) order, text laid out as the rollout engine lays it."""
    if any(t.request.context_latents is not None for t in trajs):
        raise ValueError("diffusion_nft: trajectories with context tokens (edit training) are not supported; expected "
                         "text-to-image requests")
    rows, out = training_rows(trajs, timesteps), []
    for k in range(0, len(rows), size):
        chunk = rows[k:k + size]
        samples, x0, eps, t, (txt, mask, extras) = row_tensors(trajs, chunk, text, text_pad_multiple)
        out.append(NFTMicroBatch(x_t=noised(x0, eps, t), x0=x0, t=t, txt=txt, txt_mask=mask,
                                 advantage=advantages_N[[i for i, _, _ in chunk]].to(x0.device),
                                 img_fhw=samples[0].request.img_fhw, txt_extras=extras or None))
    return out


def with_old_velocity(run, mbs: list[NFTMicroBatch]) -> list[NFTMicroBatch]:
    """``mbs`` with v_old from one forward-only pass of the run's forward step (on the last pipeline stage)."""
    return _with_velocity(run, mbs, "old_velocity")


def with_reference_velocity(run, mbs: list[NFTMicroBatch]) -> list[NFTMicroBatch]:
    """``mbs`` with v_ref (``ref_velocity``) from one forward-only pass of the run's forward step; the caller puts the
    reference's weights in place on every chunk around it (DiffusionNFT.reference_weights)."""
    return _with_velocity(run, mbs, "ref_velocity")


def _with_velocity(run, mbs: list[NFTMicroBatch], field: str) -> list[NFTMicroBatch]:
    out, _ = run.run_microbatches(mbs, forward_only=True, collect_non_loss_data=True)
    if not out:
        return mbs
    return [replace(mb, **{field: o["velocity"]}) for mb, o in zip(mbs, out)]


def loss_func(mb: NFTMicroBatch, config: NFTLossConfig, ref_out: torch.Tensor | None, output: torch.Tensor,
              non_loss_data: bool = False):
    """megatron ``loss_func``: (L, metrics); with ``non_loss_data`` the detached velocity (the old policy's or the
    reference's pass).  v_ref: the inline reference forward's (``ref_out``), else the micro-batch's ``ref_velocity``."""
    if non_loss_data:
        return {"velocity": output.detach().float()}
    if mb.old_velocity is None:
        raise ValueError("the DiffusionNFT loss needs the old policy's velocity: build the micro-batches with "
                         "with_old_velocity")
    ref_v = ref_out if ref_out is not None else mb.ref_velocity
    if config.ref_weight > 0 and ref_v is None:
        raise ValueError(f"ref_weight={config.ref_weight} needs the reference's velocity: an inline reference "
                         f"(nft_forward_step(reference=...)) or micro-batches from with_reference_velocity")
    return diffusion_nft_loss(output, mb.old_velocity, mb.x_t, mb.x0, mb.t, mb.advantage, config, ref_v)


def nft_forward_step(config: NFTLossConfig, reference: ReferenceFn | None = None, *, reference_pass: bool = False):
    """``forward_step_func(data_iterator, model)`` over ``NFTMicroBatch``es.  When ref_weight > 0 either ``reference``
    (an inline forward of the reference, on a whole model) or ``reference_pass``: the micro-batches carry
    ``ref_velocity`` from a forward-only pass of their own (``with_reference_velocity``: the form for PP)."""
    if config.ref_weight > 0 and reference is None and not reference_pass:
        raise ValueError(f"ref_weight={config.ref_weight} needs a reference policy: pass reference=, or "
                         f"reference_pass=True with micro-batches from with_reference_velocity")

    def forward_step(data_iterator: Iterator[NFTMicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        dtype = model.config.params_dtype
        inputs = (mb.x_t.to(dtype), mb.txt.to(dtype), mb.t, mb.img_fhw, mb.txt_mask)
        extras = {k: v.to(dtype) for k, v in (mb.txt_extras or {}).items()}
        output = model(*inputs, **extras)
        ref_out = None
        if config.ref_weight > 0 and reference is not None:
            with torch.no_grad(), reference(model) as ref_model:
                ref_out = ref_model(*inputs, **extras)
        return output, partial(loss_func, mb, config, ref_out)

    return forward_step
