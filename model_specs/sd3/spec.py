"""ModuleSpecs of the SD3 / SD3.5 joint block (spec-as-data, built with megatron-core ``build_module``).

One builder for every backend, as Qwen-Image's: the tensor-parallel linears come from ``linear_backend``; norms,
core attention and the MLP are the same.  Which block is which (MMDiT-X dual attention, the last block's
``context_pre_only``) is decided per block at build time (``SD3Block``'s arguments), so one spec serves them all.
The adaLN modulations are megatron-core ColumnParallelLinear with ``gather_output=True`` (sharded weights, tiny
[B, k * hidden] outputs), as in Qwen-Image.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_omni.parallel.attention import JointSDPACoreAttention
from megatron_omni.parallel.usp import USPJointCoreAttention
from model_specs.common.backends import linear_backend
from model_specs.common.gelu_mlp import GeluMLP

NORM_EPS = 1e-6  # every LayerNorm and q / k RMSNorm of SD3Transformer2DModel


@dataclass
class JointAttentionSubmodules:
    """Mirrors diffusers ``Attention(added_kv_proj_dim=dim)`` + ``JointAttnProcessor2_0`` (image = "sample",
    text = "added"); a ``context_pre_only`` block has no ``linear_added_proj`` (``to_add_out``)."""

    linear_qkv: ModuleSpec | type  # to_q, to_k, to_v fused, per-head interleaved
    linear_added_qkv: ModuleSpec | type  # add_q_proj, add_k_proj, add_v_proj fused
    q_layernorm: ModuleSpec | type  # norm_q (IdentityOp without qk_norm)
    k_layernorm: ModuleSpec | type
    added_q_layernorm: ModuleSpec | type  # norm_added_q
    added_k_layernorm: ModuleSpec | type
    core_attention: ModuleSpec | type
    linear_proj: ModuleSpec | type  # to_out.0
    linear_added_proj: ModuleSpec | type  # to_add_out


@dataclass
class SelfAttentionSubmodules:
    """Mirrors the MMDiT-X block's ``attn2``: diffusers ``Attention`` over the image tokens alone."""

    linear_qkv: ModuleSpec | type
    q_layernorm: ModuleSpec | type
    k_layernorm: ModuleSpec | type
    core_attention: ModuleSpec | type
    linear_proj: ModuleSpec | type


@dataclass
class SD3BlockSubmodules:
    """Mirrors diffusers ``JointTransformerBlock``: two streams, one joint attention, optionally ``attn2``."""

    img_mod: ModuleSpec | type  # norm1.linear (6 or, with dual attention, 9 chunks)
    txt_mod: ModuleSpec | type  # norm1_context.linear (6 chunks, or 2 in a context_pre_only block)
    img_norm1: ModuleSpec | type
    txt_norm1: ModuleSpec | type
    attention: ModuleSpec
    attention2: ModuleSpec
    img_norm2: ModuleSpec | type
    txt_norm2: ModuleSpec | type
    img_mlp: ModuleSpec  # ff
    txt_mlp: ModuleSpec  # ff_context


def sd3_block_spec(backend: str = "auto", qk_norm: bool = True, context_parallel: bool = False) -> ModuleSpec:
    """``qk_norm``: per-head RMSNorm of q and k (SD3.5) or none (SD3.0); ``context_parallel``: USP core attention
    (image tokens split over the CP group, text whole on every rank) instead of SDPA."""
    from model_specs.sd3.layers import JointAttention, SD3Block, SelfAttention

    linears = linear_backend(backend)
    head_norm = ModuleSpec(module=torch.nn.RMSNorm, params={"eps": NORM_EPS}) if qk_norm else IdentityOp
    stream_norm = ModuleSpec(module=torch.nn.LayerNorm, params={"eps": NORM_EPS, "elementwise_affine": False})
    core = USPJointCoreAttention if context_parallel else JointSDPACoreAttention
    mlp = ModuleSpec(module=GeluMLP, submodules=MLPSubmodules(linear_fc1=linears.column, linear_fc2=linears.row))
    attention = ModuleSpec(module=JointAttention, submodules=JointAttentionSubmodules(
        linear_qkv=linears.column, linear_added_qkv=linears.column, q_layernorm=head_norm, k_layernorm=head_norm,
        added_q_layernorm=head_norm, added_k_layernorm=head_norm, core_attention=core, linear_proj=linears.row,
        linear_added_proj=linears.row))
    attention2 = ModuleSpec(module=SelfAttention, submodules=SelfAttentionSubmodules(
        linear_qkv=linears.column, q_layernorm=head_norm, k_layernorm=head_norm, core_attention=core,
        linear_proj=linears.row))
    return ModuleSpec(module=SD3Block, params={"backend": linears.name}, submodules=SD3BlockSubmodules(
        img_mod=ColumnParallelLinear, txt_mod=ColumnParallelLinear, img_norm1=stream_norm, txt_norm1=stream_norm,
        attention=attention, attention2=attention2, img_norm2=stream_norm, txt_norm2=stream_norm, img_mlp=mlp,
        txt_mlp=mlp))
