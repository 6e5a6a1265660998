"""Flow-DPPO on the Algorithm interface: FlowGRPO's rollouts, advantages and micro-batches; no ratio clipping,
the KL-to-old-policy mask of ``flow_dppo.loss`` against the old policy's step means
(megatron_omni.algorithms.old_policy).  Settings: algorithm.flow_dppo.kl_threshold, and FlowGRPO's kl_beta /
kl_form for the optional KL to the reference (algorithm.clip_range is not read)."""
from __future__ import annotations

from megatron_omni.algorithms.flow_dppo.loss import FlowDPPOLossConfig, flow_dppo_loss
from megatron_omni.algorithms.old_policy import OldMeanAlgorithm


class FlowDPPO(OldMeanAlgorithm):
    name = "flow_dppo"
    policy_loss = staticmethod(flow_dppo_loss)

    def loss_config(self, cfg) -> FlowDPPOLossConfig:
        a = cfg.algorithm
        return FlowDPPOLossConfig(kl_threshold=a.flow_dppo.kl_threshold, kl_beta=a.kl_beta, kl_form=a.kl_form)


ALGORITHM = FlowDPPO()
