"""Flow-DPPO: the KL-masked, unclipped ratio loss (``loss``) and its algorithm (``algorithm.ALGORITHM``)."""
from megatron_omni.algorithms.flow_dppo.algorithm import ALGORITHM, FlowDPPO
from megatron_omni.algorithms.flow_dppo.loss import FlowDPPOLossConfig, flow_dppo_loss

__all__ = ["ALGORITHM", "FlowDPPO", "FlowDPPOLossConfig", "flow_dppo_loss"]
