"""Online Diffusion-DPO on the Algorithm interface: FlowGRPO's requests (groups of samples per prompt), the best
and the worst sample of each group as a preference pair, and the DPO loss against the initial policy (LoRA:
adapters off; full fine-tune: a float32 copy of the initial weights, ``Run.algorithm_state``, swapped in) inside
megatron-core's schedule (docs/algorithms.md, Diffusion-DPO).  The reference's errors come from a forward-only
pass before training, so it runs at every layout the loop does (PP included).

Only final samples are used: the rollout's log-probs are not read and there is no log-prob check.  A group whose
rewards are all equal has no preference and gives no pair (``zero_std_ratio``).  ``train.micro_batch_size``
samples per forward are micro_batch_size // 2 pairs (at least 1); ``train.global_batch_size // micro_batch_size``
micro-batches make one optimizer step.  Settings: algorithm.diffusion_dpo.beta.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megatron_omni.algorithms.base import RecordSpec
from megatron_omni.algorithms.clean_samples import rows_flops, text_length, train_steps
from megatron_omni.algorithms.diffusion_dpo.step import dpo_forward_step, dpo_microbatches, with_reference_errors
from megatron_omni.algorithms.ema_policy import EMAPolicy
from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO
from megatron_omni.rollout.engine import Trajectory


@dataclass
class PreferencePairs:
    """Indices into the step's trajectories: winners[k] is preferred over losers[k] (one pair per group)."""

    winners: list[int]
    losers: list[int]
    zero_std_ratio: float  # fraction of groups with all rewards equal (no pair)


def best_worst_pairs(rewards, group_ids: list) -> PreferencePairs:
    """The highest- and the lowest-reward sample of each group (the first of equals), groups in first-seen order."""
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    winners, losers, flat = [], [], 0
    for members in groups.values():
        r = [float(rewards[i]) for i in members]
        if max(r) == min(r):
            flat += 1
            continue
        winners.append(members[r.index(max(r))])
        losers.append(members[r.index(min(r))])
    return PreferencePairs(winners, losers, flat / len(groups))


class DiffusionDPO(FlowGRPO):
    name = "diffusion_dpo"
    reference = "initial"

    def check_config(self, cfg) -> None:
        if not cfg.algorithm.diffusion_dpo.beta > 0:
            raise ValueError(f"diffusion_dpo.beta: expected > 0, got {cfg.algorithm.diffusion_dpo.beta}")

    def needs_reference(self, cfg) -> bool:
        return False  # no inline reference: its weights are put in place for a pass of their own (reference_weights)

    def build_state(self, cfg, policy) -> EMAPolicy | None:
        """Full fine-tune: the initial weights (an average never updated), checkpointed; LoRA: none (adapters off)."""
        return EMAPolicy(policy.modules or [policy.module], decay=0.0) if cfg.lora.rank == 0 else None

    def reuses_uncond(self, cfg) -> bool:
        return False  # the loss runs the conditional velocity only

    def record_spec(self, cfg) -> RecordSpec:
        return RecordSpec(step_latents=False, log_probs=False)

    def forward_step(self, cfg, reference):
        return dpo_forward_step(cfg.algorithm.diffusion_dpo.beta)

    def check(self, run, trajs: list[Trajectory], text) -> dict[str, float]:
        return {}  # no log-probs are trained on

    def advantages(self, run, trajs: list[Trajectory], rewards) -> PreferencePairs:
        return best_worst_pairs(rewards, [t.request.prompt_id for t in trajs])

    def train(self, run, trajs: list[Trajectory], pairs: PreferencePairs, text) -> dict[str, float]:
        cfg = run.cfg.train
        summary = {"dpo_pairs": float(len(pairs.winners)), "zero_std_ratio": pairs.zero_std_ratio,
                   "optimizer_steps": 0}
        if not pairs.winners:
            return summary  # no group had a preference: nothing to train
        mbs = dpo_microbatches(trajs, pairs.winners, pairs.losers, text, max(1, cfg.micro_batch_size // 2),
                               run.cfg.rollout.text_pad_multiple)
        mbs = with_reference_errors(run, mbs, self.reference_weights(run))
        return {**summary, **train_steps(run, mbs)}

    def flops(self, run, trajs: list[Trajectory], text) -> float:
        """The rollout's forwards, then per group's pair 2 policy rows forward + backward and 2 reference rows, each
        row at its text length (the rewards are not at hand: a group without a preference, which trains nothing,
        is counted too)."""
        groups = {t.request.prompt_id: t.request.prompt for t in trajs}
        rows = Counter(text_length(text, p, run.cfg.rollout.text_pad_multiple) for p in groups.values())
        rows = Counter({n: 2 * k for n, k in rows.items()})
        return rows_flops(run, trajs, text, train_rows=rows, reference_rows=rows)


ALGORITHM = DiffusionDPO()
