"""The SRPO / Direct-Align loss (docs/algorithms.md, SRPO): not a policy gradient, the reward's own gradient.

A clean sample x0 (the rollout's final sample) is noised with a kept ε to x_t = (1 − t)·x0 + t·ε at an early
(noisy) t; the policy recovers it in one step, x̂0 = x_t − t·v_θ(x_t, t), and a differentiable reward scores x̂0
in its semantic-relative form, conditioned on a positive and a negative prompt:
    r_i = r(x̂0_i | positive_i) − r(x̂0_i | negative_i)        (no negative prompt: r(x̂0_i | positive_i))
    L = −scale · mean_i r_i
The gradient reaches θ through x̂0 only: dL/dv_i = scale · t_i · ∂r_i/∂x̂0_i / B.

Metrics: loss, srpo_reward (mean r(x̂0 | positive)), srpo_negative (mean r(x̂0 | negative); 0 without one),
srpo_relative (mean r_i), recovery_mse (mean (x̂0 − x0)², how far one step lands from the sample it noised).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# x̂0 [B, I, C] float32, B prompts -> [B] reward with gradients in x̂0 (the task's decode, then the reward's scorer)
DifferentiableReward = Callable[[torch.Tensor, Sequence[str]], torch.Tensor]


@dataclass
class SRPOLossConfig:
    reward_scale: float = 1.0  # the loss is −scale·mean r

    def __post_init__(self):
        if not self.reward_scale > 0:
            raise ValueError(f"reward_scale must be > 0; got {self.reward_scale!r}")


def recovered_x0(x_t_BX: torch.Tensor, v_BX: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    """x̂0 = x_t − t·v, float32, t per row."""
    t = t_B.float().view(-1, *([1] * (v_BX.dim() - 1)))
    return x_t_BX.float() - t * v_BX.float()


def srpo_loss(v_BX: torch.Tensor, x_t_BX: torch.Tensor, x0_BX: torch.Tensor, t_B: torch.Tensor,
              reward: DifferentiableReward, positive: Sequence[str], negative: Sequence[str] | None,
              config: SRPOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, metrics) of the module docstring; ``negative`` None: no negative term."""
    x0_hat = recovered_x0(x_t_BX, v_BX, t_B)
    pos_B = reward(x0_hat, positive).float()
    if pos_B.shape != (x0_hat.shape[0],):
        raise ValueError(f"the differentiable reward returned shape {tuple(pos_B.shape)} for {x0_hat.shape[0]} rows; "
                         f"expected ({x0_hat.shape[0]},)")
    if v_BX.requires_grad and not pos_B.requires_grad:
        raise ValueError("the reward's score has no gradient in x̂0 (it left autograd, e.g. through numpy or "
                         "no_grad); SRPO back-propagates it: expected a differentiable scorer")
    neg_B = reward(x0_hat, negative).float() if negative is not None else torch.zeros_like(pos_B)
    relative_B = pos_B - neg_B
    loss = -config.reward_scale * relative_B.mean()
    with torch.no_grad():
        metrics = {"loss": loss.detach().clone(),  # clone: megatron scales the returned loss in place
                   "srpo_reward": pos_B.detach().mean(), "srpo_negative": neg_B.detach().mean(),
                   "srpo_relative": relative_B.detach().mean(),
                   "recovery_mse": (x0_hat.detach() - x0_BX.float()).pow(2).mean()}
    return loss, metrics
