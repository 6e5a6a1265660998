"""Qwen-Image as a ``ModelFamily`` (model_specs.family): diffusers' ``QwenImageTransformer2DModel`` as megatron-core
specs, its mapping table (checkpoints_convert/qwen_image.py), FLOPs and true-CFG rule."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from model_specs.common.lora import FLOW_GRPO_TARGETS
from model_specs.family import ModelFamily
from model_specs.qwen_image.config import DIFFUSERS_CLASS, QwenImageConfig


class QwenImageFamily(ModelFamily):
    name = "qwen_image"
    arch_class = QwenImageConfig
    transformer_class = DIFFUSERS_CLASS
    pipeline_classes = ("QwenImagePipeline", "QwenImageEditPipeline")
    edit_pipeline_classes = ("QwenImageEditPipeline",)
    guidance_rescale = "token"  # true CFG: v rescaled to ‖v_cond‖ per token, as QwenImagePipeline does
    lora_targets = FLOW_GRPO_TARGETS

    def default_arch(self) -> QwenImageConfig:
        return QwenImageConfig()

    def arch_from_config(self, config: dict[str, Any]) -> QwenImageConfig:
        return QwenImageConfig.from_diffusers(config)

    def arch_to_config(self, arch: QwenImageConfig) -> dict[str, Any]:
        return arch.to_diffusers()

    def check_layout(self, arch: QwenImageConfig, tp: int = 1, ulysses: int = 1, pipeline_chunks: int = 1) -> None:
        arch.validate(tp)
        # Ulysses re-splits the heads a TP rank holds, so each of its ranks must get whole heads
        if arch.num_attention_heads % (tp * ulysses):
            raise ValueError(f"tp*ulysses = {tp}*{ulysses} does not divide num_attention_heads="
                             f"{arch.num_attention_heads}; expected a divisor")
        # even split of the blocks: every (virtual) pipeline stage builds the same number of layers
        if arch.num_layers % pipeline_chunks:
            raise ValueError(f"num_layers={arch.num_layers} does not split over pp*vpp = {pipeline_chunks} pipeline "
                             f"chunks; expected a multiple of {pipeline_chunks}")

    def num_blocks(self, arch: QwenImageConfig) -> int:
        return arch.num_layers

    def num_heads(self, arch: QwenImageConfig) -> int:
        return arch.num_attention_heads

    def text_dim(self, arch: QwenImageConfig) -> int:
        return arch.joint_attention_dim

    def latent_channels(self, arch: QwenImageConfig) -> int:
        if arch.out_features != arch.in_channels:
            raise ValueError(f"the model predicts {arch.out_features} channels per token but takes "
                             f"{arch.in_channels}; a velocity must have the latent's shape")
        return arch.in_channels

    def transformer_config(self, arch: QwenImageConfig, tp: int = 1, params_dtype: torch.dtype = torch.float32,
                           **overrides):
        return arch.transformer_config(tp, params_dtype=params_dtype, **overrides)

    def build(self, arch: QwenImageConfig, config, tp_group, backend: str = "local", *, cp_groups=None,
              pre_process: bool = True, post_process: bool = True, layers: Sequence[int] | None = None):
        from model_specs.qwen_image.model import QwenImageModel
        from model_specs.qwen_image.spec import qwen_image_block_spec

        context_parallel = cp_groups is not None and cp_groups.cp > 1
        return QwenImageModel(arch, config, tp_group, qwen_image_block_spec(backend, context_parallel=context_parallel),
                              cp_groups=cp_groups, pre_process=pre_process, post_process=post_process, layers=layers)

    def step_inputs(self, model, sigmas_N: torch.Tensor) -> list[dict[str, Any]]:
        # every row of a step is at sigmas[i]: the blocks' adaLN modulations for all steps at once (the weights
        # are read once per batch, not once per step; conditioning.ModulationTable)
        table = model.modulation_table(sigmas_N)
        return [{"modulation": table.step(i)} for i in range(len(sigmas_N))]

    def pipeline(self, path, dtype: torch.dtype = torch.float32, device="cpu"):
        from model_specs.qwen_image.pipeline import QwenImageParts

        return QwenImageParts.from_folder(path, dtype, device)

    def rules(self, arch: QwenImageConfig) -> list:
        from checkpoints_convert.qwen_image import qwen_image_rules

        return qwen_image_rules(arch)

    def global_rules(self) -> list:
        from checkpoints_convert.qwen_image import GLOBAL_RULES

        return GLOBAL_RULES

    def block_rules(self, arch: QwenImageConfig, index: int) -> list:
        from checkpoints_convert.qwen_image import BLOCK_RULES

        return [r.expand(index) for r in BLOCK_RULES]  # every block alike

    def forward_flops(self, arch: QwenImageConfig, batch: int, image_tokens: int, text_tokens: int) -> float:
        from model_specs.qwen_image.flops import forward_flops

        return forward_flops(arch, batch, image_tokens, text_tokens)

    def lora_forward_flops(self, arch: QwenImageConfig, rank: int, targets, batch: int, image_tokens: int,
                           text_tokens: int) -> float:
        from model_specs.qwen_image.flops import lora_forward_flops

        return lora_forward_flops(arch, rank, targets, batch, image_tokens, text_tokens)


FAMILY = QwenImageFamily()
