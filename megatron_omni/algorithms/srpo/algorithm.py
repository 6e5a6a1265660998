"""SRPO / Direct-Align on the Algorithm interface: ODE rollouts (final samples only, no log-probs), then each
sample noised at a few early timesteps with a kept ε, recovered in one step and scored by a differentiable reward
whose gradient trains the policy (``srpo.loss``; docs/algorithms.md, SRPO).  The loss is the schedule's
``loss_func`` inside megatron-core's forward_backward_func, as every algorithm's.

The trained reward (``reward.name``) must have gradients: its factory offers ``differentiable_scores`` (the reward
registry's differentiable scorer interface); any other is refused when the config is validated.  The task's
``decode`` (latents -> what the reward reads) must be differentiable too (the digits task's is; a VAE pipeline's
uint8 images are not: refused at the first loss); a latent reward (``reads = "latents"``, e.g. ``latent_scorer``)
reads the task's ``latents`` instead, differentiable on any pipeline folder (no VAE in the gradient).  Settings: algorithm.srpo.{timesteps_per_sample,
timestep_range, positive_prompt, negative_prompt, reward_scale}; the rollout's sampler settings are ignored (ODE).
"""
from __future__ import annotations

from collections import Counter

from megatron_omni.algorithms.base import RecordSpec
from megatron_omni.algorithms.clean_samples import ode_requests, rows_flops, text_length, train_steps
from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO
from megatron_omni.algorithms.srpo.loss import SRPOLossConfig
from megatron_omni.algorithms.srpo.step import srpo_forward_step, srpo_microbatches
from megatron_omni.rewards.registry import reads_of
from megatron_omni.rollout.engine import Trajectory


class SRPO(FlowGRPO):
    name = "srpo"

    def loss_config(self, cfg) -> SRPOLossConfig:
        return SRPOLossConfig(reward_scale=cfg.algorithm.srpo.reward_scale)

    def check_config(self, cfg) -> None:
        from megatron_omni.rewards.registry import differentiable_rewards, has_gradient

        self.loss_config(cfg)
        s = cfg.algorithm.srpo
        if not has_gradient(cfg.reward.name):
            raise ValueError(f"srpo: reward.name={cfg.reward.name!r} has no gradient, and SRPO back-propagates the "
                             f"reward; expected a differentiable reward, one of {differentiable_rewards()}")
        lo, hi = s.timestep_range
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"srpo.timestep_range: {list(s.timestep_range)}; expected 0 < lo <= hi <= 1 (t = 1 is "
                             f"pure noise)")
        if s.timesteps_per_sample < 1:
            raise ValueError(f"srpo.timesteps_per_sample: expected >= 1, got {s.timesteps_per_sample}")

    def needs_reference(self, cfg) -> bool:
        return False

    def reuses_uncond(self, cfg) -> bool:
        return False  # the loss runs the conditional velocity only

    def record_spec(self, cfg) -> RecordSpec:
        return RecordSpec(step_latents=False, log_probs=False)

    def forward_step(self, cfg, reference):
        return srpo_forward_step(self.loss_config(cfg))

    def requests(self, run, step: int) -> list:
        return ode_requests(super().requests(run, step))

    def check(self, run, trajs: list[Trajectory], text) -> dict[str, float]:
        return {}  # ODE rollouts: no log-probs to compare

    def train(self, run, trajs: list[Trajectory], advantages, text) -> dict[str, float]:
        """Optimizer steps over the rows; the group advantages are not used (the reward's gradient is)."""
        cfg, s = run.cfg, run.cfg.algorithm.srpo
        scorer = run.rewards.reward_fns["reward"]
        # what the reward reads: the task's images, or its latent images (a latent reward: no VAE in the gradient)
        decode = run.task.latents if reads_of(scorer) == "latents" else run.task.decode

        def reward(x0_hat_BIC, prompts):
            return scorer.differentiable_scores(decode(x0_hat_BIC), prompts)

        mbs = srpo_microbatches(trajs, text, reward, timesteps=s.timesteps_per_sample,
                                t_range=tuple(s.timestep_range), positive=s.positive_prompt,
                                negative=s.negative_prompt, size=cfg.train.micro_batch_size,
                                text_pad_multiple=cfg.rollout.text_pad_multiple)
        return train_steps(run, mbs)

    def flops(self, run, trajs: list[Trajectory], text) -> float:
        """The ODE rollout and the rows' forward + backward (the reward's own backward is not the DiT's)."""
        rows = Counter()
        for t in trajs:
            rows[text_length(text, t.request.prompt, run.cfg.rollout.text_pad_multiple)] += \
                run.cfg.algorithm.srpo.timesteps_per_sample
        return rows_flops(run, trajs, text, train_rows=rows)


ALGORITHM = SRPO()
