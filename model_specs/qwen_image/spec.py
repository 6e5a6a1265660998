"""ModuleSpecs of the Qwen-Image MMDiT block (spec-as-data, built with megatron-core ``build_module``).

One builder for every backend: the tensor-parallel linears come from ``linear_backend`` (megatron-core
local modules, or Transformer Engine when installed); norms, core attention and the MLP are the same.
The adaLN modulation is always megatron-core's ColumnParallelLinear with ``gather_output=True``:
its output is tiny ([B, 6*hidden]) but its weight is a third of the model (6.8 B of 20.4 B params),
so it is sharded rather than replicated; TE's linear does not offer ``gather_output``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_omni.parallel.attention import JointSDPACoreAttention
from megatron_omni.parallel.usp import USPJointCoreAttention
from model_specs.common.backends import linear_backend
from model_specs.common.gelu_mlp import GeluMLP

NORM_EPS = 1e-6


@dataclass
class JointAttentionSubmodules:
    """Mirrors diffusers ``Attention`` with ``added_kv_proj_dim`` (image stream = "sample", text = "added")."""

    linear_qkv: ModuleSpec | type  # to_q, to_k, to_v fused, per-head interleaved
    linear_added_qkv: ModuleSpec | type  # add_q_proj, add_k_proj, add_v_proj fused
    q_layernorm: ModuleSpec | type
    k_layernorm: ModuleSpec | type
    added_q_layernorm: ModuleSpec | type
    added_k_layernorm: ModuleSpec | type
    core_attention: ModuleSpec | type
    linear_proj: ModuleSpec | type  # to_out.0
    linear_added_proj: ModuleSpec | type  # to_add_out


@dataclass
class QwenImageBlockSubmodules:
    """Mirrors diffusers ``QwenImageTransformerBlock``: two streams, one joint attention."""

    img_mod: ModuleSpec | type
    txt_mod: ModuleSpec | type
    img_norm1: ModuleSpec | type
    txt_norm1: ModuleSpec | type
    attention: ModuleSpec
    img_norm2: ModuleSpec | type
    txt_norm2: ModuleSpec | type
    img_mlp: ModuleSpec
    txt_mlp: ModuleSpec


def qwen_image_block_spec(backend: str = "auto", context_parallel: bool = False) -> ModuleSpec:
    """``context_parallel``: USP core attention (image tokens split over the CP group) instead of SDPA."""
    from model_specs.qwen_image.layers import JointAttention, QwenImageBlock

    linears = linear_backend(backend)
    head_norm = ModuleSpec(module=torch.nn.RMSNorm, params={"eps": NORM_EPS})
    stream_norm = ModuleSpec(module=torch.nn.LayerNorm, params={"eps": NORM_EPS, "elementwise_affine": False})
    mlp = ModuleSpec(module=GeluMLP, submodules=MLPSubmodules(linear_fc1=linears.column, linear_fc2=linears.row))
    attention = ModuleSpec(
        module=JointAttention,
        submodules=JointAttentionSubmodules(
            linear_qkv=linears.column, linear_added_qkv=linears.column,
            q_layernorm=head_norm, k_layernorm=head_norm, added_q_layernorm=head_norm, added_k_layernorm=head_norm,
            core_attention=USPJointCoreAttention if context_parallel else JointSDPACoreAttention,
            linear_proj=linears.row, linear_added_proj=linears.row,
        ),
    )
    return ModuleSpec(
        module=QwenImageBlock,
        params={"backend": linears.name},
        submodules=QwenImageBlockSubmodules(
            img_mod=ColumnParallelLinear, txt_mod=ColumnParallelLinear,
            img_norm1=stream_norm, txt_norm1=stream_norm, attention=attention,
            img_norm2=stream_norm, txt_norm2=stream_norm, img_mlp=mlp, txt_mlp=mlp,
        ),
    )

