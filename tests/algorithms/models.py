"""The tiny Qwen-Image the loss tests train: diffusers' reference weights in megatron's layout, in float64, LoRA r4
on FlowGRPO's targets with the B matrices drawn nonzero (so the adapters change the output and get gradients)."""
import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora
from tests.qwen_image_reference import diffusers_reference, megatron_from_reference


def lora_model(arch, tp_group, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model = megatron_from_reference(diffusers_reference(arch), arch, tp_group, dtype=dtype)
    apply_lora(model, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(arch))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return model
