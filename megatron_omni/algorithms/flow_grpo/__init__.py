"""FlowGRPO: the clipped loss (``loss``), its megatron-core forward step (``step``), the micro-batches over (sample,
trained step) pairs (``microbatches``) and the algorithm the loop runs (``algorithm.ALGORITHM``)."""
from megatron_omni.algorithms.flow_grpo.algorithm import ALGORITHM, FlowGRPO
from megatron_omni.algorithms.flow_grpo.loss import FlowGRPOLossConfig, flow_grpo_loss, kl_to_reference
from megatron_omni.algorithms.flow_grpo.microbatches import grpo_microbatches, without_reused_uncond
from megatron_omni.algorithms.flow_grpo.step import FlowGRPOMicroBatch, flow_grpo_forward_step

__all__ = ["ALGORITHM", "FlowGRPO", "FlowGRPOLossConfig", "FlowGRPOMicroBatch", "flow_grpo_forward_step",
           "flow_grpo_loss", "grpo_microbatches", "kl_to_reference", "without_reused_uncond"]
