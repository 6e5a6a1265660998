"""RL algorithms for flow-matching DiTs: group advantages, the Flow-GRPO loss and its megatron-core
forward step.  The SDE step math is the rollout's (``megatron_omni.rollout.samplers``)."""
from megatron_omni.algorithms.advantages import GroupAdvantages, group_advantages
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig, flow_grpo_loss, kl_to_reference
from megatron_omni.algorithms.flow_grpo_step import FlowGRPOMicroBatch, flow_grpo_forward_step

__all__ = ["FlowGRPOLossConfig", "FlowGRPOMicroBatch", "GroupAdvantages", "flow_grpo_forward_step",
           "flow_grpo_loss", "group_advantages", "kl_to_reference"]
