"""Online Diffusion-DPO: best / worst pairs per prompt group (``algorithm``), their noised micro-batches and forward
step (``step``) and the DPO loss against the initial policy (``loss``)."""
from megatron_omni.algorithms.diffusion_dpo.algorithm import ALGORITHM, DiffusionDPO, PreferencePairs, best_worst_pairs
from megatron_omni.algorithms.diffusion_dpo.loss import diffusion_dpo_loss, flow_matching_error
from megatron_omni.algorithms.diffusion_dpo.step import (DPOMicroBatch, dpo_forward_step, dpo_microbatches, pair_noise,
                                                         with_reference_errors)

__all__ = ["ALGORITHM", "DPOMicroBatch", "DiffusionDPO", "PreferencePairs", "best_worst_pairs", "diffusion_dpo_loss",
           "dpo_forward_step", "dpo_microbatches", "flow_matching_error", "pair_noise", "with_reference_errors"]
