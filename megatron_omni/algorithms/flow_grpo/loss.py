"""The Flow-GRPO clipped policy loss and its KL term to a reference policy, per trained step.

For B (sample, trained step) pairs with log-probs log π_θ, log π_old [B] and advantages A [B]:
    ρ = exp(log π_θ − log π_old)
    L_policy = mean_B max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))
    L = L_policy + β·KL
with the KL to the reference policy (frozen base, or adapters disabled for LoRA) of the SDE means:
    kl_form="flow_grpo": KL_i = mean over elements (μ_θ − μ_ref)² / (2σ_t²)      (flow_grpo's recipe)
    kl_form="exact":     KL_i = mean over elements (μ_θ − μ_ref)² / (2σ_t²·(−Δ))  (the Gaussian KL of the
                         two transitions, whose variance is σ_t²·(−Δ); per element, hence averaged)
    KL = mean_B KL_i.
σ_t is the SDE's noise scale and Δ = t' − t < 0; both forms take the step std that
``megatron_omni.rollout.samplers.step_mean_std`` returns for the step's sampler kind, plus Δ.  "exact" is the
Gaussian KL of the two transitions for every kind; "flow_grpo" is flow_grpo's SDE formula (its σ_t² = std²/(−Δ),
which for the SDE and Dance-SDE is the noise scale squared).  Log-probs are per-element means
(``samplers.log_prob``), which is why ε is tiny (1e-4, 1e-5 for large DiTs).

Metrics (detached float32 scalars): loss, policy_loss, kl, ratio_mean, ratio_std (population),
clipfrac_above (ρ > 1 + ε), clipfrac_below (ρ < 1 − ε), approx_kl = ½·mean (log π_θ − log π_old)².
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KL_FORMS = ("flow_grpo", "exact")


@dataclass
class FlowGRPOLossConfig:
    clip_range: float  # ε (the run config's algorithm.clip_range holds the default)
    kl_beta: float = 0.0  # β; 0 disables the KL term and the reference forward it needs
    kl_form: str = "flow_grpo"  # see the module docstring

    def __post_init__(self):
        if not 0 < self.clip_range < 1:
            raise ValueError(f"clip_range must be > 0 and < 1; got {self.clip_range!r}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0; got {self.kl_beta!r}")
        if self.kl_form not in KL_FORMS:
            raise ValueError(f"kl_form {self.kl_form!r} is not one of {KL_FORMS}")


def _per_sample(value: torch.Tensor, b: int, name: str) -> torch.Tensor:
    """A scalar, [B] or [B, 1, ..., 1] tensor as float32 [B]."""
    flat = torch.as_tensor(value).float().reshape(-1)
    if flat.numel() not in (1, b):
        raise ValueError(f"{name} has shape {tuple(torch.as_tensor(value).shape)}; expected a scalar or {b} values")
    return flat.expand(b)


def kl_to_reference(mean_BX: torch.Tensor, ref_mean_BX: torch.Tensor, std_B: torch.Tensor, dt_B: torch.Tensor,
                    form: str = "flow_grpo") -> torch.Tensor:
    """Per-sample KL_i [B] from the step std s = σ_t·sqrt(−Δ) and Δ:
    "flow_grpo": mean (μ_θ − μ_ref)² / (2σ_t²) = mean (μ_θ − μ_ref)²·(−Δ) / (2s²);
    "exact":     mean (μ_θ − μ_ref)² / (2σ_t²·(−Δ)) = mean (μ_θ − μ_ref)² / (2s²)."""
    if form not in KL_FORMS:
        raise ValueError(f"kl_form {form!r} is not one of {KL_FORMS}")
    if mean_BX.shape != ref_mean_BX.shape:
        raise ValueError(f"policy mean {tuple(mean_BX.shape)} and reference mean {tuple(ref_mean_BX.shape)} differ")
    b = mean_BX.shape[0]
    var_B = _per_sample(std_B, b, "std") ** 2  # σ_t²·(−Δ)
    if form == "flow_grpo":
        var_B = var_B / -_per_sample(dt_B, b, "dt")  # σ_t²
    sq_B = ((mean_BX.float() - ref_mean_BX.float()) ** 2).flatten(1).mean(dim=1)
    return sq_B / (2 * var_B)


def _check_batch(log_prob_B, old_log_prob_B, advantages_B) -> None:
    shapes = [tuple(t.shape) for t in (log_prob_B, old_log_prob_B, advantages_B)]
    if len(shapes[0]) != 1 or len(set(shapes)) != 1:
        raise ValueError(f"log_prob, old_log_prob and advantages have shapes {shapes}; expected three equal [B]")


def flow_grpo_loss(log_prob_B: torch.Tensor, old_log_prob_B: torch.Tensor, advantages_B: torch.Tensor,
                   config: FlowGRPOLossConfig, mean_BX: torch.Tensor | None = None,
                   ref_mean_BX: torch.Tensor | None = None, std_B: torch.Tensor | None = None,
                   dt_B: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, metrics) for one batch of (sample, trained step) pairs.  The KL term needs the policy's and the
    reference's SDE means, the step std σ_t·sqrt(−Δ) and Δ; it is computed (and logged) whenever they are
    all given, and added to L when ``config.kl_beta > 0``."""
    _check_batch(log_prob_B, old_log_prob_B, advantages_B)
    kl_inputs = {"mean_BX": mean_BX, "ref_mean_BX": ref_mean_BX, "std_B": std_B, "dt_B": dt_B}
    kl_B = None
    if all(v is not None for v in kl_inputs.values()):
        kl_B = kl_to_reference(mean_BX, ref_mean_BX, std_B, dt_B, config.kl_form)
    eps = config.clip_range
    log_ratio_B = log_prob_B.float() - old_log_prob_B.float()
    ratio_B = torch.exp(log_ratio_B)
    adv_B = advantages_B.float()
    policy_loss = torch.maximum(-adv_B * ratio_B, -adv_B * torch.clamp(ratio_B, 1 - eps, 1 + eps)).mean()
    if config.kl_beta > 0:
        if kl_B is None:
            missing = [k for k, v in kl_inputs.items() if v is None]
            raise ValueError(f"kl_beta={config.kl_beta} needs mean_BX, ref_mean_BX, std_B and dt_B for the KL "
                             f"term; missing {missing}")
        kl = kl_B.float().mean()
        loss = policy_loss + config.kl_beta * kl
    else:
        kl = torch.zeros((), device=policy_loss.device) if kl_B is None else kl_B.float().mean()
        loss = policy_loss
    with torch.no_grad():
        ratio = ratio_B.detach()
        # clone: megatron scales the returned loss in place, the metric must keep the unscaled value
        metrics = {
            "loss": loss.detach().clone(),
            "policy_loss": policy_loss.detach().clone(),
            "kl": kl.detach().clone(),
            "ratio_mean": ratio.mean(),
            "ratio_std": ratio.std(correction=0),
            "clipfrac_above": (ratio > 1 + eps).float().mean(),
            "clipfrac_below": (ratio < 1 - eps).float().mean(),
            "approx_kl": 0.5 * (log_ratio_B.detach() ** 2).mean(),
        }
    return loss, metrics
