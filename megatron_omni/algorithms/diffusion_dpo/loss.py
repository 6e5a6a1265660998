"""The online Diffusion-DPO loss for flow matching (docs/algorithms.md, Diffusion-DPO).

A pair is the best (w) and the worst (l) sample of one prompt group, noised with one ε at one t:
x_t = (1 − t)·x0 + t·ε, whose flow-matching target is ε − x0.  With the per-sample error e = mean over elements
‖v(x_t, t) − (ε − x0)‖² of the policy (θ) and the reference (the initial policy):
    L = −log σ(−½·β·[(e_w − e_w^ref) − (e_l − e_l^ref)])
averaged over the pairs.  It lowers the winner's error relative to the reference and raises the loser's.

Metrics: loss, dpo_accuracy (pairs whose implicit margin −½β[...] > 0), dpo_margin (its mean), err_winner,
err_loser (the policy's e), err_winner_ref, err_loser_ref.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def flow_matching_error(v_BX: torch.Tensor, target_BX: torch.Tensor) -> torch.Tensor:
    """[B] mean over elements (v − target)², in float32."""
    return (v_BX.float() - target_BX.float()).pow(2).flatten(1).mean(dim=1)


def diffusion_dpo_loss(err_2B: torch.Tensor, ref_err_2B: torch.Tensor,
                       beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, metrics) for B pairs; ``err_2B`` / ``ref_err_2B``: e of the winners, then of the losers ([2B])."""
    if err_2B.dim() != 1 or err_2B.shape != ref_err_2B.shape or err_2B.shape[0] % 2:
        raise ValueError(f"errors of shapes {tuple(err_2B.shape)} and {tuple(ref_err_2B.shape)}; expected two equal "
                         f"[2B] (winners, then losers)")
    e_w, e_l = err_2B.float().chunk(2)
    r_w, r_l = ref_err_2B.float().detach().chunk(2)
    margin_B = -0.5 * beta * ((e_w - r_w) - (e_l - r_l))
    loss = -F.logsigmoid(margin_B).mean()
    with torch.no_grad():
        metrics = {"loss": loss.detach().clone(),  # clone: megatron scales the returned loss in place
                   "dpo_accuracy": (margin_B > 0).float().mean(), "dpo_margin": margin_B.detach().mean(),
                   "err_winner": e_w.detach().mean(), "err_loser": e_l.detach().mean(),
                   "err_winner_ref": r_w.mean(), "err_loser_ref": r_l.mean()}
    return loss, metrics
