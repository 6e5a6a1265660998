"""GRPO-Guard: the bias-corrected, step-reweighted clipped ratio loss (``loss``) and its algorithm
(``algorithm.ALGORITHM``)."""
from megatron_omni.algorithms.grpo_guard.algorithm import ALGORITHM, GRPOGuard
from megatron_omni.algorithms.grpo_guard.loss import grpo_guard_loss

__all__ = ["ALGORITHM", "GRPOGuard", "grpo_guard_loss"]
