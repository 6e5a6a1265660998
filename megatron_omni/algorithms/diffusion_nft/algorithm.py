"""DiffusionNFT on the Algorithm interface: ODE rollouts (no log-probs; final samples only), FlowGRPO's group
advantages, and the negative-aware flow-matching loss of ``diffusion_nft.loss`` on each sample's clean x0 noised at
a few of the schedule's timesteps, against the old policy (docs/algorithms.md, DiffusionNFT).

The old policy (``old_policy``) is the rollout's weights ("copy", refreshed every RL step) or an EMA of the weights
("ema": megatron_omni.algorithms.ema_policy, ``Run.algorithm_state``, updated after each RL step and checkpointed);
its velocities come from one forward-only pass before the step's first update (the EMA swapped in for it), so they
stay fixed through every optimizer step of the RL step.  The reference term (ref_weight > 0; the reference is the
initial policy) runs inline in each training forward at PP = 1; under PP its velocities come from a forward-only pass
of their own with the reference's weights on every chunk (``reference_weights``: LoRA's adapters off, full
fine-tune's initial weights swapped in), after the old policy's.  The rollout samples with the ODE whatever
rollout.sampler / noise_level / window say (those are the SDE algorithms'), so the step's reward_mean is already the
ODE policy's reward.  Settings: algorithm.diffusion_nft.{beta,
timesteps_per_sample, ref_weight, old_policy, ema_decay}; algorithm.adv_std / adv_clip_max (A_max) as FlowGRPO's.
"""
from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass

from megatron_omni.algorithms.base import RecordSpec
from megatron_omni.algorithms.clean_samples import ode_requests, rows_flops, text_length, train_steps
from megatron_omni.algorithms.diffusion_nft.loss import NFTLossConfig
from megatron_omni.algorithms.diffusion_nft.step import (nft_forward_step, nft_microbatches, with_old_velocity,
                                                         with_reference_velocity)
from megatron_omni.algorithms.ema_policy import EMAPolicy
from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO, InitialWeights
from megatron_omni.rollout.engine import Trajectory


@dataclass
class NFTState:
    """DiffusionNFT's state between RL steps (``Run.algorithm_state``): the EMA old policy (``old_policy: ema``) and
    the reference pass's initial weights (full fine-tune, ref_weight > 0, PP > 1), either None.  Checkpointed as
    their entries side by side: the EMA's ShardedTensors, and the initial weights' none (``InitialWeights``)."""
    ema: EMAPolicy | None = None
    initial: InitialWeights | None = None

    def sharded_state_dict(self, model_sd: dict) -> dict:
        return {k: v for part in (self.ema, self.initial) if part is not None
                for k, v in part.sharded_state_dict(model_sd).items()}

    def load(self, loaded: dict) -> None:
        for part in (self.ema, self.initial):
            if part is not None:
                part.load(loaded)


class DiffusionNFT(FlowGRPO):
    name = "diffusion_nft"

    def loss_config(self, cfg) -> NFTLossConfig:
        n = cfg.algorithm.diffusion_nft
        return NFTLossConfig(beta=n.beta, adv_clip_max=cfg.algorithm.adv_clip_max, ref_weight=n.ref_weight)

    def check_config(self, cfg) -> None:
        self.loss_config(cfg)
        n = cfg.algorithm.diffusion_nft
        if not 1 <= n.timesteps_per_sample <= cfg.rollout.num_steps:
            raise ValueError(f"diffusion_nft.timesteps_per_sample: {n.timesteps_per_sample} is outside "
                             f"1..rollout.num_steps={cfg.rollout.num_steps}")
        if not 0 <= n.ema_decay < 1:
            raise ValueError(f"diffusion_nft.ema_decay: {n.ema_decay} is outside [0, 1) (0: the last update's weights)")

    def needs_reference(self, cfg) -> bool:
        """An inline reference forward: the reference term on a whole model (PP = 1)."""
        return cfg.algorithm.diffusion_nft.ref_weight > 0 and not self.reference_pass(cfg)

    def reference_pass(self, cfg) -> bool:
        """Whether v_ref comes from a forward-only pass of its own (``with_reference_velocity``): the reference term
        under PP, where a stage cannot run the reference's chunk inline on the policy's hidden state."""
        return cfg.algorithm.diffusion_nft.ref_weight > 0 and cfg.parallel.pp > 1

    def build_state(self, cfg, policy) -> NFTState | None:
        """The EMA old policy (``old_policy: ema``) and, for the reference pass under full fine-tuning, the initial
        weights; None when neither."""
        n, modules = cfg.algorithm.diffusion_nft, policy.modules or [policy.module]
        state = NFTState(ema=EMAPolicy(modules, n.ema_decay) if n.old_policy == "ema" else None,
                         initial=InitialWeights(modules) if self.reference_pass(cfg) and cfg.lora.rank == 0 else None)
        return state if state.ema is not None or state.initial is not None else None

    def initial_weights(self, run) -> InitialWeights:
        """The reference pass's initial weights under full fine-tuning (beside the EMA in the run's NFTState)."""
        return run.algorithm_state.initial

    def reuses_uncond(self, cfg) -> bool:
        return False

    def record_spec(self, cfg) -> RecordSpec:
        return RecordSpec(step_latents=False, log_probs=False)

    def forward_step(self, cfg, reference):
        return nft_forward_step(self.loss_config(cfg), reference, reference_pass=self.reference_pass(cfg))

    def requests(self, run, step: int) -> list:
        return ode_requests(super().requests(run, step))

    def check(self, run, trajs: list[Trajectory], text) -> dict[str, float]:
        return {}  # ODE rollouts: no log-probs to compare

    def train(self, run, trajs: list[Trajectory], advantages, text) -> dict[str, float]:
        cfg = run.cfg
        mbs = nft_microbatches(trajs, advantages.advantages, text, cfg.algorithm.diffusion_nft.timesteps_per_sample,
                               cfg.train.micro_batch_size, cfg.rollout.text_pad_multiple)
        state = run.algorithm_state
        ema = state.ema if state is not None else None  # None: the old policy is the rollout's weights, the policy's
        with ema.swapped_in() if ema is not None else nullcontext():
            mbs = with_old_velocity(run, mbs)
        if self.reference_pass(cfg):
            with self.reference_weights(run):
                mbs = with_reference_velocity(run, mbs)
        summary = train_steps(run, mbs)
        if ema is not None:
            ema.update()
        return {**summary, "zero_std_ratio": advantages.zero_std_ratio}

    def flops(self, run, trajs: list[Trajectory], text) -> float:
        """The ODE rollout, the old policy's forward over every training row, the rows' forward + backward and,
        with ref_weight, the reference's forwards (inline: in both passes; under PP: its own pass, once)."""
        k = run.cfg.algorithm.diffusion_nft.timesteps_per_sample
        rows = Counter()
        for t in trajs:
            rows[text_length(text, t.request.prompt, run.cfg.rollout.text_pad_multiple)] += k
        passes = 2 if self.needs_reference(run.cfg) else int(self.reference_pass(run.cfg))
        reference = Counter({n: passes * c for n, c in rows.items()}) if passes else None
        return rows_flops(run, trajs, text, train_rows=rows, forward_rows=rows, reference_rows=reference)


ALGORITHM = DiffusionNFT()
