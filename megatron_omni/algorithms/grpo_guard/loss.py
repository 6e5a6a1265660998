"""The GRPO-Guard loss: FlowGRPO's clipped ratio with the ratio's mean bias removed and each step's gradient
reweighted (docs/algorithms.md, GRPO-Guard).

Between two Gaussians of one std s the log-ratio of a drawn x_t' has a mean that depends on how far the means
moved, −mean (μ_θ − μ_old)² / (2s²), and a scale ∝ 1/s that differs from step to step; GRPO-Guard adds the bias
back and multiplies by s before the exponential, and divides the step's loss by (−Δ) to even out the steps'
gradient sizes.  Per (sample, trained step) pair i with step std s_i = σ_t·sqrt(−Δ_i):
    b_i = mean over elements (μ_θ − μ_old)² / (2 s_i²)
    ρ_i = exp((log π_θ − log π_old + b_i)·s_i)
    L = mean_i max(−A_i·ρ_i, −A_i·clip(ρ_i, 1 − ε, 1 + ε)) / (−Δ_i)
The reference implementation trains one timestep at a time and writes s = mean(σ_t)·mean(sqrt(−Δ)) and the
weight 1 / mean(sqrt(−Δ))² over that batch; our micro-batches mix timesteps, so the means are taken per pair
(equal to the batch means when the pairs share t).

Metrics: ratio_mean, ratio_std, clipfrac_above, clipfrac_below of the corrected ρ; approx_kl = ½·mean
(log π_θ − log π_old)²; mean_bias = mean_i b_i.
"""
from __future__ import annotations

import torch

from megatron_omni.algorithms.flow_grpo.loss import FlowGRPOLossConfig
from megatron_omni.algorithms.old_policy import mean_shift, ratio_metrics


def grpo_guard_loss(log_prob_B: torch.Tensor, old_log_prob_B: torch.Tensor, advantages_B: torch.Tensor,
                    mean_BX: torch.Tensor, old_mean_BX: torch.Tensor, std_B: torch.Tensor, dt_B: torch.Tensor,
                    config: FlowGRPOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, metrics) of the module docstring; ε = ``config.clip_range``."""
    bias_B = mean_shift(mean_BX, old_mean_BX, std_B)
    log_ratio_B = log_prob_B.float() - old_log_prob_B.float()
    log_rho_B = (log_ratio_B + bias_B) * std_B.float()
    rho_B, adv_B, eps = torch.exp(log_rho_B), advantages_B.float(), config.clip_range
    clipped_B = torch.maximum(-adv_B * rho_B, -adv_B * torch.clamp(rho_B, 1 - eps, 1 + eps))
    loss = (clipped_B / -dt_B.float()).mean()
    with torch.no_grad():
        metrics = ratio_metrics(log_rho_B, eps)
        metrics.update(approx_kl=0.5 * (log_ratio_B.detach() ** 2).mean(), mean_bias=bias_B.detach().mean())
    return loss, metrics
