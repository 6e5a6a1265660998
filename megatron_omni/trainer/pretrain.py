"""Supervised flow-matching (rectified flow) training through megatron-core's schedule.

x_σ = (1 − σ)·x0 + σ·ε and the model regresses v = ε − x0 (docs/algorithms.md).  Used to give the demo a
base model before RL; the same forward_step works for SFT of any family with this forward signature.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_omni.trainer.policy import Policy, run_microbatches


@dataclass
class FlowBatch:
    x0_BIC: torch.Tensor  # clean packed tokens
    txt_BTE: torch.Tensor
    mask_BT: torch.Tensor
    img_fhw: tuple[int, int, int]
    generator_seed: int  # noise and sigmas of this batch are drawn from it (resume-exact)


def flow_matching_forward_step(data_iterator, model):
    batch: FlowBatch = next(data_iterator)
    g = torch.Generator().manual_seed(batch.generator_seed)  # drawn on the CPU: the same draws on every device
    device = batch.x0_BIC.device
    noise = torch.randn(batch.x0_BIC.shape, generator=g).to(device)
    sigma_B = torch.sigmoid(torch.randn(batch.x0_BIC.shape[0], generator=g)).to(device)  # logit-normal sigmas
    x_t = (1 - sigma_B[:, None, None]) * batch.x0_BIC + sigma_B[:, None, None] * noise
    v = model(x_t, batch.txt_BTE, sigma_B, batch.img_fhw, batch.mask_BT)
    target = noise - batch.x0_BIC

    def loss_func(v_BIC):
        loss = torch.nn.functional.mse_loss(v_BIC.float(), target)
        return loss, {"flow_loss": loss.detach().clone()}

    return v, loss_func


def pretrain(policy: Policy, x0_NIC: torch.Tensor, txt_NTE: torch.Tensor, mask_NT: torch.Tensor,
             img_fhw: tuple[int, int, int], *, steps: int, batch_size: int, seed: int,
             p_uncond: float = 0.1, uncond: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[float]:
    """``steps`` optimizer steps of flow matching; returns the loss per step.  Every draw is seeded by
    (seed, step), so the result does not depend on the machine's speed.  With ``uncond`` (the empty
    prompt's embedding and mask), a fraction ``p_uncond`` of prompts is dropped so CFG works later."""
    losses, device = [], next(policy.module.parameters()).device
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, x0_NIC.shape[0], (batch_size,), generator=g)
        txt, mask = txt_NTE[idx].clone(), mask_NT[idx].clone()
        if uncond is not None:
            drop = torch.rand(batch_size, generator=g) < p_uncond
            txt[drop], mask[drop] = uncond[0], uncond[1]
        batch = FlowBatch(x0_NIC[idx].to(device), txt.to(device), mask.to(device), img_fhw,
                          generator_seed=seed * 7919 + step)
        metrics, _ = run_microbatches(policy, flow_matching_forward_step, [batch])
        losses.append(float(metrics[0]["flow_loss"]))
    return losses
