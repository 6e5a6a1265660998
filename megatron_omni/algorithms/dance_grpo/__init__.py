"""DanceGRPO: FlowGRPO with a group's shared initial noise and a trained share of each sample's steps
(``algorithm.ALGORITHM``, ``trained_subset``)."""
from megatron_omni.algorithms.dance_grpo.algorithm import ALGORITHM, DanceGRPO, trained_subset

__all__ = ["ALGORITHM", "DanceGRPO", "trained_subset"]
