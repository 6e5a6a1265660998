"""Group-relative advantages (GRPO / Flow-GRPO): one scalar reward per sample, samples grouped by prompt.

    Â_i = clip((r_i − mean_{g(i)} r) / (std + 1e-4), −A_max, A_max)

std is the std of the whole batch's rewards ("global", flow_grpo's default), of the sample's own group
("group"), or absent ("none": mean-centring only, no division).  Stds are population stds (ddof = 0,
as flow_grpo's ``np.std``).  A group whose rewards are all equal carries no signal: its advantages are
exactly zero, ``zero_std_ratio`` is the fraction of such groups, and ``drop_zero_std`` excludes them
from ``keep``.  Pass the rewards of the whole batch (gathered over data-parallel ranks) so the global
std and the groups are the batch's, not one rank's.  The caller repeats Â_i for every trained step of
sample i's trajectory.  Arithmetic is float64; the advantages are returned as float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STD_MODES = ("global", "group", "none")
STD_EPS = 1e-4


@dataclass
class GroupAdvantages:
    """advantages [N] float32, keep [N] bool (False: sample of a dropped zero-std group),
    zero_std_ratio (fraction of groups whose rewards are all equal), num_groups."""

    advantages: torch.Tensor
    keep: torch.Tensor
    zero_std_ratio: float
    num_groups: int


def _check(rewards_N: torch.Tensor, group_ids_N: torch.Tensor, std: str, clip_max: float) -> None:
    if std not in STD_MODES:
        raise ValueError(f"advantage std mode {std!r} is not one of {STD_MODES}")
    if rewards_N.dim() != 1 or group_ids_N.shape != rewards_N.shape:
        raise ValueError(f"rewards have shape {tuple(rewards_N.shape)} and group ids {tuple(group_ids_N.shape)}; "
                         f"expected two equal shapes [N]")
    if rewards_N.numel() == 0:
        raise ValueError("rewards are empty; expected at least one sample")
    if not torch.isfinite(rewards_N).all():
        raise ValueError(f"rewards contain non-finite values: {rewards_N[~torch.isfinite(rewards_N)].tolist()[:5]}")
    if not clip_max > 0:
        raise ValueError(f"advantage clip A_max must be > 0; got {clip_max!r}")


def group_advantages(rewards_N: torch.Tensor, group_ids_N: torch.Tensor, std: str = "global",
                     clip_max: float = 5.0, drop_zero_std: bool = False) -> GroupAdvantages:
    """Â per sample, grouped by ``group_ids_N`` (prompt ids: any integer labels).  See the module doc."""
    _check(rewards_N, group_ids_N, std, clip_max)
    r_N = rewards_N.detach().to(torch.float64).cpu()
    _, group_N = torch.unique(group_ids_N.detach().cpu(), return_inverse=True)
    num_groups = int(group_N.max()) + 1
    count_G = torch.bincount(group_N, minlength=num_groups).to(torch.float64)
    mean_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_N, r_N) / count_G
    centred_N = r_N - mean_G[group_N]
    var_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_N, centred_N ** 2) / count_G
    # exact equality, not a tolerance: a group is "zero std" when its rewards carry no ordering at all
    r_max_G = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group_N, r_N, "amax")
    r_min_G = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, group_N, r_N, "amin")
    zero_std_G = r_max_G == r_min_G
    centred_N[zero_std_G[group_N]] = 0.0  # exactly zero, whatever rounding the mean had
    if std == "global":
        adv_N = centred_N / (r_N.std(correction=0) + STD_EPS)
    elif std == "group":
        adv_N = centred_N / (var_G.sqrt()[group_N] + STD_EPS)
    else:
        adv_N = centred_N
    keep_N = ~zero_std_G[group_N] if drop_zero_std else torch.ones_like(group_N, dtype=torch.bool)
    return GroupAdvantages(
        advantages=adv_N.clamp(-clip_max, clip_max).to(torch.float32).to(rewards_N.device),
        keep=keep_N.to(rewards_N.device),
        zero_std_ratio=zero_std_G.double().mean().item(),
        num_groups=num_groups,
    )
