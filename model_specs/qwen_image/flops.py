"""FLOPs of a Qwen-Image forward, for the MFU the trainer logs (2 FLOPs per multiply-add).

Per block and token: 12·h² matmul weights (QKV 3h², output h², MLP 8h²) in either stream; joint
attention 4·S²·h per sample (QKᵀ and AV over S = S_T + S_I tokens); the adaLN modulation acts once per
sample (12·h² per block).  docs/benchmarks.md counts the same way (16.6 TFLOP at 512², 60 blocks).

LoRA adapters (``lora_forward_flops``): a rank-r adapter on a K -> N linear costs 2·r·(K + N) per token
(A x, then B h), on the tokens of the linear's stream.
"""
from __future__ import annotations

from model_specs.common.flops import lora_linears_flops
from model_specs.qwen_image.conditioning import TIME_PROJ_DIM
from model_specs.qwen_image.config import QwenImageConfig


def forward_flops(arch: QwenImageConfig, batch: int, image_tokens: int, text_tokens: int,
                  modulation: bool = True) -> float:
    """``modulation=False``: without the blocks' modulation products (a forward that reads them from a
    ModulationTable built once for all of a rollout's steps)."""
    h, layers = arch.hidden_size, arch.num_layers
    tokens = image_tokens + text_tokens
    per_block = 2 * 12 * h * h * tokens + 4 * tokens * tokens * h + 2 * 12 * h * h * modulation
    embed = 2 * h * (arch.in_channels * image_tokens + arch.joint_attention_dim * text_tokens
                     + arch.out_features * image_tokens + 2 * h)
    return float(batch) * (layers * per_block + embed)


def _linears(arch: QwenImageConfig) -> dict[str, tuple[int, int, str]]:
    """Every linear of the model by diffusers name: (in features, out features, the tokens it acts on)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    block = {}
    for stream, prefix, attn in (("image", "img", ("to_q", "to_k", "to_v", "to_out.0")),
                                 ("text", "txt", ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"))):
        block.update({f"attn.{name}": (h, h, stream) for name in attn})
        block.update({f"{prefix}_mlp.net.0.proj": (h, f, stream), f"{prefix}_mlp.net.2": (f, h, stream),
                      f"{prefix}_mod.1": (h, 6 * h, "sample")})
    out = {f"transformer_blocks.{i}.{name}": dims for i in range(arch.num_layers) for name, dims in block.items()}
    out.update({"img_in": (arch.in_channels, h, "image"), "txt_in": (arch.joint_attention_dim, h, "text"),
                "time_text_embed.timestep_embedder.linear_1": (TIME_PROJ_DIM, h, "sample"),
                "time_text_embed.timestep_embedder.linear_2": (h, h, "sample"),
                "norm_out.linear": (h, 2 * h, "sample"), "proj_out": (h, arch.out_features, "image")})
    return out


def lora_forward_flops(arch: QwenImageConfig, rank: int, targets, batch: int, image_tokens: int,
                       text_tokens: int) -> float:
    """FLOPs of the LoRA adapters in one forward over ``batch`` rows (``model_specs.common.flops``)."""
    return lora_linears_flops(_linears(arch), "Qwen-Image", "'to_q', 'img_mlp.net.2' or 'proj_out'", rank, targets, batch, image_tokens,
                              text_tokens)
