"""MixGRPO (Tencent-Hunyuan/MixGRPO) on the Algorithm interface: ODE steps outside an SDE window of
rollout.window_size steps, only the window's steps recorded with log-probs and trained, and the window moving over
training (docs/algorithms.md, MixGRPO).  Everything else is FlowGRPO's (advantages, clipped loss, micro-batches).

Window starts lie in rollout.window_range (default: every start that fits), lo..hi.  algorithm.mix_grpo:
- window_mode "progressive": at RL step k the start is lo + (⌊k / period⌋·stride mod (hi − lo + 1)), early
  (noisy) steps first, back to lo past hi;
- window_mode "random": drawn uniformly in lo..hi at each RL step from its own seed (seed, step, draw −2);
- shared (default true): one start for every sample of the step; false (random only): each sample draws its own
  from its request seed, FlowGRPO's per-sample windows.
The trajectories carry their window, so a resumed run draws the same windows as an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO
from megatron_omni.data.prompts import request_seed

WINDOW_DRAW = -2  # the draw index of a step's shared random window (-1 is the step's prompt draw)


def window_start(mode: str, step: int, start_range: tuple[int, int], stride: int = 1, period: int = 1,
                 seed: int = 0) -> int:
    """The SDE window's start at RL step ``step`` (module docstring) inside the inclusive ``start_range``."""
    lo, hi = start_range
    if mode == "progressive":
        return lo + (step // period * stride) % (hi - lo + 1)
    if mode == "random":
        g = torch.Generator().manual_seed(request_seed(seed, step, WINDOW_DRAW))
        return int(torch.randint(lo, hi + 1, (1,), generator=g).item())
    raise ValueError(f"window mode {mode!r}; expected 'progressive' or 'random'")


class MixGRPO(FlowGRPO):
    name = "mix_grpo"

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        if cfg.rollout.window_size is None:
            raise ValueError("mix_grpo: trains an SDE window of rollout.window_size steps, which is unset (every "
                             "step would be SDE); expected rollout.window_size=W with 1 <= W <= rollout.num_steps")

    def shared_start(self, cfg, step: int) -> int | None:
        """The start every sample of RL step ``step`` shares; None when each sample draws its own."""
        m, r = cfg.algorithm.mix_grpo, cfg.rollout
        if not m.shared:
            return None
        start_range = tuple(r.window_range) if r.window_range is not None else (0, r.num_steps - r.window_size)
        return window_start(m.window_mode, step, start_range, m.stride, m.period, cfg.train.seed)

    def requests(self, run, step: int) -> list:
        start = self.shared_start(run.cfg, step)
        requests = super().requests(run, step)
        return requests if start is None else [replace(req, window_start=start) for req in requests]

    def train(self, run, trajs: list, advantages, text) -> dict[str, float]:
        summary = super().train(run, trajs, advantages, text)
        summary["window_start"] = sum(t.window_start for t in trajs) / len(trajs)  # mean over samples
        return summary


ALGORITHM = MixGRPO()
