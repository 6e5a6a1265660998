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

from model_specs.common import fp8
from model_specs.common.fusion import column_parts, local_column, plain_column, row_parts
from model_specs.common.lora import LoRALinear
from model_specs.common.norm_quantize import FP8Input, adaln_layer_norm, norm_modulate_quantize_rows
from model_specs.common.qk_norm_rope import apply_rope, joint_qk_norm_rope, rms_norms_fusable
from model_specs.common.rollout_linear import uses_fp8
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

    def forward(self, img_SBH, txt_SBH, cond: QwenImageConditioning, defer_bias: bool = False):
        """(image output, text output); ``defer_bias`` (the fused path): each as (output, its projection's bias
        left for the caller to add, or None: ``fusion.row_parts``)."""
        if self.fused and not torch.is_grad_enabled():
            out_SBND = self.core_attention(*self._fused_qkv(img_SBH, txt_SBH, cond), cond.attn_mask_B11S,
                                           text_len=cond.text_len)
            if defer_bias:
                return (row_parts(self.linear_proj, out_SBND[cond.text_len:]),
                        row_parts(self.linear_added_proj, out_SBND[: cond.text_len]))
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


def _reads_input(linear) -> bool:
    """Whether ``linear`` reads its input in the model dtype beside an FP8 product: an adapter not merged in."""
    return isinstance(linear, LoRALinear) and linear.enabled and not linear.base._merge_on


def _adaln_input(norm, x_SBH, shift_BH, scale_BH, consumer, residual=(None, None), gate_BH=None):
    """(x' = x + gate (r + bias), or x; the consumer's input from x'): an ``FP8Input`` from the one-pass kernel
    (``norm_quantize``) when the stream has enough rows for the FP8 GEMMs, else the modulated activation.
    ``residual``: (r, its bias or None)."""
    residual_SBH, bias_H = residual
    if x_SBH.numel() < fp8.MIN_ROWS * x_SBH.shape[-1]:
        if residual_SBH is not None:
            x_SBH = x_SBH + gate_BH[None] * (residual_SBH if bias_H is None else residual_SBH + bias_H)
        return x_SBH, _modulate(norm(x_SBH), shift_BH, scale_BH)
    xn, m, q, s = norm_modulate_quantize_rows(x_SBH, shift_BH, scale_BH, norm.eps, residual_SBH, gate_BH,
                                              _reads_input(consumer), bias_H)
    x_SBH = x_SBH if residual_SBH is None else xn
    return x_SBH, FP8Input(q, s, x_SBH, m if m.numel() else None)


class QwenImageBlock(MegatronModule):
    """diffusers ``QwenImageTransformerBlock``: adaLN-modulated image and text streams, joint attention,
    gated residuals, per-stream GELU-tanh MLPs.  With ``adaln_fp8`` (the rollout, no autograd:
    ``norm_quantize.enable_adaln_fp8``) each stream's LayerNorm + modulation (+ the gated residual before the MLP)
    writes its FP8 GEMM's quantized input in one pass."""

    adaln_fp8 = False  # set by model_specs.common.norm_quantize.enable_adaln_fp8

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

    def adaln_fp8_capable(self) -> str:
        """'' when the one-pass FP8 input computes what this block's forward does: LayerNorms without affine
        parameters, the attention fused, its QKV linears and both MLPs' fc1 plain FP8 columns; else why not."""
        attn = self.attention
        for norm in (self.img_norm1, self.txt_norm1, self.img_norm2, self.txt_norm2):
            if adaln_layer_norm(norm):
                return adaln_layer_norm(norm)
        if not attn.fused:
            return "the attention is not on its fused path (fusion.fuse_inference)"
        mlps = (self.img_mlp, self.txt_mlp)
        for linear, column in ((attn.linear_qkv, plain_column), (attn.linear_added_qkv, plain_column),
                               *((mlp.linear_fc1, local_column) for mlp in mlps)):
            base = getattr(linear, "base", linear)
            if not (uses_fp8(base) and column(base)):
                return f"{type(base).__name__} is not a local FP8 column-parallel linear (rollout.fp8)"
        if not all(getattr(mlp, "fused", False) for mlp in mlps):
            return "an MLP is not on its fused FP8 path (fusion.fuse_inference)"
        return ""

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
        if self.adaln_fp8 and not torch.is_grad_enabled():  # the FP8 GEMMs' inputs quantized in the same pass
            attn, i_fc1, t_fc1 = self.attention, self.img_mlp.linear_fc1, self.txt_mlp.linear_fc1
            img, img_in = _adaln_input(self.img_norm1, img, i_shift1, i_scale1, attn.linear_qkv)
            txt, txt_in = _adaln_input(self.txt_norm1, txt, t_shift1, t_scale1, attn.linear_added_qkv)
            img_attn, txt_attn = attn(img_in, txt_in, cond, defer_bias=True)  # each (output, its bias or None)
            img, img_in = _adaln_input(self.img_norm2, img, i_shift2, i_scale2, i_fc1, img_attn, i_gate1)
            txt, txt_in = _adaln_input(self.txt_norm2, txt, t_shift2, t_scale2, t_fc1, txt_attn, t_gate1)
        else:
            img_attn, txt_attn = self.attention(_modulate(self.img_norm1(img), i_shift1, i_scale1),
                                                _modulate(self.txt_norm1(txt), t_shift1, t_scale1), cond)
            img = img + i_gate1[None] * img_attn
            txt = txt + t_gate1[None] * txt_attn
            img_in = _modulate(self.img_norm2(img), i_shift2, i_scale2)
            txt_in = _modulate(self.txt_norm2(txt), t_shift2, t_scale2)

        img = img + i_gate2[None] * self._mlp(self.img_mlp, img_in)
        txt = txt + t_gate2[None] * self._mlp(self.txt_mlp, txt_in)
        return torch.cat([txt, img], dim=0)
