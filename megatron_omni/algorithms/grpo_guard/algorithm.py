"""GRPO-Guard on the Algorithm interface: FlowGRPO's rollouts, advantages and micro-batches; the loss against the
old policy's step means (megatron_omni.algorithms.old_policy) with the bias correction and step reweighting of
``grpo_guard.loss``.  Its settings are FlowGRPO's (algorithm.clip_range, kl_beta, kl_form)."""
from __future__ import annotations

from megatron_omni.algorithms.grpo_guard.loss import grpo_guard_loss
from megatron_omni.algorithms.old_policy import OldMeanAlgorithm


class GRPOGuard(OldMeanAlgorithm):
    name = "grpo_guard"
    policy_loss = staticmethod(grpo_guard_loss)


ALGORITHM = GRPOGuard()
