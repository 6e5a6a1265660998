"""The DiffusionNFT loss (docs/algorithms.md, DiffusionNFT): flow matching on the rollout's clean samples toward an
implicit positive policy and away from an implicit negative one, both defined against the old policy.

Per training row i (a clean sample x0 noised to x_t at t) with advantage Â_i, the policy's velocity v_θ and the old
policy's v_old:
    r_i = ½ + ½·clip(Â_i / A_max, −1, 1)                    (the sample's optimality, in [0, 1])
    v⁺ = β·v_θ + (1 − β)·v_old;   v⁻ = (1 + β)·v_old − β·v_θ
    x̂0^± = x_t − t·v^±;   w_i^± = max(mean |x̂0^± − x0|, 1e-5), detached
    L = A_max · mean_i [ r_i·mean (x̂0⁺ − x0)² / w_i⁺ + (1 − r_i)·mean (x̂0⁻ − x0)² / w_i⁻ ] / β
        (+ λ·mean_i mean (v_θ − v_ref)², the flow-matching term to the reference, when λ > 0)
A sample better than its group's mean pulls v_θ so that v⁺ reconstructs it, a worse one so that v⁻ does.

Metrics: loss, policy_loss, ref_loss, positive_loss and negative_loss (the two weighted terms, mean over rows),
optimality (mean r).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_FLOOR = 1e-5


@dataclass
class NFTLossConfig:
    beta: float = 0.5  # β of the implicit policies
    adv_clip_max: float = 5.0  # A_max (the run config's algorithm.adv_clip_max)
    ref_weight: float = 0.0  # λ; 0 = no reference term (and no reference forward)

    def __post_init__(self):
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta must be in (0, 1]; got {self.beta!r}")
        if not self.adv_clip_max > 0:
            raise ValueError(f"adv_clip_max must be > 0; got {self.adv_clip_max!r}")
        if self.ref_weight < 0:
            raise ValueError(f"ref_weight must be >= 0; got {self.ref_weight!r}")


def _per_row(x_BX: torch.Tensor) -> torch.Tensor:
    return x_BX.flatten(1).mean(dim=1)


def diffusion_nft_loss(v_BX: torch.Tensor, old_v_BX: torch.Tensor, x_t_BX: torch.Tensor, x0_BX: torch.Tensor,
                       t_B: torch.Tensor, advantages_B: torch.Tensor, config: NFTLossConfig,
                       ref_v_BX: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, metrics) of the module docstring, float32."""
    v, old_v, x_t, x0 = v_BX.float(), old_v_BX.float().detach(), x_t_BX.float(), x0_BX.float()
    t = t_B.float().view(-1, *([1] * (v.dim() - 1)))
    beta, a_max = config.beta, config.adv_clip_max
    r_B = 0.5 + 0.5 * torch.clamp(advantages_B.float() / a_max, -1, 1)
    x0_pos = x_t - t * (beta * v + (1 - beta) * old_v)
    x0_neg = x_t - t * ((1 + beta) * old_v - beta * v)
    w_pos = _per_row((x0_pos - x0).abs()).detach().clamp_min(WEIGHT_FLOOR)
    w_neg = _per_row((x0_neg - x0).abs()).detach().clamp_min(WEIGHT_FLOOR)
    pos_B = r_B * _per_row((x0_pos - x0) ** 2) / w_pos
    neg_B = (1 - r_B) * _per_row((x0_neg - x0) ** 2) / w_neg
    policy = a_max * (pos_B + neg_B).mean() / beta
    ref = torch.zeros((), device=policy.device)
    if config.ref_weight > 0:
        if ref_v_BX is None:
            raise ValueError(f"ref_weight={config.ref_weight} needs the reference's velocity ref_v_BX")
        ref = _per_row((v - ref_v_BX.float().detach()) ** 2).mean()
    loss = policy + config.ref_weight * ref
    with torch.no_grad():
        metrics = {"loss": loss.detach().clone(), "policy_loss": policy.detach().clone(),  # clones: megatron scales
                   "ref_loss": ref.detach().clone(), "positive_loss": pos_B.detach().mean(),  # the loss in place
                   "negative_loss": neg_B.detach().mean(), "optimality": r_B.mean()}
    return loss, metrics
