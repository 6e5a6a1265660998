"""The Qwen-Image MMDiT block and its joint attention as megatron-core modules (math only).

Layout: Megatron's [s, b, h].  A block takes and returns ONE joint hidden state
cat([text S_T, image S_I], dim=0) so a pipeline stage boundary carries a single tensor; the split
point is ``cond.text_len``.  Legend: S sequence, B batch, H hidden, N local heads, D head dim.
"""
from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from model_specs.common.fusion import column_parts
from model_specs.common.qk_norm_rope import apply_rope, joint_qk_norm_rope, rms_norms_fusable
from model_specs.qwen_image.conditioning import QwenImageConditioning
from model_specs.qwen_image.spec import JointAttentionSubmodules, QwenImageBlockSubmodules


def _linear_kwargs(config: TransformerConfig, tp_group, name: str, column: bool) -> dict:
    """Keyword arguments every backend's parallel linear accepts (as megatron-core's MLP passes them)."""
    kw = dict(config=config, bias=True, skip_bias_add=False, is_expert=False, tp_group=tp_group,
              tp_comm_buffer_name=name)
    if column:
        kw.update(init_method=config.init_method, gather_output=False)
    else:
        kw.update(init_method=config.output_layer_init_method, input_is_parallel=True)
    return kw


class JointAttention(MegatronModule):
    """diffusers ``Attention`` + ``QwenDoubleStreamAttnProcessor2_0``: per-stream QKV, QK-norm, RoPE,
    one attention over [text; image], per-stream output projection.  Heads are split over TP."""

    def __init__(self, config: TransformerConfig, submodules: JointAttentionSubmodules, tp_group, cp_groups=None):
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
        self.linear_added_proj = build_module(submodules.linear_added_proj, hidden, hidden,
                                              **_linear_kwargs(config, tp_group, "proj", column=False))

    fused = False  # set by model_specs.common.fusion.fuse_inference

    def fusable(self) -> str:
        """'' when ``joint_qk_norm_rope`` computes what the plain path does here; else why not."""
        return rms_norms_fusable(self.q_layernorm, self.k_layernorm, self.added_q_layernorm, self.added_k_layernorm)

    def refresh_fused(self) -> None:
        """Nothing derived from the weights: the kernel reads the norms' weights as they are."""

    def _fused_qkv(self, img_SBH, txt_SBH, cond: QwenImageConditioning):
        qkv_i, bias_i, lora_i = column_parts(self.linear_qkv, img_SBH)
        qkv_t, bias_t, lora_t = column_parts(self.linear_added_qkv, txt_SBH)
        streams = ((qkv_t, self.added_q_layernorm.weight, self.added_k_layernorm.weight, cond.txt_freqs, bias_t,
                    lora_t), (qkv_i, self.q_layernorm.weight, self.k_layernorm.weight, cond.img_freqs, bias_i, lora_i))
        return joint_qk_norm_rope(*streams, heads=self.local_heads, eps=self.q_layernorm.eps)

    def _qkv(self, linear, q_layernorm, k_layernorm, x_SBH, freqs):
        qkv_SBN3D, _ = linear(x_SBH)
        s, b = x_SBH.shape[:2]
        # fused rows are interleaved per head: [q_h, k_h, v_h] for each local head h
        q, k, v = qkv_SBN3D.view(s, b, self.local_heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        return apply_rope(q_layernorm(q), freqs), apply_rope(k_layernorm(k), freqs), v

    def forward(self, img_SBH, txt_SBH, cond: QwenImageConditioning):
        if self.fused and not torch.is_grad_enabled():
            out_SBND = self.core_attention(*self._fused_qkv(img_SBH, txt_SBH, cond), cond.attn_mask_B11S,
                                           text_len=cond.text_len)
            return self._out(out_SBND, cond)
        qi, ki, vi = self._qkv(self.linear_qkv, self.q_layernorm, self.k_layernorm, img_SBH, cond.img_freqs)
        qt, kt, vt = self._qkv(self.linear_added_qkv, self.added_q_layernorm, self.added_k_layernorm, txt_SBH,
                               cond.txt_freqs)
        out_SBND = self.core_attention(torch.cat([qt, qi]), torch.cat([kt, ki]), torch.cat([vt, vi]),
                                       cond.attn_mask_B11S, text_len=cond.text_len)
        return self._out(out_SBND, cond)

    def _out(self, out_SBND, cond: QwenImageConditioning):
        txt_out, _ = self.linear_added_proj(out_SBND[: cond.text_len])
        img_out, _ = self.linear_proj(out_SBND[cond.text_len:])
        return img_out, txt_out


def _modulate(x_SBH, shift_BH, scale_BH):
    return x_SBH * (1 + scale_BH[None]) + shift_BH[None]


class QwenImageBlock(MegatronModule):
    """diffusers ``QwenImageTransformerBlock``: adaLN-modulated image and text streams, joint attention,
    gated residuals, per-stream GELU-tanh MLPs."""

    def __init__(self, config: TransformerConfig, submodules: QwenImageBlockSubmodules, layer_number: int,
                 tp_group, backend: str = "local", cp_groups=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        hidden = config.hidden_size
        mod_kw = dict(config=config, init_method=config.init_method, bias=True, gather_output=True,
                      skip_bias_add=False, tp_group=tp_group)
        # 6 chunks per stream: (shift, scale, gate) for the attention half, then for the MLP half
        self.img_mod = build_module(submodules.img_mod, hidden, 6 * hidden, **mod_kw)
        self.txt_mod = build_module(submodules.txt_mod, hidden, 6 * hidden, **mod_kw)
        self.img_norm1 = build_module(submodules.img_norm1, hidden)
        self.txt_norm1 = build_module(submodules.txt_norm1, hidden)
        self.attention = build_module(submodules.attention, config=config, tp_group=tp_group, cp_groups=cp_groups)
        self.img_norm2 = build_module(submodules.img_norm2, hidden)
        self.txt_norm2 = build_module(submodules.txt_norm2, hidden)
        mlp_kw = dict(config=config, ffn_hidden_size=config.ffn_hidden_size, tp_group=tp_group)
        self.img_mlp = build_module(submodules.img_mlp, **mlp_kw)
        self.txt_mlp = build_module(submodules.txt_mlp, **mlp_kw)

    @staticmethod
    def _mlp(mlp, x_SBH):
        out, bias = mlp(x_SBH)
        return out if bias is None else out + bias

    def forward(self, hidden_SBH: torch.Tensor, cond: QwenImageConditioning,
                modulation: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``modulation``: this block's (image, text) modulation [1 or B, 6H] from a ModulationTable, else
        computed here from cond.temb_BH."""
        if modulation is None:
            act_BH = torch.nn.functional.silu(cond.temb_BH)
            modulation = self.img_mod(act_BH)[0], self.txt_mod(act_BH)[0]
        img_mod, txt_mod = modulation
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = img_mod.chunk(6, dim=-1)
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = txt_mod.chunk(6, dim=-1)
        txt, img = hidden_SBH[: cond.text_len], hidden_SBH[cond.text_len:]

        img_attn, txt_attn = self.attention(_modulate(self.img_norm1(img), i_shift1, i_scale1),
                                            _modulate(self.txt_norm1(txt), t_shift1, t_scale1), cond)
        img = img + i_gate1[None] * img_attn
        txt = txt + t_gate1[None] * txt_attn

        img = img + i_gate2[None] * self._mlp(self.img_mlp, _modulate(self.img_norm2(img), i_shift2, i_scale2))
        txt = txt + t_gate2[None] * self._mlp(self.txt_mlp, _modulate(self.txt_norm2(txt), t_shift2, t_scale2))
        return torch.cat([txt, img], dim=0)
