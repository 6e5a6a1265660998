"""FLOPs of an SD3 / SD3.5 forward, for the MFU the trainer logs (2 FLOPs per multiply-add), counted as
model_specs/qwen_image/flops.py counts Qwen-Image's.

Per block and token: 12·h² matmul weights (QKV 3h², output h², MLP 8h²) in either stream, except the last
(``context_pre_only``) block's text stream, which has only its QKV (3h²); joint attention 4·S²·h per sample over
S = T + I; an MMDiT-X block adds 4·h² per image token (``attn2``'s QKV and output) and 4·I²·h of image-only
attention; the adaLN modulations act once per sample ((6 or 9)·h² image, (6 or 2)·h² text).

LoRA adapters (``lora_forward_flops``): a rank-r adapter on a K -> N linear costs 2·r·(K + N) per token of its
stream.
"""
from __future__ import annotations

from model_specs.common.flops import lora_linears_flops
from model_specs.sd3.conditioning import TIME_PROJ_DIM
from model_specs.sd3.config import SD3Config


def _block_linears(arch: SD3Config, i: int) -> dict[str, tuple[int, int, str]]:
    """Block i's linears by diffusers name (under ``transformer_blocks.{i}.``): (in, out, the tokens they act on)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    last, dual = i == arch.num_layers - 1, i in arch.dual_attention_layers
    out = {name: (h, h, "image") for name in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")}
    out.update({name: (h, h, "text") for name in ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")})
    out.update({"ff.net.0.proj": (h, f, "image"), "ff.net.2": (f, h, "image"),
                "norm1.linear": (h, (9 if dual else 6) * h, "sample"),
                "norm1_context.linear": (h, (2 if last else 6) * h, "sample")})
    if not last:
        out.update({"attn.to_add_out": (h, h, "text"), "ff_context.net.0.proj": (h, f, "text"),
                    "ff_context.net.2": (f, h, "text")})
    if dual:
        out.update({name: (h, h, "image") for name in ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")})
    return out


def _linears(arch: SD3Config) -> dict[str, tuple[int, int, str]]:
    """Every linear of the model by diffusers name (the patch embedding's conv counted as the linear it is)."""
    h = arch.hidden_size
    out = {f"transformer_blocks.{i}.{name}": dims for i in range(arch.num_layers)
           for name, dims in _block_linears(arch, i).items()}
    out.update({"pos_embed.proj": (arch.in_features, h, "image"),
                "context_embedder": (arch.joint_attention_dim, h, "text"),
                "time_text_embed.timestep_embedder.linear_1": (TIME_PROJ_DIM, h, "sample"),
                "time_text_embed.timestep_embedder.linear_2": (h, h, "sample"),
                "time_text_embed.text_embedder.linear_1": (arch.pooled_projection_dim, h, "sample"),
                "time_text_embed.text_embedder.linear_2": (h, h, "sample"),
                "norm_out.linear": (h, 2 * h, "sample"), "proj_out": (h, arch.out_features, "image")})
    return out


def forward_flops(arch: SD3Config, batch: int, image_tokens: int, text_tokens: int) -> float:
    tokens = {"image": image_tokens, "text": text_tokens, "sample": 1}
    matmuls = sum(2 * k * n * tokens[stream] for k, n, stream in _linears(arch).values())
    s, h = image_tokens + text_tokens, arch.hidden_size
    attention = arch.num_layers * 4 * s * s * h + len(arch.dual_attention_layers) * 4 * image_tokens ** 2 * h
    return float(batch) * (matmuls + attention)


def lora_forward_flops(arch: SD3Config, rank: int, targets, batch: int, image_tokens: int,
                       text_tokens: int) -> float:
    """FLOPs of the LoRA adapters in one forward over ``batch`` rows (``model_specs.common.flops``)."""
    return lora_linears_flops(_linears(arch), "SD3", "'attn.to_q', 'attn.add_k_proj' or 'ff.net.2'", rank, targets, batch, image_tokens,
                              text_tokens)
