"""MixGRPO: FlowGRPO with an SDE window that moves over training (``algorithm.ALGORITHM``, ``window_start``)."""
from megatron_omni.algorithms.mix_grpo.algorithm import ALGORITHM, MixGRPO, window_start

__all__ = ["ALGORITHM", "MixGRPO", "window_start"]
