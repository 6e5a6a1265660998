"""What the algorithms that train on the rollout's final (clean) samples share (Diffusion-DPO, DiffusionNFT): the
noised sample x_t = (1 − t)·x0 + t·ε with its flow-matching target ε − x0, seeded per sample and draw, the ODE
rollout requests and the tensors of a micro-batch of such rows, the FLOPs of a step counted row by row at each
row's text length, and the optimizer steps over their micro-batches.

Legend: I image tokens, C packed channels.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from megatron_omni.algorithms.flow_grpo.microbatches import _text_rows
from megatron_omni.data.prompts import request_seed
from megatron_omni.data.text_layout import padded_length
from megatron_omni.rollout.engine import Trajectory
from megatron_omni.trainer.mfu import forward_flops, lora_forward_flops, step_flops


def sample_generator(traj: Trajectory, draw: int) -> torch.Generator:
    """A generator of draw ``draw`` of ``traj``'s request seed: a resumed run draws the same numbers."""
    return torch.Generator().manual_seed(request_seed(traj.request.seed, 0, draw))


def noised(x0_BX: torch.Tensor, eps_BX: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε (rectified flow, docs/algorithms.md), t per row."""
    t_B1 = t_B.view(-1, *([1] * (x0_BX.dim() - 1)))
    return (1 - t_B1) * x0_BX + t_B1 * eps_BX


def ode_requests(requests: list) -> list:
    """The requests as ODE rollouts: final samples only, no SDE window, no log-prob form (a CPS recipe's "simple"
    belongs to its SDE steps and is refused for ODE)."""
    return [replace(r, sampler="ode", window_size=None, window_range=None, log_prob_form="gaussian")
            for r in requests]


def row_tensors(trajs: list[Trajectory], chunk: list[tuple], text, text_pad_multiple: int) -> tuple:
    """One micro-batch's rows (sample index, t, ε [I, C]) as (samples, x0 [B, I, C] float32, ε [B, I, C], t [B],
    (text [B, T, E], mask, extras)) on the samples' device, text laid out as the rollout engine lays it out."""
    samples = [trajs[i] for i, _, _ in chunk]
    device = samples[0].latents.device
    x0 = torch.stack([s.final_sample.float() for s in samples])
    eps = torch.stack([e for _, _, e in chunk]).to(device)
    t = torch.tensor([t for _, t, _ in chunk], device=device)
    (text_rows,) = _text_rows(samples, text, False, text_pad_multiple, device)
    return samples, x0, eps, t, text_rows


def rows_flops(run, trajs: list[Trajectory], text, train_rows: Counter, forward_rows: Counter | None = None,
               reference_rows: Counter | None = None) -> float:
    """FLOPs of the rollout's forwards (cond and, with CFG, uncond rows per step) plus the given rows (text length ->
    count): ``train_rows`` forward + backward, ``forward_rows`` forward only, ``reference_rows`` the reference's
    forwards (the base alone with LoRA)."""
    cfg = run.cfg
    arch, fhw = cfg.model.arch, run.task.img_fhw
    image_tokens = fhw[0] * fhw[1] * fhw[2]
    forward, reference = Counter(forward_rows or {}), Counter(reference_rows or {})
    for t in trajs:
        forward[text_length(text, t.request.prompt, cfg.rollout.text_pad_multiple)] += cfg.rollout.num_steps
        if t.request.cfg:
            forward[text_length(text, t.request.negative_prompt, cfg.rollout.text_pad_multiple)] += \
                cfg.rollout.num_steps
    return sum(step_flops(forward_flops(arch, 1, image_tokens, n), forward[n], 0, train_rows[n],
                          frozen_base=cfg.lora.rank > 0, reference_rows=reference[n],
                          adapter_flops_per_row=lora_forward_flops(arch, cfg.lora.rank, cfg.lora_targets, 1,
                                                                   image_tokens, n))
               for n in forward.keys() | train_rows.keys() | reference.keys())


def train_steps(run, mbs: list) -> dict[str, float]:
    """Optimizer steps over ``mbs``, ``train.global_batch_size // train.micro_batch_size`` micro-batches each: the
    loss metrics' means, grad_norm (mean over the steps) and optimizer_steps."""
    t = run.cfg.train
    per_opt_step = max(1, t.global_batch_size // t.micro_batch_size)
    metrics, norms = [], []
    for k in range(0, len(mbs), per_opt_step):
        out, grad_norm = run.run_microbatches(mbs[k:k + per_opt_step])
        metrics += out
        norms.append(float(grad_norm))
    summary = {key: torch.stack([m[key].float() for m in metrics]).mean().item() for key in metrics[0]} \
        if metrics else {}  # metrics exist on the last pipeline stage only
    summary.update(grad_norm=sum(norms) / len(norms), optimizer_steps=len(norms))
    return summary


def text_length(text, prompt: str, multiple: int) -> int:
    """The prompt's text length as the engine and the trainer lay it out (real tokens, padded to ``multiple``)."""
    emb, mask = text[prompt][:2]  # (a family's text extras, SD3's pooled text, may follow)
    return padded_length([emb.shape[0] if mask is None else int(mask.sum())], multiple)
