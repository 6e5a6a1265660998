"""DanceGRPO (XueZeyue/DanceGRPO) on the Algorithm interface: FlowGRPO's group advantages and clipped loss, with
the samples of a prompt group sharing one initial noise and each sample trained on a random share of its
stochastic steps (docs/algorithms.md, DanceGRPO).

The sampler is the run's (rollout.sampler; the published method is the Dance-SDE on every step:
``rollout.sampler=dance rollout.window_size=null``); every step the rollout drew stochastically keeps its log-prob,
and the trainer scores each with the formula that drew it.  algorithm.dance_grpo:
- shared_noise: a group's initial noise from one seed (seed, step, draw −3 − group), its steps' noise its own;
- timestep_fraction τ: each sample trains ⌊τ·n⌋ (at least 1) of its n stochastic steps, drawn from its request
  seed (draw −4), so a resumed run trains the same steps.  The log-prob check scores all n in a pass of its own,
  or the trained ones when it is folded into the first optimizer step (FlowGRPO.folded_check_pairs).
Logs ``trained_steps``, the mean trained steps per sample.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO
from megatron_omni.data.prompts import request_seed
from megatron_omni.rollout.engine import Trajectory

GROUP_NOISE_DRAW = -3  # group k's shared initial noise: draw -3 - k (-1 the prompts, -2 MixGRPO's window)
SUBSET_DRAW = -4  # of a request's own seed: its trained steps


def trained_subset(traj: Trajectory, fraction: float) -> Trajectory:
    """``traj`` training only ⌊fraction·n⌋ (>= 1) of its n trained steps, drawn from its request seed; the rollout's
    kept uncond outputs follow their steps."""
    steps = torch.nonzero(traj.trained).flatten()
    count = max(1, int(fraction * len(steps)))
    g = torch.Generator().manual_seed(request_seed(traj.request.seed, 0, SUBSET_DRAW))
    pick = torch.randperm(len(steps), generator=g)[:count].sort().values
    trained = torch.zeros_like(traj.trained)
    trained[steps[pick]] = True
    uncond = None if traj.uncond_velocity is None else traj.uncond_velocity[pick.to(traj.uncond_velocity.device)]
    return replace(traj, trained=trained, uncond_velocity=uncond)


class DanceGRPO(FlowGRPO):
    name = "dance_grpo"

    def requests(self, run, step: int) -> list:
        cfg, requests = run.cfg, super().requests(run, step)
        if not cfg.algorithm.dance_grpo.shared_noise:
            return requests
        # prompt_id is the group's index k in the step (FlowGRPO.requests)
        return [replace(r, noise_seed=request_seed(cfg.train.seed, step, GROUP_NOISE_DRAW - r.prompt_id))
                for r in requests]

    def trained(self, cfg, trajs: list[Trajectory]) -> list[Trajectory]:
        fraction = cfg.algorithm.dance_grpo.timestep_fraction
        return [trained_subset(t, fraction) for t in trajs]

    def train_microbatches(self, run, trajs: list[Trajectory], advantages, text) -> list:
        return super().train_microbatches(run, self.trained(run.cfg, trajs), advantages, text)

    def train(self, run, trajs: list[Trajectory], advantages, text) -> dict[str, float]:
        summary = super().train(run, trajs, advantages, text)
        summary["trained_steps"] = sum(int(t.trained.sum()) for t in self.trained(run.cfg, trajs)) / len(trajs)
        return summary

    def flops(self, run, trajs: list[Trajectory], text, check_samples: int | None = None) -> float:
        """FlowGRPO's count with the trained subset, plus the log-prob check over every stochastic step."""
        check = super().flops(run, trajs, text, check_samples) - super().flops(run, trajs, text, check_samples=0)
        return super().flops(run, self.trained(run.cfg, trajs), text, check_samples=0) + check


ALGORITHM = DanceGRPO()
