"""Trajectories -> Flow-GRPO micro-batches over (sample, trained step) pairs.

Pairs are taken in (sample, step) order and cut into micro-batches of ``size`` pairs; a micro-batch
carries exactly what the rollout saw for each pair (x_t, x_t', t, t', the rollout's log-prob, the sampler kind
and log-prob form that drew x_t', the prompt's text embedding and the negative prompt's when the rollout used
true CFG; a request's own embeddings when it carries them, an edit's, else the text table's; and the request's
context tokens, an edit's source image).  Text is laid out as the
rollout engine lays it out (``megatron_omni.data.text_layout``): real tokens only, each prompt padded to the
length the engine gave it (cond and negative prompt apart), a micro-batch's branch to its longest row, and no mask
when nothing is padded.

``reuse_uncond``: the micro-batches also carry the rollout's uncond output of each pair
(``Trajectory.uncond_velocity``), so the training forward skips its uncond rows.  Valid only while the
policy's weights are the rollout's: ``without_reused_uncond`` drops it for the optimizer steps after the first.
"""
from __future__ import annotations

import torch

from dataclasses import replace

from megatron_omni.algorithms.flow_grpo.step import FlowGRPOMicroBatch
from megatron_omni.data.text_layout import pad_rows, padded_length, real_tokens, real_tokens_of
from megatron_omni.rollout.engine import EngineConfig, Trajectory
from megatron_omni.rollout.samplers import to_device
from model_specs.family import stack_extras

# prompt -> (emb [T, E], mask [T]) or (emb, mask, extras {name: one prompt's tensor}): trainer.build.TextTable
TextTable = dict[str, tuple]


def _pairs(trajs: list[Trajectory]) -> list[tuple[int, int]]:
    return [(i, j) for i, tr in enumerate(trajs) for j in torch.nonzero(tr.trained.cpu()).flatten().tolist()]


def _reused_uncond(trajs: list[Trajectory], chunk: list[tuple[int, int]]) -> torch.Tensor:
    """[B, I, C] the rollout's uncond output of each (sample, step) pair of ``chunk``."""
    rows = []
    for i, j in chunk:
        tr = trajs[i]
        if tr.uncond_velocity is None:
            raise ValueError(f"trajectory {i} has no uncond_velocity to reuse: generate with "
                             f"Request(keep_uncond_velocity=True) and true CFG")
        rows.append(tr.uncond_velocity[int(tr.trained[:j].cpu().sum())])  # kept in trained-step order
    return torch.stack(rows).float()


def without_reused_uncond(mbs: list[FlowGRPOMicroBatch]) -> list[FlowGRPOMicroBatch]:
    """The micro-batches with the uncond branch recomputed: for any step after the policy was updated."""
    return [replace(mb, uncond_velocity=None) for mb in mbs]


def _table_entries(rows: list[Trajectory], text: TextTable, cfg: bool) -> dict[str, tuple]:
    """{prompt: (emb, mask)} of the table's prompts that ``rows`` read (cond, and negative with ``cfg``)."""
    used = {r.prompt for r in (t.request for t in rows) if r.prompt_emb is None}
    used |= {r.negative_prompt for r in (t.request for t in rows) if cfg and r.negative_prompt_emb is None}
    return {p: tuple(text[p][:2]) for p in sorted(used)}


def _text_rows(rows: list[Trajectory], text: TextTable, cfg: bool, multiple: int, device,
               real: dict[str, torch.Tensor] | None = None):
    """The micro-batch's cond (text, mask, extras), and with ``cfg`` the negative prompt's, each branch in the
    engine's layout: every prompt padded to its own multiple of ``multiple``, the branch to its longest row; the
    extras (model_specs.family) stacked per row, {} for a family without.  ``real``: the table's prompts' real
    tokens (``text_layout.real_tokens_of``; None: of the rows' prompts, here)."""
    if real is None:
        real = real_tokens_of(_table_entries(rows, text, cfg))

    def tokens(prompt: str, emb: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        if emb is not None:  # the request's own embeddings (e.g. an edit's, encoded with its source image)
            return real_tokens(emb, mask, prompt)
        return real[prompt]

    def extras(prompt: str, emb: torch.Tensor | None, own: dict | None) -> dict:
        if emb is not None:
            return own or {}
        return text[prompt][2] if len(text[prompt]) > 2 else {}

    q = [t.request for t in rows]
    branches = [[tokens(r.prompt, r.prompt_emb, r.prompt_mask) for r in q]]
    row_extras = [[extras(r.prompt, r.prompt_emb, r.prompt_extras) for r in q]]
    if cfg:
        branches.append([tokens(r.negative_prompt, r.negative_prompt_emb, r.negative_prompt_mask) for r in q])
        row_extras.append([extras(r.negative_prompt, r.negative_prompt_emb, r.negative_prompt_extras) for r in q])
    out = [pad_rows(parts, max(padded_length([p.shape[0]], multiple) for p in parts)) for parts in branches]
    return [(txt.to(device), None if mask is None else mask.to(device),
             {k: v.to(device) for k, v in stack_extras(ext).items()}) for (txt, mask), ext in zip(out, row_extras)]


def grpo_microbatches(trajs: list[Trajectory], advantages_N: torch.Tensor, text: TextTable,
                      size: int, reuse_uncond: bool = False,
                      text_pad_multiple: int = EngineConfig.text_pad_multiple) -> list[FlowGRPOMicroBatch]:
    req = trajs[0].request
    shared = ("img_fhw", "noise_level", "guidance_scale", "sampler", "log_prob_form")
    for t in trajs:
        differ = [f"{k}={getattr(t.request, k)!r} vs {getattr(req, k)!r}" for k in shared
                  if getattr(t.request, k) != getattr(req, k)]
        ctx = [None if r.context_latents is None else tuple(r.context_latents.shape) for r in (t.request, req)]
        if ctx[0] != ctx[1]:
            differ.append(f"context_latents {ctx[0]} vs {ctx[1]}")
        if differ:
            raise ValueError(f"trajectories of one training batch must share {', '.join(shared)} and the context "
                             f"shape; request {t.request.prompt_id!r} differs from the first: {'; '.join(differ)}")
    pairs = _pairs(trajs)
    if not pairs:
        raise ValueError("no trained steps in these trajectories (sampler 'ode', or an empty SDE window)")
    device = trajs[0].latents.device
    real = real_tokens_of(_table_entries(trajs, text, req.cfg))  # one host read of every mask
    sigmas = [t.sigmas.cpu() for t in trajs]  # (on the host already: Trajectory keeps them there)
    advantages_N = advantages_N.detach().float().cpu()
    out = []
    for k in range(0, len(pairs), size):
        chunk = pairs[k:k + size]
        rows = [trajs[i] for i, _ in chunk]
        steps = [j for _, j in chunk]
        # t, t', advantage of each pair: one asynchronous copy from the host
        t_B, t_next_B, adv_B = to_device(torch.stack([
            torch.stack([sigmas[i][j] for i, j in chunk]), torch.stack([sigmas[i][j + 1] for i, j in chunk]),
            advantages_N[[i for i, _ in chunk]]]), device).unbind(0)
        (txt, mask, extras), *negative = _text_rows(rows, text, req.cfg, text_pad_multiple, device, real)
        uncond = {}
        if req.cfg:
            (u_txt, u_mask, u_extras), = negative
            uncond = dict(uncond_txt=u_txt, uncond_mask=u_mask, guidance_scale=req.guidance_scale,
                          cfg_rescale=req.cfg_rescale, uncond_extras=u_extras or None)
            if reuse_uncond:
                uncond["uncond_velocity"] = _reused_uncond(trajs, chunk).to(device)
        out.append(FlowGRPOMicroBatch(
            x_t=torch.stack([t.latents[j] for t, j in zip(rows, steps)]),
            txt=txt, txt_mask=mask, img_fhw=req.img_fhw, txt_extras=extras or None,
            x_next=torch.stack([t.latents[j + 1] for t, j in zip(rows, steps)]),
            t=t_B, t_next=t_next_B,
            old_log_prob=torch.stack([t.log_probs[j] for t, j in zip(rows, steps)]).to(device),
            advantage=adv_B,
            noise_level=req.noise_level, sigma_1=float(sigmas[chunk[0][0]][1]), sampler=req.sampler,
            log_prob_form=req.log_prob_form, **uncond,
            context=None if req.context_latents is None else
            torch.stack([t.request.context_latents for t in rows]).to(device)))
    return out
