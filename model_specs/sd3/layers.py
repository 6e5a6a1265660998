"""The SD3 / SD3.5 joint block and its attentions as megatron-core modules (math only).

Layout: Megatron's [s, b, h].  A block takes and returns ONE joint hidden state cat([text T, image I], dim=0), so
a pipeline stage boundary carries a single tensor; the split point is ``cond.text_len``.  The last block
(``context_pre_only``) leaves the text rows as they came: nothing reads them after it.
Legend: S sequence, B batch, H hidden, N local heads, D head dim, T text tokens, I image tokens (this CP rank's).

Inference fusions (model_specs.common.fusion, the engine's ``rollout.fuse``): both attentions prepare q / k / v with
``joint_qk_norm_rope`` (the QKV bias and a LoRA output added, per-head RMSNorm, no rotation, the joint layout: one
Triton pass on CUDA) once ``fused`` is set and autograd is off; the MLPs are ``GeluMLP`` (fc1 + GELU epilogue).
"""
from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from model_specs.common.fusion import column_parts
from model_specs.common.qk_norm_rope import joint_qk_norm_rope, rms_norms_fusable
from model_specs.sd3.conditioning import SD3Conditioning
from model_specs.sd3.spec import JointAttentionSubmodules, SD3BlockSubmodules, SelfAttentionSubmodules


def _linear_kwargs(config: TransformerConfig, tp_group, name: str, column: bool) -> dict:
    """Keyword arguments every backend's parallel linear accepts (as megatron-core's MLP passes them)."""
    kw = dict(config=config, bias=True, skip_bias_add=False, is_expert=False, tp_group=tp_group,
              tp_comm_buffer_name=name)
    if column:
        kw.update(init_method=config.init_method, gather_output=False)
    else:
        kw.update(init_method=config.output_layer_init_method, input_is_parallel=True)
    return kw


def _heads(linear, q_norm, k_norm, x_SBH: torch.Tensor, heads: int, head_dim: int):
    """A stream's fused QKV -> per-head normed q, k and v, each [S, B, N, D] (rows interleaved per head:
    [q_h, k_h, v_h] for each local head h, ``checkpoints_convert.mapping.fuse_qkv``)."""
    qkv_SBN3D, _ = linear(x_SBH)
    s, b = x_SBH.shape[:2]
    q, k, v = qkv_SBN3D.view(s, b, heads, 3 * head_dim).split(head_dim, dim=-1)
    return q_norm(q), k_norm(k), v


def _stream(linear, q_norm, k_norm, x_SBH: torch.Tensor) -> tuple:
    """A stream of ``joint_qk_norm_rope``: (QKV product, q / k norm weights, no rotation, bias, LoRA output)."""
    product, bias, lora = column_parts(linear, x_SBH)
    return product, q_norm.weight, k_norm.weight, None, bias, lora


class _FusedQKV:
    """The fusion protocol (model_specs.common.fusion) of an attention whose q / k norms the kernel computes."""

    fused = False  # set by model_specs.common.fusion.fuse_inference

    def fusable(self) -> str:
        """'' when ``joint_qk_norm_rope`` computes what the plain path does here (SD3.5's RMS q / k norms); else
        why not (SD3.0 has no q / k norm)."""
        return rms_norms_fusable(*self.qk_norms())

    def refresh_fused(self) -> None:
        """Nothing derived from the weights: the kernel reads the norms' weights as they are."""

    def takes_fused_path(self) -> bool:
        return self.fused and not torch.is_grad_enabled()  # the kernel has no backward


class JointAttention(_FusedQKV, MegatronModule):
    """diffusers ``Attention`` + ``JointAttnProcessor2_0``: per-stream QKV and q / k norm, one attention over
    [text; image] (no positional rotation: SD3 adds its positions at the patch embedding), per-stream output
    projections; the text one absent with ``context_pre_only``.  Heads are split over TP."""

    def __init__(self, config: TransformerConfig, submodules: JointAttentionSubmodules, tp_group, cp_groups=None,
                 context_pre_only: bool = False):
        super().__init__(config=config)
        hidden, self.head_dim = config.hidden_size, config.kv_channels
        self.local_heads = config.num_attention_heads // tp_group.size()
        self.linear_qkv = build_module(submodules.linear_qkv, hidden, 3 * hidden,
                                       **_linear_kwargs(config, tp_group, "qkv", column=True))
        self.linear_added_qkv = build_module(submodules.linear_added_qkv, hidden, 3 * hidden,
                                             **_linear_kwargs(config, tp_group, "qkv", column=True))
        self.q_layernorm = build_module(submodules.q_layernorm, self.head_dim, dtype=config.params_dtype)
        self.k_layernorm = build_module(submodules.k_layernorm, self.head_dim, dtype=config.params_dtype)
        self.added_q_layernorm = build_module(submodules.added_q_layernorm, self.head_dim, dtype=config.params_dtype)
        self.added_k_layernorm = build_module(submodules.added_k_layernorm, self.head_dim, dtype=config.params_dtype)
        self.core_attention = build_module(submodules.core_attention, cp_groups=cp_groups)
        self.linear_proj = build_module(submodules.linear_proj, hidden, hidden,
                                        **_linear_kwargs(config, tp_group, "proj", column=False))
        self.linear_added_proj = None if context_pre_only else build_module(
            submodules.linear_added_proj, hidden, hidden, **_linear_kwargs(config, tp_group, "proj", column=False))

    def qk_norms(self) -> tuple:
        return self.q_layernorm, self.k_layernorm, self.added_q_layernorm, self.added_k_layernorm

    def _qkv(self, img_SBH, txt_SBH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the joint [text; image] sequence, each [T + I, B, N, D]."""
        if self.takes_fused_path():
            return joint_qk_norm_rope(_stream(self.linear_added_qkv, self.added_q_layernorm, self.added_k_layernorm,
                                              txt_SBH),
                                      _stream(self.linear_qkv, self.q_layernorm, self.k_layernorm, img_SBH),
                                      heads=self.local_heads, eps=self.q_layernorm.eps)
        qi, ki, vi = _heads(self.linear_qkv, self.q_layernorm, self.k_layernorm, img_SBH, self.local_heads,
                            self.head_dim)
        qt, kt, vt = _heads(self.linear_added_qkv, self.added_q_layernorm, self.added_k_layernorm, txt_SBH,
                            self.local_heads, self.head_dim)
        return torch.cat([qt, qi]), torch.cat([kt, ki]), torch.cat([vt, vi])

    def forward(self, img_SBH, txt_SBH, cond: SD3Conditioning):
        """(image output [I, B, H], text output [T, B, H] or None with ``context_pre_only``)."""
        out_SBND = self.core_attention(*self._qkv(img_SBH, txt_SBH), cond.attn_mask_B11S, text_len=cond.text_len)
        img_out, _ = self.linear_proj(out_SBND[cond.text_len:])
        if self.linear_added_proj is None:
            return img_out, None
        txt_out, _ = self.linear_added_proj(out_SBND[: cond.text_len])
        return img_out, txt_out


class SelfAttention(_FusedQKV, MegatronModule):
    """The MMDiT-X block's ``attn2``: diffusers ``Attention`` (no added projections) over the image tokens alone.
    Under context parallelism the same USP core runs with no text rows: image tokens split over the CP group."""

    def __init__(self, config: TransformerConfig, submodules: SelfAttentionSubmodules, tp_group, cp_groups=None):
        super().__init__(config=config)
        hidden, self.head_dim = config.hidden_size, config.kv_channels
        self.local_heads = config.num_attention_heads // tp_group.size()
        self.linear_qkv = build_module(submodules.linear_qkv, hidden, 3 * hidden,
                                       **_linear_kwargs(config, tp_group, "qkv", column=True))
        self.q_layernorm = build_module(submodules.q_layernorm, self.head_dim, dtype=config.params_dtype)
        self.k_layernorm = build_module(submodules.k_layernorm, self.head_dim, dtype=config.params_dtype)
        self.core_attention = build_module(submodules.core_attention, cp_groups=cp_groups)
        self.linear_proj = build_module(submodules.linear_proj, hidden, hidden,
                                        **_linear_kwargs(config, tp_group, "proj", column=False))

    def qk_norms(self) -> tuple:
        return self.q_layernorm, self.k_layernorm

    def forward(self, img_SBH):
        if self.takes_fused_path():  # the kernel's text stream left empty
            image = _stream(self.linear_qkv, self.q_layernorm, self.k_layernorm, img_SBH)
            q, k, v = joint_qk_norm_rope((image[0][:0], *image[1:4]), image, heads=self.local_heads,
                                         eps=self.q_layernorm.eps)
        else:
            q, k, v = _heads(self.linear_qkv, self.q_layernorm, self.k_layernorm, img_SBH, self.local_heads,
                             self.head_dim)
        out, _ = self.linear_proj(self.core_attention(q, k, v, None, text_len=0))
        return out


def _modulate(x_SBH, shift_BH, scale_BH):
    return x_SBH * (1 + scale_BH[None]) + shift_BH[None]


class SD3Block(MegatronModule):
    """diffusers ``JointTransformerBlock``: adaLN-Zero-modulated image and text streams, joint attention, gated
    residuals, per-stream GELU-tanh MLPs.  ``dual_attention`` (MMDiT-X, ``SD35AdaLayerNormZeroX``): a second,
    image-only attention on the same normed image tokens under its own (shift, scale, gate).
    ``context_pre_only`` (the last block): the text stream only feeds the joint attention's keys and values,
    modulated by ``AdaLayerNormContinuous`` (scale, shift)."""

    def __init__(self, config: TransformerConfig, submodules: SD3BlockSubmodules, layer_number: int, tp_group,
                 backend: str = "local", cp_groups=None, dual_attention: bool = False,
                 context_pre_only: bool = False):
        super().__init__(config=config)
        self.layer_number, self.dual_attention, self.context_pre_only = layer_number, dual_attention, context_pre_only
        hidden = config.hidden_size
        mod_kw = dict(config=config, init_method=config.init_method, bias=True, gather_output=True,
                      skip_bias_add=False, tp_group=tp_group)
        self.img_mod = build_module(submodules.img_mod, hidden, (9 if dual_attention else 6) * hidden, **mod_kw)
        self.txt_mod = build_module(submodules.txt_mod, hidden, (2 if context_pre_only else 6) * hidden, **mod_kw)
        self.img_norm1 = build_module(submodules.img_norm1, hidden)
        self.txt_norm1 = build_module(submodules.txt_norm1, hidden)
        self.attention = build_module(submodules.attention, config=config, tp_group=tp_group, cp_groups=cp_groups,
                                      context_pre_only=context_pre_only)
        if dual_attention:
            self.attention2 = build_module(submodules.attention2, config=config, tp_group=tp_group,
                                           cp_groups=cp_groups)
        self.img_norm2 = build_module(submodules.img_norm2, hidden)
        mlp_kw = dict(config=config, ffn_hidden_size=config.ffn_hidden_size, tp_group=tp_group)
        self.img_mlp = build_module(submodules.img_mlp, **mlp_kw)
        if not context_pre_only:
            self.txt_norm2 = build_module(submodules.txt_norm2, hidden)
            self.txt_mlp = build_module(submodules.txt_mlp, **mlp_kw)

    @staticmethod
    def _mlp(mlp, x_SBH):
        out, bias = mlp(x_SBH)
        return out if bias is None else out + bias

    def forward(self, hidden_SBH: torch.Tensor, cond: SD3Conditioning, modulation=None) -> torch.Tensor:
        """``modulation``: the block-runner protocol's slot for precomputed modulations; SD3's adaLN input mixes
        the pooled text into the timestep embedding, so it is per row and always computed here (None)."""
        if modulation is not None:
            raise ValueError("SD3Block computes its modulation from cond.temb_BD; expected modulation=None")
        act_BH = torch.nn.functional.silu(cond.temb_BD)
        img_mod, txt_mod = self.img_mod(act_BH)[0], self.txt_mod(act_BH)[0]
        txt, img = hidden_SBH[: cond.text_len], hidden_SBH[cond.text_len:]

        i_chunks = img_mod.chunk(9 if self.dual_attention else 6, dim=-1)
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = i_chunks[:6]
        img_normed = self.img_norm1(img)
        if self.context_pre_only:
            t_scale1, t_shift1 = txt_mod.chunk(2, dim=-1)
        else:
            t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = txt_mod.chunk(6, dim=-1)
        img_attn, txt_attn = self.attention(_modulate(img_normed, i_shift1, i_scale1),
                                            _modulate(self.txt_norm1(txt), t_shift1, t_scale1), cond)
        img = img + i_gate1[None] * img_attn
        if self.dual_attention:
            x_shift, x_scale, x_gate = i_chunks[6:]
            img = img + x_gate[None] * self.attention2(_modulate(img_normed, x_shift, x_scale))
        img = img + i_gate2[None] * self._mlp(self.img_mlp, _modulate(self.img_norm2(img), i_shift2, i_scale2))
        if not self.context_pre_only:
            txt = txt + t_gate1[None] * txt_attn
            txt = txt + t_gate2[None] * self._mlp(self.txt_mlp, _modulate(self.txt_norm2(txt), t_shift2, t_scale2))
        return torch.cat([txt, img], dim=0)
