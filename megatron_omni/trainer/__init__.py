"""The FlowGRPO training loop behind `megatron-omni train`: policy, step, checkpoints, micro-batches, MFU."""
