"""What the ratio losses that compare against the old policy's step *mean* share (GRPO-Guard, Flow-DPPO): the old
policy's means μ_old of every trained pair, its megatron ``loss_func`` and its algorithm base.

μ_old is the step mean the rollout's weights give at (x_t, t).  The rollout keeps only log π_old, so a forward-only
pass of megatron's schedule scores every training micro-batch before the first update (``with_old_means``); it
runs while the weights are still the rollout's (the true-CFG uncond outputs kept by the rollout are reused there,
as in the log-prob check), so μ_old is the rollout's mean to rounding.  Under PP the means exist on the last stage,
the only one whose ``loss_func`` runs.

Legend: B pairs of a micro-batch, X the latent elements of one pair ([I, C]).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Callable

import torch

from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO
from megatron_omni.algorithms.flow_grpo.loss import kl_to_reference
from megatron_omni.algorithms.flow_grpo.step import (FlowGRPOMicroBatch, flow_grpo_forward_step, guided_velocity,
                                                     loss_func, reference_mean, step_log_prob)

# (log π_θ [B], log π_old [B], A [B], μ_θ [B, *X], μ_old [B, *X], step std [B], Δ [B], config) -> (L, metrics)
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class OldMeanMicroBatch(FlowGRPOMicroBatch):
    """A FlowGRPO micro-batch with the old policy's step means of its pairs."""

    old_mean: torch.Tensor | None = None  # [B, I, C] float32 μ_old; None on pipeline stages before the last


def with_old_means(run, mbs: list[FlowGRPOMicroBatch]) -> list[OldMeanMicroBatch]:
    """``mbs`` with μ_old from one forward-only pass of the run's forward step (``loss_func``'s non-loss data)."""
    out, _ = run.run_microbatches(mbs, forward_only=True, collect_non_loss_data=True)
    means = [o["mean"] for o in out] if out else [None] * len(mbs)  # [] on stages before the last
    return [OldMeanMicroBatch(**{f.name: getattr(mb, f.name) for f in fields(mb)}, old_mean=mean)
            for mb, mean in zip(mbs, means)]


def old_mean_loss_func(policy_loss: PolicyLoss, mb: OldMeanMicroBatch, config, ref_out: torch.Tensor | None,
                       output: torch.Tensor, non_loss_data: bool = False):
    """megatron ``loss_func`` (flow_grpo.step.loss_func's signature, ``policy_loss`` bound first): L = the policy
    loss + β·KL to the reference (flow_grpo.loss.kl_to_reference, ``config.kl_form``).  ``non_loss_data``: the
    detached log π_θ and μ_θ, as FlowGRPO's."""
    if non_loss_data:
        return loss_func(mb, config, ref_out, output, non_loss_data=True)
    if mb.old_mean is None:
        raise ValueError("this loss compares against the old policy's step means: build the micro-batches with "
                         "megatron_omni.algorithms.old_policy.with_old_means")
    mean_BX, log_prob_B, std_B11 = step_log_prob(guided_velocity(output, mb), mb)
    std_B, dt_B = std_B11.reshape(-1).expand(mean_BX.shape[0]), (mb.t_next - mb.t).float()
    policy, metrics = policy_loss(log_prob_B, mb.old_log_prob, mb.advantage, mean_BX, mb.old_mean, std_B, dt_B,
                                  config)
    loss, kl = policy, torch.zeros((), device=policy.device)
    ref_mean_BX = reference_mean(mb, config, ref_out)  # the inline reference's, or the reference pass's
    if ref_mean_BX is not None:
        kl = kl_to_reference(mean_BX, ref_mean_BX, std_B, dt_B, config.kl_form).mean()
        loss = policy + config.kl_beta * kl
    # clones: megatron scales the returned loss in place, the metrics must keep the unscaled values
    metrics.update(loss=loss.detach().clone(), policy_loss=policy.detach().clone(), kl=kl.detach().clone())
    return loss, metrics


def mean_shift(mean_BX: torch.Tensor, old_mean_BX: torch.Tensor, std_B: torch.Tensor) -> torch.Tensor:
    """[B] mean over elements (μ_θ − μ_old)² / (2 s²): the Gaussian KL between the two steps (shared std s)."""
    if mean_BX.shape != old_mean_BX.shape:
        raise ValueError(f"policy mean {tuple(mean_BX.shape)} and old mean {tuple(old_mean_BX.shape)} differ")
    sq_B = ((mean_BX.float() - old_mean_BX.float()) ** 2).flatten(1).mean(dim=1)
    return sq_B / (2 * std_B.float() ** 2)


def ratio_metrics(log_ratio_B: torch.Tensor, clip_range: float | None = None) -> dict[str, torch.Tensor]:
    """ratio_mean, ratio_std (population), approx_kl = ½·mean Δlog π², and with ``clip_range`` the clip fractions
    above 1 + ε and below 1 − ε (docs/algorithms.md, Metrics)."""
    log_ratio = log_ratio_B.detach().float()
    ratio = torch.exp(log_ratio)
    out = {"ratio_mean": ratio.mean(), "ratio_std": ratio.std(correction=0),
           "approx_kl": 0.5 * (log_ratio ** 2).mean()}
    if clip_range is not None:
        out.update(clipfrac_above=(ratio > 1 + clip_range).float().mean(),
                   clipfrac_below=(ratio < 1 - clip_range).float().mean())
    return out


class OldMeanAlgorithm(FlowGRPO):
    """FlowGRPO's rollouts, advantages, micro-batches and optimizer steps with a loss against μ_old
    (``policy_loss``, given by the subclass); the forward-only pass that gives μ_old runs before training."""

    policy_loss: PolicyLoss  # set as staticmethod(fn)

    def forward_step(self, cfg, reference):
        return flow_grpo_forward_step(self.loss_config(cfg), reference=reference,
                                      reference_pass=self.reference_pass(cfg),
                                      loss=partial(old_mean_loss_func, self.policy_loss))

    def train_microbatches(self, run, trajs, advantages, text) -> list[OldMeanMicroBatch]:
        return with_old_means(run, super().train_microbatches(run, trajs, advantages, text))

    def flops(self, run, trajs, text, check_samples: int | None = None) -> float:
        """FlowGRPO's step plus the old means' forward-only pass over every sample's pairs."""
        old_means = super().flops(run, trajs, text, check_samples=len(trajs)) - super().flops(
            run, trajs, text, check_samples=0)
        return super().flops(run, trajs, text, check_samples) + old_means
