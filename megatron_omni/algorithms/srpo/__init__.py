"""SRPO / Direct-Align: the one-step recovery loss with a differentiable reward (``loss``), its micro-batches and
forward step (``step``) and the algorithm (``algorithm.ALGORITHM``)."""
from megatron_omni.algorithms.srpo.algorithm import ALGORITHM, SRPO
from megatron_omni.algorithms.srpo.loss import SRPOLossConfig, recovered_x0, srpo_loss
from megatron_omni.algorithms.srpo.step import (SRPOMicroBatch, reward_prompt, srpo_forward_step, srpo_microbatches,
                                                srpo_rows)

__all__ = ["ALGORITHM", "SRPO", "SRPOLossConfig", "SRPOMicroBatch", "recovered_x0", "reward_prompt",
           "srpo_forward_step", "srpo_loss", "srpo_microbatches", "srpo_rows"]
