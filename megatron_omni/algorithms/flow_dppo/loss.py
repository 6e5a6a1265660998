"""The Flow-DPPO loss: the unclipped ratio objective with a trust region from the exact Gaussian KL of each step
to the old policy's (docs/algorithms.md, Flow-DPPO).

Per (sample, trained step) pair i with step std s_i (both policies' steps share it):
    D_i = mean over elements (μ_θ − μ_old)² / (2 s_i²)          the KL of the two Gaussian steps, per element
    ρ_i = exp(log π_θ − log π_old)
    masked_i = D_i ≥ τ  and  ((ρ_i > 1 and A_i > 0) or (ρ_i < 1 and A_i < 0))   (it would move further away)
    L = mean_i (1 − masked_i)·(−A_i·ρ_i)
Nothing is clipped: a pair inside the trust region, or one that moves back toward the old policy, keeps its whole
gradient; a masked pair none.  τ = ``kl_threshold`` (algorithm.flow_dppo.kl_threshold, 1e-5).

Metrics: ratio_mean, ratio_std, approx_kl, masked_frac (masked pairs), old_kl = mean_i D_i.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_omni.algorithms.flow_grpo.loss import KL_FORMS
from megatron_omni.algorithms.old_policy import mean_shift, ratio_metrics


@dataclass
class FlowDPPOLossConfig:
    kl_threshold: float  # τ (the run config's algorithm.flow_dppo.kl_threshold holds the default)
    kl_beta: float = 0.0  # β of the optional KL to the reference (flow_grpo.loss.kl_to_reference)
    kl_form: str = "flow_grpo"

    def __post_init__(self):
        if not self.kl_threshold > 0:
            raise ValueError(f"kl_threshold must be > 0; got {self.kl_threshold!r}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0; got {self.kl_beta!r}")
        if self.kl_form not in KL_FORMS:
            raise ValueError(f"kl_form {self.kl_form!r} is not one of {KL_FORMS}")


def flow_dppo_loss(log_prob_B: torch.Tensor, old_log_prob_B: torch.Tensor, advantages_B: torch.Tensor,
                   mean_BX: torch.Tensor, old_mean_BX: torch.Tensor, std_B: torch.Tensor, dt_B: torch.Tensor,
                   config: FlowDPPOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, metrics) of the module docstring (``dt_B`` is unused: the KL needs only the step std)."""
    log_ratio_B = log_prob_B.float() - old_log_prob_B.float()
    ratio_B, adv_B = torch.exp(log_ratio_B), advantages_B.float()
    with torch.no_grad():
        kl_B = mean_shift(mean_BX, old_mean_BX, std_B)
        away_B = ((ratio_B > 1) & (adv_B > 0)) | ((ratio_B < 1) & (adv_B < 0))
        masked_B = (kl_B >= config.kl_threshold) & away_B
    loss = (torch.where(masked_B, 0.0, -adv_B * ratio_B)).mean()
    with torch.no_grad():
        metrics = ratio_metrics(log_ratio_B)
        metrics.update(masked_frac=masked_B.float().mean(), old_kl=kl_B.mean())
    return loss, metrics
