"""SD3 / SD3.5 as a ``ModelFamily`` (model_specs.family): diffusers' ``SD3Transformer2DModel`` as megatron-core
specs, its mapping table (checkpoints_convert/sd3.py), FLOPs and the ``StableDiffusion3Pipeline`` parts
(model_specs/sd3/pipeline.py: the pooled text reaches the denoiser as the text extra ``pooled_BP``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from model_specs.family import ModelFamily
from model_specs.sd3.config import DIFFUSERS_CLASS, SD3Config, sd35_medium

# flow_grpo's SD3.5 LoRA preset: the joint attention's projections of both streams (not attn2, not the MLPs)
SD3_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out")


class SD3Family(ModelFamily):
    name = "sd3"
    arch_class = SD3Config
    transformer_class = DIFFUSERS_CLASS
    pipeline_classes = ("StableDiffusion3Pipeline",)
    guidance_rescale = None  # plain CFG, as StableDiffusion3Pipeline
    cfg_needs_negative_prompt = False  # the pipeline runs CFG for any guidance_scale > 1, negative "" by default
    lora_targets = SD3_LORA_TARGETS

    def default_arch(self) -> SD3Config:
        return sd35_medium()

    def arch_from_config(self, config: dict[str, Any]) -> SD3Config:
        return SD3Config.from_diffusers(config)

    def arch_to_config(self, arch: SD3Config) -> dict[str, Any]:
        return arch.to_diffusers()

    def check_layout(self, arch: SD3Config, tp: int = 1, ulysses: int = 1, pipeline_chunks: int = 1) -> None:
        arch.validate(tp)
        if arch.num_attention_heads % (tp * ulysses):  # Ulysses re-splits a TP rank's heads: whole heads each
            raise ValueError(f"tp*ulysses = {tp}*{ulysses} does not divide num_attention_heads="
                             f"{arch.num_attention_heads}; expected a divisor")
        if arch.num_layers % pipeline_chunks:
            raise ValueError(f"num_layers={arch.num_layers} does not split over pp*vpp = {pipeline_chunks} pipeline "
                             f"chunks; expected a multiple of {pipeline_chunks}")

    def num_blocks(self, arch: SD3Config) -> int:
        return arch.num_layers

    def num_heads(self, arch: SD3Config) -> int:
        return arch.num_attention_heads

    def text_dim(self, arch: SD3Config) -> int:
        return arch.joint_attention_dim

    def latent_channels(self, arch: SD3Config) -> int:
        if arch.out_features != arch.in_features:
            raise ValueError(f"the model predicts {arch.out_features} channels per token but takes "
                             f"{arch.in_features}; a velocity must have the latent's shape")
        return arch.in_features

    def transformer_config(self, arch: SD3Config, tp: int = 1, params_dtype: torch.dtype = torch.float32,
                           **overrides):
        return arch.transformer_config(tp, params_dtype=params_dtype, **overrides)

    def build(self, arch: SD3Config, config, tp_group, backend: str = "local", *, cp_groups=None,
              pre_process: bool = True, post_process: bool = True, layers: Sequence[int] | None = None):
        from model_specs.sd3.model import SD3Model
        from model_specs.sd3.spec import sd3_block_spec

        context_parallel = cp_groups is not None and cp_groups.cp > 1
        spec = sd3_block_spec(backend, arch.qk_norm is not None, context_parallel=context_parallel)
        return SD3Model(arch, config, tp_group, spec, cp_groups=cp_groups, pre_process=pre_process,
                        post_process=post_process, layers=layers)

    def pipeline(self, path, dtype: torch.dtype = torch.float32, device="cpu"):
        from model_specs.sd3.pipeline import SD3Parts

        return SD3Parts.from_folder(path, dtype, device)

    def rules(self, arch: SD3Config) -> list:
        from checkpoints_convert.sd3 import sd3_rules

        return sd3_rules(arch)

    def global_rules(self) -> list:
        from checkpoints_convert.sd3 import GLOBAL_RULES

        return GLOBAL_RULES

    def block_rules(self, arch: SD3Config, index: int) -> list:
        from checkpoints_convert.sd3 import block_rules

        return block_rules(arch, index)  # MMDiT-X attn2 in dual_attention_layers, the last block context_pre_only

    def forward_flops(self, arch: SD3Config, batch: int, image_tokens: int, text_tokens: int) -> float:
        from model_specs.sd3.flops import forward_flops

        return forward_flops(arch, batch, image_tokens, text_tokens)

    def lora_forward_flops(self, arch: SD3Config, rank: int, targets, batch: int, image_tokens: int,
                           text_tokens: int) -> float:
        from model_specs.sd3.flops import lora_forward_flops

        return lora_forward_flops(arch, rank, targets, batch, image_tokens, text_tokens)


FAMILY = SD3Family()
